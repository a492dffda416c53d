"""Switch and migration costs at 8-4096 GPUs (issue 42): `rollwise sim switch-costs`.

A projection, not a simulation of every request: for a cluster of H100s with local NVMe serving an 8B model, each
engine switching jobs PlexRL's way (two jobs interleaved, 2 switches per GRPO step), it estimates with the pool's own
cost model (rollwise.pool.startup_cost: `estimate_start`, `estimate_migration`) what one switch costs from each tier
of the model cache, what draining a busy slot costs by waiting for its requests vs by migrating them, and how much of
PlexRL's multiplexing gain (37.58% fewer GPU-hours than dedicated engines) is kept once those costs are paid.

Figures and their sources (each can be overridden by a flag; all are assumptions at the stated precision):
- Llama-3.1-8B in bf16: 16 GB. ServerlessLLM's README (H100 + NVMe): safetensors loads it in 4.4 s (today's switch,
  a full load: ~3.6 GB/s), ServerlessLLM's format in 0.7 s: its disks read at least 16 GB / 0.7 s = ~23 GB/s, taken as
  the disk's read limit. rollwise's flat reader reads at `flat_read_efficiency` of the raw parallel read limit
  (0.88: `goals.vs_limit` measured by `rollwise bench load` on this machine, docs/bench/load.json), and copies each
  verified chunk to the GPU while it reads the next (rollwise.model.flat_reader), so a disk-tier load costs the
  slower of the read and the pinned PCIe copy. `flat_load_projection` = 4.4 s over that. Measured on an H200 since
  (docs/bench/load_gpu_h200.json): transformers 5's from_pretrained reads 6.2-6.4 GB/s from the page cache, not
  ServerlessLLM's 3.6, and the flat load 12.5-13.5 GB/s: 2.0-2.2x, not this projection's 5.5x.
- memory tier: pinned host memory to the GPU over PCIe Gen5 x16, 64 GB/s peak, ~40 GB/s assumed achieved.
- remote tier: a shared store of `--store-gbps` (100 GB/s assumed) split among the engines loading at once (all of
  them, when every job's step ends together), at most 12.5 GB/s per node (100 Gb/s NIC, 8 GPUs).
- a sleeping engine wakes in 0.5 s (vLLM sleep mode level 1: weights back from host memory is the memory tier; the
  KV cache re-allocated); building an engine around loaded weights: 2 s (CUDA graphs captured; an assumption).
- migration: the target prefills every token of the moved requests (prompt + generated) at 3.1e-5 s/token
  (rollwise/sim/configs/h100-7b.yaml's prefill, an H100 roofline at 50% MFU); decode steps 7.5 ms (same file).
- the requests a drained slot runs: 64 sequences, 1024-token prompts, output lengths lognormal (median 1024,
  sigma 1.0, capped at 8192), each at a uniformly random point of its generation when the drain starts; waiting
  costs the longest remaining one's decode steps.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from rollwise.pool.startup_cost import StartupCost, estimate_migration, estimate_start
from rollwise.sim.commands import SimCommand, write_json

PLEXRL_SAVING = 0.3758  # PlexRL: time-slicing full models used 37.58% fewer GPU-hours than dedicated engines


@dataclass(frozen=True)
class Assumptions:
    model_gb: float = 16.0
    safetensors_s: float = 4.4  # ServerlessLLM README, Llama-3.1-8B, H100 + NVMe
    serverlessllm_s: float = 0.7
    flat_read_efficiency: float = 0.88  # rollwise bench load, goals.vs_limit (this machine, idle)
    memory_gbps: float = 40.0
    store_gbps: float = 100.0
    node_gbps: float = 12.5
    gpus_per_node: int = 8
    wake_s: float = 0.5
    build_s: float = 2.0
    prefill_s_per_token: float = 3.1e-5
    decode_step_s: float = 0.0075
    running: int = 64
    prompt_tokens: int = 1024
    median_output: int = 1024
    output_sigma: float = 1.0
    max_output: int = 8192
    step_s: float = 60.0  # one GRPO step (generation + training) of a job
    switches_per_step: int = 2


def drain_costs(a: Assumptions, cost: StartupCost, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """(mean seconds to drain a busy slot by waiting, by migrating), over `draws` random batches."""
    rng = random.Random(seed)
    wait = migrate = 0.0
    for _ in range(draws):
        remaining, tokens = 0, 0
        for _ in range(a.running):
            length = min(a.max_output, max(1, int(rng.lognormvariate(math.log(a.median_output), a.output_sigma))))
            done = int(rng.random() * length)
            remaining = max(remaining, length - done)
            tokens += a.prompt_tokens + done
        wait += remaining * a.decode_step_s
        migrate += estimate_migration(cost, tokens)
    return wait / draws, migrate / draws


def flat_disk_gbps(a: Assumptions) -> float:
    """A flat checkpoint's load rate from local NVMe to the GPU: the reader's share of the disk's read limit, or the
    pinned PCIe copy where that is slower (the two overlap chunk by chunk)."""
    return min(a.flat_read_efficiency * a.model_gb / a.serverlessllm_s, a.memory_gbps)


def flat_load_projection(a: Assumptions) -> dict[str, Any]:
    """ServerlessLLM's safetensors load over the projected flat load, onto an H100 + NVMe."""
    ratio = a.safetensors_s / (a.model_gb / flat_disk_gbps(a))
    return {"safetensors_over_flat": ratio, "flat_s": a.model_gb / flat_disk_gbps(a), "safetensors_s": a.safetensors_s}


def project(sizes: list[int], a: Assumptions) -> list[dict[str, Any]]:
    nbytes = int(a.model_gb * 1e9)
    rows = []
    # a drain moves tokens within a node, whatever the cluster's size: the same at every size
    wait_s, migrate_s = drain_costs(a, StartupCost(migrate_s_per_token=a.prefill_s_per_token))
    for gpus in sizes:
        engines = gpus  # one 8B engine per GPU
        remote_gbps = min(a.node_gbps / a.gpus_per_node, a.store_gbps / engines)
        disk_gbps = flat_disk_gbps(a)
        cost = StartupCost(wake_s=a.wake_s, build_s=a.build_s, memory_gbps=a.memory_gbps, disk_gbps=disk_gbps,
                           remote_gbps=remote_gbps, migrate_s_per_token=a.prefill_s_per_token)
        starts = {where: estimate_start(cost, where, nbytes) for where in ("sleeping", "memory", "disk", "remote")}
        starts["today"] = a.build_s + a.safetensors_s  # a switch is a full safetensors load

        def kept(per_switch: float) -> float:
            """The share of PlexRL's saving left once each switch costs `per_switch` engine-seconds."""
            overhead = a.switches_per_step * per_switch / a.step_s
            return max(0.0, (PLEXRL_SAVING - (1 - PLEXRL_SAVING) * overhead) / PLEXRL_SAVING)

        rows.append({"gpus": gpus, "engines": engines, "start_s": starts, "drain_wait_s": wait_s,
                     "drain_migrate_s": migrate_s,
                     "gain_kept": {"idle_switch_" + w: kept(s) for w, s in starts.items()}
                     | {"drain_wait_then_memory": kept(wait_s + starts["memory"]),
                        "drain_migrate_then_memory": kept(migrate_s + starts["memory"])}})
    return rows


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="8,64,512,4096", help="cluster sizes in GPUs, comma-separated")
    p.add_argument("--step-s", type=float, default=Assumptions.step_s, help="seconds per GRPO step of a job")
    p.add_argument("--store-gbps", type=float, default=Assumptions.store_gbps,
                   help="the remote store's aggregate bandwidth (GB/s), shared by the engines loading at once")
    p.add_argument("--flat-read-efficiency", type=float, default=Assumptions.flat_read_efficiency,
                   help="the flat reader's share of the raw read limit (`rollwise bench load`'s goals.vs_limit)")


def _run(args: argparse.Namespace, console: Console) -> int:
    try:
        sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated GPU counts, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must name GPU counts >= 1, got {args.sizes!r}")
    if args.step_s <= 0 or args.store_gbps <= 0:
        raise ValueError("--step-s and --store-gbps must be > 0")
    if not 0 < args.flat_read_efficiency <= 1:
        raise ValueError(f"--flat-read-efficiency must be in (0, 1], got {args.flat_read_efficiency}")
    a = Assumptions(step_s=args.step_s, store_gbps=args.store_gbps, flat_read_efficiency=args.flat_read_efficiency)
    rows = project(sizes, a)
    table = Table(title=f"switch costs, {a.model_gb:g} GB model on H100 + NVMe (seconds; share of PlexRL's "
                        f"{PLEXRL_SAVING:.2%} saving kept at {a.step_s:g} s/step, {a.switches_per_step} switches)")
    for col in ("GPUs", "wake", "memory", "disk (flat)", "remote", "today", "drain: wait", "drain: migrate",
                "kept: memory", "kept: remote", "kept: today", "kept: wait+mem", "kept: migrate+mem"):
        table.add_column(col, justify="right")
    for r in rows:
        s, k = r["start_s"], r["gain_kept"]
        table.add_row(str(r["gpus"]), *(f"{s[w]:.2f}" for w in ("sleeping", "memory", "disk", "remote", "today")),
                      f"{r['drain_wait_s']:.1f}", f"{r['drain_migrate_s']:.2f}",
                      *(f"{k[key]:.0%}" for key in ("idle_switch_memory", "idle_switch_remote", "idle_switch_today",
                                                    "drain_wait_then_memory", "drain_migrate_then_memory")))
    console.print(table)
    load = flat_load_projection(a)
    console.print(f"A flat load onto the GPU from NVMe (projected): {load['flat_s']:.2f} s against ServerlessLLM's "
                  f"safetensors {a.safetensors_s:g} s = {load['safetensors_over_flat']:.2f}x (measured on an H200: "
                  "2.0-2.2x transformers 5's from_pretrained, docs/bench/load_gpu_h200.json)")
    console.print("Assumptions and sources: rollwise/sim/switch_costs.py (every figure is +-30% at best).")
    write_json(args.json, {"assumptions": asdict(a), "rows": rows, "flat_load_projection": load}, console)
    return 0


def command() -> SimCommand:
    return SimCommand("switch-costs", "project pool switch and migration costs at 8-4096 GPUs (issue 42)",
                      _add_arguments, _run)
