"""The engine core: an engine on its own thread, which keeps stepping while the trainer trains.

Why a thread and not a process: the reference engine and the trainer share one model process on
CPU; torch releases the GIL inside its kernels, so generation and the train step really overlap.
Every engine call (submit, abort, weight update, pause) runs *on the worker thread, between two
engine steps*, so the engine is never touched by two threads and a weight update never lands in
the middle of a step. Finished samples come out of `completions`, in finishing order; or, for a
caller that gives `outputs` (the engine server), are handed to it at the end of each pass on the
worker thread, with nothing queued (vLLM v1's shape: a submit queue in, one hand-off per step out).

`EngineWorker` is the local `RolloutBackend` (rollwise.types.contracts); the Ray engine actor, the engine
server and the pool's slots run one each. The pool swaps which engine a worker steps with
`swap_engine` (a slot serves one job's engine at a time; `None`: an idle worker that steps nothing).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollwise.engine.contract import Engine, add_all
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.types.generation import Completion, GenerationRequest

if TYPE_CHECKING:
    from torch import Tensor

    from rollwise.types.generation import ModelInfo
    from rollwise.types.weight_update import WeightUpdate
    from rollwise.types.weights import AdapterSpec, ExpectedWeights

T = TypeVar("T")


class EngineStopped(RuntimeError):
    """The worker thread is gone (an engine step raised, or it was closed): no command will run."""


class StepOutputs(Protocol):
    """Where a worker hands each pass's results, on its own thread (instead of `completions`)."""

    def passed(self, finished: list[Completion]) -> None:
        """After every pass of the loop (its commands run, then one engine step when there is work):
        the samples that step finished, possibly none."""

    def failed(self, error: BaseException) -> None:
        """The loop ended on `error`; every queued command was answered with EngineStopped first."""


# What a command runs on: the worker's engine, between two steps. None only on a pool slot's idle worker, whose
# commands never touch it (rollwise.pool.slots: they name the tenancy's engine themselves).
Command = Callable[[Engine], T]


class EngineWorker:
    def __init__(self, engine: Engine | None, name: str = "engine-0", outputs: StepOutputs | None = None) -> None:
        self.engine = engine
        self.completions: queue.Queue[Completion] = queue.Queue()
        self._outputs = outputs
        self._commands: queue.Queue[tuple[Command[Any], Future]] = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.step_seconds = 0.0  # time spent inside engine.step(): the engine's busy time
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ commands (any thread)

    def post(self, fn: Command[T], on_done: Callable[[Future], None] | None = None) -> Future:
        """Queue fn(engine) for the next step boundary and return at once. `on_done(future)` runs on the worker
        thread once it has run (or was refused with EngineStopped): an event loop's caller batches it into the
        pass's `outputs` instead of blocking a thread on the answer."""
        self._raise_if_failed()
        future: Future = Future()
        if on_done is not None:  # before it is queued: a callback added to a finished future runs on this thread
            future.add_done_callback(on_done)
        self._commands.put((fn, future))
        return future

    def call(self, fn: Command[T], timeout: float | None = 600.0) -> T:
        """Run fn(engine) on the worker thread between two steps and return its result (in-process
        only: the servers that own an EngineWorker use it; the RolloutBackend methods below wrap it)."""
        future = self.post(fn)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # a worker that dies after the check above never answers: notice it instead of waiting out
            try:
                wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
                return future.result(timeout=wait)
            except FutureTimeout:
                self._raise_if_failed()
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def call_here(self, fn: Command[T]) -> T:
        """Run fn(engine) on the calling thread while the worker thread waits between two steps: the same
        guarantee as `call`, for heavy tensor work. A 538 MB weight copy ran ~30% slower on the worker
        thread than on the trainer's thread (a second OpenMP team on cores whose first team still spins
        after the train step); measured by `rollwise bench sync`."""
        self._raise_if_failed()
        holding, released = threading.Event(), threading.Event()

        def hold(engine: Engine) -> None:
            holding.set()
            released.wait()

        future: Future = Future()
        self._commands.put((hold, future))
        while not holding.wait(0.1):
            self._raise_if_failed()  # a dead worker never reaches the step boundary
            if not self._thread.is_alive():
                raise EngineStopped(f"engine worker {self._thread.name} is closed")
        try:
            return fn(self.engine)
        finally:
            released.set()
            future.result(timeout=60)

    def submit(self, requests: list[GenerationRequest]) -> None:
        """All admitted at the same step boundary, or none (a refused request withdraws the others)."""
        self.call(lambda engine: add_all(engine, requests))

    def abort(self, request_ids: list[str]) -> list[Completion]:
        return self.call(lambda engine: [c for rid in request_ids for c in engine.abort(rid)])

    def load_weights(self, update: WeightUpdate) -> None:
        """Load a WeightUpdate through the engine side's checked two-phase commit
        (rollwise.engine.weight_receiver): the whole update is checked against the engine's model and
        tokenizer here, then applied between two steps (`apply_weights`), or refused with nothing applied.
        The one way weights come in: the transports (rollwise.sync) call down to it, never the reverse."""
        self.weight_receiver().receive(update)

    def weight_receiver(self) -> WeightReceiver:
        """The engine side's checked receiver for this worker: full weights and LoRA adapters (both engines
        serve adapters), each applied on this thread between two steps."""
        return WeightReceiver(self, self.model_info().tokenizer_fingerprint, adapters=self)

    @property
    def expected_weights(self) -> ExpectedWeights:
        return self.engine.expected_weights

    def loaded_adapters(self) -> dict[str, int]:
        return self.engine.loaded_adapters()

    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        self.call_here(lambda engine: engine.load_adapter(spec, state, version))

    def apply_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """The engine contract's apply step (Engine.apply_weights: it validates names and shapes before it
        copies anything), run on this thread between two steps. The receiver calls it after its checks; so
        do callers that have no manifest (the simulator's versions-only updates, the pool server's slots)."""
        self.call_here(lambda engine: engine.apply_weights(state_dict, version))

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def pause(self) -> None:
        self.call(lambda engine: engine.pause())

    def resume(self) -> None:
        self.call(lambda engine: engine.resume())

    def model_info(self) -> ModelInfo:
        return self.call(lambda engine: engine.model_info())

    def metrics(self) -> dict[str, float]:
        """Placement metrics for the step record: one local engine has none (a fleet reports restarts)."""
        return {}

    def swap_engine(self, engine: Engine | None) -> Engine | None:
        """Step `engine` from now on (between two steps; None: step nothing); returns the engine it replaced. Not from
        inside `call` (it waits for the worker thread): there, assign `worker.engine` directly."""

        def swap(old: Engine | None) -> Engine | None:
            self.engine = engine
            return old

        return self.call(swap)

    def next_completion(self, timeout: float) -> Completion | None:
        self._raise_if_failed()
        try:
            return self.completions.get(timeout=timeout)
        except queue.Empty:
            self._raise_if_failed()
            return None

    def close(self) -> None:
        self._stop.set()
        self._commands.put((lambda engine: None, Future()))  # wake the loop
        self._thread.join(timeout=60)

    # ------------------------------------------------------------ the loop (worker thread)

    @property
    def failure(self) -> BaseException | None:
        """What ended the worker thread (an engine step raised; every call raises from then on), or None."""
        return self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise EngineStopped(f"engine worker {self._thread.name} failed: {self._error!r}") from self._error

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                fn, future = self._commands.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # the caller sees it; the engine keeps serving
                    future.set_exception(exc)

    def _busy(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished() and not self.engine.paused

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands(block=not self._busy())
                finished: list[Completion] = []
                if self._busy():
                    started = time.perf_counter()
                    finished = self.engine.step()
                    self.step_seconds += time.perf_counter() - started
                if self._outputs is not None:
                    self._outputs.passed(finished)
                else:
                    for completion in finished:
                        self.completions.put(completion)
        except BaseException as exc:  # surfaced to the controller on its next call
            self._error = exc
            while not self._commands.empty():
                _, future = self._commands.get()
                future.set_exception(EngineStopped(f"engine worker failed: {exc!r}"))
            if self._outputs is not None:
                self._outputs.failed(exc)
