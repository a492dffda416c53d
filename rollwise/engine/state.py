"""The state every engine keeps the same way: paused, sleeping, unfinished requests, the busy timeline.

The reference engine, the vLLM engine and the simulator's engine differ in how they generate, how many
sequences they run and how sleep frees memory; the rules below are the contract's
(rollwise.engine.contract.Engine) and must not drift apart between them, so they live here once:

- pause()/resume() are idempotent; in-flight requests keep their state while paused.
- The timeline is a list of (clock time, running sequences) points; the engines append one after
  every step and every change to the running batch. A paused engine generates nothing, so while
  paused every point records 0 running, whatever still holds KV. reset_timeline() starts a new list
  (readers that kept the old one keep what it had).
- sleep() needs an idle engine; wake() on an awake engine does nothing.

The clock is time.monotonic for the real engines and the simulator's virtual clock for SimEngine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from rollwise.types.weights import AdapterSpec


class EngineState:
    """Base of the engines: the shared state and its rules. A subclass provides `num_running` and,
    for sleep, `_free_memory()` / `_restore_memory()`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._paused = False
        self._sleeping = False
        # request id -> its samples not returned yet (finished or aborted samples are returned)
        self._unfinished: dict[str, int] = {}
        self.timeline: list[tuple[float, int]] = []  # (clock time, running sequences)

    # ---------------------------------------------------------------- what the subclass provides

    @property
    def num_running(self) -> int:
        raise NotImplementedError

    def _free_memory(self) -> bool:
        """Release what memory sleep can release; returns whether any was freed."""
        raise NotImplementedError

    def _restore_memory(self) -> None:
        """Undo _free_memory (called only on a sleeping engine)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- flags

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def _sample_returned(self, request_id: str) -> bool:
        """One sample of `request_id` finished; returns whether that was its last one."""
        self._unfinished[request_id] -= 1
        if self._unfinished[request_id]:
            return False
        del self._unfinished[request_id]
        return True

    # ---------------------------------------------------------------- pause / resume

    def pause(self) -> None:
        """Stop generating; in-flight requests keep their state and continue on resume()."""
        if not self._paused:
            self._paused = True
            self.mark_timeline()  # records 0 running: nothing generates while paused

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self.mark_timeline()

    # ---------------------------------------------------------------- sleep / wake

    def sleep(self) -> bool:
        """Release what memory the backend can (the engine must be idle); returns whether memory was
        freed. A sleeping engine refuses new requests until wake()."""
        if self.has_unfinished():
            raise RuntimeError("sleep() needs an idle engine: finish or abort its requests first")
        freed = self._free_memory()
        self._sleeping = True
        return freed

    def wake(self) -> None:
        if self._sleeping:
            self._restore_memory()
            self._sleeping = False

    # ---------------------------------------------------------------- timeline

    def mark_timeline(self, starting: int = 0, at: float | None = None) -> None:
        """Append (now, running sequences) to the timeline; 0 while paused. `starting`: sequences busy from
        now on that num_running does not count (about to be prefilled, or finished since `at`). `at`: a
        time already past, for an engine that learns which sequences ran in a step only after it."""
        when = self._clock() if at is None else at
        self.timeline.append((when, 0 if self._paused else self.num_running + starting))

    def reset_timeline(self) -> None:
        self.timeline = []

    # ---------------------------------------------------------------- LoRA adapters: none unless the engine serves them

    def loaded_adapters(self) -> dict[str, int]:
        return {}

    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        raise ValueError(f"the {getattr(self, 'name', 'engine')} engine serves no LoRA adapters: "
                         f"adapter {spec.name!r} was not loaded")

    def unload_adapter(self, name: str) -> None:
        raise ValueError(f"the {getattr(self, 'name', 'engine')} engine does not unload LoRA adapters: "
                         f"adapter {name!r} stays as it is")

    # ---------------------------------------------------------------- what an engine without these keeps: nothing

    @property
    def prefix_cache_tokens(self) -> int:
        return 0

    def flush_prefix_cache(self) -> int:
        return 0

    def close(self) -> None:
        return None
