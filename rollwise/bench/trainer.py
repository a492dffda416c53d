"""`rollwise bench trainer`: one GRPO batch through 1 trainer rank (2 threads) and through 2 FSDP2
ranks (1 thread each) on this machine, side by side (issue 18).

Reported per setting: trained tokens/s; model-FLOPs utilisation, 6·N·trained tokens / (step time ·
measured peak), the peak being a timed large fp32 matmul on the same 2 threads (so MFU compares
against what this machine's cores actually do, not a datasheet); per-rank bytes of parameters,
gradients and optimizer state (each rank's shards) and the rank process's peak resident memory; and
the time to gather the weights from the ranks and push them into an engine through the checked
weight path, next to the single-process trainer's push.
Goals (issue 18): each of 2 ranks holds ≤ 0.6× the single-process parameter+gradient+optimizer
bytes, and the sharded push takes ≤ 1.5× the single-process push.

`rollwise bench trainer-step` (issue 23 item 2, `run_trainer_step_bench`): ONE train step of a batch
shaped like the default run's (8 groups × 16 samples, a ~100-token prompt, responses up to 48
tokens, two groups with zero advantage), under trainer variants ("arms": the train.* switches that
change how a step computes, not what it learns), run interleaved in one process (A, B, ..., B, A,
...) so that load from other work hits every arm alike. Reported: each arm's median step time and
its median ratio to the baseline arm over the rounds, and its MFU against a matmul peak measured in
the same run.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch import nn

from rollwise.types.engine_config import EngineConfig
from rollwise.types.train_config import TrainConfig, TrainerConfig
from rollwise.engine.factory import create_engine
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.observe.flops import DenseModel, training_flops
from rollwise.model.precision import resolve_dtype
from rollwise.observe.peak import measure_matmul
from rollwise.types.weight_update import WeightUpdate
from rollwise.train.sharded import ShardedTrainer
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.microbatch import chunk_samples
from rollwise.types.sample import Sample

THREADS = 2  # the machine's cores for the trainer: 1 rank × 2 threads, or 2 ranks × 1 thread
MEMORY_GOAL = 0.6  # each rank's parameter+gradient+optimizer bytes vs one process's
PUSH_GOAL = 1.5  # sharded gather+push time vs the single-process push
FINGERPRINT = "bench"


def measure_matmul_peak(threads: int, size: int, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of this machine's matmuls in `dtype` on `threads` threads (rollwise.observe.peak's
    measurement, uncached: the bench's peak is taken in the same run as its steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul("cpu", dtype, size)
    finally:
        torch.set_num_threads(before)


def bench_batch(vocab: int, groups: int, group_size: int, prompt_len: int, response_len: int,
                seed: int) -> list[Sample]:
    """GRPO groups of random tokens with nonzero advantages (every sample is trained)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            response = [rng.randrange(3, vocab) for _ in range(response_len)]
            advantage = (1.0 if i % 2 else -1.0) * rng.uniform(0.5, 1.5)
            samples.append(Sample(sample_id=f"{g}/{i}", group_id=str(g), problem_id=str(g), prompt_ids=prompt,
                                  response_ids=response, behaviour_logprobs=[-5.0] * response_len,
                                  versions=[0] * response_len, finish_reason="length", advantage=advantage))
    return samples


def loopback_bytes() -> int:
    """Bytes sent over this machine's loopback interface so far (/proc/net/dev): the local ranks'
    gloo collectives travel over TCP on 127.0.0.1, so the difference across a step is their traffic
    (on an idle machine; anything else on loopback is counted too). 0 where /proc is absent."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])  # transmit bytes
    except OSError:
        pass
    return 0


def _timed_push(trainer: Any, engine: Any) -> float:
    """Gather the full weights (from the ranks, for the sharded trainer) and commit them to `engine`."""
    start = time.perf_counter()
    WeightReceiver(engine, FINGERPRINT).receive(WeightUpdate.of_state(trainer.weights(), trainer.version, FINGERPRINT))
    return time.perf_counter() - start


def _run_setting(label: str, world_size: int, model: nn.Module, tokenizer: Any, cfg: TrainConfig,
                 batch: list[Sample], steps: int, engine: Any, params: int, peak: float) -> dict[str, Any]:
    trainer = ShardedTrainer(model, cfg, TrainerConfig(world_size=world_size, device="cpu"),
                             pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, threads=THREADS)
    try:
        trainer.train_step(batch)  # warm-up: first-step allocations and optimizer state
        sent, start = loopback_bytes(), time.perf_counter()
        metrics = [trainer.train_step(batch) for _ in range(steps)]
        tokens = sum(m["trained_tokens"] for m in metrics)
        step_s = (time.perf_counter() - start) / steps
        step_bytes = (loopback_bytes() - sent) / steps
        sent = loopback_bytes()
        push_s = _timed_push(trainer, engine)
        push_bytes = loopback_bytes() - sent
        memory = trainer.memory()
    finally:
        trainer.close()
    held = [m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in memory]
    return {"setting": label, "world_size": world_size, "threads_per_rank": THREADS // world_size,
            "step_s": step_s, "trained_tokens_per_step": tokens / steps,
            "trained_tokens_per_s": tokens / steps / step_s,
            "mfu": 6.0 * params * (tokens / steps) / (step_s * peak),
            "push_s": push_s, "ranks": memory, "max_rank_param_grad_optim_bytes": max(held),
            # Local ranks copy their shards into the shared landing inside each step (rank_main):
            # the gather's cost, paid in the step rather than at push time.
            "landing_s_per_step": sum(m.get("weights_landing_s", 0.0) for m in metrics) / steps,
            # What the simulator's collective model charges (rollwise.sim.cost.CollectiveModel): bytes
            # each rank sent per train step and per push, in units of the model's fp32 bytes.
            "collective_bytes_per_step_per_rank": step_bytes / world_size,
            "collective_model_bytes_per_step_per_rank": step_bytes / world_size / (4 * params),
            "micro_batches_per_rank": -(-len(chunk_samples(batch, cfg)[1]) // world_size),
            "push_collective_bytes": push_bytes}


def _single_process_push(model: nn.Module, tokenizer: Any, cfg: TrainConfig, engine: Any) -> float:
    """The world_size=1 trainer's push (weights in this process: no gather), best of two."""
    trainer = GRPOTrainer(copy.deepcopy(model), cfg, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer)
    return min(_timed_push(trainer, engine) for _ in range(2))


def run_trainer_bench(model: nn.Module, tokenizer: Any, *, model_spec: str, quick: bool = False,
                      seed: int = 0) -> dict[str, Any]:
    groups, group_size, prompt_len, response_len, steps, matmul = (
        (2, 4, 16, 32, 1, 1024) if quick else (4, 8, 64, 192, 3, 2048))
    cfg = TrainConfig(lr=1e-6, micro_batch_size=4, off_policy_correction="none")
    batch = bench_batch(int(model.config.vocab_size), groups, group_size, prompt_len, response_len, seed)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    peak = measure_matmul_peak(THREADS, matmul)
    engine = create_engine(EngineConfig(kind="reference"), copy.deepcopy(model), tokenizer, model_name=model_spec,
                           tokenizer_fingerprint=FINGERPRINT)
    single_push = _single_process_push(model, tokenizer, cfg, engine)
    rows = [_run_setting(f"{ws} rank{'s' if ws > 1 else ''} × {THREADS // ws} thread{'s' if ws == 1 else ''}",
                         ws, model, tokenizer, cfg, batch, steps, engine, params, peak) for ws in (1, 2)]
    one = rows[0]["max_rank_param_grad_optim_bytes"]
    for row in rows:
        row["param_grad_optim_vs_one_rank"] = row["max_rank_param_grad_optim_bytes"] / one
        row["push_vs_single_process"] = row["push_s"] / single_push
        row["push_with_landing_vs_single_process"] = (row["push_s"] + row["landing_s_per_step"]) / single_push
    two = rows[1]
    return {"benchmark": "trainer", "model": model_spec, "quick": quick, "parameters": params,
            "batch": {"samples": len(batch), "prompt_tokens": prompt_len, "response_tokens": response_len,
                      "micro_batch_size": cfg.micro_batch_size, "timed_steps": steps},
            "matmul_peak_flops": peak, "matmul_size": matmul, "threads": THREADS,
            "single_process_push_s": single_push, "rows": rows,
            "goals": {"memory_per_rank_vs_one_rank": {"goal": MEMORY_GOAL,
                                                      "measured": two["param_grad_optim_vs_one_rank"],
                                                      "met": two["param_grad_optim_vs_one_rank"] <= MEMORY_GOAL},
                      "push_vs_single_process": {"goal": PUSH_GOAL, "measured": two["push_vs_single_process"],
                                                 "met": two["push_vs_single_process"] <= PUSH_GOAL}}}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_trainer_bench(result: dict[str, Any]) -> Table:
    b = result["batch"]
    table = Table(title=f"trainer: {result['model']} ({result['parameters'] / 1e6:.1f}M parameters), "
                        f"{b['samples']} samples × ({b['prompt_tokens']}+{b['response_tokens']}) tokens, "
                        f"matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s on {result['threads']} threads")
    for col in ("setting", "step s", "trained tok/s", "MFU", "params MiB/rank", "grads MiB/rank",
                "optim MiB/rank", "P+G+O vs 1 rank", "peak RSS MiB/rank", "push s (+ in-step landing s)", "push vs 1 process (+ landing)",
                "collective model-bytes/micro-batch/rank"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in result["rows"]:
        ranks = row["ranks"]
        table.add_row(row["setting"], f"{row['step_s']:.2f}", f"{row['trained_tokens_per_s']:.0f}",
                      f"{row['mfu']:.1%}", "/".join(_mib(m["param_bytes"]) for m in ranks),
                      "/".join(_mib(m["grad_bytes"]) for m in ranks), "/".join(_mib(m["optim_bytes"]) for m in ranks),
                      f"{row['param_grad_optim_vs_one_rank']:.2f}×",
                      "/".join(_mib(m["peak_rss_bytes"]) for m in ranks),
                      f"{row['push_s']:.3f} (+{row['landing_s_per_step']:.3f})",
                      f"{row['push_vs_single_process']:.2f}× ({row['push_with_landing_vs_single_process']:.2f}×)",
                      f"{row['collective_model_bytes_per_step_per_rank'] / row['micro_batches_per_rank']:.2f}")
    goals = result["goals"]
    mem, push = goals["memory_per_rank_vs_one_rank"], goals["push_vs_single_process"]
    table.caption = (f"single-process push {result['single_process_push_s']:.3f} s; goals (2 ranks): "
                     f"P+G+O per rank ≤ {mem['goal']}× → {mem['measured']:.2f}× ({'met' if mem['met'] else 'NOT met'}), "
                     f"push ≤ {push['goal']}× → {push['measured']:.2f}× ({'met' if push['met'] else 'NOT met'})")
    return table


# ---------------------------------------------------------------- rollwise bench trainer-step

# Each arm is a set of train.* overrides on the default TrainConfig; "baseline" is the step before
# issue 23 item 2, "default" today's defaults. Ratios are to the baseline.
_BEFORE = {"fused_logprobs": False, "fused_optimizer": False, "pack_responses": False, "pack_groups": False}
STEP_ARMS: dict[str, dict[str, Any]] = {
    "baseline": _BEFORE,
    **{switch: {**_BEFORE, switch: True} for switch in list(_BEFORE)[:3]},  # each change on its own
    "pack_groups": {**_BEFORE, "pack_responses": True, "pack_groups": True},  # it extends pack_responses
    "default_without_pack_groups": {"pack_groups": False},  # today's defaults less the latest change
    "default": {},
    # mixed precision: matmuls in bfloat16 under autocast (its MFU is against the bf16 peak)
    "default_bfloat16": {"compute_dtype": "bfloat16"},
    # activation checkpointing (issue 41 item 7): decoder layers recomputed in the backward
    "default_checkpointing": {"gradient_checkpointing": True},
    # a smaller micro-batch token budget (issue 41 item 7): less activation memory, more micro-batches per step
    "default_micro_batch_1024": {"micro_batch_tokens": 1024},
    # LM-head chunk (issue 41 item 7; the default is 512): fewer [chunk, vocab] float32 temporaries in flight at
    # the same FLOPs, but one more weight-gradient accumulation per chunk
    "default_logprob_chunk_256": {"logprob_chunk_tokens": 256},
    "default_logprob_chunk_1024": {"logprob_chunk_tokens": 1024},
}


def default_like_batch(vocab: int, groups: int, group_size: int, prompt_len: int, max_response: int,
                       zero_groups: int, seed: int) -> list[Sample]:
    """GRPO groups like the default run's: one prompt per group, responses of 1/4 to all of
    `max_response` tokens, the first `zero_groups` groups with zero advantage (skipped by the trainer)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            length = rng.randint(max(max_response // 4, 1), max_response)
            advantage = 0.0 if g < zero_groups else (1.0 if i % 2 else -1.0) * rng.uniform(0.5, 1.5)
            samples.append(Sample(sample_id=f"{g}/{i}", group_id=str(g), problem_id=str(g), prompt_ids=prompt,
                                  response_ids=[rng.randrange(3, vocab) for _ in range(length)],
                                  behaviour_logprobs=[-5.0] * length, versions=[0] * length, finish_reason="stop",
                                  advantage=advantage))
    return samples


def _timed_step(trainer: GRPOTrainer, batch: list[Sample]) -> float:
    start = time.perf_counter()
    trainer.train_step(batch)
    return time.perf_counter() - start


def run_trainer_step_bench(model: nn.Module, tokenizer: Any, *, model_spec: str, quick: bool = False,
                           rounds: int = 3, arms: list[str] | None = None, groups: int | None = None,
                           seed: int = 0) -> dict[str, Any]:
    """Every arm's trainer shares `model` (lr 1e-9: the weights barely move, so each arm steps on the
    same weights) and keeps its own optimizer state; one warm-up step each, then `rounds` rounds,
    every other round in reverse order (drift in the machine's load falls on all arms alike)."""
    arms = arms or list(STEP_ARMS)
    unknown = [a for a in arms if a not in STEP_ARMS]
    if unknown or "baseline" not in arms:
        raise ValueError(f"trainer-step arms must include 'baseline' and be among {', '.join(STEP_ARMS)}; got {arms}")
    default_groups, group_size, prompt_len, max_response, matmul = (
        (2, 4, 16, 16, 512) if quick else (8, 16, 100, 48, 2048))
    groups = groups or default_groups
    batch = default_like_batch(int(model.config.vocab_size), groups, group_size, prompt_len, max_response,
                               zero_groups=max(groups // 4, 1) if groups > 1 else 0, seed=seed)
    base = dict(lr=1e-9, micro_batch_size=16, off_policy_correction="none")
    trainers = {arm: GRPOTrainer(model, TrainConfig(**base, **STEP_ARMS[arm]), pad_token_id=tokenizer.pad_token_id)
                for arm in arms}
    cfg = trainers["baseline"].cfg
    flops = training_flops(DenseModel.from_hf_config(model.config), batch, cfg,
                           skip_zero_advantage=cfg.skips_zero_advantage())
    threads = torch.get_num_threads()
    # each arm is held to the peak of the dtype its matmuls run in
    peaks = {dtype: measure_matmul_peak(threads, matmul, resolve_dtype(dtype))
             for dtype in {trainer.cfg.compute_dtype for trainer in trainers.values()}}
    peak = peaks[cfg.compute_dtype]
    for trainer in trainers.values():
        trainer.train_step(batch)  # warm-up: allocations, optimizer state
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            times[arm].append(_timed_step(trainers[arm], batch))
    rows = []
    for arm in arms:
        ratios = [t / b for t, b in zip(times[arm], times["baseline"])]
        step_s = statistics.median(times[arm])
        rows.append({"arm": arm, "overrides": STEP_ARMS[arm], "step_s": times[arm], "median_step_s": step_s,
                     "median_ratio_to_baseline": statistics.median(ratios),
                     "mfu": flops / (step_s * peaks[trainers[arm].cfg.compute_dtype]),
                     "peak_dtype": trainers[arm].cfg.compute_dtype})
    trained = [s for s in batch if s.advantage != 0.0]
    return {"benchmark": "trainer-step", "model": model_spec, "quick": quick, "rounds": rounds, "threads": threads,
            "batch": {"samples": len(batch), "trained_samples": len(trained), "groups": groups,
                      "prompt_tokens": prompt_len, "max_response_tokens": max_response,
                      "trained_tokens": sum(s.trained_tokens for s in trained)},
            "train_flops_per_step": flops, "matmul_peak_flops": peak,
            "matmul_peak_flops_by_dtype": peaks, "rows": rows}


def format_trainer_step_bench(result: dict[str, Any]) -> Table:
    b = result["batch"]
    table = Table(title=f"trainer-step: {result['model']}, {b['samples']} samples ({b['trained_samples']} trained, "
                        f"{b['trained_tokens']} tokens), {result['rounds']} interleaved rounds, "
                        "peak " + ", ".join(f"{dtype} {flops / 1e9:.1f}" for dtype, flops in
                                          result.get("matmul_peak_flops_by_dtype", {"float32": result["matmul_peak_flops"]}).items())
                        + f" GFLOP/s on {result['threads']} threads")
    for col in ("arm", "overrides", "median step s", "vs baseline (median of rounds)", "MFU"):
        table.add_column(col, justify="left" if col in ("arm", "overrides") else "right")
    for row in result["rows"]:
        table.add_row(row["arm"], ", ".join(f"{k}={v}" for k, v in row["overrides"].items()) or "(defaults)",
                      f"{row['median_step_s']:.2f}", f"{row['median_ratio_to_baseline']:.3f}×",
                      f"{row['mfu']:.1%} of {row.get('peak_dtype', 'float32')}")
    table.caption = "ratios from arms run interleaved in one process: valid on a loaded machine; step times are not"
    return table
