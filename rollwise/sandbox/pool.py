"""A pool of sandboxes: bounded, pre-warmed, and always cleaned up.

- `max_sandboxes` bounds live sandboxes (workspaces on disk, pods in a cluster), forks included;
  `acquire` waits for a free slot up to `acquire_timeout_s`, then raises with the numbers.
- `max_concurrent_runs` bounds commands running at once across all of the pool's sandboxes (the
  CPU-bound part); a rollout holding a sandbox between turns costs no CPU.
- `warm` sandboxes are created ahead (and set up with `setup`, e.g. a repository checkout) by a
  background thread, so `acquire` does not wait for creation: milliseconds locally, seconds for a pod.
- Cleanup: a sandbox closes when released; `close()` (also on `with`, and at interpreter exit)
  closes every sandbox still out, killing anything running in it, and removes the pool's temp root.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from typing_extensions import Self

from rollwise.sandbox.isolation import IsolationReport, detect_isolation
from rollwise.sandbox.launch import IsolationLevel
from rollwise.sandbox.limits import announce_limits
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import RunResult, Sandbox, SandboxError, SandboxLimits
from rollwise.sandbox.workspace import WorkspaceRoot

log = logging.getLogger("rollwise.sandbox")


@dataclass
class PoolStats:
    live: int = 0  # sandboxes that exist (warm + handed out)
    warm: int = 0
    running: int = 0  # commands running now
    peak_running: int = 0
    peak_live: int = 0
    created: int = 0
    closed: int = 0


class _CountingGate:
    """A semaphore that also records how many holders it has had at once (for stats and tests)."""

    def __init__(self, n: int, stats: PoolStats, lock: threading.Lock) -> None:
        self._sem = threading.BoundedSemaphore(n)
        self._stats, self._lock = stats, lock

    def acquire(self) -> bool:
        self._sem.acquire()
        with self._lock:
            self._stats.running += 1
            self._stats.peak_running = max(self._stats.peak_running, self._stats.running)
        return True

    def release(self) -> None:
        with self._lock:
            self._stats.running -= 1
        self._sem.release()


class PooledSandbox:
    """A pool's sandbox: the Sandbox interface, plus `close()` gives the slot back to the pool."""

    def __init__(self, pool: SandboxPool, inner: Sandbox) -> None:
        self._pool, self._inner = pool, inner

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def workdir(self) -> str:
        return self._inner.workdir

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def inner(self) -> Sandbox:
        return self._inner

    def run(self, command: str, timeout_s: float | None = None, *, stdin: bytes | None = None) -> RunResult:
        return self._inner.run(command, timeout_s, stdin=stdin)

    def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        return self._inner.read_file(path, max_bytes)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._inner.write_file(path, data)

    def list(self, path: str = "."):
        return self._inner.list(path)

    def fork(self) -> PooledSandbox:
        """A copy counted against the pool (waits for a slot like `acquire`)."""
        self._pool._take_slot()
        try:
            child = self._inner.fork()
        except BaseException:
            self._pool._give_slot()
            raise
        return self._pool._adopt(child)

    def close(self) -> None:
        self._pool._release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SandboxPool:
    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_sandboxes: int = 16,
        max_concurrent_runs: int = 2,
        warm: int = 0,
        setup: Callable[[Sandbox], None] | None = None,
        factory: Callable[[threading.Semaphore | _CountingGate], Sandbox] | None = None,
        max_level: IsolationLevel | str | None = None,
        acquire_timeout_s: float = 60.0,
    ) -> None:
        """`factory(run_gate)` makes one sandbox (default: a LocalSandbox in this pool's temp root);
        a custom factory (e.g. Kubernetes) must make its sandbox hold `run_gate` while a command runs."""
        if max_sandboxes < 1 or max_concurrent_runs < 1:
            raise ValueError(f"max_sandboxes and max_concurrent_runs must be >= 1, got {max_sandboxes}, "
                             f"{max_concurrent_runs}")
        if not 0 <= warm <= max_sandboxes:
            raise ValueError(f"warm must be between 0 and max_sandboxes={max_sandboxes}, got {warm}")
        self.limits = limits or SandboxLimits()
        self.max_sandboxes, self.warm_target = max_sandboxes, warm
        self.acquire_timeout_s = acquire_timeout_s
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)
        self._gate = _CountingGate(max_concurrent_runs, self.stats, self._lock)
        self._setup = setup
        self._root: WorkspaceRoot | None = None
        self.isolation: IsolationReport | None = None  # set for the local backend
        if factory is None:
            isolation = self.isolation = detect_isolation(max_level=max_level)  # once, loudly, up front
            self.limits_report = announce_limits(isolation)
            self._root = WorkspaceRoot()
            root = self._root

            def factory(gate):
                return LocalSandbox(self.limits, isolation=isolation, root=root, run_gate=gate)

        self._factory = factory
        self._warm: deque[Sandbox] = deque()
        self._out: dict[str, PooledSandbox] = {}
        self._closed = False
        self._refill_wanted = threading.Event()
        self._refiller: threading.Thread | None = None
        if warm:
            self._refiller = threading.Thread(target=self._refill_loop, name="sandbox-pool-warm", daemon=True)
            self._refiller.start()
            self._refill_wanted.set()
        atexit.register(self.close)

    # -- slots -----------------------------------------------------------------------------------
    def _take_slot(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.acquire_timeout_s if timeout_s is None else timeout_s)
        with self._slots:
            while self.stats.live >= self.max_sandboxes:
                if self._closed:
                    raise SandboxError("sandbox pool is closed")
                # A warm sandbox nobody holds can make room for a fork or a differently set-up one.
                if self._warm:
                    spare = self._warm.popleft()
                    self.stats.warm -= 1
                    self.stats.live -= 1
                    self.stats.closed += 1
                    threading.Thread(target=spare.close, daemon=True).start()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxError(
                        f"sandbox pool exhausted: {self.stats.live} of max_sandboxes={self.max_sandboxes} are "
                        f"in use after waiting {self.acquire_timeout_s:g} s; release sandboxes (close / with) "
                        f"or raise max_sandboxes")
                self._slots.wait(left)
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            self.stats.live += 1
            self.stats.peak_live = max(self.stats.peak_live, self.stats.live)

    def _give_slot(self) -> None:
        with self._slots:
            self.stats.live -= 1
            self._slots.notify_all()

    def _new(self) -> Sandbox:
        sb = self._factory(self._gate)
        try:
            if self._setup is not None:
                self._setup(sb)
        except BaseException:
            sb.close()
            raise
        with self._lock:
            self.stats.created += 1
        return sb

    def _adopt(self, sb: Sandbox) -> PooledSandbox:
        pooled = PooledSandbox(self, sb)
        with self._lock:
            if self._closed:
                sb.close()
                raise SandboxError("sandbox pool is closed")
            self._out[sb.id] = pooled
        return pooled

    # -- public ----------------------------------------------------------------------------------
    def acquire(self, timeout_s: float | None = None) -> PooledSandbox:
        """A fresh sandbox (warm if one is ready). Close it, or use `with pool.sandbox() as sb`."""
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            sb = self._warm.popleft() if self._warm else None
            if sb is not None:
                self.stats.warm -= 1
        if sb is None:
            self._take_slot(timeout_s)
            try:
                sb = self._new()
            except BaseException:
                self._give_slot()
                raise
        self._refill_wanted.set()
        return self._adopt(sb)

    @contextmanager
    def sandbox(self, timeout_s: float | None = None) -> Iterator[PooledSandbox]:
        sb = self.acquire(timeout_s)
        try:
            yield sb
        finally:
            sb.close()

    def _release(self, pooled: PooledSandbox) -> None:
        with self._lock:
            known = self._out.pop(pooled.id, None) is not None
        if not known:
            return  # closed twice, or by pool.close() already
        try:
            pooled.inner.close()
        finally:
            with self._slots:
                self.stats.live -= 1
                self.stats.closed += 1
                self._slots.notify_all()
            self._refill_wanted.set()

    def _refill_loop(self) -> None:
        while not self._closed:
            self._refill_wanted.wait(timeout=1.0)
            self._refill_wanted.clear()
            while not self._closed:
                with self._lock:
                    need = len(self._warm) < self.warm_target and self.stats.live < self.max_sandboxes
                if not need:
                    break
                try:
                    self._take_slot(timeout_s=0)
                except SandboxError:
                    break
                try:
                    sb = self._new()
                except Exception as exc:  # noqa: BLE001 -- user setup code: keep serving cold, say why
                    self._give_slot()
                    log.warning("could not pre-create a warm sandbox: %s", exc)
                    time.sleep(1.0)
                    break
                with self._lock:
                    if self._closed:
                        closing = sb
                    else:
                        self._warm.append(sb)
                        self.stats.warm += 1
                        closing = None
                if closing is not None:
                    closing.close()

    def wait_warm(self, timeout_s: float = 30.0) -> bool:
        """Block until `warm` sandboxes are ready (start-up, benchmarks, tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self._warm) >= self.warm_target:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Close every sandbox (warm and handed out, killing running commands) and remove the temp root."""
        with self._slots:
            if self._closed:
                return
            self._closed = True
            doomed = list(self._warm) + [p.inner for p in self._out.values()]
            self._warm.clear()
            self._out.clear()
            self.stats.warm = 0
            self._slots.notify_all()
        self._refill_wanted.set()
        errors = []
        for sb in doomed:
            try:
                sb.close()
            except Exception as exc:  # noqa: BLE001 -- any backend error: keep closing the others
                errors.append(f"{sb.id}: {exc}")
        with self._lock:
            self.stats.closed += len(doomed)
            self.stats.live = 0
        if self._refiller is not None:
            self._refiller.join(timeout=5)
        if self._root is not None:
            self._root.close()
        atexit.unregister(self.close)
        if errors:
            log.warning("sandbox pool close: %d sandboxes failed to close cleanly: %s", len(errors), errors)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
