"""How this process, and every process it starts, allocates memory on Linux: freed memory is kept for reuse up to
a bound, and given back beyond it.

Why keep: glibc's malloc serves a large block (above 128 KiB at first, its threshold adapting up to 32 MiB) with
a fresh mmap and unmaps it when it is freed, and it trims the top of its heap back to the kernel once 128 KiB
(later up to 64 MiB) are free there. A model step frees and then allocates tensors of the same sizes over and over
(logits, activations, sampling buffers), so every micro-batch faults the same memory in again, 4 KiB at a time.
On the VMs this project runs on a page fault costs ~10 us, ~2.5 ms per MB of fresh memory: the reference engine's
sampler spent 41 ms of a 64-sequence SmolLM2 step where 17 ms was its work, and a train step spent ~13% of its CPU
in the kernel. (vLLM's and PyTorch's CPU guides recommend preloading tcmalloc for the same reason.)

Why bounded: sessions 20-25 kept every freed block for good (no mmap, no trim). The heap fragmented as
micro-batch shapes changed and the default run's resident size grew ~0.15 GB a step, to 9.5 GB where glibc's
defaults peak at 7.2 GB. Now blocks up to 32 MiB come from the heap and are reused (the threshold fixed there, not
adapting from 128 KiB), larger ones are mmapped and given back when freed, and the heap's free top is kept up to
256 MiB, grown 64 MiB at a time. docs/benchmarks/default-run.md ("Peak memory against TRL's") has the candidates
measured (trimming at each step boundary, 2 arenas, transparent huge pages) and why this one. (32 MiB is the
largest mmap threshold glibc takes.)

This needs no extra library: `mallopt` for this process, and the same settings, from the same table, as MALLOC_*_
variables in the environment for the processes it starts (vLLM's engine core, engine servers, Ray workers,
benchmark jobs), which glibc reads when they start. `rollwise bench allocator` measures it against glibc's
defaults and the old unbounded policy, side by side.

Left alone: another allocator already preloaded (tcmalloc, jemalloc), any MALLOC_*_ variable the user set, a
libc that is not glibc, and ROLLWISE_MALLOC=system (glibc's defaults).
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

OPT_OUT = "ROLLWISE_MALLOC"  # =system: leave glibc's defaults
# One table, so the mallopt of this process and the environment of the processes it starts cannot disagree:
# (glibc's mallopt parameter from malloc.h, the variable that sets it in a new process, its value).
_SETTINGS: tuple[tuple[int, str, int], ...] = (
    (-3, "MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD: larger blocks mmapped, given back when freed
    (-1, "MALLOC_TRIM_THRESHOLD_", 256 << 20),  # M_TRIM_THRESHOLD: the heap's free top kept up to this
    (-2, "MALLOC_TOP_PAD_", 64 << 20),  # M_TOP_PAD: grow the heap 64 MiB at a time (fewer brk calls)
)
ENVIRONMENT = {name: str(value) for _, name, value in _SETTINGS}
_tuned: bool | None = None


def is_glibc_malloc_variable(name: str) -> bool:
    """MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX ...: the variables glibc reads at process
    start."""
    return name.startswith("MALLOC_") and (name.endswith("_") or name in ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST"))


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
    """Switch glibc to the bounded policy in this process and the ones it starts (once; later calls return the
    first answer). Returns whether it did."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = tuning_applies(os.environ, platform.system(), platform.libc_ver()[0])
    if _tuned:
        libc = ctypes.CDLL("libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, _, value in _SETTINGS)  # 1: accepted
        if ok:
            os.environ.update(ENVIRONMENT)
        _tuned = ok
    return _tuned
