"""A run's memory: a warning before the machine runs out, and the peak its processes held.

When a Linux machine runs out of memory the kernel's OOM killer ends the largest process with SIGKILL: no
Python exception, no message from rollwise, only "Killed" from the shell (or an engine that vanished). That
happens to people who start several runs side by side on one machine (three default vLLM runs need ~27 GB).
`MemoryWatch` samples the machine's available memory every second on a thread of its own and prints one
warning, naming the settings that use memory, when it falls below `low_fraction` of the total (at least
`low_floor_gib`); it warns again only after memory came back. It also keeps the peak resident memory of this
process and its children (a vLLM engine core, engine servers), which `peak_rss_gb` (this process alone)
misses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import psutil

GIB = 1024**3


@dataclass(frozen=True)
class MemoryReading:
    available: int  # bytes the machine can still give out (MemAvailable)
    total: int
    run_rss: int  # resident bytes of this process and its children


def read_memory() -> MemoryReading:
    vm = psutil.virtual_memory()
    run = psutil.Process()
    rss = run.memory_info().rss
    for child in run.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended between the listing and the reading
            pass
    return MemoryReading(vm.available, vm.total, rss)


def low_memory_message(reading: MemoryReading, hints: str) -> str:
    return (f"memory is nearly exhausted: {reading.available / GIB:.1f} GiB of {reading.total / GIB:.1f} GiB is "
            f"left, and this run's processes hold {reading.run_rss / GIB:.1f} GiB. If the machine runs out, the "
            f"kernel kills a process without a message (the shell prints 'Killed'). To use less: {hints}; or "
            "stop other jobs on this machine.")


class MemoryWatch:
    """Call `warn` once each time available memory falls below the threshold; `peak_run_rss` after `stop()`.
    `read` is injectable so tests can replay a sequence of readings."""

    def __init__(self, warn: Callable[[str], None], hints: str, *, interval_s: float = 1.0,
                 low_fraction: float = 0.05, low_floor_gib: float = 1.0,
                 read: Callable[[], MemoryReading] = read_memory) -> None:
        if not 0 < low_fraction < 1 or interval_s <= 0:
            raise ValueError("low_fraction must lie in (0, 1) and interval_s be positive")
        self.warn, self.hints, self.read = warn, hints, read
        self.interval_s, self.low_fraction, self.low_floor = interval_s, low_fraction, low_floor_gib * GIB
        self.peak_run_rss = 0
        self.min_available: int | None = None
        self.warnings = 0
        self._armed = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def threshold(self, total: int) -> float:
        return max(self.low_fraction * total, self.low_floor)

    def check(self) -> None:
        """One sample: track the peak, warn on a fall below the threshold, re-arm once memory is back above
        twice the threshold (so a run hovering at the line does not print a warning every second)."""
        reading = self.read()
        self.peak_run_rss = max(self.peak_run_rss, reading.run_rss)
        self.min_available = reading.available if self.min_available is None else min(self.min_available,
                                                                                           reading.available)
        line = self.threshold(reading.total)
        if self._armed and reading.available < line:
            self._armed = False
            self.warnings += 1
            self.warn(low_memory_message(reading, self.hints))
        elif not self._armed and reading.available > 2 * line:
            self._armed = True

    def start(self) -> MemoryWatch:
        self.check()  # a machine already short of memory is reported before anything big starts
        self._thread = threading.Thread(target=self._loop, name="memory-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except psutil.Error:  # a reading that failed is skipped; the next one tries again
                pass

    def summary(self) -> dict[str, float | None]:
        return {"peak_rss_run_gb": self.peak_run_rss / GIB,
                "min_available_memory_gb": None if self.min_available is None else self.min_available / GIB,
                "low_memory_warnings": self.warnings}
