"""`rollwise serve pool ...`: its own argument parser (rollwise/cli.py hands the arguments over)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rollwise.pool.cache_settings import CacheSettings
from rollwise.serve.settings import add_front_arguments

DESCRIPTION = (
    "A shared engine pool: owns N reference engines and time-slices them across the `rollwise train` jobs that "
    "attach to it (`rollwise train pool.url=http://127.0.0.1:PORT pool.job=NAME pool.priority=P`). Each job brings "
    "its own model and policy versions; the pool places the job's engine on a slot and moves it through active / "
    "sleeping (KV freed, weights in host memory) / evicted (weights only in the pool's per-job store), timing every "
    "transition. A slot switches when its job has no work and another has (one job's generation fills another's "
    "training gap), and after --min-slice seconds when a job with less engine time per unit of priority waits. "
    "Every request and weight update carries its job's token: jobs never see each other's weights or samples. "
    "LoRA jobs (`rollwise train train.lora.rank=8 pool.url=...`) on one base share one engine per slot and run in "
    "one batch, each request with its own job's adapter: no switch between them. "
    "A load takes the job's weights (or adapter) from the fastest tier of the model cache that holds them "
    "(--cache-memory-gib, --cache-dir/--cache-disk-gib, else the job's pushed copy), and a waiting job goes to the "
    "free slot where it starts soonest (it sleeps there; else memory, disk, remote). "
    "GET /state shows slots, states, queues, per-job engine-hours and measured transition costs; /metrics is "
    "Prometheus text. "
    "Who may attach: with API keys (--api-keys FILE, or ROLLWISE_API_KEYS=k1,k2) a job attaches only with one "
    "(the trainer sends ROLLWISE_API_KEY); without keys the pool serves only a loopback --host (anyone on this "
    "machine may attach) unless --insecure-no-auth is given. A job whose weights or adapter fail on an engine is "
    "stopped with an error (its requests answered with it); the slot keeps serving the other jobs."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollwise serve pool", description=DESCRIPTION,
        epilog="example: rollwise serve pool --engines 1 --port 8300 & rollwise train model=tiny:0 "
               "pool.url=http://127.0.0.1:8300 pool.job=a & rollwise train model=tiny:1 "
               "pool.url=http://127.0.0.1:8300 pool.job=b pool.priority=2",
    )
    p.add_argument("--engines", type=int, default=1, metavar="N", help="engine slots (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=16, metavar="N",
                   help="sequences each engine generates at once (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=1024, metavar="N",
                   help="prompt + generated tokens per sequence (at most the model's positions) (default: %(default)s)")
    p.add_argument("--min-slice", type=float, default=5.0, metavar="S",
                   help="seconds a job with work keeps a slot before a more deserving job may take it "
                   "(default: %(default)s)")
    p.add_argument("--drain-by", default="migration", choices=["migration", "wait"],
                   help="how a slot drained for another job empties: migration moves its running requests to a "
                   "slot serving the same job when one has room (else waits); wait lets them finish there "
                   "(default: %(default)s)")
    p.add_argument("--max-sleeping", type=int, default=4, metavar="N",
                   help="sleeping engines kept per slot (host memory); more are evicted, least recently used "
                   "first (default: %(default)s)")
    p.add_argument("--job-timeout", type=float, default=120.0, metavar="S",
                   help="detach a job that made no call for S seconds (its trainer died without detaching; an "
                   "attached trainer polls several times a second) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads for the engines (0: torch's default) (default: %(default)s)")
    p.add_argument("--max-jobs", type=int, default=16, metavar="N",
                   help="jobs attached at once, all keys together; more get 429 (default: %(default)s)")
    p.add_argument("--max-jobs-per-key", type=int, default=None, metavar="N",
                   help="jobs attached at once with one API key; more get 429 (default: --max-jobs)")
    p.add_argument("--max-queued-per-job", type=int, default=4096, metavar="N",
                   help="requests a job may have in flight (queued or running); more get 429 with Retry-After "
                   "(default: %(default)s)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="host memory the pool lets its jobs hold (each job: its model, the pool's copy of its weights, "
                   "an engine per slot); an attach that does not fit gets 503 (default: 90%% of the memory "
                   "available at start)")
    p.add_argument("--cache-memory-gib", type=float, default=0.0, metavar="GIB",
                   help="host-memory tier of the model cache: the jobs' weights (and LoRA adapters) engines loaded "
                   "last, least recently used / lowest priority evicted first; 0: none (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="local-disk tier of the model cache: flat checkpoints under DIR (default: none)")
    p.add_argument("--cache-disk-gib", type=float, default=16.0, metavar="GIB",
                   help="bytes the disk tier may hold under --cache-dir (default: %(default)s)")
    add_front_arguments(p, port=8300)  # --host, --port, --api-keys, --insecure-no-auth, limits, drain, log level
    return p


def cache_settings(args: argparse.Namespace) -> CacheSettings:
    """The model cache's tiers from the flags; a bad size names its flag (ValueError)."""
    for flag, value in (("--cache-memory-gib", args.cache_memory_gib), ("--cache-disk-gib", args.cache_disk_gib)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a number of GiB >= 0, got {value}")
    return CacheSettings(memory_bytes=int(args.cache_memory_gib * 2**30),
                         disk_dir=None if args.cache_dir is None else Path(args.cache_dir),
                         disk_bytes=int(args.cache_disk_gib * 2**30))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from rollwise.pool.server import serve
    from rollwise.serve.front import Front

    try:
        if args.memory_budget is not None and not (math.isfinite(args.memory_budget) and args.memory_budget > 0):
            raise ValueError(f"--memory-budget must be a positive number of GiB, got {args.memory_budget}")
        budget = None if args.memory_budget is None else int(args.memory_budget * 2**30)
        cache = cache_settings(args)
        serve(args.engines, front=Front.from_args(args), max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, min_slice_s=args.min_slice, drain_by=args.drain_by, max_sleeping=args.max_sleeping,
              job_timeout_s=args.job_timeout, max_jobs=args.max_jobs, max_jobs_per_key=args.max_jobs_per_key,
              max_queued_per_job=args.max_queued_per_job, memory_budget_bytes=budget, cache=cache)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    return 0
