"""`rollwise bench load`: how fast a model's weights get into memory, by loader, against the limits measured in
the same run (issue 42, item 1's benchmark).

Models: the bundled SmolLM2-135M (its safetensors directory as converted, fp32) and, in the full run, a
Llama-3.2-1B-shaped model with random weights in bf16 (rollwise.bench.sync's shape:llama-3.2-1b), each written
once as a Hugging Face directory and as a flat checkpoint (rollwise.model.flat_format) in a scratch directory.

Every arm is timed until its weights are resident in this process's memory: safetensors and transformers map
the file and read pages lazily on first touch, so every arm's result is touched one byte per 4 KiB page
(a page fault each where the bytes are not there yet, ~free where they are) inside the timed region.

Arms returning a model: `transformers.from_pretrained` and the flat model (load_flat_model: parallel read,
checksums, views, meta-device construction). Arms returning tensors: safetensors `load_file`, vLLM's own
safetensors weight iterator copying into preallocated tensors (what its DefaultModelLoader does), and the flat
read (parallel read + checksums), also without checksums and with half as many checksum threads as readers (a
diagnostic arm: do hashers competing with readers for the cores cost the cold read?); every arm's process CPU
seconds (user + system) beside its wall time. Where CUDA exists, two more model arms load into GPU memory
(`from_pretrained(device_map="cuda")` and the flat model read into one pinned buffer, moved in one transfer, then
views): `goals.vs_from_pretrained_gpu`, ServerlessLLM's comparison. Limits: a raw parallel read of the flat data file into a fresh
buffer (the best of 1 and N threads) and a memory copy of the same bytes into a preallocated buffer. Page cache:
every file read once before; disk (full run only): each run after evicting the arm's files (drop_caches where
writable, else posix_fadvise DONTNEED: the JSON says which). Arms interleave round-robin, median of the repeats.
Then the pool job-switch section (rollwise.bench.load_switch; `--switch` runs it alone): its own key `switch`, its
goal `goals.switch_memory_vs_full_load` beside the others.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from rollwise.bench import load_arms as arms
from rollwise.bench.load_switch import SWITCH_GOAL, run_switch_bench, switch_rows
from rollwise.model.flat_model import flatten_directory, flatten_model
from rollwise.model.flat_reader import read_index
from rollwise.model.loading import cache_dir, resolve_model_path

GOALS = {"vs_from_pretrained": 5.0, "vs_limit": 0.8}
MODEL_ARMS = ("from_pretrained", "flat model")
TENSOR_ARMS = ("safetensors load_file", "vllm iterator", "flat read", "flat read, no checksum")


def _touch(result: Any) -> None:
    """Fault in every page of every tensor the arm returned (one byte per 4 KiB)."""
    tensors = result.state_dict().values() if isinstance(result, torch.nn.Module) else (
        result.values() if isinstance(result, dict) else [result])
    for t in tensors:
        if t.numel():
            int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum())


def _timed(fn: Callable[[], Any]) -> float:
    return _timed_cpu(fn)[0]


def _timed_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, user + system: the kernel's page copies and faults count)."""
    cpu, start = os.times(), time.perf_counter()
    result = fn()
    _touch(result)
    seconds, cpu_end = time.perf_counter() - start, os.times()
    del result
    gc.collect()
    return seconds, (cpu_end.user - cpu.user) + (cpu_end.system - cpu.system)


def _prepare(name: str, work: Path) -> dict[str, Any]:
    """(hf_dir, flat_dir, dtype) of one benchmark model, written under work."""
    if name == "smollm2-135m":
        hf_dir = resolve_model_path("bundled:smollm2-135m-instruct")
        flat_dir = work / "smollm2-flat"
        flatten_directory(hf_dir, flat_dir)
    else:
        from rollwise.bench.sync import load_bench_model

        model = load_bench_model("shape:llama-3.2-1b")[0].to(torch.bfloat16)
        hf_dir, flat_dir = work / "llama-1b-hf", work / "llama-1b-flat"
        model.save_pretrained(hf_dir, safe_serialization=True)
        flatten_model(model, flat_dir)
        del model
        gc.collect()
    index = read_index(flat_dir)
    dtype = next(t.dtype for t in index.layout.tensors())
    return {"hf_dir": hf_dir, "flat_dir": flat_dir, "dtype": getattr(torch, dtype), "bytes": index.layout.total_bytes,
            "tensors": sum(len(b.tensors) for b in index.layout.buckets), "aliases": len(index.layout.aliases),
            "chunks": len(index.layout.buckets)}


def _arm_functions(m: dict[str, Any], vllm_skip: str | None) -> dict[str, tuple[Callable[[], Any], list[Path]]]:
    hf, flat, dtype = m["hf_dir"], m["flat_dir"], m["dtype"]
    st_files = sorted(hf.glob("*.safetensors"))
    flat_files = [arms.flat_data_file(flat)]
    fns: dict[str, tuple[Callable[[], Any], list[Path]]] = {
        "from_pretrained": (lambda: arms.from_pretrained(hf, dtype), st_files),
        "flat model": (lambda: arms.flat_model(flat, dtype), flat_files),
        "safetensors load_file": (lambda: arms.safetensors_load_file(hf), st_files),
        "flat read": (lambda: arms.flat_read(flat), flat_files),
        "flat read, no checksum": (lambda: arms.flat_read(flat, verify=False), flat_files),
        f"flat read, {arms.half_hashers()} hasher(s)": (lambda: arms.flat_read(flat, hashers=arms.half_hashers()),
                                                        flat_files),
        "read limit, 1 thread": (lambda: arms.raw_read(flat_files[0], 1), flat_files),
        f"read limit, {arms.flat_threads()} threads": (lambda: arms.raw_read(flat_files[0], arms.flat_threads()),
                                                      flat_files),
    }
    if torch.cuda.is_available():  # the load ServerlessLLM measures: into GPU memory (one pinned transfer vs per tensor)
        fns["from_pretrained -> cuda"] = (lambda: arms.from_pretrained(hf, dtype, "cuda"), st_files)
        fns["flat model -> cuda"] = (lambda: arms.flat_model(flat, dtype, "cuda"), flat_files)
    if vllm_skip is None:
        into = {n: torch.empty_like(t) for n, t in arms.flat_read(flat).items()}
        fns["vllm iterator"] = (lambda: arms.vllm_iterator(hf, into), st_files)
    return fns


def _measure(m: dict[str, Any], repeats: int, cold_method: str | None, vllm_skip: str | None) -> dict[str, Any]:
    fns = _arm_functions(m, vllm_skip)
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    for name, (fn, _) in fns.items():  # warm-up: imports, the page cache, allocator growth
        _timed(fn)
    for _ in range(repeats):
        for name, (fn, files) in fns.items():
            if cold_method is not None:
                arms.evict(files, cold_method)
            wall, cpu = _timed_cpu(fn)
            times[name].append(wall)
            cpus[name].append(cpu)
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    limit_name = min((n for n in seconds if n.startswith("read limit")), key=seconds.__getitem__)
    if cold_method is None:  # memory: the copy every loader's bytes go through at least once
        src = arms.raw_read(arms.flat_data_file(m["flat_dir"]), arms.flat_threads())
        dst = torch.empty_like(src)
        copies = [_timed(lambda: arms.memcpy(src, dst)) for _ in range(repeats + 1)][1:]
        seconds["memcpy"] = statistics.median(copies)
        del src, dst
    gb = m["bytes"] / 1e9
    return {
        "arms": {name: {"seconds": round(s, 5), "gb_per_s": round(gb / s, 3)}
                 | ({"cpu_s": round(statistics.median(cpus[name]), 4)} if cpus.get(name) else {})
                 for name, s in seconds.items()},
        "limit": limit_name,
        "vs_from_pretrained": round(seconds["from_pretrained"] / seconds["flat model"], 3),
        "vs_limit": round(seconds[limit_name] / seconds["flat read"], 3),
        "model_vs_limit": round(seconds[limit_name] / seconds["flat model"], 3),
        "vs_load_file": round(seconds["safetensors load_file"] / seconds["flat read"], 3),
        **({"vs_vllm": round(seconds["vllm iterator"] / seconds["flat read"], 3)} if "vllm iterator" in seconds else {}),
        **({"vs_memcpy": round(seconds["memcpy"] / seconds["flat read"], 3)} if "memcpy" in seconds else {}),
        **({"vs_from_pretrained_gpu": round(seconds["from_pretrained -> cuda"] / seconds["flat model -> cuda"], 3)}
           if "flat model -> cuda" in seconds else {}),
    }


def run_load_bench(*, quick: bool, repeats: int | None = None, progress: Callable[[str], None] = print,
                   switch: bool = True) -> dict:
    """Every load arm, then (`switch`) the pool job-switch section (rollwise.bench.load_switch)."""
    repeats = repeats or (3 if quick else 5)
    names = ["smollm2-135m"] if quick else ["smollm2-135m", "llama-3.2-1b-shape"]
    method, why = ("none", "--quick: page cache only") if quick else arms.drop_method()
    vllm_skip = arms.vllm_unavailable()
    root = cache_dir() / "bench-load"
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run.", dir=root))
    models: dict[str, Any] = {}
    try:
        for name in names:
            progress(f"writing {name} as a flat checkpoint")
            m = _prepare(name, work)
            os.sync()  # the files just written are flushed now, not written back during the page-cache rounds
            entry = {k: m[k] for k in ("bytes", "tensors", "aliases", "chunks")} | {"dtype": str(m["dtype"])}
            progress(f"{name}: page cache, {repeats} rounds")
            entry["page_cache"] = _measure(m, repeats, None, vllm_skip)
            if method != "none":
                progress(f"{name}: cold ({method}), {repeats} rounds")
                entry["disk"] = _measure(m, repeats, method, vllm_skip)
            models[name] = entry
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cases = [case for entry in models.values() for key in ("page_cache", "disk") if (case := entry.get(key))]
    goals = {key: min(case[key] for case in cases) for key in GOALS}
    gpu = [case["vs_from_pretrained_gpu"] for case in cases if "vs_from_pretrained_gpu" in case]
    # ServerlessLLM's 5x is a load into GPU memory; reported beside the CPU-resident goal (None: no GPU here)
    goals["vs_from_pretrained_gpu"] = min(gpu) if gpu else None
    result = {
        "quick": quick, "repeats": repeats, "threads": arms.flat_threads(), "torch_threads": torch.get_num_threads(),
        "cold": {"method": method, "note": why}, "vllm_arm": {"skipped": vllm_skip} if vllm_skip else {"ran": True},
        "models": models,
        "goals": goals | {"targets": GOALS | {"vs_from_pretrained_gpu": GOALS["vs_from_pretrained"]},
                          "met": {k: goals[k] >= t for k, t in GOALS.items()}
                          | {"vs_from_pretrained_gpu": None if not gpu else min(gpu) >= GOALS["vs_from_pretrained"]},
                          "how": "worst case over models and cache states: from_pretrained seconds / flat model "
                                 "seconds; read limit seconds / flat read (with checksums) seconds"},
    }
    if switch:
        add_switch(result, run_switch_bench(quick=quick, repeats=repeats, progress=progress))
    return result


def add_switch(result: dict, section: dict) -> None:
    """The switch section into a load bench result: its own key, and its goal beside the others."""
    result["switch"] = section
    goals = result.setdefault("goals", {"targets": {}, "met": {}})
    goals["switch_memory_vs_full_load"] = section["goal"]["switch_memory_vs_full_load"]
    goals["targets"]["switch_memory_vs_full_load"] = SWITCH_GOAL
    goals["met"]["switch_memory_vs_full_load"] = section["goal"]["met"]


def format_load_bench(result: dict) -> Table:
    table = Table(title=f"Weight loading until resident ({result['threads']} read threads, median of "
                        f"{result['repeats']}; cold: {result['cold']['method']})")
    for column in ("model", "cache", "arm", "seconds", "GB/s"):
        table.add_column(column, justify="left" if column in ("model", "cache", "arm") else "right")
    for name, entry in result["models"].items():
        for key in ("page_cache", "disk"):
            case = entry.get(key)
            if case is None:
                continue
            for arm, row in case["arms"].items():
                table.add_row(f"{name} ({entry['bytes'] / 1e6:.0f} MB {entry['dtype'].removeprefix('torch.')})",
                              key.replace("_", " "), arm + (" (limit)" if arm == case["limit"] else ""),
                              f"{row['seconds']:.3f}", f"{row['gb_per_s']:.2f}")
    g = result["goals"]
    table.caption = (f"flat model vs from_pretrained: {g['vs_from_pretrained']:.2f}x (goal >= 5: "
                     f"{'met' if g['met']['vs_from_pretrained'] else 'NOT met'}); flat read vs read limit: "
                     f"{g['vs_limit']:.2f} (goal >= 0.8: {'met' if g['met']['vs_limit'] else 'NOT met'}); worst case."
                     + (f"\nvLLM arm skipped: {result['vllm_arm']['skipped']}" if "skipped" in result["vllm_arm"]
                        else ""))
    return table


def format_switch_bench(section: dict) -> Table:
    table = Table(title=f"Pool job switch by tier vs a full load (one slot, reference engine, median of "
                        f"{section['repeats']}; cold: {section['cold']['method']})")
    for column in ("model", "cache", "arm", "seconds"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for row in switch_rows(section):
        table.add_row(*row)
    g = section["goal"]
    table.caption = (f"memory-tier switch vs full load: {g['switch_memory_vs_full_load']:.2f}x (goal >= "
                     f"{g['target']:g}: {'met' if g['met'] else 'NOT met'}); worst case")
    return table


def cli_bench_load(args: Any, console: Any) -> int:
    from rollwise.sim.commands import write_json

    progress = lambda line: console.print(line)  # noqa: E731
    if args.switch:  # the pool job-switch section alone (rollwise.bench.load_switch)
        result: dict = {"quick": args.quick}
        add_switch(result, run_switch_bench(quick=args.quick, repeats=args.rounds, progress=progress))
    else:
        result = run_load_bench(quick=args.quick, repeats=args.rounds, progress=progress)
    result["command"] = "rollwise bench load" + (" --switch" if args.switch else "") + (
        " --quick" if args.quick else "") + (f" --json {args.json}" if args.json else "")
    if "models" in result:
        console.print(format_load_bench(result))
    console.print(format_switch_bench(result["switch"]))
    write_json(args.json, result, console)
    return 0
