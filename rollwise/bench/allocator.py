"""`rollwise bench allocator`: glibc's default malloc vs rollwise's allocator policies (rollwise.model.allocator).

Three arms, each a fresh child process that differs only in the environment it starts with (glibc reads
MALLOC_*_ when a process starts):

- `system`: none of the variables (glibc's defaults, ROLLWISE_MALLOC=system);
- `unbounded`: sessions 20-25's policy, every freed block kept for good (UNBOUNDED_ENVIRONMENT);
- `bounded`: today's default, rollwise.model.allocator.ENVIRONMENT (blocks up to 32 MiB reused from the heap,
  larger ones given back; the heap's free top kept up to 256 MiB).

Each child runs one workload on the bundled model (`--quick`: a tiny model) and reports its time per unit, the
minor page faults (memory faulted in), the kernel CPU seconds it took and its peak resident size:

- engine: reference-engine decode steps of 64 sequences (the sampler's logits, probabilities and CDF are
  ~75 MB of fresh buffers a step);
- train: default-shaped GRPO train steps (rollwise.bench.trainer.default_like_batch, 8 groups x 16).

Arms rotate, the first arm changing from round to round, so the machine's drift falls on all; ratios are per
round (arm / system), then the median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from rollwise.model.allocator import ENVIRONMENT, OPT_OUT, is_glibc_malloc_variable

WORKLOADS = ("engine", "train")
ARMS = ("system", "unbounded", "bounded")
# The policy before session 26, kept here as the comparison arm: nothing mmapped, nothing ever trimmed.
UNBOUNDED_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                         "MALLOC_TOP_PAD_": str(64 << 20)}


def arm_environment(arm: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not is_glibc_malloc_variable(k)}
    env[OPT_OUT] = "system"  # rollwise code in the child leaves glibc as the environment sets it
    if arm != "system":
        env.update(UNBOUNDED_ENVIRONMENT if arm == "unbounded" else ENVIRONMENT)
    return env


def _usage() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def _engine_units(quick: bool, units: int) -> list[tuple[float, float, int]]:
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.types.generation import GenerationRequest, SamplingParams
    from rollwise.model.loading import load_model

    model, _ = load_model("tiny:0" if quick else "bundled:smollm2-135m-instruct")
    sequences, prompt = (16, 32) if quick else (64, 150)
    engine = ReferenceEngine(model, max_num_seqs=sequences, max_model_len=prompt + units + 16, seed=0)
    vocab = int(model.config.vocab_size)
    params = SamplingParams(max_tokens=units + 8, ignore_eos=True)
    for i in range(sequences):
        engine.add_request(GenerationRequest(f"r{i}", [3 + (i * 7 + j) % (vocab - 3) for j in range(prompt)], params))
    for _ in range(4):  # the prefill, then warm decode steps
        engine.step()
    return [_timed(engine.step) for _ in range(units)]


def _train_units(quick: bool, units: int) -> list[tuple[float, float, int]]:
    from rollwise.bench.trainer import default_like_batch
    from rollwise.types.train_config import TrainConfig
    from rollwise.model.loading import load_model
    from rollwise.train.trainer import GRPOTrainer

    model, tokenizer = load_model("tiny:0" if quick else "bundled:smollm2-135m-instruct")
    groups, group_size, prompt_len, max_response = (2, 4, 16, 16) if quick else (8, 16, 100, 48)
    batch = default_like_batch(int(model.config.vocab_size), groups, group_size, prompt_len, max_response,
                               zero_groups=max(groups // 4, 1), seed=0)
    trainer = GRPOTrainer(model, TrainConfig(lr=1e-9, off_policy_correction="none"), pad_token_id=tokenizer.pad_token_id)
    trainer.train_step(batch)  # warm-up: optimizer state
    return [_timed(lambda: trainer.train_step(batch)) for _ in range(units)]


def _timed(unit: Any) -> tuple[float, float, int]:
    """(wall seconds, kernel CPU seconds, minor page faults) of one call."""
    stime0, faults0 = _usage()
    start = time.perf_counter()
    unit()
    wall = time.perf_counter() - start
    stime1, faults1 = _usage()
    return wall, stime1 - stime0, faults1 - faults0


def worker_main(argv: list[str]) -> None:
    """`python -m rollwise.bench.allocator --worker WORKLOAD [--quick] --units N`: one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=WORKLOADS, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--units", type=int, required=True)
    args = p.parse_args(argv)
    units = (_engine_units if args.worker == "engine" else _train_units)(args.quick, args.units)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
    print(json.dumps({"wall_s": [u[0] for u in units], "kernel_s": [u[1] for u in units],
                      "minor_faults": [u[2] for u in units], "peak_rss_gib": [peak_gb]}), flush=True)


def _run_child(workload: str, arm: str, quick: bool, units: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-m", "rollwise.bench.allocator", "--worker", workload, "--units", str(units),
                           *(["--quick"] if quick else [])],
                          env=arm_environment(arm), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the {arm} {workload} child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    return {key: statistics.median(values) for key, values in measured.items()}


def run_allocator_bench(quick: bool = False, pairs: int | None = None, workloads: tuple[str, ...] = WORKLOADS,
                        progress: Any = None) -> dict[str, Any]:
    pairs = pairs or (1 if quick else 3)
    units = {"engine": 6 if quick else 12, "train": 1 if quick else 2}
    result: dict[str, Any] = {"benchmark": "allocator", "quick": quick, "pairs": pairs, "arms": list(ARMS),
                              "environment": ENVIRONMENT, "unbounded_environment": UNBOUNDED_ENVIRONMENT,
                              "workloads": {}}
    for workload in workloads:
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for pair in range(pairs):
            for arm in ARMS[pair % len(ARMS):] + ARMS[:pair % len(ARMS)]:
                if progress:
                    progress(f"{workload}: round {pair + 1}/{pairs}, {arm}")
                runs[arm].append(_run_child(workload, arm, quick, units[workload]))
        summary: dict[str, Any] = {"runs": runs}
        for arm in ARMS[1:]:
            ratios = [a["wall_s"] / s["wall_s"] for s, a in zip(runs["system"], runs[arm])]
            summary[f"wall_ratio_{arm}_to_system"] = statistics.median(ratios)
            summary[f"wall_ratios_{arm}"] = ratios
        summary.update({f"{arm}_{key}": statistics.median(r[key] for r in runs[arm])
                        for arm in ARMS for key in ("wall_s", "kernel_s", "minor_faults", "peak_rss_gib")})
        result["workloads"][workload] = summary
    return result


def format_allocator_bench(result: dict[str, Any]) -> str:
    lines = [f"glibc malloc as it is (system) vs every freed block kept (unbounded) vs kept up to a "
             f"bound (bounded, the default); {result['pairs']} round(s) of fresh processes per workload; "
             "medians per unit (an engine step or a train step):"]
    for name, w in result["workloads"].items():
        lines.append(f"  {name}:")
        for arm in ARMS:
            ratio = "" if arm == "system" else f" | {arm} / system {w[f'wall_ratio_{arm}_to_system']:.3f}x"
            lines.append(f"    {arm:>9} {w[f'{arm}_wall_s'] * 1e3:8.1f} ms, {w[f'{arm}_minor_faults']:9,.0f} "
                         f"page faults, {w[f'{arm}_kernel_s'] * 1e3:7.1f} ms in the kernel, "
                         f"peak {w[f'{arm}_peak_rss_gib']:.2f} GiB{ratio}")
    return "\n".join(lines)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
