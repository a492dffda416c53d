"""The local sandbox backend: a workspace directory plus bubblewrap (or the strongest fallback).

Each `run` launches a fresh isolated process tree over the same workspace directory, so files
persist across a rollout's turns while no process does. `fork` copies the directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import rollwise.sandbox.files as files
import rollwise.sandbox.seccomp as seccomp
from rollwise.sandbox.cgroups import LAUNCHER_PIDS, CgroupError, CommandCgroup, cgroup_support
from rollwise.sandbox.isolation import IsolationReport, detect_isolation
from rollwise.sandbox.launch import IsolationLevel, LaunchFds, build_launch
from rollwise.sandbox.process import Capture, ProcessOutcome, kill_group, run_bounded
from rollwise.sandbox.types import (
    FileInfo,
    LimitName,
    MiB,
    RunResult,
    SandboxError,
    SandboxLifecycle,
    SandboxLimits,
)
from rollwise.sandbox.workspace import WorkspaceRoot, default_root

# Error output that means an rlimit made a call fail (an rlimit refuses, it does not kill), checked
# in this order. Best effort: the command's own messages, in the usual libc/Python/shell wording.
_LIMIT_HINTS: list[tuple[LimitName, tuple[str, ...]]] = [
    ("disk", ("No space left on device", "Disk quota exceeded")),
    ("memory", ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory", "memory exhausted")),
    ("file_size", ("File too large",)),
    ("open_files", ("Too many open files",)),
    ("processes", ("Resource temporarily unavailable", "Cannot fork", "can't fork", "fork: retry")),
]


class LocalSandbox(SandboxLifecycle):
    """One rollout's workspace on this machine. See rollwise.sandbox.types.Sandbox for the contract."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: IsolationReport | None = None,
        max_level: IsolationLevel | str | None = None,
        root: WorkspaceRoot | None = None,
        run_gate: threading.Semaphore | None = None,
        _workspace: Path | None = None,
    ) -> None:
        super().__init__()
        self.limits = limits or SandboxLimits()
        self.isolation = isolation or detect_isolation(max_level=max_level)
        self._root = root or default_root()
        self._gate = run_gate  # a pool's limit on commands running at once, shared by its sandboxes
        self._lock = threading.Lock()  # one command / file op / fork at a time
        self._running: subprocess.Popen | None = None
        self._stop = threading.Event()  # set by close(): the running command is stopped like a timed-out one
        self._ws = _workspace or self._root.new_workspace(
            self.isolation.mode.sandbox_uid, disk_bytes=self.limits.disk_bytes, max_files=self.limits.max_files)
        self.leftovers: list[str] = []  # what close() could not remove (logged; never raised)

    # -- identity ---------------------------------------------------------------------------------
    @property
    def level(self) -> IsolationLevel:
        return self.isolation.level

    @property
    def host_path(self) -> Path:
        """The workspace on the host (for tests and debugging; tools should use the methods)."""
        return self._ws

    @property
    def workdir(self) -> str:
        return build_launch(self.isolation.mode, self._ws, "", self.limits).env["HOME"]

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self._id}, level={self.level.value}, closed={self._closed})"

    # -- commands ---------------------------------------------------------------------------------
    def run(self, command: str, timeout_s: float | None = None, *, stdin: bytes | None = None) -> RunResult:
        timeout = float(timeout_s) if timeout_s is not None else self.limits.timeout_s
        if timeout <= 0:
            raise SandboxError(f"timeout_s must be > 0, got {timeout_s}")
        gate = self._gate
        if gate is not None:
            gate.acquire()
        try:
            with self._lock:
                self._check_open()
                return self._run_locked(command, timeout, stdin)
        finally:
            if gate is not None:
                gate.release()

    def _new_cgroup(self) -> CommandCgroup | None:
        """This command's memory (+pids) cgroup, or None where the machine has no usable one."""
        support = cgroup_support()
        if not support.usable:
            return None
        return CommandCgroup(support, self.limits.whole_memory_bytes, self.limits.max_processes + LAUNCHER_PIDS)

    def _run_locked(self, command: str, timeout: float, stdin: bytes | None) -> RunResult:
        try:
            cgroup = self._new_cgroup()
        except CgroupError as exc:  # fail closed: no command runs without the bound the report promises
            out, err = Capture.new(self.limits.max_output_bytes), Capture.new(self.limits.max_output_bytes)
            return self._result(command, timeout, ProcessOutcome(126, out, err, 0.0, None, spawn_error=str(exc)))
        try:
            outcome = self._launch(command, timeout, stdin, cgroup)
            oom_kills = cgroup.oom_kills() if cgroup is not None else 0
        finally:
            self._running = None  # also when the launch raised: close() must never signal a finished group
            if cgroup is not None:
                cgroup.remove()  # after run_bounded: nothing of the command is left in it
        return self._result(command, timeout, outcome, oom_kills)

    def _launch(self, command: str, timeout: float, stdin: bytes | None,
                cgroup: CommandCgroup | None) -> ProcessOutcome:
        bwrap = self.level is IsolationLevel.BWRAP
        info = os.pipe() if bwrap else None  # bwrap reports its pid namespace's init here
        prog = seccomp.program() if bwrap else None
        seccomp_fd = seccomp.program_fd(prog) if prog is not None else None
        try:
            fds = LaunchFds(info=info[1] if info else None, seccomp=seccomp_fd)
            launch = build_launch(self.isolation.mode, self._ws, command, self.limits, fds)
            argv, user, group = launch.argv, launch.user, launch.group
            if cgroup is not None:  # join it before anything else runs; the uid switch moves into the wrapper
                argv, user, group = cgroup.wrap(argv, user, group), None, None
            return run_bounded(
                argv, cwd=launch.cwd, env=launch.env, timeout_s=timeout,
                keep_bytes=self.limits.max_output_bytes, kill_bytes=self.limits.kill_output_bytes,
                stdin=stdin, user=user, group=group, preexec_fn=launch.preexec_fn,
                on_start=self._set_running, info_pipe=info, stop=self._stop,
                extra_fds=(seccomp_fd,) if seccomp_fd is not None else (),
                # Without namespaces, killed orphans count against the uid's RLIMIT_NPROC until
                # the host's init reaps them: give it a moment before the next command forks.
                reap_wait_s=2.5 if self.level is IsolationLevel.RLIMITS else 0.0,
            )
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)

    def _set_running(self, proc: subprocess.Popen) -> None:
        self._running = proc

    def _result(self, command: str, timeout: float, o: ProcessOutcome, oom_kills: int = 0) -> RunResult:
        code = o.returncode
        sig = None
        if code is not None:
            # Through bwrap/unshare/sh a signal death arrives as 128+n; directly, as -n.
            n = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
            if n is not None:
                try:
                    sig = signal.Signals(n).name
                except ValueError:
                    sig = None
        killed = o.killed_for is not None
        limit: LimitName | None = None
        reason: str | None = None
        if o.spawn_error is not None:
            limit, reason = "launch", o.spawn_error
        elif o.killed_for == "timeout":
            limit, reason = "timeout", f"killed: wall-clock timeout after {timeout:g} s"
        elif o.killed_for == "output":
            limit, reason = "output", f"killed: wrote more than {self.limits.kill_output_bytes} bytes of output"
        elif self._closed:
            killed, code, reason = True, None, "killed: the sandbox was closed while the command ran"
        elif oom_kills > 0:  # the kernel killed a process of it; the main one may have survived
            killed = killed or sig == "SIGKILL"
            code = None if killed else code  # as for the other kills: no exit status of its own
            limit, reason = "memory", (
                f"{'killed' if killed else 'a process of the command was killed'}: its processes together "
                f"(files in /tmp, /dev/shm and memfds included) used more than the sandbox's memory limit "
                f"({self.limits.whole_memory_bytes} bytes); {oom_kills} process(es) killed")
        elif sig in ("SIGXCPU",) or (sig == "SIGKILL" and o.wall_s >= self.limits.cpu_s):
            limit, reason = "cpu_time", f"CPU time limit ({self.limits.cpu_s} s) exceeded ({sig})"
        elif sig == "SIGXFSZ":
            limit, reason = "file_size", f"file size limit ({self.limits.max_file_bytes} bytes) exceeded"
        elif code not in (0, None):
            limit = _limit_hint(o.stderr.text() + o.stdout.text())
            if limit == "disk" and self._inodes_full():
                limit = "inodes"
            if limit is not None:
                reason = f"hit the {limit} limit ({_limit_value(self.limits, limit)})"
        return RunResult(
            command=command, exit_code=code, signal=sig,
            stdout=o.stdout.text(), stderr=o.stderr.text(),
            stdout_bytes=o.stdout.total, stderr_bytes=o.stderr.total,
            stdout_truncated=o.stdout.truncated, stderr_truncated=o.stderr.truncated,
            wall_s=round(o.wall_s, 4), killed=killed, limit=limit, reason=reason,
        )

    def _inodes_full(self) -> bool:
        try:
            return os.statvfs(self._ws).f_ffree == 0
        except OSError:
            return False

    # -- files --------------------------------------------------------------------------------------
    def read_file(self, path: str, max_bytes: int = 1 * MiB) -> bytes:
        with self._lock:
            self._check_open()
            return files.read_file(str(self._ws), path, self.workdir, max_bytes)

    def write_file(self, path: str, data: bytes | str) -> None:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        with self._lock:
            self._check_open()
            files.write_file(str(self._ws), path, self.workdir, raw, self.isolation.mode.sandbox_uid)

    def list(self, path: str = ".") -> list[FileInfo]:
        with self._lock:
            self._check_open()
            return files.list_dir(str(self._ws), path, self.workdir)

    # -- lifecycle ----------------------------------------------------------------------------------
    def fork(self) -> LocalSandbox:
        with self._lock:
            self._check_open()
            ws = self._root.copy_workspace(self._ws, self.isolation.mode.sandbox_uid,
                                           disk_bytes=self.limits.disk_bytes, max_files=self.limits.max_files)
        return LocalSandbox(self.limits, isolation=self.isolation, root=self._root, run_gate=self._gate,
                            _workspace=ws)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A command running in another thread is stopped by run_bounded the way a timeout stops it (the
        # namespace's init first, so nothing is orphaned); killing its group from here orphaned bwrap's init.
        self._stop.set()
        # run() holds the lock until its processes are gone: nothing writes any more once we hold it.
        if not self._lock.acquire(timeout=2.0):
            running = self._running
            if running is not None:  # its pipes closed but it did not exit: the group kill frees the lock
                kill_group(running.pid)
            self._lock.acquire()
        try:
            self.leftovers = self._root.remove(self._ws)
        finally:
            self._lock.release()


def _limit_hint(text: str) -> LimitName | None:
    for name, needles in _LIMIT_HINTS:
        if any(n in text for n in needles):
            return name
    return None


def _limit_value(limits: SandboxLimits, name: LimitName) -> str:
    return {
        "memory": f"{limits.memory_bytes} bytes of address space",
        "file_size": f"{limits.max_file_bytes} bytes per file",
        "open_files": f"{limits.max_open_files} open files",
        "processes": f"{limits.max_processes} processes",
        "disk": f"workspace quota {limits.disk_bytes} bytes, /tmp and /dev/shm {limits.tmp_bytes} bytes each",
        "inodes": f"workspace quota {limits.max_files} files",
    }.get(name, "")
