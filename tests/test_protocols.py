"""Every implementation of the three protocols (rollwise.types.contracts) conforms, and keeps the shared
semantics: submit -> completion -> load_weights (checked whole) -> later tokens carry the version."""

from __future__ import annotations


import pytest
import torch

from completions import collect

from rollwise.config import load_config
from rollwise.engine.core import EngineWorker
from rollwise.engine.factory import create_engine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.types.contracts import RolloutBackend, RolloutControl, Trainer
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.weights import WeightUpdateError

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _request(rid: str, n: int = 2) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7], SamplingParams(max_tokens=6, temperature=1.0, n=n, seed=3, ignore_eos=True))


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) * 0.05 if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def _versions_move(backend: RolloutBackend, update: WeightUpdate) -> None:
    """The shared semantics, through the protocol only."""
    assert isinstance(backend, RolloutBackend)
    backend.submit([_request("before")])
    before = collect(backend, 2)
    assert {v for c in before for v in c.versions} == {update.version - 1}
    backend.load_weights(update)
    assert backend.model_info().policy_version == update.version
    backend.submit([_request("after")])
    after = collect(backend, 2)
    assert {(c.request_id, c.index) for c in after} == {("after", 0), ("after", 1)}
    assert {v for c in after for v in c.versions} == {update.version}
    assert backend.abort(["nothing-in-flight"]) == []
    assert isinstance(backend.metrics(), dict)


def test_engine_worker_is_a_backend_and_refuses_a_bad_update_whole():
    model, tok = load_model("tiny:0")
    fp = tokenizer_fingerprint(tok)
    engine = create_engine("reference", model, tok, max_num_seqs=4, max_model_len=64, tokenizer_fingerprint=fp)
    worker = EngineWorker(engine)
    try:
        _versions_move(worker, WeightUpdate.of_state(_perturbed(model, 1), 1, fp))
        held = engine.model.state_dict()["model.norm.weight"].clone()
        # Another tokenizer's update: refused before anything is applied; the engine stays at version 1.
        with pytest.raises(WeightUpdateError, match="tokenizer fingerprint"):
            worker.load_weights(WeightUpdate.of_state(_perturbed(model, 2), 2, "0" * 64))
        bad = _perturbed(model, 3)
        bad.pop("model.norm.weight")
        with pytest.raises(WeightUpdateError, match="missing weight 'model.norm.weight'"):
            worker.load_weights(WeightUpdate.of_state(bad, 2, fp))
        assert worker.model_info().policy_version == 1
        assert torch.equal(engine.model.state_dict()["model.norm.weight"], held)
    finally:
        worker.close()


def test_sim_cluster_is_a_backend():
    from rollwise.sim.cluster import SimCluster
    from rollwise.sim.cost import CostModel
    from rollwise.sim.engine import SimEngine, VirtualClock

    cost = CostModel(step_overhead_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3,
                     decode_s_per_ctx_token=1e-6, max_num_seqs=4, max_model_len=64, weight_update_s=0.25)
    clock = VirtualClock()
    cluster = SimCluster([SimEngine(cost, clock=clock), SimEngine(cost, clock=clock)], clock)
    model, _ = load_model("tiny:0")
    update = WeightUpdate.of_state(model.state_dict(), 1, None)
    assert cluster.load_weights(WeightUpdate.of_state(model.state_dict(), 0, None)) is None  # no float any more
    _versions_move(cluster, update)
    assert cluster.weights_loaded_at <= clock.now


def test_pool_worker_is_a_backend():
    from rollwise.control.pool_backend import PoolClient, PoolWorker
    from rollwise.pool.scheduler import Policy
    from rollwise.pool.engine_pool import EnginePool
    from rollwise.pool.app import create_app

    model, tok = load_model("tiny:0")
    fp = tokenizer_fingerprint(tok)
    pool = EnginePool(1, max_num_seqs=8, max_model_len=96, policy=Policy(min_slice_s=0.05))
    with serve_in_thread(create_app(pool)) as (url, _):
        client = PoolClient(url)
        client.attach("conformance", "tiny:0", 1.0, fp)
        worker = PoolWorker(client, fp, poll_s=0.2)
        try:
            worker.load_weights(WeightUpdate.of_state(model.state_dict(), 0, fp))
            _versions_move(worker, WeightUpdate.of_state(_perturbed(model, 1), 1, fp))
        finally:
            worker.close()
            client.detach()
            client.close()


def test_ray_fleet_declares_the_backend_methods():
    """Its behaviour runs on a real cluster in tests/test_ray_placement.py; here: the declared shape."""
    pytest.importorskip("ray")
    from rollwise.control.ray.fleet import RayEngineFleet
    from rollwise.control.ray.placement import RayTrainer

    assert issubclass(RayEngineFleet, RolloutBackend)
    for name in ("train_step", "weights", "save_checkpoint", "load_checkpoint"):
        assert callable(getattr(RayTrainer, name)), name


def test_grpo_trainer_is_a_trainer_with_zero_copy_weights_and_checkpoints(tmp_path):
    from rollwise.train.trainer import GRPOTrainer

    cfg = load_config(None, ["model=tiny:0"])
    model, tok = load_model("tiny:0")
    trainer = GRPOTrainer(model, cfg.train, pad_token_id=0, tokenizer=tok)
    assert isinstance(trainer, Trainer)
    weights = trainer.weights()
    norm = model.state_dict()["model.norm.weight"]
    assert weights["model.norm.weight"].data_ptr() == norm.data_ptr()  # a view: nothing copied
    trainer.version = 5
    ckpt = trainer.save_checkpoint(tmp_path, 3, {"note": "x"}, keep_last=1)
    trainer.version = 0
    state = trainer.load_checkpoint(ckpt)
    assert trainer.version == 5 and state["step"] == 3 and state["note"] == "x"


def test_controllers_have_the_whole_interface():
    from rollwise.agent.controller import AgentController
    from rollwise.reward.batch import Unscored
    from rollwise.rollout.controller import RolloutController
    from rollwise.rollout.data import ProblemStream
    from rollwise.rollout.sync_rollout import PromptEncoder
    from rollwise.tasks import make_task

    cfg = load_config(None, ["model=tiny:0", "task.name=basic_arithmetic"])
    model, tok = load_model("tiny:0")
    worker = EngineWorker(create_engine("reference", model, tok, max_num_seqs=4, max_model_len=64))
    try:
        controller = RolloutController(cfg, worker, PromptEncoder(tok, cfg.prompt, cfg.reward),
                                       ProblemStream(make_task(cfg.task).problems("train"), 0), Unscored())
        assert isinstance(controller, RolloutControl)
        # Its one step metric: completions taken while a group was being scored (none yet; rollout.group_scoring).
        assert controller.step_metrics() == {"reward_overlapped_completions": 0.0}
    finally:
        worker.close()
    members = [m for m in dir(RolloutControl) if not m.startswith("_")]
    missing = [m for m in members if not hasattr(AgentController, m) and m not in ("ledger", "score_seconds",
                                                                                    "next_group")]
    assert missing == []


def test_weight_sender_follows_the_placement_and_refuses_one_that_cannot_reach_the_engines():
    from pydantic import ValidationError

    from rollwise.config import RunConfig

    base = {"task": {"kind": "reasoning_gym", "name": "basic_arithmetic"}}
    # auto: each placement's own sender
    assert RunConfig.model_validate(base).weight_sender == "inprocess"
    assert RunConfig.model_validate({**base, "placement": "ray"}).weight_sender == "ray"
    assert RunConfig.model_validate({**base, "pool": {"url": "http://127.0.0.1:1"}}).weight_sender == "http"
    # naming the placement's own sender is accepted
    assert RunConfig.model_validate({**base, "placement": "ray", "sync": {"sender": "ray"}}).weight_sender == "ray"
    # the Ray object store cannot reach engines in this process; nor can a collective (engine actors only)
    for placement, sender in (("local", "ray"), ("local", "collective"), ("ray", "inprocess"), ("ray", "http")):
        with pytest.raises(ValidationError, match=rf"sync.sender='{sender}'.*placement={placement}.*sync.sender=auto"):
            RunConfig.model_validate({**base, "placement": placement, "sync": {"sender": sender}})
    with pytest.raises(ValidationError, match="sync.sender"):
        RunConfig.model_validate({**base, "sync": {"sender": "carrier-pigeon"}})
