"""The sharded trainer (trainer.world_size=2): FSDP2 ranks on gloo compute one process's gradient,
push one process's weights through the checked path, and resume across world sizes (issue 18)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rollwise.config import ConfigError, load_config
from rollwise.types.train_config import TrainConfig, TrainerConfig
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.types.weight_update import WeightUpdate
from rollwise.train.distributed import RankSpec, free_port, init_rank
from rollwise.train.rank import RankTrainer
from rollwise.train.sharded import ShardedTrainer, split_work
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample
from random_groups import random_groups
from test_resume import _write_config, setup  # noqa: F401  (setup: test_resume's warmed-up tiny model fixture)

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks need 2 CPU cores")


def _samples(seed: int, groups: int = 3, group_size: int = 3) -> list[Sample]:
    return random_groups(seed, "advantage", groups, group_size)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(lr=1e-3, micro_batch_size=2, off_policy_correction="none", **kw)


def _single_gradients(cfg: TrainConfig, samples: list[Sample]) -> dict[str, torch.Tensor]:
    trainer = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=0)
    grads: dict[str, torch.Tensor] = {}
    trainer.before_step = lambda m: grads.update({n: p.grad.clone() for n, p in m.named_parameters()})
    trainer.train_step(samples)
    return grads


def _rank_gradients(rank: int, port: int, cfg: TrainConfig, samples: list[Sample], out: dict) -> None:
    spec = RankSpec(rank, 2, port, "cpu", threads=1)
    trainer = RankTrainer(tiny_llama(seed=3), cfg, spec, init_rank(spec), pad_token_id=0, temperature=1.0)
    work = split_work(samples, cfg, 2)

    def gather(model):  # every rank all-gathers; rank 0 reports the full gradients
        full = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        if rank == 0:
            out.update(full)
    trainer.before_step = gather
    trainer.train(work[rank])
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("loss_agg,share,recompute", [
    ("token_mean", True, False), ("seq_mean_token_mean", True, False), ("token_mean", False, False),
    ("seq_mean_token_mean", False, False),
    ("token_mean", False, True),  # activation checkpointing: the recompute re-gathers the layer's shards
    ("token_mean", True, "selective"),  # selective: matmul outputs kept, the rest recomputed over gathered shards
])
def test_two_ranks_compute_the_single_process_gradient(loss_agg, share, recompute):
    cfg = _cfg(loss_agg=loss_agg, share_prompt_prefix=share, gradient_checkpointing=recompute)
    samples = _samples(seed=1)
    work = split_work(samples, cfg, 2)
    tokens = [int(w.weights.numel()) for w in work]
    assert tokens[0] != tokens[1] and min(tokens) > 0  # unequal, both ranks train
    expected = _single_gradients(cfg, samples)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_gradients, args=(free_port(), cfg, samples, out), nprocs=2)
        got = dict(out)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        rel = float((got[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30))
        assert rel <= 1e-5, f"{name}: max relative error {rel:.2e}"


def test_split_work_balances_tokens_and_pads_micro_batches():
    cfg = _cfg(share_prompt_prefix=False)
    samples = _samples(seed=2, groups=4)
    work = split_work(samples, cfg, 2)
    costs = [sum(len(s.prompt_ids) + len(s.response_ids) for c in w.chunks for s in c) for w in work]
    assert abs(costs[0] - costs[1]) <= max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert len(work[0].chunks) + work[0].padding == len(work[1].chunks) + work[1].padding
    # The global weights: every trained token of the batch, each exactly once.
    assert sum(float(w.weights.sum()) for w in work) == pytest.approx(1.0, abs=1e-6)


def test_world_size_the_machine_cannot_hold_is_refused():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"trainer.world_size={cores + 1}.*at most {cores}"):
        load_config(None, [f"trainer.world_size={cores + 1}"])
    assert load_config(None, ["trainer.world_size=2"]).trainer.world_size == 2


def _tok_pad():
    tok = tiny_tokenizer()
    return tok, tok.pad_token_id


def test_push_from_shards_equals_the_single_process_push(tmp_path):
    from rollwise.engine.factory import create_engine
    from rollwise.types.engine_config import EngineConfig

    cfg = _cfg()
    tok, pad = _tok_pad()
    single = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=pad, tokenizer=tok)
    sharded = ShardedTrainer(tiny_llama(seed=3), cfg, TrainerConfig(world_size=2, device="cpu"), pad_token_id=pad,
                             tokenizer=tok, bucket_mb=0.01)  # many buckets
    try:
        before = sharded.weights()
        reference = single.weights()
        assert list(before) == list(reference)
        for name in reference:
            assert torch.equal(before[name], reference[name]), name
        samples = _samples(seed=4)
        single.train_step(samples)
        metrics = sharded.train_step(samples)
        assert sharded.version == single.version == 1
        assert metrics["trained_tokens"] == sum(s.trained_tokens for s in samples)
        after = sharded.weights()
        ref_update = WeightUpdate.of_state(single.weights(), 1, "fp")
        update = WeightUpdate.of_state(after, sharded.version, "fp")
        assert update.manifest.aliases == ref_update.manifest.aliases  # tied embeddings sent once
        assert [b.tensors for b in update.manifest.buckets] == [b.tensors for b in ref_update.manifest.buckets]
        for name, tensor in ref_update.tensors().items():
            # float noise of the reduction order, which Adam's normalisation can lift to ~1e-6 on a weight
            # with a near-zero gradient; a lost or doubled update would move it by ~lr = 1e-3
            torch.testing.assert_close(update.tensors()[name], tensor, rtol=1e-5, atol=1e-5)
        # Through the engine's checked commit, as a local run pushes it.
        engine = create_engine(EngineConfig(kind="reference"), tiny_llama(seed=3), tok, model_name="tiny",
                               tokenizer_fingerprint="fp")
        WeightReceiver(engine, "fp").receive(update)
        state = engine.model.state_dict()
        for name, tensor in after.items():
            assert torch.equal(state[name], tensor), name
    finally:
        sharded.close()


def _resume_run(tmp_path, first_ws: int, second_ws: int):
    """Two steps at first_ws, a checkpoint, then one step at second_ws; against three straight steps
    in one process. The checkpoint is restored bit for bit; the step after it matches the straight
    run to float noise (a lost Adam state would move weights by ~lr = 1e-3)."""
    cfg = _cfg()
    tok, pad = _tok_pad()

    def make(ws):
        if ws == 1:
            return GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=pad, tokenizer=tok)
        return ShardedTrainer(tiny_llama(seed=4), cfg, TrainerConfig(world_size=ws, device="cpu"),
                              pad_token_id=pad, tokenizer=tok)

    def close(t):
        if isinstance(t, ShardedTrainer):
            t.close()

    straight = make(1)
    for step in range(3):
        straight.train_step(_samples(seed=10 + step))
    a = make(first_ws)
    if first_ws > 1:  # the sharded trainer starts from another init: the checkpoint must override it
        a.close()
        a = ShardedTrainer(tiny_llama(seed=3), cfg, TrainerConfig(world_size=first_ws, device="cpu"),
                           pad_token_id=pad, tokenizer=tok)
    try:
        for step in range(2):
            a.train_step(_samples(seed=10 + step))
        ckpt = a.save_checkpoint(tmp_path, 2, {}, keep_last=1)
        saved = {n: t.clone() for n, t in a.weights().items()}
    finally:
        close(a)
    b = make(second_ws)
    if second_ws == 1:
        b.model.load_state_dict(tiny_llama(seed=4).state_dict())
    try:
        assert b.load_checkpoint(ckpt)["step"] == 2 and b.version == 2
        restored = b.weights()
        for name, tensor in saved.items():
            assert torch.equal(restored[name], tensor), name
        b.train_step(_samples(seed=12))
        assert b.version == 3
        got = b.weights()
    finally:
        close(b)
    for name, tensor in straight.weights().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-5, msg=name)


def test_resume_two_ranks_to_one(tmp_path):
    _resume_run(tmp_path, 2, 1)


def test_resume_one_rank_to_two(tmp_path):
    _resume_run(tmp_path, 1, 2)


def test_train_loop_with_two_ranks(setup, tmp_path):
    """`rollwise train trainer.world_size=2` through the real loop on a tiny model: the ranks train
    (a warmed-up tiny model, so groups carry signal), push to the engine, and checkpoint with DCP."""
    import io
    import json

    from rich.console import Console
    from rollwise.control.train_loop import train

    task_path, model_dir = setup
    out = tmp_path / "run"
    cfg = _write_config(tmp_path / "c.yaml", task_path, str(model_dir), out, steps=2, every=2)
    summary = train(load_config(cfg, ["trainer.world_size=2"]), Console(file=io.StringIO()))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert any(r["trained_tokens"] > 0 for r in records)
    assert summary is not None and (out / "checkpoints" / "step_000002" / "dcp").is_dir()

    # The same run with torchrun starting the two ranks (rank 0 drives, rank 1 follows): the same
    # steps on the same samples, so the same losses and the same weight update. (Not bit-equal weights:
    # the engine's batches can form differently under load, moving logprobs by float noise, and Adam
    # turns noise on near-zero gradients into +-lr; the update as a whole must agree.)
    import subprocess
    import sys

    from safetensors.torch import load_file

    out2 = tmp_path / "run_torchrun"
    cfg2 = _write_config(tmp_path / "c2.yaml", task_path, str(model_dir), out2, steps=2, every=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "rollwise.cli", "train", "--config", str(cfg2), "trainer.world_size=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records2 = [json.loads(line) for line in (out2 / "metrics.jsonl").read_text().splitlines()]
    assert [r["trained_tokens"] for r in records2] == [r["trained_tokens"] for r in records]
    for a, b in zip(records, records2):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])

    def weights(directory):
        return {n: t for f in directory.glob("*.safetensors") for n, t in load_file(f).items()}

    start = weights(model_dir)
    final = weights(out / "checkpoints" / "step_000002" / "model")
    final2 = weights(out2 / "checkpoints" / "step_000002" / "model")
    assert final.keys() == final2.keys()
    names = [n for n in final if n in start]  # a tied LM head is stored once in the starting model
    update = torch.cat([(final[n] - start[n]).flatten() for n in names])
    update2 = torch.cat([(final2[n] - start[n]).flatten() for n in names])
    assert update.norm() > 0
    assert (update2 - update).norm() <= 0.05 * update.norm(), ((update2 - update).norm(), update.norm())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (a rank idle at its pipe uses none)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_rank_killed_mid_step_fails_clearly_then_resume_trains(tmp_path):
    """SIGKILL rank 1 while a step runs: the step fails within seconds naming rank 1 and the resume
    key, rank 0 (blocked in a collective with the dead rank) is stopped too, and a new trainer
    resumes from the last checkpoint and trains."""
    import signal
    import threading
    import time

    from rollwise.train.rank_group import TrainerRankError

    cfg = TrainConfig(lr=1e-3, micro_batch_size=1, off_policy_correction="none")
    tok, pad = _tok_pad()
    trainer = ShardedTrainer(tiny_llama(seed=3), cfg, TrainerConfig(world_size=2, device="cpu"),
                             pad_token_id=pad, tokenizer=tok)
    try:
        trainer.train_step(_samples(seed=20))
        ckpt = trainer.save_checkpoint(tmp_path, 1, {}, keep_last=1)
        saved = {name: t.clone() for name, t in trainer.weights().items()}  # valid until the next command
        long_step = [s for seed in range(30, 36) for s in _samples(seed=seed, groups=4, group_size=4)]
        for s in long_step:  # long responses, one sample per micro-batch: a step of many collectives
            s.response_ids = s.response_ids * 20
            s.behaviour_logprobs, s.versions = [-4.5] * len(s.response_ids), [0] * len(s.response_ids)
        victim = trainer.group.ranks[1].process
        idle = _cpu_seconds(victim.pid)
        failure: list[BaseException] = []

        def step() -> None:
            # Steps repeat until one fails: however fast this machine is, the kill below lands
            # inside a step (a single step could finish before rank 1 shows CPU time).
            try:
                while True:
                    trainer.train_step(long_step)
            except BaseException as e:  # noqa: BLE001 (handed to the test thread)
                failure.append(e)

        thread = threading.Thread(target=step)
        thread.start()
        while _cpu_seconds(victim.pid) < idle + 0.3:  # rank 1 is computing: the step is under way
            time.sleep(0.01)
        assert thread.is_alive() and not failure, failure
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(timeout=60)
        assert not thread.is_alive(), "train_step hung after a rank died"
        assert time.monotonic() - killed_at < 30
        assert len(failure) == 1 and isinstance(failure[0], TrainerRankError)
        message = str(failure[0])
        assert "rank 1 (exit code -9) died during train" in message
        assert "checkpoint.resume=auto" in message
        assert not any(r.process.is_alive() for r in trainer.group.ranks)  # rank 0 stopped too
    finally:
        trainer.close()
    resumed = ShardedTrainer(tiny_llama(seed=4), cfg, TrainerConfig(world_size=2, device="cpu"),
                             pad_token_id=pad, tokenizer=tok)
    try:
        assert resumed.load_checkpoint(ckpt)["step"] == 1 and resumed.version == 1
        for name, tensor in resumed.weights().items():
            assert torch.equal(tensor, saved[name]), name
        metrics = resumed.train_step(_samples(seed=21))
        assert resumed.version == 2 and metrics["trained_tokens"] > 0
    finally:
        resumed.close()


def test_bench_trainer_quick_runs_and_two_ranks_halve_the_training_state():
    """`rollwise bench trainer --quick` end to end (not for numbers): both settings train the batch,
    and each of 2 ranks holds half the parameter+gradient+optimizer bytes of 1 rank (FSDP2 shards)."""
    from rollwise.bench.trainer import format_trainer_bench, run_trainer_bench
    from rollwise.model.loading import load_model

    model, tok = load_model("tiny:0")
    result = run_trainer_bench(model, tok, model_spec="tiny:0", quick=True)
    one, two = result["rows"]
    assert one["trained_tokens_per_step"] == two["trained_tokens_per_step"] == 8 * 32
    assert len(one["ranks"]) == 1 and len(two["ranks"]) == 2
    assert all(r["grad_bytes"] > 0 and r["optim_bytes"] > 0 for r in one["ranks"] + two["ranks"])
    assert 0.45 <= two["param_grad_optim_vs_one_rank"] <= 0.6 and result["goals"]["memory_per_rank_vs_one_rank"]["met"]
    assert result["matmul_peak_flops"] > 0 and 0 < two["mfu"] < 1
    assert format_trainer_bench(result).row_count == 2


def test_spawning_ranks_inside_a_torchrun_process_is_refused(monkeypatch):
    """Under torchrun, ShardedTrainer(model, ...) would spawn N ranks in every process: refused,
    naming the ways that work (`rollwise train` under torchrun joins the launched ranks instead)."""
    from rollwise.train.rank_group import TrainerRankError

    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainerRankError, match=r"torchrun.*--nproc-per-node=N -m rollwise.cli train trainer.world_size=N.*without torchrun"):
        ShardedTrainer(tiny_llama(seed=3), _cfg(), TrainerConfig(world_size=2, device="cpu"), pad_token_id=0)


def test_one_rank_bf16_mixed_precision_trains_close_to_fp32():
    """trainer.mixed_precision=bf16 at world size 1 runs a one-rank FSDP2 group (the path a single
    GPU takes, on gloo here): bf16 compute, fp32 master weights and reduction, so the step's loss and
    gradient norm stay within bf16 noise of fp32 and the pushed weights are fp32."""
    from rollwise.control.placement.base import needs_ranks

    assert not needs_ranks(TrainerConfig(device="cpu"))
    assert needs_ranks(TrainerConfig(device="cpu", mixed_precision="bf16"))
    assert load_config(None, ["trainer.mixed_precision=bf16"]).trainer.world_size == 1
    tok, pad = _tok_pad()
    results = {}
    for mp_policy in ("none", "bf16"):
        t = ShardedTrainer(tiny_llama(seed=3), _cfg(), TrainerConfig(world_size=1, device="cpu",
                                                                     mixed_precision=mp_policy),
                           pad_token_id=pad, tokenizer=tok)
        try:
            results[mp_policy] = (t.train_step(_samples(seed=4)), t.weights())
        finally:
            t.close()
    single = GRPOTrainer(tiny_llama(seed=3), _cfg(), pad_token_id=pad).train_step(_samples(seed=4))
    fp32, bf16 = results["none"][0], results["bf16"][0]
    assert fp32["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert bf16["loss"] != fp32["loss"]  # the policy really computed in bf16
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2, abs=2e-3)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2)
    assert all(w.dtype == torch.float32 for w in results["bf16"][1].values())
