"""The sandbox contract: what every backend (local bubblewrap, Kubernetes) offers one rollout.

A sandbox is one isolated workspace that lives as long as its rollout: files written in turn 1 are
there in turn 5. Processes do not outlive a `run` (each command runs in a fresh process tree that is
killed when the command ends), so the filesystem is the only state carried between turns; that is
what makes `fork` a plain copy of the workspace.

Everything crossing this boundary is plain, typed data (pydantic), so results can be logged,
sent to another process, or returned to the model as a tool result.
"""

from __future__ import annotations

import uuid
from typing import Literal, Protocol, runtime_checkable


from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Self

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Which limit a command ran into. "memory", "processes" and "open_files" are read off the command's
# own error output (an rlimit makes a call fail, it does not kill), so they are best effort.
LimitName = Literal["timeout", "output", "cpu_time", "memory", "processes", "open_files", "file_size", "disk",
                    "inodes", "launch"]


class SandboxError(RuntimeError):
    """A sandbox operation could not be done (closed sandbox, bad path, backend failure)."""


class SandboxLimits(BaseModel):
    """Per-command resource limits. rlimits apply to every process the command starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(30.0, gt=0, description="wall-clock limit of one command; the whole process tree is killed")
    cpu_s: int = Field(30, ge=1, description="RLIMIT_CPU per process, seconds (SIGXCPU, then SIGKILL one second later)")
    memory_bytes: int = Field(1 * GiB, ge=16 * MiB, description="RLIMIT_AS per process (virtual address space)")
    sandbox_memory_bytes: int | None = Field(
        None, ge=16 * MiB, description="memory all processes of one command may use together, pages of /tmp, "
        "/dev/shm and memfds included (a memory cgroup, where this machine enforces one: see "
        "rollwise.sandbox.limits_in_force); None: the same as memory_bytes")
    max_processes: int = Field(64, ge=4, description="RLIMIT_NPROC: processes/threads of the sandbox user")
    max_open_files: int = Field(256, ge=16, description="RLIMIT_NOFILE per process")
    max_file_bytes: int = Field(64 * MiB, ge=1 * KiB, description="RLIMIT_FSIZE: largest file a process may write")
    max_output_bytes: int = Field(64 * KiB, ge=256, description="stdout/stderr bytes kept per stream (head + tail)")
    disk_bytes: int = Field(
        512 * MiB, ge=1 * MiB, description="workspace quota in bytes (a tmpfs per workspace where this machine "
        "allows it: see rollwise.sandbox.limits_in_force)")
    max_files: int = Field(100_000, ge=64, description="workspace quota in files and directories (inodes)")
    tmp_bytes: int = Field(256 * MiB, ge=1 * MiB, description="size of the sandbox's private /tmp and of /dev/shm, each")
    kill_output_bytes: int = Field(
        64 * MiB, ge=1 * KiB, description="a command that writes more than this to stdout+stderr is killed"
    )

    @property
    def whole_memory_bytes(self) -> int:
        """The memory bound of the whole command (sandbox_memory_bytes, defaulting to memory_bytes)."""
        return self.sandbox_memory_bytes if self.sandbox_memory_bytes is not None else self.memory_bytes

    @model_validator(mode="after")
    def _check(self) -> SandboxLimits:
        if self.kill_output_bytes < self.max_output_bytes:
            raise ValueError(
                f"kill_output_bytes ({self.kill_output_bytes}) must be >= max_output_bytes ({self.max_output_bytes})"
            )
        return self


class RunResult(BaseModel):
    """What one command did. `killed` means the sandbox (not the command) ended it; `reason` says why."""

    model_config = ConfigDict(frozen=True)

    command: str
    exit_code: int | None  # None when the sandbox killed the command before it exited
    signal: str | None = None  # e.g. "SIGXCPU" when the command died of a signal
    stdout: str  # decoded (utf-8, replacement characters), truncated to max_output_bytes with a marker line
    stderr: str
    stdout_bytes: int  # bytes the command wrote, including what was cut
    stderr_bytes: int
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float
    killed: bool = False
    limit: LimitName | None = None  # the limit the command ran into, when one is recognised
    reason: str | None = None  # human-readable: why it was killed / which limit it hit

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed


class FileInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str  # relative to the workspace root
    kind: Literal["file", "dir", "symlink", "other"]
    size: int


@runtime_checkable
class Sandbox(Protocol):
    """One rollout's isolated workspace. Implementations are thread-safe; commands of one sandbox
    run one at a time (a rollout's turns are sequential), different sandboxes run in parallel."""

    @property
    def id(self) -> str: ...

    @property
    def workdir(self) -> str:
        """The workspace path as commands inside the sandbox see it (their working directory)."""
        ...

    @property
    def closed(self) -> bool: ...

    def run(self, command: str, timeout_s: float | None = None, *, stdin: bytes | None = None) -> RunResult:
        """Run a shell command (`/bin/sh -c`) in the workspace. Never raises for what the command does."""
        ...

    def read_file(self, path: str, max_bytes: int = 1 * MiB) -> bytes: ...

    def write_file(self, path: str, data: bytes | str) -> None: ...

    def list(self, path: str = ".") -> list[FileInfo]: ...

    def fork(self) -> Sandbox:
        """A new sandbox whose workspace starts as a copy of this one's; the two then diverge."""
        ...

    def close(self) -> None:
        """Kill anything still running and remove the workspace. Idempotent."""
        ...


class SandboxLifecycle:
    """What every backend's sandbox does the same way around its workspace: a fresh id, a `closed` flag
    that `close()` sets once, use as a context manager (leaving the block closes it), and refusing work
    once closed. A backend calls `super().__init__()` first and implements `close()`."""

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex[:12]
        self._closed = False

    @property
    def id(self) -> str:
        return self._id

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed")
