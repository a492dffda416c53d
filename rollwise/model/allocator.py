"""How this process, and every process it starts, allocates memory on Linux: big tensors are kept for reuse.

Why: glibc's malloc serves a large block (above 128 KiB at first, adapting up to 32 MiB) with a fresh mmap and
unmaps it when it is freed, and it trims the top of its heap back to the kernel. A model step frees and then
allocates tensors of the same sizes over and over (logits, activations, sampling buffers), so every step faults
the same memory in again, 4 KiB at a time. On the VMs this project runs on a page fault costs ~10 us, ~2.5 ms
per MB of fresh memory: the reference engine's sampler spent 41 ms of a 64-sequence SmolLM2 step where 17 ms
was its work, and a train step spent ~13% of its CPU in the kernel. (vLLM's and PyTorch's CPU guides recommend
preloading tcmalloc for the same reason; vLLM warns when it is missing.)

This needs no extra library. glibc's own switches make every block come from the heap (no mmap) and never trim
it: `mallopt` for this process, and MALLOC_*_ variables in the environment for the processes it starts (vLLM's
engine core, engine servers, Ray workers, benchmark jobs), which glibc reads when they start. The cost: memory
a process frees stays with it for reuse (its resident size stays at its peak) instead of going back to the
machine. `rollwise bench allocator` measures what it saves, side by side.

Left alone: another allocator already preloaded (tcmalloc, jemalloc), any MALLOC_*_ variable the user set, a
libc that is not glibc, and ROLLWISE_MALLOC=system (glibc's defaults).
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

OPT_OUT = "ROLLWISE_MALLOC"  # =system: leave glibc's defaults
# glibc's mallopt parameters (malloc.h) and the environment variables that set them in a new process.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
ENVIRONMENT = {
    "MALLOC_MMAP_MAX_": "0",  # no block is mmapped, so none is unmapped when freed
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # the heap's free top is never given back
    "MALLOC_TOP_PAD_": str(64 << 20),  # grow the heap 64 MiB at a time (fewer brk calls)
}
_tuned: bool | None = None


def is_glibc_malloc_variable(name: str) -> bool:
    """MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, ...: the variables glibc reads at process start."""
    return name.startswith("MALLOC_") and name.endswith("_")


def tuning_applies(environ: Mapping[str, str], system: str, libc: str) -> bool:
    """Whether to switch glibc over, given the environment, the OS (platform.system()) and the C library
    (platform.libc_ver()[0])."""
    if environ.get(OPT_OUT, "").lower() == "system" or system != "Linux" or libc != "glibc":
        return False
    if any(lib in environ.get("LD_PRELOAD", "") for lib in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    # A MALLOC_*_ variable the user set wins; in a process rollwise started they are ours, and glibc read them
    # when the process started.
    return not any(is_glibc_malloc_variable(name) for name in environ)


def keep_freed_memory() -> bool:
    """Switch glibc to keeping freed memory for reuse in this process and the ones it starts (once; later
    calls return the first answer). Returns whether it did."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = tuning_applies(os.environ, platform.system(), platform.libc_ver()[0])
    if _tuned:
        libc = ctypes.CDLL("libc.so.6")
        # mallopt returns 1 on success. -1 as a size_t: no trim threshold at all.
        ok = all(libc.mallopt(param, value) == 1
                 for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 64 << 20)))
        if ok:
            os.environ.update(ENVIRONMENT)
        _tuned = ok
    return _tuned
