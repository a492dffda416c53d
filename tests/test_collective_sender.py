"""`placement: ray` + `sync.sender: collective` (issue 18 item 3): the driver is rank 0 of one weight
group that every engine actor joins; each update is one gloo broadcast (NCCL on GPUs: the same code,
not run here), committed by each engine through the same checked WeightReceiver. On a real local
Ray cluster (CPU), with reference engines and the tiny model:

- a short `train` run pushes every step's weights over the broadcast, and the engines then sample
  with exactly the trainer's logprobs (train-inference mismatch ~0);
- a fleet's pushes: the engines' greedy logprobs equal a local engine's on the pushed weights; a
  mis-shaped tensor or damaged bytes (a wrong checksum) are refused by every engine, named, and the
  engines keep serving the previous version; an engine Ray restarts rejoins a re-formed group;
- the config refuses the collective sender where no Ray engine actors run, naming the fix.
"""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray", reason="placement: ray needs Ray: pip install -e '.[ray]'")

from ray_local import ray_cluster, ray_config  # noqa: E402,F401 (the Ray cluster fixture)

from rollwise.config import RunConfig, load_config  # noqa: E402
from rollwise.control.ray import placement as ray_placement  # noqa: E402
from rollwise.control.train_loop import train  # noqa: E402
from rollwise.engine.reference.engine import ReferenceEngine  # noqa: E402
from rollwise.types.generation import GenerationRequest, SamplingParams  # noqa: E402
from rollwise.model.loading import load_model, tokenizer_fingerprint  # noqa: E402
from rollwise.model.tiny import tiny_llama  # noqa: E402
from rollwise.sync import distributed  # noqa: E402
from rollwise.types.weight_update import WeightUpdate  # noqa: E402
from rollwise.types.weights import WeightUpdateError  # noqa: E402

PROMPTS = [[5, 17, 30, 42, 11], [9, 8, 7]]
WRONG_SHAPE = "model.layers.0.mlp.up_proj.weight"


def test_collective_sender_is_refused_without_ray_engine_actors():
    from pydantic import ValidationError

    base = {"task": {"kind": "reasoning_gym", "name": "basic_arithmetic"}}
    assert RunConfig.model_validate({**base, "placement": "ray", "sync": {"sender": "collective"}}).weight_sender \
        == "collective"
    for where in ({"placement": "local"}, {"pool": {"url": "http://127.0.0.1:1"}}):
        with pytest.raises(ValidationError, match=r"sync.sender='collective' cannot reach the engines.*"
                                                  r"sync.sender=auto.*or use placement=ray"):
            RunConfig.model_validate({**base, **where, "sync": {"sender": "collective"}})


def test_train_pushes_every_step_by_broadcast_and_engines_match_the_trainer(ray_cluster, tmp_path, monkeypatch):
    """Sync rollout: step 2 samples with the weights step 1 pushed over the group, so the trainer's
    recomputed logprobs equal the engines' (the mismatch every sender must reach, ~1e-5)."""
    cfg = load_config(ray_config(tmp_path, ray_cluster, mode="sync", steps=2),
                      ["sync.sender=collective", "checkpoint.every=0"])
    fleets = []
    monkeypatch.setattr(ray_placement, "FLEET_HOOKS", [fleets.append])
    monkeypatch.chdir(tmp_path)
    summary = train(cfg)

    (fleet,) = fleets
    assert fleet.collective is not None and fleet.collective.formed == 1  # joined once, at fleet start
    assert fleet.collective.pushes == 2  # one broadcast per step, none through the object store
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2] and summary["policy_version"] == 2
    assert all(r["mismatch_abs_logp"] < 1e-5 for r in records), [r["mismatch_abs_logp"] for r in records]
    assert summary["samples"]["trained"] == 2 * 4 * 4


# ---------------------------------------------------------------- one fleet, pushed to directly


def _greedy_local(state: dict[str, torch.Tensor] | None) -> list[tuple[list[int], list[float]]]:
    model, _ = load_model("tiny:0")
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=64, seed=0)
    if state is not None:
        engine.apply_weights(state, 1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    done = engine.generate([GenerationRequest(f"g{i}", p, params) for i, p in enumerate(PROMPTS)])
    return [(c.token_ids, c.logprobs) for c in sorted(done, key=lambda c: c.request_id)]


def _greedy_fleet(fleet, tag: str) -> list[tuple[list[int], list[float]]]:
    """The same greedy requests through the fleet (each GRPO-group key goes to one engine; two keys
    spread over both engines), with the version every token was sampled at."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fleet.submit([GenerationRequest(f"{tag}{i}", p, params) for i, p in enumerate(PROMPTS)])
    done = []
    while len(done) < len(PROMPTS):
        c = fleet.next_completion(timeout=30)
        assert c is not None, "the fleet returned nothing within 30 s"
        done.append(c)
    return [(c.token_ids, c.logprobs) for c in sorted(done, key=lambda c: c.request_id)]


def _same(got, expected) -> bool:
    return ([t for t, _ in got] == [t for t, _ in expected]
            and all(g == pytest.approx(w, abs=1e-5) for (_, g), (_, w) in zip(got, expected)))


def _versions(fleet) -> list[int]:
    return [ray.get(s.actor.model_info.remote()).policy_version for s in fleet.slots if s.alive]


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    """Until process `pid` (a killed actor's, on this host) has exited."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"the killed actor's process {pid} is still running"
        time.sleep(0.05)


def test_fleet_broadcast_applies_refuses_bad_updates_whole_and_rejoins_a_restarted_engine(
        ray_cluster, tmp_path, monkeypatch):
    cfg = load_config(ray_config(tmp_path, ray_cluster, mode="sync"),
                      ["sync.sender=collective", "ray.max_restarts=1"])
    model, tokenizer = load_model(cfg.model)
    fp = tokenizer_fingerprint(tokenizer)
    start = WeightUpdate.of_state(model.state_dict(), 0, fp)
    fleet, _, close = ray_placement.place_on_ray(cfg, fingerprint=fp, eos_ids=None, initial=start)
    try:
        assert fleet.collective is not None and fleet.collective.formed == 1 and fleet.collective.device == "cpu"
        new = tiny_llama(seed=1).state_dict()
        expected = _greedy_local(new)
        assert not _same(expected, _greedy_local(None))  # the two weight sets are told apart

        fleet.load_weights(WeightUpdate.of_state(new, 1, fp))
        assert _versions(fleet) == [1, 1]
        assert _same(_greedy_fleet(fleet, "a"), expected)

        # A mis-shaped tensor: every engine refuses it before reading a byte, each one named.
        bad = dict(new)
        bad[WRONG_SHAPE] = torch.zeros(bad[WRONG_SHAPE].shape[0] + 1, bad[WRONG_SHAPE].shape[1])
        with pytest.raises(WeightUpdateError, match=r"version 2 was rejected by 2 of 2 engines: engine 0: .*"
                                                    rf"{WRONG_SHAPE}: shape .*\| engine 1: "):
            fleet.load_weights(WeightUpdate.of_state(bad, 2, fp))

        # Damaged bytes: the manifest's checksum of bucket 0 is wrong (as if the bytes changed on the way).
        honest = distributed.build_manifest

        def wrong_checksum(*args, **kwargs):
            manifest = honest(*args, **kwargs)
            b0 = manifest.buckets[0]
            return manifest.model_copy(update={"buckets": (b0.model_copy(update={"checksum": (b0.checksum or 0) ^ 1}),
                                                           *manifest.buckets[1:])})

        with monkeypatch.context() as mp:
            mp.setattr(distributed, "build_manifest", wrong_checksum)
            with pytest.raises(WeightUpdateError, match=r"rejected by 2 of 2 engines: engine 0: .*checksum "
                                                        r"mismatch.*\| engine 1: .*checksum mismatch"):
                fleet.load_weights(WeightUpdate.of_state(tiny_llama(seed=2).state_dict(), 2, fp))
        # Both refusals left every engine serving version 1, and the group still works.
        assert _versions(fleet) == [1, 1]
        assert _same(_greedy_fleet(fleet, "b"), expected)
        assert fleet.collective.formed == 1

        # Engine 1 dies; the next push breaks on it, Ray restarts it (re-synced to version 1 through the
        # object store), the group is re-formed with the new incarnation and the push goes through.
        old_token, old_pid = fleet.slots[1].token, fleet.slots[1].info["pid"]
        ray.kill(fleet.slots[1].actor, no_restart=False)
        _wait_gone(old_pid)  # ray.kill returns before the process dies: a push in between still reaches it
        fleet.load_weights(WeightUpdate.of_state(new, 2, fp))
        assert fleet.slots[1].token != old_token and fleet.restarts == 1
        assert fleet.restart_log[0]["policy_version"] == 1  # re-synced to what every engine held then
        assert fleet.collective.formed == 2
        assert _versions(fleet) == [2, 2]
        assert _same(_greedy_fleet(fleet, "c"), expected)
    finally:
        fleet.close()
        close()
