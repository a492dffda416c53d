"""Weight-sync benchmark: each transport pushing the same state dict, next to a plain memory copy.

The memory copy (one torch copy of the same number of bytes into a preallocated buffer, measured in
the same run) is the local limit: every transport moves at least those bytes once. Each transport is
timed end to end, from `push` until the engine serves the new version (the manifest, the checksum
pass, the copies, the verification and the apply included). A checksum pass (xxh3) over the same bytes
is shown too, because the file and broadcast transports pay it once per side.

A train.lora adapter (rank 16 on every projection) is pushed beside the model on the training path and
over gloo, and compared with the full push on each, as the median of back-to-back pairs (issue 22's goal:
>= 50x less time). `shape:NAME` models (SHAPES) are public models' shapes with random weights, for the
sizes where an adapter's share of the bytes is what it is in practice.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from rich.table import Table

from rollwise.bench.adapters import random_adapter
from rollwise.engine.core import EngineWorker
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.bucket_layout import bucket_checksum, build_manifest, flatten_bucket
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.types.weights import WeightManifest
from rollwise.sync.distributed import (
    KEEP_BUFFERS_MB,
    DistributedReceiver,
    DistributedSender,
    init_weight_group,
    loopback_init_method,
)
from rollwise.sync.adapters import adapter_update
from rollwise.engine.weight_receiver import StagedUpdate
from rollwise.sync.files import FileReceiver, FileTransport
from rollwise.types.weights import AdapterSpec

BUCKET_MB = 64
ADAPTER_RANK = 16  # train.lora's default rank
ENGINE_KW = {"max_num_seqs": 1, "max_model_len": 8}  # the KV cache is irrelevant here: keep it tiny

SHAPE_PREFIX = "shape:"
# Public models' shapes (their config.json), built here with random weights: a push moves and checks bytes
# whatever they say, and no hub is reachable. The bundled SmolLM2-135M is too small to show what an adapter
# push saves: a rank-16 adapter on every projection is 1/28 of its bytes, 1/110 of Llama-3.2-1B's.
SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": True},
}


def load_bench_model(spec: str) -> tuple[Any, Any]:
    """A model spec as `rollwise.model.loading.load_model` takes it, or `shape:NAME` (one of SHAPES, random
    weights, the tiny tokenizer for the fingerprint: nothing is tokenized here)."""
    if not spec.startswith(SHAPE_PREFIX):
        return load_model(spec)
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollwise.model.tiny import tiny_tokenizer

    name = spec[len(SHAPE_PREFIX):]
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: one of {sorted(SHAPES)}")
    config = LlamaConfig(**SHAPES[name], max_position_embeddings=2048)
    with torch.device("meta"):  # allocate once, then fill: HF's per-module init takes minutes at this size
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own memory, tied ones too
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    for buffer_name, buffer in model.named_buffers():  # rotary inv_freq: real values, not garbage
        if buffer_name.endswith("inv_freq"):
            buffer.copy_(type(model.model.rotary_emb)(config=config).inv_freq)
    return model.eval(), tiny_tokenizer()


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and allocator growth are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _engine_process(index: int, init_method: str, model_spec: str, keep_buffers_mb: float = KEEP_BUFFERS_MB) -> None:
    """Rank 1: a ReferenceEngine on its own copy of the model, applying broadcasts until closed."""
    model, tokenizer = load_bench_model(model_spec)
    engine = ReferenceEngine(model, **ENGINE_KW)
    del model
    receiver = WeightReceiver(engine, tokenizer_fingerprint(tokenizer), adapters=engine)  # it serves LoRA too
    group = init_weight_group(index + 1, 2, init_method, timeout_s=600)
    try:
        DistributedReceiver(group, receiver, keep_buffers_mb=keep_buffers_mb).serve()
    finally:
        group.close()


def _time_gloo(state: dict, fingerprint: str, model_spec: str, repeats: int, bucket_mb: float,
               adapter: tuple[dict, AdapterSpec] | None = None, *, keep_all_buffers: bool = False) -> dict[str, float]:
    """Full pushes to one engine process over gloo; with `adapter`, that adapter's pushes to the same engine
    too, and their paired time ratio (full / adapter, the median of back-to-back pairs). keep_all_buffers: the
    engine keeps a full update's receive buffers too (a second copy of the model; only adapter-sized ones by
    default), so a full push writes memory already mapped, as it does on a GPU's caching allocator."""
    init_method = loopback_init_method()
    keep_mb = float("inf") if keep_all_buffers else KEEP_BUFFERS_MB
    ctx = mp.spawn(_engine_process, args=(init_method, model_spec, keep_mb), nprocs=1, join=False)
    done = False
    group = None
    seconds: dict[str, float] = {}
    try:
        group = init_weight_group(0, 2, init_method, timeout_s=600)
        sender = DistributedSender(group, fingerprint, bucket_mb=bucket_mb)
        versions = iter(range(1, 10**6))

        def push_full() -> None:
            sender.push(state, next(versions))

        seconds["gloo broadcast" + (", buffers kept" if keep_all_buffers else "")] = _median_seconds(push_full, repeats)
        if adapter is not None:
            tensors, spec = adapter

            def push_adapter() -> None:
                sender.push(tensors, next(versions), adapter=spec)

            seconds["adapter gloo broadcast"] = _median_seconds(push_adapter, repeats)
            seconds["gloo: full / adapter"] = 1.0 / _paired_ratio(push_adapter, push_full, repeats)
        sender.close()
        done = True
    finally:
        if group is not None:
            group.close()
        if not done:  # the engine process would wait for the next broadcast until the group times out
            for process in ctx.processes:
                process.terminate()
    while not ctx.join(timeout=60):  # raises if the engine process failed
        pass
    return seconds


def _paired_ratio(fn: Callable[[], Any], baseline: Callable[[], Any], repeats: int) -> float:
    """Median over back-to-back pairs of fn's time / baseline's time. This VM's memory bandwidth drifts
    between runs by as much as the 1.2x goal's margin; within one pair it cancels."""
    fn()  # warm-up
    baseline()
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        baseline()
        middle = time.perf_counter()
        fn()
        ratios.append((time.perf_counter() - middle) / (middle - start))
    return statistics.median(ratios)


def _memcpy(state: dict, layout: WeightManifest) -> Callable[[], Any]:
    src = torch.cat([flatten_bucket(b, state) for b in layout.buckets])  # the same bytes, contiguous
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _time_local_transports(model: Any, state: dict, fingerprint: str, repeats: int,
                           bucket_mb: float, memcpy: Callable[[], Any]) -> tuple[dict[str, float], float]:
    """In-process and files, both into one ReferenceEngine in this process."""
    engine = ReferenceEngine(model, **ENGINE_KW, tokenizer_fingerprint=fingerprint)
    receiver = WeightReceiver(engine, fingerprint)
    versions = iter(range(1, 10**6))
    seconds: dict[str, float] = {}
    # Exactly the training loop's local path (InProcessSender + the engine core): a WeightUpdate of
    # views, checked whole on this thread, applied on the engine's thread between two steps.
    worker = EngineWorker(engine, name="bench-sync")
    try:
        def push() -> None:
            worker.load_weights(WeightUpdate.of_state(state, next(versions), fingerprint))

        seconds["in-process"] = _median_seconds(push, repeats)
        in_process_ratio = _paired_ratio(push, memcpy, 3 * repeats)
    finally:
        worker.close()

    with tempfile.TemporaryDirectory(prefix="rollwise-sync-bench-") as root:
        files = FileTransport(root, fingerprint, bucket_mb=bucket_mb)
        loader = FileReceiver(receiver)
        split: dict[str, list[float]] = {"write": [], "read": []}

        def through_files() -> None:
            start = time.perf_counter()
            directory = files.push(state, next(versions))
            written = time.perf_counter()
            loader.load(directory)
            split["write"].append(written - start)
            split["read"].append(time.perf_counter() - written)
            shutil.rmtree(directory)  # keep the disk footprint to one version (inside the "files" time)

        seconds["files"] = _median_seconds(through_files, repeats)
        seconds["files: write"] = statistics.median(split["write"][1:])  # [0] is the warm-up
        seconds["files: read + apply"] = statistics.median(split["read"][1:])
    return seconds, in_process_ratio


def _time_adapter_push(model: Any, state: dict, adapter: dict, spec: AdapterSpec, fingerprint: str,
                       repeats: int, *, time_full: bool) -> dict[str, float]:
    """train.lora's push (rollwise.sync.adapters) into a ReferenceEngine through its EngineWorker (the training
    path), paired with the full push on the same path; and the adapter checksummed and staged bucket by
    bucket, as a byte-moving transport delivers it."""
    engine = ReferenceEngine(model, **ENGINE_KW, tokenizer_fingerprint=fingerprint)
    versions = iter(range(1, 10**6))
    seconds: dict[str, float] = {}
    worker = EngineWorker(engine, name="bench-sync-adapter")
    try:
        def push_adapter() -> None:
            worker.load_weights(adapter_update(adapter, spec, next(versions), fingerprint))

        def push_full() -> None:
            worker.load_weights(WeightUpdate.of_state(state, next(versions), fingerprint))

        if time_full:  # (the full bench times it among the local transports)
            seconds["in-process"] = _median_seconds(push_full, repeats)
        seconds["adapter in-process"] = _median_seconds(push_adapter, repeats)
        seconds["in-process: full / adapter"] = 1.0 / _paired_ratio(push_adapter, push_full, 3 * repeats)
    finally:
        worker.close()
    receiver = WeightReceiver(engine, fingerprint, adapters=engine)

    def checksummed() -> None:
        update = adapter_update(adapter, spec, next(versions), fingerprint, checksum=True)
        staged = StagedUpdate(update.manifest)
        for bucket in update.manifest.buckets:
            staged.add_flat(bucket.index, flatten_bucket(bucket, adapter))
        receiver.commit(staged)

    seconds["adapter checksummed"] = _median_seconds(checksummed, repeats)
    return seconds


def _adapter_summary(ratios: dict[str, float], seconds: dict[str, float], nbytes: int, adapter: dict,
                     rank: int) -> dict:
    """The adapter push against the full push on each path measured (issue 22: goal >= 50x less time)."""
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    paths = {path: ratios[f"{path}: full / adapter"] for path in ("in-process", "gloo")
             if f"{path}: full / adapter" in ratios}
    summary = {"rank": rank, "bytes": adapter_bytes, "bytes_vs_full": nbytes / adapter_bytes,
               # time ratios, each the median of back-to-back (full, adapter) pairs on one path
               "time_vs_full": paths, "goal_50x_met": {path: ratio >= 50 for path, ratio in paths.items()}}
    if "gloo broadcast, buffers kept" in seconds:  # medians of separate runs, not pairs
        summary["gloo_kept_buffers_vs_adapter"] = seconds["gloo broadcast, buffers kept"] / seconds["adapter gloo broadcast"]
    return summary


def run_sync_bench(model: Any, tokenizer: Any, *, model_spec: str, quick: bool, seed: int = 0,
                   bucket_mb: float = BUCKET_MB, adapter_only: bool = False) -> dict:
    """Median seconds per push (quick: 2 timed repeats, full: 5, each after one warm-up). adapter_only: only
    the full and the adapter push on the training path and over gloo, for models whose extra copies (memcpy's
    two buffers, the files transport's version on disk and in memory) would not fit this machine."""
    torch.manual_seed(seed)
    repeats = 2 if quick else 5
    fingerprint = tokenizer_fingerprint(tokenizer)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    layout = build_manifest(state, 0, fingerprint, bucket_mb, checksum=False)
    nbytes = layout.total_bytes
    adapter = random_adapter(model, ADAPTER_RANK)  # named as the trainer's PEFT adapter names them
    seconds: dict[str, float] = {}
    # gloo first: the engine process holds two copies of the model while it starts, this process one.
    seconds.update(_time_gloo(state, fingerprint, model_spec, repeats, bucket_mb, adapter))
    memcpy = in_process_ratio = None
    if adapter_only:  # what the full push costs without faulting in fresh receive buffers every time
        seconds.update(_time_gloo(state, fingerprint, model_spec, repeats, bucket_mb, keep_all_buffers=True))
    else:
        memcpy_fn = _memcpy(state, layout)
        memcpy = seconds["memcpy"] = _median_seconds(memcpy_fn, repeats)
        seconds["checksum"] = _median_seconds(lambda: [bucket_checksum(b, state) for b in layout.buckets], repeats)
        local, in_process_ratio = _time_local_transports(model, state, fingerprint, repeats, bucket_mb, memcpy_fn)
        seconds.update(local)
        del memcpy_fn
    seconds.update(_time_adapter_push(model, state, *adapter, fingerprint, repeats, time_full=adapter_only))

    ratios = {name: seconds.pop(name) for name in list(seconds) if name.endswith(": full / adapter")}
    summary = _adapter_summary(ratios, seconds, nbytes, adapter[0], ADAPTER_RANK)
    rows = [
        {"name": name, "seconds": s, "bytes": summary["bytes"] if name.startswith("adapter") else nbytes,
         "x_memcpy_time": None if memcpy is None else s / memcpy}
        for name, s in seconds.items()
    ]
    for row in rows:
        row["gb_per_s"] = row["bytes"] / row["seconds"] / 1e9
    result = {
        "config": {
            "model": model_spec, "quick": quick, "repeats": repeats, "bucket_mb": bucket_mb, "bytes": nbytes,
            "params": sum(p.numel() for p in model.parameters()),
            "tensors": sum(len(b.tensors) for b in layout.buckets), "tied_aliases": len(layout.aliases),
            "buckets": len(layout.buckets), "torch_threads": torch.get_num_threads(),
            "tmpdir": tempfile.gettempdir(), "adapter_only": adapter_only,
        },
        # train.lora (issue 22): the adapter push vs the full push on the same path (goal >= 50x less time)
        "adapter": summary,
        "rows": rows,
    }
    if in_process_ratio is not None:
        # The training path's cost next to a plain copy of the same bytes (goal: within 1.2x), as the
        # median ratio of back-to-back pairs (the table's rows are medians taken minutes apart).
        result["in_process_vs_memcpy"] = in_process_ratio
        result["in_process_within_1_2x"] = in_process_ratio <= 1.2
    return result


NOTES = {
    "memcpy": "local limit: one torch copy into a preallocated buffer",
    "checksum": "xxh3 pass over every byte (paid once per side by files and broadcast)",
    "in-process": "the training path: WeightUpdate of views, checked whole, engine copy (no checksum)",
    "files": "write + read + verify + apply (+ deleting the version dir)",
    "files: write": "checksum + safetensors buckets + manifest (page cache)",
    "files: read + apply": "load + checksum + verify + engine copy",
    "gloo broadcast": "to 1 engine process over loopback TCP, until it acked",
    "gloo broadcast, buffers kept": "the same, the engine reusing its receive buffers (a second copy of the model)",
    "adapter gloo broadcast": "the adapter below, the same way, loaded beside the engine's base weights",
    "adapter in-process": "train.lora: rank-16 adapter on every projection, the training path (its own bytes)",
    "adapter checksummed": "the same adapter: checksum + flat buckets + staged + verify + load (its own bytes)",
}


def format_sync_bench(result: dict) -> Table:
    cfg = result["config"]
    table = Table(title=(
        f"Weight sync: {cfg['model']}, {cfg['bytes'] / 1e6:.0f} MB in {cfg['tensors']} tensors "
        f"({cfg['buckets']} buckets of <= {cfg['bucket_mb']} MiB), median of {cfg['repeats']}, "
        f"{cfg['torch_threads']} threads"
    ))
    for column in ("transport", "seconds", "GB/s", "time vs memcpy", "what is timed"):
        table.add_column(column, justify="left" if column in ("transport", "what is timed") else "right")
    captions = []
    if "in_process_vs_memcpy" in result:
        ratio = result["in_process_vs_memcpy"]
        captions.append(f"in-process (the training path) / memcpy, median of back-to-back pairs: {ratio:.2f}x "
                        f"({'within' if ratio <= 1.2 else 'OVER'} the 1.2x goal)")
    a = result["adapter"]
    for path, ratio in a["time_vs_full"].items():
        captions.append(f"adapter push (rank {a['rank']}, {a['bytes'] / 1e6:.1f} MB, {a['bytes_vs_full']:.0f}x fewer "
                        f"bytes), {path}: {ratio:.0f}x less time than the full push, median of back-to-back pairs "
                        f"({'meets' if a['goal_50x_met'][path] else 'MISSES'} the 50x goal)")
    if "gloo_kept_buffers_vs_adapter" in a:
        captions.append(f"gloo with the engine keeping its receive buffers: the full push takes "
                        f"{a['gloo_kept_buffers_vs_adapter']:.0f}x the adapter push's time (medians)")
    table.caption = "\n".join(captions)
    for row in result["rows"]:
        vs_memcpy = "-" if row["x_memcpy_time"] is None else f"{row['x_memcpy_time']:.1f}x"
        table.add_row(row["name"], f"{row['seconds']:.3f}", f"{row['gb_per_s']:.2f}", vs_memcpy,
                      NOTES.get(row["name"], ""))
    return table
