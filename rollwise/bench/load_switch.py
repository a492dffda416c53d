"""`rollwise bench load`'s switch section (`--switch`: that section alone): a pool job switch from each tier of
the pool's model cache against today's switch, a full load (issue 42, item 2's benchmark goal).

One real pool (rollwise.pool.engine_pool, in this process, its reference engines, one slot, nothing kept
sleeping) with three full-parameter jobs of the same model: every switch after the first recycles the outgoing
job's engine for the incoming one (its weights replaced from the tier: Engine.replace_weights), as the pool does
between full jobs of one model; the first builds one. The
tiered cache's priorities pin each job to one tier: the memory tier holds one model (job `memory`, priority 3),
the disk tier two (`memory`'s and `disk`'s flat checkpoints; `disk`, priority 2, never displaces `memory` in
the memory tier), and `remote` (priority 1) fits in neither, so it always comes from the job's store: the
weights it pushed, referenced in host memory, which is what every switch did before issue 42. The slot goes
round memory, disk, remote; each switch's seconds are the pool's own (the load transition /state reports: the
engine recycled, or built around the job's model, its weights fetched from the tier and applied), and the tier it names is
checked against the job's (a mismatch fails the run).

Today's switch, a full load, is timed beside them in the same rounds: the job's model directory through
`transformers.from_pretrained`, then the same engine build with those weights applied (the pool's own
TenantEngines): the pool's switch with from_pretrained as its weight source. `parts` times the pieces alone
(engine build, apply_weights, flat read, from_pretrained), to show where a switch's time goes.

Cache states: page cache (every file read before), and, full run only, disk: the tier's flat files and the model
directory evicted before each of their rounds (rollwise.bench.load_arms.evict). Arms interleave; medians.
`goals.switch_memory_vs_full_load` = full load / memory-tier switch, the worst over models and cache states.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rollwise.bench import load_arms as arms
from rollwise.model.flat_reader import read_flat
from rollwise.model.loading import BUNDLED_PREFIX, cache_dir, load_model, resolve_model_path
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.jobs import Job
from rollwise.pool.model_cache import weights_bytes
from rollwise.pool.scheduler import Policy
from rollwise.pool.startup_cost import Tier
from rollwise.types.generation import SamplingParams

SWITCH_GOAL = 5.0
PRIORITY: dict[Tier, float] = {"memory": 3.0, "disk": 2.0, "remote": 1.0}  # job name = the tier that serves it
FULL_LOAD = "full load (from_pretrained)"
ARM_NAMES: dict[str, str] = {"memory": "memory tier", "disk": "disk tier (flat checkpoint)",
                             "remote": "remote tier (pushed weights in host memory: the pool before issue 42)"}


class SwitchRig:
    """A one-slot pool whose three jobs load from the memory, disk and remote tier respectively."""

    def __init__(self, spec: str, model: torch.nn.Module, tokenizer: Any, disk_dir: Path, *,
                 max_num_seqs: int = 16, max_model_len: int = 1024) -> None:
        state = model.state_dict()
        nbytes = weights_bytes(state)
        self.disk_dir = disk_dir
        self.pool = EnginePool(1, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               policy=Policy(min_slice_s=0.0), max_sleeping=0,  # every switch back is a load
                               cache=CacheSettings(memory_bytes=nbytes, disk_dir=disk_dir, disk_bytes=2 * nbytes))
        self.pool.start()
        self.jobs: dict[Tier, Job] = {}
        for tier, priority in PRIORITY.items():
            job = self.pool.attach(tier, spec, priority, None, loaded=(model, tokenizer))
            self.pool.push_weights(job, state, 1)  # the model's own weights, as a trainer's first push
            self.jobs[tier] = job
        self._requests = 0

    def switch(self, tier: Tier, timeout: float = 600.0) -> tuple[str, float]:
        """Switch the slot to job `tier` (one 1-token request of it): (the tier the pool says served it, the load
        transition's seconds)."""
        job = self.jobs[tier]
        done = threading.Event()
        self._requests += 1
        self.pool.submit(job, [(f"r{self._requests}", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))],
                         waiter=done)
        if not done.wait(timeout):
            raise RuntimeError(f"bench load --switch: job {tier!r}'s request did not finish in {timeout:.0f} s "
                               f"(slot errors: {self.pool.state()['slots'][0]['errors']})")
        loads = [t for t in self.pool.state()["transitions"] if t["kind"] == "load" and t["job"] == tier]
        if not loads:
            raise RuntimeError(f"bench load --switch: job {tier!r} ran without a load (was its engine kept?)")
        reason = loads[-1]["reason"]  # "recycle (memory tier) for memory (after remote)", or "load (...": built
        served = reason.split("(", 1)[1].split(" tier", 1)[0] if reason.startswith(("load (", "recycle (")) else reason
        return served, float(loads[-1]["seconds"])

    def full_load(self, hf_dir: Path, dtype: torch.dtype) -> float:
        """Today's switch for job `memory`, timed: from_pretrained of its model directory, then the pool's engine
        build with those weights applied."""
        job = self.jobs["memory"]
        t = time.perf_counter()
        loaded = arms.from_pretrained(hf_dir, dtype)
        engine = self.pool.engines.new(job)
        engine.apply_weights(loaded.state_dict(), job.version)
        seconds = time.perf_counter() - t
        del engine, loaded
        gc.collect()
        return seconds

    def close(self) -> None:
        self.pool.close()


def _prepare(spec: str, work: Path) -> tuple[torch.nn.Module, Any, Path, torch.dtype]:
    """(model, tokenizer, its Hugging Face directory, dtype): a bundled model's own directory; a shape or tiny
    model written once under `work`."""
    if spec.startswith("shape:"):
        from rollwise.bench.sync import load_bench_model

        model, tokenizer = load_bench_model(spec)
        model = model.to(torch.bfloat16)
    else:
        model, tokenizer = load_model(spec)
    model.eval()
    if spec.startswith(BUNDLED_PREFIX):
        hf_dir = resolve_model_path(spec)
    else:
        hf_dir = work / "hf"
        model.save_pretrained(hf_dir, safe_serialization=True)
    return model, tokenizer, hf_dir, next(model.parameters()).dtype


def _median_parts(rig: SwitchRig, hf_dir: Path, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Each piece of a switch alone (job `memory`'s): where the time goes. One extra engine at a time (the 1B
    shape's fp32 engine is ~6 GB with its KV cache)."""
    job = rig.jobs["memory"]
    flat = next(p for p in rig.disk_dir.iterdir() if p.is_dir())  # a flat checkpoint of this model
    names = ("engine build (template copy + KV cache)", "apply_weights (checks + copy)", "flat read (checksums)",
             "from_pretrained")
    out: dict[str, list[float]] = {name: [] for name in names}

    def timed(name: str, fn: Callable[[], object]) -> object:
        t = time.perf_counter()
        result = fn()
        out[name].append(time.perf_counter() - t)
        return result

    for _ in range(repeats):
        engine: Any = timed(names[0], lambda: rig.pool.engines.new(job))
        timed(names[1], lambda e=engine: e.apply_weights(job.weights, job.version))
        del engine
        gc.collect()
        for name, fn in ((names[2], lambda: read_flat(flat).state),
                         (names[3], lambda: arms.from_pretrained(hf_dir, dtype))):
            result = timed(name, fn)
            del result
            gc.collect()
    return {name: round(statistics.median(ts), 5) for name, ts in out.items()}


def _measure(rig: SwitchRig, hf_dir: Path, dtype: torch.dtype, repeats: int, cold: str | None) -> dict[str, Any]:
    """`repeats` rounds, each one switch per tier and one full load (cold: their files evicted first)."""
    times: dict[str, list[float]] = {name: [] for name in [*ARM_NAMES.values(), FULL_LOAD]}
    for _ in range(repeats):
        for tier in PRIORITY:
            if cold is not None and tier == "disk":
                arms.evict([f for f in rig.disk_dir.rglob("*") if f.is_file()], cold)
            served, seconds = rig.switch(tier)
            if served != tier:
                raise RuntimeError(f"bench load --switch: job {tier!r} was served by the {served} tier, not its own "
                                   "(the cache's budgets or priorities no longer pin it)")
            times[ARM_NAMES[tier]].append(seconds)
        if cold is not None:
            arms.evict([f for f in hf_dir.iterdir() if f.is_file()], cold)
        times[FULL_LOAD].append(rig.full_load(hf_dir, dtype))
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    memory = seconds[ARM_NAMES["memory"]]
    return {"arms": {name: {"seconds": round(s, 5)} for name, s in seconds.items()},
            "memory_vs_full_load": round(seconds[FULL_LOAD] / memory, 3),
            "disk_vs_full_load": round(seconds[FULL_LOAD] / seconds[ARM_NAMES["disk"]], 3),
            "memory_vs_remote": round(seconds[ARM_NAMES["remote"]] / memory, 3)}


def run_switch_bench(*, quick: bool, repeats: int | None = None, specs: list[str] | None = None,
                     progress: Callable[[str], None] = print, max_num_seqs: int = 16,
                     max_model_len: int = 1024) -> dict[str, Any]:
    """The switch section: per model and cache state, the arms' median seconds and ratios; `goals` the worst."""
    repeats = repeats or (3 if quick else 5)
    specs = specs or (["bundled:smollm2-135m-instruct"] if quick
                      else ["bundled:smollm2-135m-instruct", "shape:llama-3.2-1b"])
    method, why = ("none", "--quick: page cache only") if quick else arms.drop_method()
    root = cache_dir() / "bench-load"
    root.mkdir(parents=True, exist_ok=True)
    models: dict[str, Any] = {}
    for spec in specs:
        work = Path(tempfile.mkdtemp(prefix="switch.", dir=root))
        rig = None
        try:
            progress(f"switch: {spec}, a one-slot pool with a job per tier")
            model, tokenizer, hf_dir, dtype = _prepare(spec, work)
            rig = SwitchRig(spec, model, tokenizer, work / "disk-tier", max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
            warm = {tier: rig.switch(tier)[0] for tier in PRIORITY}  # first loads: remote, written to the tiers
            rig.full_load(hf_dir, dtype)
            entry: dict[str, Any] = {"bytes": weights_bytes(model.state_dict()), "dtype": str(dtype),
                                     "first_loads": warm}
            progress(f"switch: {spec}: page cache, {repeats} rounds")
            entry["page_cache"] = _measure(rig, hf_dir, dtype, repeats, None)
            if method != "none":
                progress(f"switch: {spec}: cold ({method}), {repeats} rounds")
                entry["disk"] = _measure(rig, hf_dir, dtype, repeats, method)
            entry["parts"] = _median_parts(rig, hf_dir, dtype, repeats)
            entry["cache"] = {t: {k: v for k, v in r.items() if k != "entries"} if isinstance(r, dict) else r
                              for t, r in rig.pool.state()["model_cache"].items()}
            models[spec] = entry
        finally:
            if rig is not None:
                rig.close()
            shutil.rmtree(work, ignore_errors=True)
    cases = [case for entry in models.values() for key in ("page_cache", "disk") if (case := entry.get(key))]
    worst = min(case["memory_vs_full_load"] for case in cases)
    return {"quick": quick, "repeats": repeats, "cold": {"method": method, "note": why},
            "pool": {"engine": "reference", "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                     "max_sleeping": 0},
            "models": models,
            "goal": {"switch_memory_vs_full_load": worst, "target": SWITCH_GOAL, "met": worst >= SWITCH_GOAL,
                     "how": "worst case over models and cache states: full load (from_pretrained + the pool's engine "
                            "build) seconds / memory-tier pool switch seconds"}}


def switch_rows(section: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(model, cache, arm, seconds) rows for the bench's table."""
    rows = []
    for spec, entry in section["models"].items():
        for key in ("page_cache", "disk"):
            case = entry.get(key)
            for arm, row in (case or {}).get("arms", {}).items():
                rows.append((f"{spec} ({entry['bytes'] / 1e6:.0f} MB)", key.replace("_", " "), arm,
                             f"{row['seconds']:.3f}"))
    return rows
