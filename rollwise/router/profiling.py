"""The router process under cProfile: `ROLLWISE_ROUTER_PROFILE=PATH rollwise serve router ...` (the bench's router
arms inherit the variable) writes its stats to PATH when it stops; `python -m pstats PATH` reads them.

Times are the event-loop thread's CPU clock, not wall time: on a loaded machine waiting for a core is not the
router's cost. Garbage collection runs inside whatever function allocates, so cProfile cannot tell it apart:
its collections and CPU seconds since the router started serving are logged per generation.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import time
from collections.abc import Callable

PROFILE_ENV = "ROLLWISE_ROUTER_PROFILE"
log = logging.getLogger("rollwise.router")


class GcCounts:
    """Collections and CPU seconds per generation, from gc's callbacks."""

    def __init__(self) -> None:
        self.reset()
        self._started = 0.0

    def reset(self) -> None:
        self.counts = {generation: [0, 0.0] for generation in range(3)}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            entry = self.counts[info["generation"]]
            entry[0] += 1
            entry[1] += time.thread_time() - self._started


def run_profiled(run: Callable[[], None], path: str, gc_counts: GcCounts) -> None:
    """`run()` under cProfile; stats to `path` and the collections to the log when it returns."""
    import cProfile

    # uvicorn re-raises the SIGTERM it stopped on once it has shut down: as SystemExit here, so stats get written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    gc.callbacks.append(gc_counts)
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
        gc.callbacks.remove(gc_counts)
        profiler.dump_stats(path)
        log.warning("router profile written to %s; garbage collections while serving (generation: [count, CPU s]): "
                    "%s", path, gc_counts.counts)
