"""How one command is launched at each isolation level: the argv, its uid, its environment.

Three levels, strongest first (rollwise.sandbox.isolation picks the strongest this machine allows):

  bwrap    bubblewrap: user, network, pid, ipc and uts namespaces; a private filesystem view
           (system dirs read-only, the workspace read-write at /workspace, private /proc, /dev,
           and size-limited /tmp and /dev/shm; the root and /dev read-only); no nested user
           namespaces (--disable-userns) and a seccomp deny list (rollwise.sandbox.seccomp)
  unshare  util-linux unshare: network, pid, ipc and uts namespaces, but the host filesystem view
  rlimits  a plain process group with rlimits and a timeout: no namespaces at all

At every level the command runs under `prlimit` (rlimits on CPU time, address space, processes,
open files and file size), set *inside* the namespaces: RLIMIT_NPROC is counted per user and user
namespace, so set outside it would count every sandbox (and, as root, every root process on the
host) against one sandbox's limit. When the host process is root, commands run as an unprivileged
uid (nobody) instead: root ignores RLIMIT_NPROC, and it can read root-only files.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path

from rollwise.sandbox.types import SandboxLimits


class IsolationLevel(str, Enum):
    BWRAP = "bwrap"
    UNSHARE = "unshare"
    RLIMITS = "rlimits"


# What isolation can give; each mode says which of these it has.
FEATURES: dict[str, str] = {
    "network": "no network (own network namespace with only a loopback device)",
    "filesystem": "own filesystem view (system read-only, workspace read-write, private /tmp)",
    "pid": "own pid namespace (host processes invisible; the whole tree dies with the command)",
    "user_namespace": "own user namespace (no capabilities on the host)",
    "unprivileged_uid": "commands run as an unprivileged host uid (RLIMIT_NPROC enforced, root-only files unreadable)",
}

# What is lost without each feature, for the start-up warning.
MISSING_MEANS: dict[str, str] = {
    "network": "commands CAN REACH THE NETWORK",
    "filesystem": "commands see the host filesystem and may write wherever the sandbox uid may",
    "pid": "commands see host processes; a process that leaves its process group can outlive the command",
    "user_namespace": "no user namespace: capabilities are dropped only by the uid switch",
    "unprivileged_uid": "commands run as host root: RLIMIT_NPROC is not enforced (fork bombs are bounded "
    "only by a pids cgroup where there is one, see limits_in_force, else by the timeout) and root-only host "
    "files mounted in are readable",
}

WORKDIR_IN_SANDBOX = "/workspace"
NOBODY = (65534, 65534)
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class LaunchMode:
    """One concrete way to launch commands (a level plus the details that made it work here)."""

    name: str
    level: IsolationLevel
    features: frozenset[str]
    user_namespace: bool = False  # bwrap/unshare: create a user namespace
    host_uid: tuple[int, int] | None = None  # switch to this uid/gid before launching (root hosts)
    inner_uid: tuple[int, int] | None = None  # switch inside the namespaces (root without user namespaces)
    ro_binds: tuple[str, ...] = field(default=())

    @property
    def sandbox_uid(self) -> tuple[int, int] | None:
        """The host uid/gid that must own the workspace, or None for the current user."""
        return self.host_uid or self.inner_uid


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    user: int | None
    group: int | None
    preexec_fn: Callable[[], None] | None


def rlimit_values(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    # CPU: soft limit sends SIGXCPU (catchable), the hard limit one second later SIGKILL.
    return {
        "cpu": (limits.cpu_s, limits.cpu_s + 1),
        "as": (limits.memory_bytes, limits.memory_bytes),
        "nproc": (limits.max_processes, limits.max_processes),
        "nofile": (limits.max_open_files, limits.max_open_files),
        "fsize": (limits.max_file_bytes, limits.max_file_bytes),
    }


_RESOURCE = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "nofile": resource.RLIMIT_NOFILE,
    "fsize": resource.RLIMIT_FSIZE,
}


def prlimit_argv(limits: SandboxLimits) -> list[str] | None:
    """`prlimit --cpu=S:H ... --`, or None when util-linux's prlimit is not installed."""
    exe = shutil.which("prlimit")
    if exe is None:
        return None
    return [exe, *(f"--{name}={soft}:{hard}" for name, (soft, hard) in rlimit_values(limits).items()), "--"]


def _preexec_rlimits(limits: SandboxLimits) -> Callable[[], None]:
    values = {_RESOURCE[name]: v for name, v in rlimit_values(limits).items()}

    def apply() -> None:  # runs in the child between fork and exec
        for res, v in values.items():
            resource.setrlimit(res, v)

    return apply


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):  # merged-/usr systems: /bin -> usr/bin
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args + ["--ro-bind", "/etc", "/etc"]


@lru_cache(maxsize=None)
def bwrap_supports(flag: str) -> bool:
    """Whether this bubblewrap knows `flag` (--disable-userns needs 0.8, --size 0.5)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout + out.stderr


def _setpriv(uid_gid: tuple[int, int]) -> list[str]:
    exe = shutil.which("setpriv") or "setpriv"
    uid, gid = uid_gid
    return [exe, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs", "--"]


@dataclass(frozen=True)
class LaunchFds:
    """File descriptors the launcher inherits (bwrap only): where it reports the namespace's init
    pid (`--info-fd`, see rollwise.sandbox.process) and where it reads the seccomp program."""

    info: int | None = None
    seccomp: int | None = None


def build_launch(mode: LaunchMode, workspace: Path, command: str, limits: SandboxLimits,
                 fds: LaunchFds | None = None) -> Launch:
    """The argv that runs `/bin/sh -c command` in `workspace` at `mode`'s isolation."""
    inner = ["/bin/sh", "-c", command]
    rl = prlimit_argv(limits)
    preexec = None
    if rl is None:
        # No prlimit binary: set the limits on the launcher itself (inherited by everything inside).
        # Weaker: RLIMIT_NPROC then counts all processes of the sandbox uid, not this sandbox's.
        preexec = _preexec_rlimits(limits)
        rl = []
    drop = _setpriv(mode.inner_uid) if mode.inner_uid else []
    host_ws = str(workspace)

    if mode.level is IsolationLevel.BWRAP:
        argv = [
            shutil.which("bwrap") or "bwrap",
            "--die-with-parent",  # the launcher dies -> everything inside dies
            "--new-session",  # no TIOCSTI into a terminal
            "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox",
        ]
        if mode.user_namespace:
            argv += ["--unshare-user", "--uid", str(NOBODY[0]), "--gid", str(NOBODY[1]), "--cap-drop", "ALL"]
            if bwrap_supports("--disable-userns"):  # no nested user namespace: no capabilities to mount with
                argv += ["--disable-userns"]
        if bwrap_supports("--as-pid-1"):
            # The command is the namespace's pid 1, with no bwrap init above it. bwrap's init reports the
            # command's exit and bwrap exits at once, before the init has exited: every command, even one
            # that exited cleanly, left that init to the host's PID 1 as an orphan zombie of the sandbox
            # uid, counted against its RLIMIT_NPROC until reaped (~2 s on a VM, never where PID 1 does not
            # reap: docker without --init, a Python entrypoint). Without the init, bwrap reaps the command
            # itself. Inside, orphans of the command go to the command (not to an init that reaps them)
            # until it ends, when the kernel ends the whole namespace.
            argv += ["--as-pid-1"]
        fds = fds or LaunchFds()
        if fds.info is not None:
            argv += ["--info-fd", str(fds.info)]
        if fds.seccomp is not None:
            argv += ["--seccomp", str(fds.seccomp)]
        argv += _system_binds()
        for path in mode.ro_binds:
            argv += ["--ro-bind", path, path]
        argv += [
            "--bind", host_ws, WORKDIR_IN_SANDBOX, "--chdir", WORKDIR_IN_SANDBOX,
            "--proc", "/proc", "--dev", "/dev",
        ]
        # Size-limited: files in /tmp and /dev/shm are memory nobody else counts.
        size = ["--size", str(limits.tmp_bytes)] if bwrap_supports("--size") else []
        argv += [*size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm"]
        # The root and /dev are bwrap's own tmpfs without a size: nothing may be written there.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--"]
        argv += drop + rl + inner
        workdir = WORKDIR_IN_SANDBOX
    elif mode.level is IsolationLevel.UNSHARE:
        argv = [shutil.which("unshare") or "unshare"]
        if mode.user_namespace:
            argv += ["--user", "--map-root-user"]
        argv += ["--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc", "--"]
        # The first process of a pid namespace is its init, which ignores signals it has no handler
        # for (SIGXCPU, SIGTERM...): a tiny sh init runs the command as pid 2 instead, passes stdin
        # through (a background job's stdin would be /dev/null) and returns its status.
        argv += ["/bin/sh", "-c", 'exec 3<&0; "$@" <&3 3<&- & wait $!', "sandbox-init"]
        argv += drop + rl + inner
        workdir = host_ws
    else:
        argv = rl + inner
        workdir = host_ws

    env = {
        "PATH": _PATH,
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # Without a private /tmp, temporary files go to the workspace, not a /tmp shared with the host.
        "TMPDIR": "/tmp" if "filesystem" in mode.features else workdir,
    }
    user, group = mode.host_uid if mode.host_uid else (None, None)
    return Launch(argv=argv, cwd=host_ws, env=env, user=user, group=group, preexec_fn=preexec)


def candidate_modes(ro_binds: tuple[str, ...] = ()) -> list[LaunchMode]:
    """Every mode worth probing on this host, strongest first."""
    root = os.geteuid() == 0
    drop = NOBODY if root else None
    full = frozenset(FEATURES)
    modes: list[LaunchMode] = []
    if shutil.which("bwrap"):
        modes.append(LaunchMode("bwrap", IsolationLevel.BWRAP, full, user_namespace=True, host_uid=drop,
                                ro_binds=ro_binds))
        if root:
            # User namespaces refused for nobody, or the uid switch refused: stay root, keep namespaces.
            modes.append(LaunchMode("bwrap (as root, user namespace)", IsolationLevel.BWRAP,
                                    full - {"unprivileged_uid"}, user_namespace=True, ro_binds=ro_binds))
            modes.append(LaunchMode("bwrap (as root, no user namespace)", IsolationLevel.BWRAP,
                                    full - {"user_namespace"}, inner_uid=NOBODY, ro_binds=ro_binds))
    if shutil.which("unshare"):
        ns = frozenset({"network", "pid", "user_namespace", "unprivileged_uid"})
        modes.append(LaunchMode("unshare", IsolationLevel.UNSHARE, ns,
                                user_namespace=True, host_uid=drop))
        if root:
            modes.append(LaunchMode("unshare (as root, no user namespace)", IsolationLevel.UNSHARE,
                                    ns - {"user_namespace"}, inner_uid=NOBODY))
    modes.append(LaunchMode("rlimits", IsolationLevel.RLIMITS, frozenset({"unprivileged_uid"}), host_uid=drop))
    if root:
        modes.append(LaunchMode("rlimits (as root)", IsolationLevel.RLIMITS, frozenset()))
    return modes
