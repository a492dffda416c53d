"""Rewards computed by a pool of isolated worker processes.

Reward code is untrusted (DESIGN invariant 4): it may raise, hang, eat memory, kill its own
process or return garbage. Here it runs in spawned worker processes, never in the training loop:

- every call has a timeout; a worker that does not answer in time is SIGKILLed (with its whole
  process group) and replaced, and the call gets an error result saying so;
- a worker that dies (segfault, os._exit, MemoryError in C code) is replaced, the call gets an
  error result with the exit status;
- each worker runs under RLIMIT_AS (`memory_bytes`);
- reward functions are named by import path, `package.module:function` or `path/to/file.py:function`,
  and loaded inside the worker; an import error, an exception, or a return value that is not a
  finite number or a RewardResult gives an error result naming the function.

Every submitted call resolves to exactly one `PoolReward` (never an exception, never nothing, also
when the pool is closed under it), so no sample is lost (DESIGN invariant 3); a failed call carries
`error_reward` (default 0.0) and the reason.

The reward function contract:

    def my_reward(problem: Problem, response: str, finish_reason: str | None) -> float | RewardResult

Example (`rollwise.reward.code_exec:python_tests` runs the response's program and the problem's
tests in a sandbox):

    with RewardPool(workers=2, timeout_s=30) as pool:
        results = pool.score("rollwise.reward.code_exec:python_tests",
                             [(problem, response_text, "stop")])

Why this file runs past ~400 lines: the pool is one state machine (spawn, timeout kill, replacement,
close) whose promise of exactly one PoolReward per call is only checkable when read in one place.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import math
import multiprocessing
import os
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from typing_extensions import Self

from rollwise.reward.batch import REWARD_ERROR, REWARD_ERROR_KIND, ScoredSample
from rollwise.reward.scoring import CORRECT_THRESHOLD, OUTCOMES, RewardResult
from rollwise.types.task import Problem

REWARD_WORKER_PID = "reward_worker_pid"  # on a sample scored in the pool: the worker process that scored it
WORKER_START_TIMEOUT_S = 120.0  # a spawned worker's interpreter start-up, before any call's timeout runs
ErrorKind = Literal["import", "exception", "bad_return", "timeout", "crash", "pool_closed"]
log = logging.getLogger("rollwise.reward")
RewardFn = Callable[[Problem, str, "str | None"], "float | RewardResult"]


class RewardFnError(ValueError):
    """A reward function path is malformed or cannot be loaded."""


@dataclass(frozen=True)
class PoolReward:
    """One reward call's outcome. `error` is None when the function returned a valid reward."""

    key: str  # the caller's id for the call (e.g. the sample id)
    fn: str
    reward: float
    result: RewardResult | None = None  # when the function returned a RewardResult
    error: str | None = None
    error_kind: ErrorKind | None = None
    elapsed_s: float = 0.0
    worker_pid: int | None = None  # the worker process that ran it (None: it never reached one)

    @property
    def ok(self) -> bool:
        return self.error is None


# -- loading (runs inside the worker) ------------------------------------------------------------

def parse_fn_path(path: str) -> tuple[str, str]:
    """Split "module:function" / "file.py:function"; raises RewardFnError with the expected form."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise RewardFnError(
            f"reward function must be given as 'package.module:function' or 'path/to/file.py:function', got {path!r}")
    module, name = (s.strip() for s in path.split(":"))
    if not module or not name.isidentifier():
        raise RewardFnError(f"reward function {path!r}: need a module and a function name around the ':'")
    return module, name


def load_reward_fn(path: str) -> RewardFn:
    """Import the reward function named by `path`. Errors name the function and what went wrong."""
    module_name, fn_name = parse_fn_path(path)
    try:
        if module_name.endswith(".py") or "/" in module_name:
            file = Path(module_name).resolve()
            if not file.is_file():
                raise FileNotFoundError(f"no such file: {file}")
            spec = importlib.util.spec_from_file_location(f"rollwise_reward_{file.stem}", file)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {file} as a Python module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # user code at import time can raise anything
        raise RewardFnError(f"reward function {path!r}: importing {module_name!r} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise RewardFnError(f"reward function {path!r}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise RewardFnError(f"reward function {path!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return fn


def _validate(path: str, value: Any) -> tuple[float, RewardResult | None]:
    if isinstance(value, RewardResult):
        reward = value.reward
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise _BadReturn(f"reward function {path!r} returned a RewardResult with reward={reward!r}; "
                             "it must be a finite number")
        if value.outcome not in OUTCOMES:
            raise _BadReturn(f"reward function {path!r} returned a RewardResult with outcome={value.outcome!r}; "
                             f"it must be one of {list(OUTCOMES)}")
        return float(reward), value
    if isinstance(value, (bool, int, float)) and not isinstance(value, complex):
        reward = float(value)
        if not math.isfinite(reward):
            raise _BadReturn(f"reward function {path!r} returned {value!r}; a reward must be a finite number")
        return reward, None
    shown = repr(value)
    shown = shown[:200] + "..." if len(shown) > 200 else shown
    raise _BadReturn(f"reward function {path!r} returned {shown} ({type(value).__name__}); "
                     "it must return a float or a rollwise.reward.RewardResult")


class _BadReturn(Exception):
    pass


def run_reward_fn(path: str, fn: RewardFn, args: tuple, kwargs: dict[str, Any],
                  memory_bytes: int | None = None) -> tuple:
    """Call a loaded reward function: ("ok", reward, RewardResult | None) or ("error", kind, message). In a pool
    worker, and in the trainer's process for `reward.executor: inprocess` (debugging)."""
    try:
        reward, result = _validate(path, fn(*args, **kwargs))
        return ("ok", reward, result)
    except _BadReturn as exc:
        return ("error", "bad_return", str(exc))
    except BaseException as exc:  # noqa: BLE001 -- untrusted code, SystemExit included
        hint = f" (worker memory limit {memory_bytes} bytes)" if isinstance(exc, MemoryError) else ""
        return ("error", "exception", f"reward function {path!r} raised {type(exc).__name__}: {exc}{hint}")


def _worker_main(conn, memory_bytes: int | None, preload: tuple[str, ...] = ()) -> None:
    """Worker loop: receive (op, fn path, args), reply ("ok", reward, result) or ("error", kind, message).
    op "load" only imports the function (RewardPool.check)."""
    os.setsid()  # own process group: the parent's kill reaches whatever the reward code started
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing verifier must not write core files
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which closes us
    cache: dict[str, RewardFn] = {}
    for module in preload:  # heavy imports before "ready", so no call's timeout pays for them
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 -- the call that needs it reports the import error, naming the function
            pass
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        op, path, args, kwargs = msg
        try:
            fn = cache.get(path)
            if fn is None:
                fn = cache[path] = load_reward_fn(path)
        except RewardFnError as exc:
            conn.send(("error", "import", str(exc)))
            continue
        if op == "load":
            conn.send(("ok", 0.0, None))
            continue
        reply = run_reward_fn(path, fn, args, kwargs, memory_bytes)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 -- e.g. an unpicklable RewardResult field
            conn.send(("error", "bad_return", f"reward function {path!r}: its result cannot be sent back: {exc}"))


# -- the pool (parent side) ----------------------------------------------------------------------

@dataclass
class PoolStats:
    calls: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    workers_started: int = 0
    workers_replaced: int = 0


@dataclass
class _Call:
    key: str
    fn: str
    args: tuple
    future: Future
    kwargs: dict[str, Any] = field(default_factory=dict)
    worker_pid: int | None = None
    op: Literal["call", "load"] = "call"


class _Worker:
    """One worker process and its pipe; replaced whole when it hangs or dies."""

    def __init__(self, ctx, memory_bytes: int | None, preload: tuple[str, ...] = ()) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, memory_bytes, preload), daemon=True,
                                name="rollwise-reward-worker")
        self.proc.start()
        child.close()
        self.conn = parent
        # Wait for the worker's "ready": its interpreter start-up (seconds on a busy machine) must not count
        # against the first call's timeout, which starts when the worker picks the call up.
        try:
            ready = parent.poll(WORKER_START_TIMEOUT_S) and parent.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise OSError(f"reward worker did not start within {WORKER_START_TIMEOUT_S:g} s")

    def kill(self) -> None:
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.kill()
        else:
            self.conn.close()

    def exit_reason(self) -> str:
        self.proc.join(timeout=2)
        code = self.proc.exitcode
        if code is None:
            return "worker stopped answering"
        if code < 0:
            try:
                return f"worker died of {signal.Signals(-code).name}"
            except ValueError:
                return f"worker died of signal {-code}"
        return f"worker exited with code {code}"


class RewardPool:
    def __init__(
        self,
        workers: int = 2,
        *,
        timeout_s: float = 30.0,
        memory_bytes: int | None = 2 * 1024**3,
        error_reward: float = 0.0,
        preload: Sequence[str] = (),
    ) -> None:
        """`workers` processes (started now, so start-up cost is paid once), each call bounded by
        `timeout_s` from the moment a worker picks it up, each worker by `memory_bytes` (RLIMIT_AS;
        None for no limit: reward code that imports torch needs several GiB of address space). `preload`: modules
        each worker imports as it starts (and again when replaced), before it takes calls."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not math.isfinite(error_reward):
            raise ValueError(f"error_reward must be a finite number, got {error_reward}")
        self.timeout_s, self.memory_bytes, self.error_reward = timeout_s, memory_bytes, error_reward
        self.preload = tuple(preload)
        self.stats = PoolStats()
        self._ctx = multiprocessing.get_context("spawn")  # no inherited threads, locks or CUDA state
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker | None] = [None] * workers
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"reward-pool-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- submitting -------------------------------------------------------------------------------
    def submit(self, fn: str, problem: Problem, response: str, finish_reason: str | None = None,
               key: str = "", kwargs: dict[str, Any] | None = None) -> Future[PoolReward]:
        """Queue one call; the future always resolves to a PoolReward. A malformed `fn` raises
        RewardFnError right away (a config error, not a reward error). `kwargs` (picklable) are passed to the
        function after the three arguments: the built-in task verifier takes its task and reward config so."""
        return self._submit(_Call(key=key, fn=fn, args=(problem, response, finish_reason), future=Future(),
                                  kwargs=kwargs or {}))

    def _submit(self, call: _Call) -> Future[PoolReward]:
        parse_fn_path(call.fn)
        fut = call.future
        with self._lock:
            closed = self._closed
            if not closed:
                self.stats.calls += 1
                self._queue.put(call)
        if closed:
            self._finish(call, error=("pool_closed", "the reward pool is closed"), elapsed=0.0)
        return fut

    def score(self, fn: str, calls: Iterable[tuple[Problem, str, str | None]],
              keys: Sequence[str] | None = None) -> list[PoolReward]:
        """Score many (problem, response, finish_reason) in parallel; results in input order."""
        calls = list(calls)
        keys = list(keys) if keys is not None else [str(i) for i in range(len(calls))]
        futures = [self.submit(fn, p, r, f, key=k) for (p, r, f), k in zip(calls, keys, strict=True)]
        return [f.result() for f in futures]

    async def ascore(self, fn: str, problem: Problem, response: str, finish_reason: str | None = None,
                     key: str = "") -> PoolReward:
        """`submit` for asyncio callers (the agent layer)."""
        return await asyncio.wrap_future(self.submit(fn, problem, response, finish_reason, key))

    def check(self, fn: str) -> str | None:
        """Load `fn` in a worker (not here: importing user code may hang); None if it loads, else why.
        Use at start-up so a typo in a config fails before training, with the function named."""
        res = self._submit(_Call(key="check", fn=fn, args=(), future=Future(), op="load")).result()
        return res.error

    # -- serving ----------------------------------------------------------------------------------
    def _worker(self, slot: int) -> _Worker:
        w = self._workers[slot]
        if w is None or not w.proc.is_alive():
            if w is not None:
                w.kill()
            w = self._workers[slot] = _Worker(self._ctx, self.memory_bytes, self.preload)
            with self._lock:
                self.stats.workers_started += 1
        return w

    def _replace(self, slot: int) -> None:
        w = self._workers[slot]
        if w is not None:
            w.kill()
        self._workers[slot] = None
        with self._lock:
            self.stats.workers_replaced += 1
            closed = self._closed
        if not closed:
            self._worker(slot)  # the replacement starts now, not when the next call waits for it

    def _serve(self, slot: int) -> None:
        try:
            self._worker(slot)  # warm start; if it fails, the first call retries and reports why
        except OSError as exc:
            log.warning("reward worker %d did not start: %s", slot, exc)
        while True:
            call = self._queue.get()
            if call is None:
                return
            start = time.monotonic()
            kind, message, reply = self._run_one(slot, call)
            elapsed = time.monotonic() - start
            if reply is not None and reply[0] == "ok":
                self._finish(call, reward=reply[1], result=reply[2], elapsed=elapsed)
            elif reply is not None:
                self._finish(call, error=(reply[1], reply[2]), elapsed=elapsed)
            else:
                self._finish(call, error=(kind, message), elapsed=elapsed)

    def _run_one(self, slot: int, call: _Call) -> tuple[ErrorKind, str, tuple | None]:
        """Hand `call` to this slot's worker and wait; (kind, message, None) when no reply came."""
        try:
            w = self._worker(slot)
            call.worker_pid = w.proc.pid
            w.conn.send((call.op, call.fn, call.args, call.kwargs))
        except Exception as exc:  # noqa: BLE001 -- unpicklable arguments, worker start failure
            return "exception", f"could not hand the call to a worker: {type(exc).__name__}: {exc}", None
        try:
            if w.conn.poll(self.timeout_s):
                return "exception", "", w.conn.recv()
        except (EOFError, OSError):
            reason = w.exit_reason()
            self._replace(slot)
            return "crash", f"reward function {call.fn!r} crashed its worker ({reason}); worker replaced", None
        self._replace(slot)
        msg = f"reward function {call.fn!r} did not return within {self.timeout_s:g} s; worker killed and replaced"
        return "timeout", msg, None

    def _finish(self, call: _Call, *, reward: float | None = None, result: RewardResult | None = None,
                error: tuple[ErrorKind, str] | None = None, elapsed: float) -> None:
        if error is None:
            out = PoolReward(call.key, call.fn, float(reward), result, elapsed_s=elapsed, worker_pid=call.worker_pid)
            with self._lock:
                self.stats.ok += 1
        else:
            kind, message = error
            out = PoolReward(call.key, call.fn, self.error_reward, None, message, kind, elapsed, call.worker_pid)
            with self._lock:
                self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        if not call.future.done():
            call.future.set_result(out)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers. Calls still queued resolve to `pool_closed` errors (not lost)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        for call in pending:
            self._finish(call, error=("pool_closed", "the reward pool was closed before this call ran"),
                         elapsed=0.0)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)
        for w in self._workers:
            if w is not None:
                w.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_pool_reward(s: ScoredSample, r: PoolReward) -> None:
    """Write one call's outcome on its sample, as rollwise.reward.batch.score_samples does: reward, outcome and
    correctness from a RewardResult (a bare number: full reward counts as correct, like a verifier score of 1);
    a failed call gets the error reward, outcome `unparseable`, and its reason and kind in
    extra[REWARD_ERROR] / extra[REWARD_ERROR_KIND] (a verifier that failed inside `score`: kind `verifier`)."""
    s.reward = r.reward
    if r.worker_pid is not None:
        s.extra[REWARD_WORKER_PID] = r.worker_pid
    if r.result is not None:
        s.outcome = r.result.outcome
        s.strict_correct = r.result.strict_correct
        s.lenient_correct = r.result.lenient_correct
        if r.result.error:
            s.extra[REWARD_ERROR], s.extra[REWARD_ERROR_KIND] = r.result.error, "verifier"
    elif r.ok:
        s.strict_correct = s.lenient_correct = r.reward >= CORRECT_THRESHOLD
        s.outcome = "correct" if s.strict_correct else "formatted_wrong"
    else:
        s.outcome = "unparseable"
        s.strict_correct = s.lenient_correct = False
        s.extra[REWARD_ERROR], s.extra[REWARD_ERROR_KIND] = r.error, r.error_kind


def score_samples_in_pool(pool: RewardPool, fn: str, samples: list, problems: dict[str, Problem]) -> list[PoolReward]:
    """Like rollwise.reward.batch.score_samples, through the pool: fills reward (and, from a
    RewardResult, outcome and correctness) on each Sample in place; errors go to extra["reward_error"]."""
    results = pool.score(fn, [(problems[s.problem_id], s.response_text, s.finish_reason) for s in samples],
                         keys=[s.sample_id for s in samples])
    for s, r in zip(samples, results, strict=True):
        apply_pool_reward(s, r)
    return results
