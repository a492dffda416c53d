"""Run one process tree with a wall-clock deadline and bounded output capture.

Why not `subprocess.run(timeout=...)`: it buffers all output in memory (a command printing
gigabytes would take the host down with it) and on timeout it kills only the direct child, not the
grandchildren holding the pipes open. Here the child starts its own session (process group), the
output is drained as it comes and only a head and a tail are kept, and any way out (deadline,
too much output, normal exit) ends with SIGKILL to the whole group. Killing the group also kills
the sandbox launcher (bwrap/unshare), whose pid-namespace init then takes every process inside
the sandbox with it, including ones that started their own session.

That kill is asynchronous: the launcher is gone at once, the processes inside die a few
milliseconds later, and until then they still write to the workspace. So with bubblewrap the
namespace's init is watched too (its host pid comes from `bwrap --info-fd`): the kernel lets a
pid namespace's init finish exiting only after every other process of the namespace is gone, so
once a pidfd on it reports the exit, nothing of the command is left. `run_bounded` returns only then.

Stdin is written from a thread (a command reads it at its own pace; a single write would stop
at the 64 KiB pipe buffer), and a command that cannot even start (a NUL byte in it, an argument
over the kernel's 128 KiB limit) is an outcome with `spawn_error`, not an exception.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# After the main process exits, processes it left in the background may still hold the pipes
# open; wait this long for EOF, then kill them (commands do not outlive their turn).
_EXIT_GRACE_S = 0.2


@dataclass
class Capture:
    """Keeps the first and last `keep // 2` bytes of a stream and counts all of them."""

    keep: int
    head: bytearray
    tail: bytearray
    total: int = 0

    @classmethod
    def new(cls, keep: int) -> Capture:
        return cls(keep=keep, head=bytearray(), tail=bytearray())

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            excess = len(self.tail) - (self.keep - self.keep // 2)
            if excess > 0:
                del self.tail[:excess]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        head = self.head.decode("utf-8", errors="replace")
        if not self.truncated:
            return head + self.tail.decode("utf-8", errors="replace")
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"\n[rollwise: output truncated: {cut} of {self.total} bytes cut from the middle]\n"
        return head + marker + self.tail.decode("utf-8", errors="replace")


@dataclass
class ProcessOutcome:
    returncode: int | None  # None when we killed it before it exited
    stdout: Capture
    stderr: Capture
    wall_s: float
    killed_for: str | None  # "timeout" | "output" | "stopped" (its owner asked: the sandbox is closing)
    spawn_error: str | None = None  # the command could not be started at all (and why)
    stragglers: bool = False  # processes of the command outlived the wait for them (should not happen)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (started with start_new_session=True)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pid: int, timeout_s: float = 2.0) -> bool:
    """Wait until no process of the group exists, zombies included.

    Without a pid namespace, killed orphans are reaped by the host's init whenever it gets to it;
    until then they still count against the sandbox uid's RLIMIT_NPROC, and the next command
    would fail to fork. Only worth it without namespaces (with them, RLIMIT_NPROC is counted per
    sandbox and the next command starts in a fresh user namespace).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.005)
    return False


def run_bounded(
    argv: Sequence[str],
    *,
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    keep_bytes: int,
    kill_bytes: int,
    stdin: bytes | None = None,
    user: int | None = None,
    group: int | None = None,
    preexec_fn: Callable[[], None] | None = None,
    on_start: Callable[[subprocess.Popen], None] | None = None,
    reap_wait_s: float = 0.0,
    info_pipe: tuple[int, int] | None = None,
    extra_fds: tuple[int, ...] = (),
    stop: threading.Event | None = None,
) -> ProcessOutcome:
    """Run `argv`, return its exit status and captured output; never leaves a process behind.

    `on_start` receives the Popen right after the spawn. `stop`: set from another thread (sandbox close while
    a command hangs), the command is killed within ~0.1 s the way a timeout kills it (the namespace's init
    first: see _let_launcher_reap). `reap_wait_s`: see wait_group_gone.
    `info_pipe`: (read, write) ends of the pipe whose write end argv names in `bwrap --info-fd`;
    both are closed here. `extra_fds`: more fds the command inherits (the caller closes them).
    """
    start = time.monotonic()
    out, err = Capture.new(keep_bytes), Capture.new(keep_bytes)
    try:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: one killpg reaches every descendant
            close_fds=True,
            pass_fds=((info_pipe[1],) if info_pipe else ()) + extra_fds,
            user=user,
            group=group,
            extra_groups=[] if user is not None else None,  # drop root's supplementary groups too
            preexec_fn=preexec_fn,  # noqa: PLW1509 -- only without a prlimit binary (see launch.py)
        )
    except (OSError, ValueError) as exc:  # E2BIG, "embedded null byte", ...: a result, not a crash
        if info_pipe:
            os.close(info_pipe[0])
            os.close(info_pipe[1])
        return ProcessOutcome(126, out, err, time.monotonic() - start, None, spawn_error=_spawn_error(exc))
    if info_pipe:
        os.close(info_pipe[1])  # only bwrap writes it; we see EOF when bwrap is gone
    if on_start is not None:
        on_start(proc)
    killed_for: str | None = None
    writer = None
    stragglers = False
    try:
        if stdin is not None and proc.stdin is not None:
            writer = threading.Thread(target=_write_stdin, args=(proc.stdin, stdin), daemon=True)
            writer.start()
        killed_for = _pump(proc, out, err, deadline=start + timeout_s, kill_bytes=kill_bytes, stop=stop)
    finally:
        info = _read_ready(info_pipe[0]) if info_pipe else b""
        _let_launcher_reap(proc, _init_pid(info), killed=killed_for is not None)
        kill_group(proc.pid)  # whatever happened above: nothing of this command survives it
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()
        if info_pipe:
            stragglers = not _wait_namespace_gone(info + _read_to_end(info_pipe[0]), timeout_s=5.0)
        if reap_wait_s > 0:
            wait_group_gone(proc.pid, reap_wait_s)
        if writer is not None:
            writer.join(timeout=5.0)  # every reader is gone: the write ends with EPIPE
        elif proc.stdin is not None:
            proc.stdin.close()
    returncode = None if killed_for is not None else proc.returncode
    return ProcessOutcome(returncode, out, err, time.monotonic() - start, killed_for, stragglers=stragglers)


def _spawn_error(exc: BaseException) -> str:
    if isinstance(exc, ValueError) and "null byte" in str(exc):
        return "the command contains a NUL byte, which no program argument can hold; remove it"
    if isinstance(exc, OSError) and exc.errno == 7:  # E2BIG
        return ("the command is too long for the kernel (one argument may hold at most 128 KiB); "
                "write long input to a file or pass it on stdin")
    return f"could not start the command: {type(exc).__name__}: {exc}"


def _read_ready(fd: int) -> bytes:
    """What is in the pipe now, without waiting (bwrap writes its --info-fd JSON once, at start)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""
    finally:
        os.set_blocking(fd, True)


def _read_to_end(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _init_pid(info: bytes) -> int | None:
    """The host pid of the pid namespace's init, from bwrap's --info-fd JSON (None before it wrote it)."""
    try:
        return int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _let_launcher_reap(proc: subprocess.Popen, init_pid: int | None, *, killed: bool) -> None:
    """Have the launcher (bwrap) reap its namespace's init before the group kill reaches the launcher.

    Killed first, the launcher left the dying init to the host's PID 1 as an orphan zombie: ~2 s on a
    VM whose init reaps, forever in a container whose PID 1 never reaps (docker without --init, a
    Python entrypoint), and every such zombie of the sandbox uid counts against its RLIMIT_NPROC until
    later commands cannot fork. That happened after *every* command, even one that exited normally:
    its pipes close a moment before bwrap has reaped the init and exited. So: a command we stop gets its
    namespace's init killed (which ends everything inside), and then, in both cases, the launcher gets a
    moment to reap it and exit on its own.
    """
    if killed:
        if init_pid is None or proc.poll() is not None:  # (bwrap alive: the pid is still its child's)
            return  # no namespace init we know of: the group kill is all there is
        try:
            os.kill(init_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
    try:
        proc.wait(timeout=_EXIT_GRACE_S if not killed else 1.0)
    except subprocess.TimeoutExpired:
        pass  # a launcher that does not exit is killed with its group


def _wait_namespace_gone(info: bytes, timeout_s: float) -> bool:
    """Wait until the pid namespace bwrap reported in `info` (its --info-fd JSON) is empty; False if it is
    not in time.

    bwrap is gone when this runs, so `info` is its whole JSON (or nothing, if it failed before creating
    the namespace). The kernel completes the exit of a namespace's init only after every other process
    of that namespace has exited, and a pidfd reports exactly that exit.
    """
    init_pid = _init_pid(info)
    if init_pid is None:
        return True  # bwrap never got as far as starting anything
    try:
        pidfd = os.pidfd_open(init_pid)
    except ProcessLookupError:
        return True  # exited and reaped: the namespace was empty before that
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # normally already dying (--die-with-parent)
    except ProcessLookupError:
        pass
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


def _write_stdin(pipe, data: bytes) -> None:
    """Blocking writes at the command's pace, from a thread; a command that stops reading (or
    exits) ends the write with EPIPE, a killed one too."""
    try:
        pipe.write(data)
        pipe.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


def _pump(proc: subprocess.Popen, out: Capture, err: Capture, *, deadline: float, kill_bytes: int,
          stop: threading.Event | None = None) -> str | None:
    """Drain both pipes until EOF, a limit or `stop`; returns why the caller must kill it, or None."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if stop is not None and stop.is_set():
                return "stopped"
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                return None  # background leftovers hold the pipes; the caller's killpg ends them
            # (a stop is noticed within 0.1 s: polled, since nothing else wakes a select on the command's pipes)
            wait = min(deadline - now, 0.05 if exited_at is not None else 0.1 if stop is not None else 0.5)
            for key, _ in sel.select(timeout=wait):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.feed(chunk)
                if out.total + err.total > kill_bytes:
                    return "output"
        # Pipes closed: wait for the exit status, still under the deadline.
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return "timeout"
        return None
    finally:
        sel.close()
