"""This machine's matmul peak (FLOP/s), the denominator of model-FLOPs utilisation.

On a CPU it is measured: the best of a few large matrix multiplies in the model's dtype on every
core this process may use. A measurement takes about a second, so it is made once and cached
(JSON under $ROLLWISE_CACHE, else ~/.cache/rollwise) keyed by CPU model, core count, dtype and
torch version. A busy machine gives a low peak (and a flattering MFU): a peak measured under load
is measured again when a run starts on a calmer machine, the higher kept; delete the cache file,
or call machine_peak(remeasure=True), to measure afresh.

On CUDA GPUs the peak is the datasheet's dense tensor-core figure for the device (by name), and
measured like a CPU's when the device is not in the table.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Dense (no sparsity) tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name() and
# dtype. Checked in order: more specific names first. fp32 matmuls run as TF32 where enabled; we
# quote the TF32 figure for them.
_DATASHEET: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("H100", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}),  # SXM / HBM3
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("L40S", {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12}),
    ("L4", {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12}),
    ("A10G", {"bfloat16": 70e12, "float16": 70e12, "float32": 35e12}),
    ("A10", {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12}),
    ("V100", {"float16": 125e12, "float32": 15.7e12}),
    ("T4", {"float16": 65e12, "float32": 8.1e12}),
]


CPU_MATMUL_SIZE = 2048  # 17 GFLOP a matmul: ~0.1 s on 2 cores, long enough for the cores to reach their peak


@dataclass(frozen=True)
class Peak:
    """A peak and where it came from (shown beside every MFU so a reader can judge it)."""

    flops: float  # FLOP/s of the whole machine for the loop (every core; every visible GPU)
    source: str  # "measured" or "datasheet"
    device: str  # CPU model or GPU name
    dtype: str
    units: int  # cores measured together, or GPUs counted
    kind: str = "cpu"  # "cpu" or "cuda"


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise"))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; a container's cpuset included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_matmul(device: str = "cpu", dtype: torch.dtype = torch.float32, size: int = 2048,
                   reps: int = 5) -> float:
    """FLOP/s of the fastest of `reps` size x size matmuls (after a warm-up), on the threads torch
    uses now (CPU) or on the current GPU."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: allocations, thread pool, kernel selection
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _cpu_matmul_size(dtype: torch.dtype, target_s: float = 0.5, probe: int = 256) -> int:
    """The size, up to CPU_MATMUL_SIZE, whose matmul takes about target_s here. A dtype this CPU only
    emulates (bfloat16 without AVX512-BF16 or AMX) runs 50-100x slower than float32: a 2048 matmul then
    takes tens of seconds, and a peak measurement minutes. Native dtypes keep CPU_MATMUL_SIZE."""
    a = torch.randn(probe, probe).to(dtype)
    torch.mm(a, a)  # warm-up
    start = time.perf_counter()
    torch.mm(a, a)
    seconds = max(time.perf_counter() - start, 1e-9)
    size = probe * (target_s / seconds) ** (1 / 3)  # matmul time grows with size cubed
    return int(min(CPU_MATMUL_SIZE, max(probe, size)) // 64 * 64)


def datasheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    key = str(dtype).removeprefix("torch.")
    for name, peaks in _DATASHEET:
        if name in device_name:
            return peaks.get(key)
    return None


def _cpu_peak(dtype: torch.dtype, remeasure: bool) -> Peak:
    """Cached per CPU model, cores, dtype and torch version. A peak measured on a busy machine (the
    1-minute load average then above a quarter of the cores) is measured again when a later run
    starts on a calmer one, and the higher of the two is kept: other work only ever lowers a peak."""
    cores, name = usable_cores(), _cpu_name()
    key = f"cpu|{name}|{cores}|{dtype}|torch {torch.__version__}"
    path = cache_dir() / "matmul_peak.json"
    cached = _read_cache(path)
    entry = _valid_entry(cached.get(key))
    load = os.getloadavg()[0]
    if entry is not None and not remeasure:
        busy_then = entry["load_1m"] > 0.25 * cores
        if not (busy_then and load < entry["load_1m"]):
            return Peak(**entry["peak"])
    before = torch.get_num_threads()
    torch.set_num_threads(cores)  # the machine's peak: every core at once
    try:
        flops = measure_matmul("cpu", dtype, size=_cpu_matmul_size(dtype))
        peak = Peak(flops, "measured", name, str(dtype).removeprefix("torch."), cores)
    finally:
        torch.set_num_threads(before)
    if entry is not None and not remeasure and entry["peak"]["flops"] > peak.flops:
        return Peak(**entry["peak"])  # the busy machine's measurement was still the higher one
    cached[key] = {"peak": asdict(peak), "load_1m": load}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=2))
    tmp.replace(path)  # atomic: two runs starting together never read half a file
    return peak


def _valid_entry(entry: object) -> dict | None:
    """A cache entry this version wrote, or None (absent, damaged, or from another version)."""
    try:
        Peak(**entry["peak"])  # type: ignore[index]
        float(entry["load_1m"])  # type: ignore[index]
        return entry  # type: ignore[return-value]
    except (TypeError, KeyError, ValueError):
        return None


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent or damaged: measure again


def machine_peak(dtype: torch.dtype = torch.float32, device: str | None = None, remeasure: bool = False) -> Peak:
    """The peak of the machine the loop runs on: every visible GPU when device is "cuda" (default:
    when CUDA is available), else every usable CPU core."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return _cpu_peak(dtype, remeasure)
    name, count = torch.cuda.get_device_name(), torch.cuda.device_count()
    per_device = datasheet_peak(name, dtype)
    source = "datasheet"
    if per_device is None:
        per_device, source = measure_matmul("cuda", dtype, size=8192, reps=10), "measured"
    return Peak(per_device * count, source, name, str(dtype).removeprefix("torch."), count, kind="cuda")
