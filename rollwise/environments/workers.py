"""Environment workers: processes rollwise starts, health-checks, restarts and stops.

    service = EnvService(WorkerSpec(argv=[python, script, config_json]), workers=2, rollout_timeout_s=120)
    service.start()                      # every worker said hello (the environment loaded), or ConfigError-ish
    reply = service.run(RolloutRequest(...))   # never raises: a failure is RolloutReply(ok=False, error=why)
    service.close()

Where a worker runs is its `WorkerHost`: `local_worker` (a process of this one, the default) or another host
offering the same `EnvWorker` interface over a WorkerProcess it owns elsewhere (rollwise.control.ray.env_workers:
one Ray actor per worker, for `placement: ray`). The service's health checks, restarts and failure handling
are the same for every host.

A worker runs under any interpreter (an environment's own virtual environment), speaks the JSON-lines
protocol of rollwise.environments.protocol, and is killed with its whole process group. What one
environment does wrong costs the rollouts it was running, never the caller: a crash (the process exits),
a hang (no reply within the timeout; a worker that then misses a health ping is replaced), garbage (a
reply that fails validation, or a line over MAX_REPLY_BYTES), output floods (stderr is drained, only
its tail is kept, for error messages).
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollwise.environments.protocol import MAX_REPLY_BYTES, Hello, RolloutReply, RolloutRequest

STDERR_TAIL_BYTES = 4096
_ID = re.compile(rb'"id"\s*:\s*"([^"]{1,256})"')


class WorkerSpec(BaseModel):
    """What process runs an environment: argv (interpreter first), extra environment variables, a label."""

    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    label: str = "environment"


class WorkerError(RuntimeError):
    """A worker did not start (its environment failed to load, or it never said hello)."""


class EnvWorker(Protocol):
    """One environment worker as EnvService drives it (WorkerProcess, or a host that owns one elsewhere)."""

    name: str

    def start(self, timeout_s: float) -> Hello: ...
    def alive(self) -> bool: ...
    def in_flight(self) -> int: ...
    def kill(self, reason: str = "the worker was stopped") -> None: ...
    def submit(self, request: RolloutRequest) -> Future[RolloutReply | str]: ...
    def ping(self, timeout_s: float) -> bool: ...
    def cancel(self, rollout_id: str) -> None: ...
    def where(self) -> WorkerPlace: ...


class WorkerPlace(BaseModel):
    """Where a worker runs: its process, the process that owns it (this one, or an actor) and that one's node."""

    worker_pid: int | None
    host_pid: int
    node: str = "local"


WorkerHost = Callable[[WorkerSpec, int], EnvWorker]  # (spec, worker index) -> a worker, not started yet


@dataclass(frozen=True)
class WorkerHosting:
    """Where an environment's workers run (`make`) and the address they reach this process's proxy on."""

    make: WorkerHost
    proxy_host: str = "127.0.0.1"


class WorkerProcess:
    """One worker process and the replies it owes."""

    def __init__(self, spec: WorkerSpec, name: str) -> None:
        self.spec, self.name = spec, name
        self._pending: dict[str, Future[RolloutReply | str]] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self._hello: Future[Hello] = Future()
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float) -> Hello:
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen(self.spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as exc:
            raise WorkerError(f"{self.spec.label}: cannot run {self.spec.argv[0]!r}: {exc}") from None
        threading.Thread(target=self._read_replies, name=f"{self.name}-out", daemon=True).start()
        threading.Thread(target=self._drain_stderr, name=f"{self.name}-err", daemon=True).start()
        try:
            hello = self._hello.result(timeout=timeout_s)
        except FutureTimeout:
            self.kill()
            raise WorkerError(f"{self.spec.label}: the worker did not start within {timeout_s:g}s"
                              f"{self._tail_text()}") from None
        except WorkerError:
            self.kill()
            raise
        if not hello.ok:
            self.kill()
            raise WorkerError(f"{self.spec.label}: {hello.error or 'the environment failed to load'}")
        return hello

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def where(self) -> WorkerPlace:
        return WorkerPlace(worker_pid=self.proc.pid if self.proc is not None else None, host_pid=os.getpid())

    def kill(self, reason: str = "the worker was stopped") -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the environment's own children too
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        self._fail_all(reason)

    # ------------------------------------------------------------------ requests

    def submit(self, request: RolloutRequest) -> Future[RolloutReply | str]:
        return self._send(request.id, request.model_dump_json())

    def ping(self, timeout_s: float) -> bool:
        ping_id = f"ping-{uuid.uuid4().hex[:8]}"
        future = self._send(ping_id, json.dumps({"type": "ping", "id": ping_id}))
        try:
            return future.result(timeout=timeout_s) == "pong"
        except FutureTimeout:
            with self._lock:
                self._pending.pop(ping_id, None)
            return False

    def cancel(self, rollout_id: str) -> None:
        # Resolved, not dropped: whoever still waits on it (a host relaying for this worker) is answered.
        self._resolve(rollout_id, RolloutReply.failure(rollout_id, "cancelled: rollwise stopped waiting for it"))
        self._write(json.dumps({"type": "cancel", "id": rollout_id}))

    def _send(self, request_id: str, line: str) -> Future[RolloutReply | str]:
        future: Future[RolloutReply | str] = Future()
        with self._lock:
            self._pending[request_id] = future
        if not self._write(line):
            self._resolve(request_id, RolloutReply.failure(request_id, f"the worker is gone{self._exit_text()}"))
        return future

    def _write(self, line: str) -> bool:
        assert self.proc is not None and self.proc.stdin is not None
        with self._write_lock:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, ValueError, OSError):
                return False

    # ------------------------------------------------------------------ replies

    def _resolve(self, request_id: str, value: RolloutReply | str) -> None:
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for request_id, future in pending.items():
            if not future.done():
                future.set_result(RolloutReply.failure(request_id, reason))
        if not self._hello.done():
            self._hello.set_exception(WorkerError(f"{self.spec.label}: {reason}"))

    def _read_replies(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        while True:
            line = out.readline(MAX_REPLY_BYTES + 1)
            if not line:
                break
            if len(line) > MAX_REPLY_BYTES and not line.endswith(b"\n"):
                while (rest := out.readline(MAX_REPLY_BYTES)) and not rest.endswith(b"\n"):
                    pass  # skip the rest of the oversized line
                match = _ID.search(line[:4096])
                if match:
                    rid = match.group(1).decode(errors="replace")
                    self._resolve(rid, RolloutReply.failure(rid, f"the environment's reply is over "
                                                                 f"{MAX_REPLY_BYTES} bytes"))
                continue
            self._handle(line)
        self.proc.wait()
        self._fail_all(f"the worker exited{self._exit_text()}")

    def _handle(self, line: bytes) -> None:
        try:
            data = json.loads(line)
        except ValueError:
            return  # not a reply (the protocol's lines are JSON): ignored
        if not isinstance(data, dict):
            return
        kind, rid = data.get("type"), str(data.get("id", ""))
        if kind == "hello" and not self._hello.done():
            try:
                self._hello.set_result(Hello.model_validate(data))
            except ValidationError as exc:
                self._hello.set_exception(WorkerError(f"{self.spec.label}: bad hello: {exc.errors()[0]['msg']}"))
        elif kind == "pong":
            self._resolve(rid, "pong")
        elif kind == "result":
            try:
                reply = RolloutReply.model_validate(data)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                reply = RolloutReply.failure(rid, f"the environment returned garbage: {where}: {err['msg']}")
            self._resolve(rid, reply)

    def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while chunk := self.proc.stderr.read1(65536):
            self._tail.append(chunk)
            self._tail_bytes += len(chunk)
            while self._tail_bytes - len(self._tail[0]) >= STDERR_TAIL_BYTES:
                self._tail_bytes -= len(self._tail.popleft())

    def _tail_text(self) -> str:
        text = b"".join(self._tail)[-STDERR_TAIL_BYTES:].decode(errors="replace").strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return f"; its last output: {lines[-1][-300:]}" if lines else ""

    def _exit_text(self) -> str:
        code = self.proc.poll() if self.proc is not None else None
        return (f" (exit code {code})" if code is not None else "") + self._tail_text()


def local_worker(spec: WorkerSpec, index: int) -> WorkerProcess:
    """The default WorkerHost: a process of this one."""
    return WorkerProcess(spec, f"{spec.label}-{index}")


LOCAL = WorkerHosting(make=local_worker)


class EnvService:
    """`workers` processes of one environment (each made by `host`: local processes by default). `run` sends a rollout to the least busy live worker and
    waits at most `rollout_timeout_s`; a dead worker is started again before it gets more work, and a
    worker that misses a health ping after a timeout is replaced."""

    def __init__(self, spec: WorkerSpec, *, workers: int = 1, rollout_timeout_s: float = 300.0,
                 start_timeout_s: float = 600.0, ping_timeout_s: float = 10.0,
                 host: WorkerHost = local_worker) -> None:
        # start_timeout_s: a fresh virtual environment's first start compiles its bytecode (measured: 2+ minutes for
        # verifiers' ~700 MB on a busy 2-core machine); a load that fails says so at once (hello ok=false).
        self.spec, self.host = spec, host
        self.rollout_timeout_s, self.start_timeout_s, self.ping_timeout_s = rollout_timeout_s, start_timeout_s, ping_timeout_s
        self.workers: list[EnvWorker] = [host(spec, i) for i in range(workers)]
        self.hello: Hello | None = None
        self.restarts = 0
        self._closed = False
        self._lock = threading.Lock()
        self._restarting: dict[int, threading.Lock] = {i: threading.Lock() for i in range(workers)}

    def start(self) -> Hello:
        """Start every worker; raises WorkerError (naming the environment and why) if one does not load."""
        errors: list[BaseException] = []

        def one(w: EnvWorker) -> None:
            try:
                self.hello = w.start(self.start_timeout_s)
            except WorkerError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.close()
            raise errors[0]
        assert self.hello is not None
        return self.hello

    def _replace(self, index: int, reason: str) -> None:
        with self._restarting[index]:
            old = self.workers[index]
            if (old.alive() and reason == "crashed") or self._closed:
                return  # another thread already replaced it, or the service is closed
            old.kill(f"the worker was replaced: {reason}")
            with self._lock:
                self.restarts += 1
            fresh = self.host(self.spec, index)
            try:
                fresh.start(self.start_timeout_s)
            except WorkerError:
                pass  # still dead: its next rollout fails with the reason, and it is tried again then
            with self._lock:
                self.workers[index] = fresh
            if self._closed:
                fresh.kill()

    def _pick(self) -> int:
        with self._lock:
            return min(range(len(self.workers)), key=lambda i: self.workers[i].in_flight())

    def run(self, request: RolloutRequest) -> RolloutReply:
        # A group's members go to one worker (an environment that scores groups waits for all of them there).
        grouped = request.group is not None and self.hello is not None and self.hello.group_rollouts
        index = zlib.crc32(request.group.encode()) % len(self.workers) if grouped else self._pick()  # type: ignore[union-attr]
        if not self.workers[index].alive():
            self._replace(index, "crashed")
        worker = self.workers[index]
        future = worker.submit(request)
        try:
            value = future.result(timeout=self.rollout_timeout_s)
        except FutureTimeout:
            worker.cancel(request.id)
            if not worker.ping(self.ping_timeout_s):  # hung: killed now (its rollouts fail), restarted aside
                worker.kill(f"the worker was replaced: no answer to a health check after rollout {request.id} timed out")
                threading.Thread(target=self._replace, args=(index, "hung"), daemon=True).start()
            return RolloutReply.failure(request.id, f"timeout: no result within {self.rollout_timeout_s:g}s")
        if not isinstance(value, RolloutReply):  # a pong under a rollout's id: the worker is confused
            return RolloutReply.failure(request.id, "the environment returned garbage: not a result")
        return value

    def places(self) -> list[WorkerPlace]:
        """Where each worker runs now (the step's metrics report it)."""
        with self._lock:
            workers = list(self.workers)
        return [w.where() for w in workers]

    def close(self) -> None:
        self._closed = True
        threads = [threading.Thread(target=w.kill) for w in self.workers]  # a remote host's kill is a round trip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
