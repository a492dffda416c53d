"""The router process under cProfile: `ROLLWISE_ROUTER_PROFILE=PATH rollwise serve router ...` (the bench's router
arms inherit the variable) profiles it from the moment it is ready to serve (start-up, imports and the
tokenizer excluded) and writes the stats to PATH when it stops; `python -m pstats PATH` reads them.

Times are the event-loop thread's CPU clock, not wall time: on a loaded machine waiting for a core is not the
router's cost. Garbage collection runs inside whatever function allocates, so cProfile cannot tell it apart:
its collections and CPU seconds while serving are logged per generation.
"""

from __future__ import annotations

import cProfile
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable

PROFILE_ENV = "ROLLWISE_ROUTER_PROFILE"
log = logging.getLogger("rollwise.router")


class Profiling:
    """cProfile on CPU time plus garbage collections per generation ([count, CPU s]), from serving() on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.profiler = cProfile.Profile(time.thread_time)
        self.collections = {generation: [0, 0.0] for generation in range(3)}
        self._gc_started = 0.0

    def serving(self) -> None:
        """Called on the event loop's thread once the router is ready to serve."""
        gc.callbacks.append(self._count_collection)
        self.profiler.enable()

    def _count_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            entry = self.collections[info["generation"]]
            entry[0] += 1
            entry[1] += time.thread_time() - self._gc_started

    def run(self, run: Callable[[], None]) -> None:
        """`run()`, then the stats to `path` and the collections to the log."""
        # uvicorn re-raises the SIGTERM it stopped on once it has shut down: as SystemExit here, so stats get written.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            run()
        finally:
            self.profiler.disable()
            if self._count_collection in gc.callbacks:
                gc.callbacks.remove(self._count_collection)
            self.profiler.dump_stats(self.path)
            log.warning("router profile written to %s; garbage collections while serving (generation: "
                        "[count, CPU s]): %s", self.path, self.collections)
