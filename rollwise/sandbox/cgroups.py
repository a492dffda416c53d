"""A memory (and pids) cgroup per sandbox command: a bound on what all its processes use together.

rlimits are per process: `max_processes` processes may each use `memory_bytes`, and files in the
sandbox's tmpfs mounts (/tmp, /dev/shm, the workspace) and memfds are not process memory at all.
A memory cgroup charges every page its processes fault in, tmpfs and memfd pages included, so one
limit bounds the whole command. On a command's start a fresh cgroup is made under this process's
own one, with `SandboxLimits.sandbox_memory_bytes` (RAM and swap) and a pids limit; the launcher
joins it *before* it execs bubblewrap (a tiny `sh` wrapper writes its own pid to `cgroup.procs`,
then drops to the sandbox uid with setpriv), so nothing the command forks can start outside it.
After the command, whatever is left in the cgroup is killed and the directory removed.

Which cgroup API: v2 when this process's cgroup2 offers the memory controller (and it can be
enabled for children), else v1's memory hierarchy (plus the v1 pids hierarchy when mounted). The
machine's answer is probed once per process, including a real over-limit allocation that must be
OOM-killed: a kernel that accepts the limit but does not enforce it (gVisor-like) is reported as
such, and commands then run without a cgroup, as `limits_in_force()` says.

Pages of the workspace tmpfs written by one command stay charged to that command's cgroup after
it ends (v1 moves them to the parent when the cgroup is removed); the workspace's own size limit
(`disk_bytes`) bounds them across commands.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from rollwise.scratch import sweep_stale

log = logging.getLogger("rollwise.sandbox")

MiB = 1024 * 1024
# bwrap, its pid-namespace init, prlimit/setpriv are exec'd in place; a few spare for the launcher.
LAUNCHER_PIDS = 8
_PREFIX = "rollwise-sandbox-"
# $0 and $1: the cgroup.procs files to join (the same file twice with v2), then the command.
_JOIN = ('{ echo $$ >"$0" && echo $$ >"$1"; } || '
         '{ echo "rollwise: could not join the sandbox cgroup" >&2; exit 125; }; shift; exec "$@"')


class CgroupError(RuntimeError):
    """A command's cgroup could not be created or configured."""


@dataclass(frozen=True)
class CgroupSupport:
    """What this machine allows: where per-command cgroups go, or why there are none."""

    version: int | None  # 2, 1, or None when no usable memory controller was found
    memory_parent: Path | None
    pids_parent: Path | None  # v2: the same as memory_parent when the pids controller is there
    detail: str  # how memory is bounded, or why it is not

    @property
    def usable(self) -> bool:
        return self.memory_parent is not None


class CommandCgroup:
    """One command's cgroup(s): made with limits, joined by the launcher, removed afterwards."""

    def __init__(self, support: CgroupSupport, memory_bytes: int, max_pids: int) -> None:
        if support.memory_parent is None:
            raise CgroupError(f"no usable memory cgroup: {support.detail}")
        self.version = support.version
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.memory_dir = support.memory_parent / name
        self.pids_dir = support.pids_parent / name if support.pids_parent is not None else None
        self.dirs = [d for d in (self.memory_dir, self.pids_dir) if d is not None]
        self.dirs = list(dict.fromkeys(self.dirs))  # v2: one directory for both
        try:
            for d in self.dirs:
                d.mkdir()
            self._set_limits(memory_bytes, max_pids)
        except OSError as exc:
            self.remove()
            raise CgroupError(f"could not set up the command's cgroup {self.memory_dir}: {exc}") from exc

    def _set_limits(self, memory_bytes: int, max_pids: int) -> None:
        m = self.memory_dir
        if self.version == 2:
            _write(m / "memory.max", memory_bytes)
            if (m / "memory.swap.max").exists():
                _write(m / "memory.swap.max", 0)  # swap would extend the limit
            if (m / "pids.max").exists():
                _write(m / "pids.max", max_pids)
            return
        _write(m / "memory.limit_in_bytes", memory_bytes)
        if (m / "memory.memsw.limit_in_bytes").exists():  # memory + swap: swap would extend the limit
            _write(m / "memory.memsw.limit_in_bytes", memory_bytes)
        if self.pids_dir is not None:
            _write(self.pids_dir / "pids.max", max_pids)

    def wrap(self, argv: Sequence[str], user: int | None, group: int | None) -> list[str]:
        """`argv` behind a launcher that joins this cgroup first, then (root hosts) drops to
        `user`/`group` as subprocess's `user=`/`group=`/`extra_groups=[]` would. The caller
        starts it with no uid switch of its own: an unprivileged process may not join a cgroup."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        drop: list[str] = []
        if user is not None:
            gid = group if group is not None else user
            drop = [shutil.which("setpriv") or "setpriv", f"--reuid={user}", f"--regid={gid}", "--clear-groups", "--"]
        return ["/bin/sh", "-c", _JOIN, procs[0], procs[-1], *drop, *argv]

    def oom_kills(self) -> int:
        """How many processes the kernel killed for this cgroup's memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.memory_dir / name).read_text()
        except OSError:
            return 0
        m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(m.group(1)) if m else 0

    def remove(self, timeout_s: float = 5.0) -> list[str]:
        """Kill whatever is still in the cgroup, then remove it; what could not be removed is
        returned (and logged), never raised."""
        left: list[str] = []
        for d in self.dirs:
            if d.exists() and not _empty_and_remove(d, timeout_s):
                left.append(str(d))
        if left:
            log.warning("sandbox cgroups left behind (still busy): %s", left)
        return left


def _write(path: Path, value: int | str) -> None:
    path.write_text(str(value))


def _pids(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _empty_and_remove(d: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in _pids(d):  # normally none: run_bounded waited for the whole tree
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY while the killed ones finish exiting
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


# -- probing this machine -----------------------------------------------------------------------
def _mounts() -> Iterator[tuple[Path, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            yield Path(fields[4]), rest[0], set(rest[2].split(","))


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path ("" is the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            out[c] = path
    return out


def _v2_parent(mount: Path, own: dict[str, str]) -> tuple[Path | None, bool, str]:
    """(parent, pids too?, why not) for cgroup v2."""
    parent = mount / own.get("", "/").lstrip("/")
    try:
        available = (parent / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return None, False, f"cgroup v2 at {mount}: {exc}"
    if "memory" not in available:
        return None, False, f"cgroup v2 at {mount} has no memory controller for this process's cgroup"
    wanted = [c for c in ("memory", "pids") if c in available]
    try:
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        missing = [c for c in wanted if c not in enabled]
        if missing:  # refused (EBUSY) when processes live in `parent` itself and it is not the root
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
    except OSError as exc:
        return None, False, f"cgroup v2 at {parent}: cannot enable memory for child cgroups ({exc})"
    return parent, "pids" in wanted, ""


def _find_support() -> CgroupSupport:
    try:
        mounts = list(_mounts())
        own = _own_cgroups()
    except (OSError, ValueError) as exc:
        return CgroupSupport(None, None, None, f"cannot read this process's cgroups: {exc}")
    reasons: list[str] = []
    for mount, fstype, _ in mounts:
        if fstype == "cgroup2":
            parent, pids, why = _v2_parent(mount, own)
            if parent is not None:
                return CgroupSupport(2, parent, parent if pids else None, "cgroup v2 memory.max, memory.swap.max 0")
            reasons.append(why)
    v1 = {c: mount / own[c].lstrip("/") for mount, fstype, opts in mounts if fstype == "cgroup"
          for c in ("memory", "pids") if c in opts and c in own}
    if "memory" in v1:
        if not os.access(v1["memory"], os.W_OK):
            reasons.append(f"cgroup v1 memory at {v1['memory']} is not writable by uid {os.geteuid()}")
        else:
            pids = v1.get("pids") if "pids" in v1 and os.access(v1["pids"], os.W_OK) else None
            return CgroupSupport(1, v1["memory"], pids, "cgroup v1 memory.limit_in_bytes and memory.memsw.limit_in_bytes")
    else:
        reasons.append("no cgroup v1 memory hierarchy mounted")
    return CgroupSupport(None, None, None, "; ".join(reasons) or "no cgroup file system mounted")


def _verify(support: CgroupSupport) -> str | None:
    """Allocate 96 MiB under a 32 MiB limit: None if the kernel OOM-kills it, else why not."""
    try:
        cg = CommandCgroup(support, 32 * MiB, 16)
    except CgroupError as exc:
        return str(exc)
    try:
        argv = cg.wrap([sys.executable, "-c", "b = b'x' * (96 << 20)"], None, None)
        proc = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        kills = cg.oom_kills()
        if proc.returncode == 125:
            return proc.stderr.decode(errors="replace").strip()
        if proc.returncode == 0 or kills == 0:
            return (f"{support.detail} accepted a 32 MiB limit but a 96 MiB allocation was not OOM-killed "
                    f"(exit {proc.returncode}, oom_kill {kills}): the kernel does not enforce it")
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"enforcement probe failed: {exc}"
    finally:
        cg.remove()


def _sweep_stale(parent: Path | None) -> None:
    """Remove empty cgroups of sandbox hosts that died before removing them."""
    if parent is None:
        return

    def remove_if_empty(d: Path) -> list[str]:
        if _pids(d):
            return [f"{d} still has processes"]
        try:
            d.rmdir()  # a cgroup directory goes with rmdir, never a tree removal
        except OSError as exc:
            return [str(exc)]
        return []

    sweep_stale(_PREFIX, parent, remove=remove_if_empty)


@lru_cache(maxsize=1)
def cgroup_support() -> CgroupSupport:
    """This machine's answer, probed (and tested for real enforcement) once per process."""
    found = _find_support()
    if not found.usable:
        return found
    _sweep_stale(found.memory_parent)
    if found.pids_parent != found.memory_parent:
        _sweep_stale(found.pids_parent)
    why_not = _verify(found)
    if why_not is not None:
        return CgroupSupport(None, None, None, why_not)
    return found
