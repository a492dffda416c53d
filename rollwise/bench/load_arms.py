"""The timed arms of `rollwise bench load` (rollwise.bench.load): each loads one model's weights one way and
returns what a caller would use, and the page-cache eviction the cold runs rely on.

Arms that return a model (from_pretrained, flat model) are compared with each other; arms that return tensors
(safetensors load_file, vLLM's weight iterator, flat read) with each other and with the limits: a raw parallel
read of the same file into a fresh buffer, and a memory copy of the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollwise.model.flat_model import load_flat_model
from rollwise.model.flat_format import DEFAULT_CHUNK_MB
from rollwise.model.flat_reader import allocate, default_threads, read_flat, read_index

PIECE = int(DEFAULT_CHUNK_MB * 2**20)  # the flat reader's own unit: the limit is the same reads without the rest


def from_pretrained(hf_dir: Path, dtype: torch.dtype, device: str | None = None) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, **({"device_map": device} if device else {}))


def flat_model(flat_dir: Path, dtype: torch.dtype, device: str | None = None) -> object:
    return load_flat_model(flat_dir, dtype, device=device)


def safetensors_load_file(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def vllm_iterator(hf_dir: Path, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's own loading path without a model: its safetensors weight iterator (what DefaultModelLoader reads
    with), each tensor copied into a preallocated destination as vLLM's default_weight_loader does."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = [str(f) for f in sorted(hf_dir.glob("*.safetensors"))]
    for name, tensor in safetensors_weights_iterator(files, use_tqdm_on_load=False):
        into[name].copy_(tensor)
    return into


def vllm_unavailable() -> str | None:
    """Why the vLLM arm cannot run here (None: it can)."""
    try:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: no vLLM arm, with the reason shown
        return f"vLLM's weight_utils does not import here ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def flat_read(flat_dir: Path, verify: bool = True, hashers: int | None = None) -> dict[str, torch.Tensor]:
    """hashers: checksum threads (None: the reader's default, as many as readers; the diagnostic arm passes half
    as many, so a run shows whether hashers competing with readers for the cores is what the checksums cost)."""
    return read_flat(flat_dir, verify=verify, hashers=hashers).state


def raw_read(path: Path, threads: int) -> torch.Tensor:
    """The read limit: the file's bytes into a fresh buffer with `threads` parallel preads, nothing else."""
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    buffer = allocate(size, pin=False)
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDONLY)

    def read(start: int) -> None:
        end = min(start + PIECE, size)
        while start < end:
            start += os.preadv(fd, [view[start:end]], start)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(read, range(0, size, PIECE)))
    finally:
        os.close(fd)
    return buffer


def memcpy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The memory limit: one torch copy of the same bytes into a preallocated buffer (torch's own threads)."""
    return dst.copy_(src)


def flat_threads() -> int:
    return default_threads()


def half_hashers() -> int:
    """The diagnostic arm's checksum threads: one per two readers, at least one."""
    return max(1, flat_threads() // 2)


def flat_data_file(flat_dir: Path) -> Path:
    return flat_dir / read_index(flat_dir).data_file


# ---------------------------------------------------------------------------- cold reads


def drop_method() -> tuple[str, str]:
    """How this machine can evict files from the page cache: ("drop_caches" | "fadvise" | "none", why)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches", "echo 1 > /proc/sys/vm/drop_caches worked (root, writable /proc/sys)"
    except OSError as exc:
        reason = f"/proc/sys/vm/drop_caches not writable ({exc.strerror})"
    if hasattr(os, "posix_fadvise"):
        return "fadvise", (f"{reason}; per-file posix_fadvise(POSIX_FADV_DONTNEED) instead (evicts this guest's "
                           "clean pages; a hypervisor's or network disk's own cache may still serve them)")
    return "none", f"{reason}, and no posix_fadvise: no cold runs"


def evict(files: list[Path], method: str) -> None:
    """Drop these files' pages from the page cache before a cold run."""
    if method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
