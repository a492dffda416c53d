"""Things on disk a process owns for its lifetime, named after its pid so the next one can sweep them.

A process removes its scratch when it closes; a process killed outright (the OOM killer, SIGKILL, a
node's watchdog) cannot. Each name starts `{prefix}{pid}-`, so a later process of the same kind can
tell which ones were left by a process that no longer exists and remove them before it makes its own.
Used for vLLM's weights directory (a copy of the whole model under /tmp), the sandboxes' workspace
roots and their cgroups. A pid the kernel has since reused keeps its entry: sweeping errs on keeping.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts: signalling it is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_pid(name: str, prefix: str) -> int | None:
    """The pid in a `{prefix}{pid}-...` name; None for a name of another shape."""
    m = re.match(rf"^{re.escape(prefix)}(\d+)-", name)
    return int(m.group(1)) if m else None


def left_by_dead_process(path: Path, prefix: str) -> bool:
    """`path` is named `{prefix}{pid}-...` and that process is gone."""
    pid = owner_pid(path.name, prefix)
    return pid is not None and not pid_alive(pid)


def _remove_tree(path: Path) -> list[str]:
    try:
        shutil.rmtree(path)
    except OSError as exc:
        return [str(exc)]
    return []


def sweep_stale(prefix: str, parent: Path | None = None,
                remove: Callable[[Path], list[str]] = _remove_tree) -> list[Path]:
    """Remove the directories `{prefix}{pid}-*` under `parent` (default: the temp dir) whose process is gone;
    `remove(path)` returns what it could not remove (then the entry is not counted: another user's, or a
    sweeper racing this one). Returns what was removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for entry in parent.glob(f"{prefix}*"):
        if entry.is_dir() and not entry.is_symlink() and left_by_dead_process(entry, prefix):
            if not remove(entry):
                removed.append(entry)
    return removed


def scratch_dir(prefix: str, parent: Path | None = None) -> Path:
    """A fresh directory `{prefix}{this pid}-XXXXXXXX` under `parent` (default: the temp dir), after sweeping
    the ones that killed processes left there. The caller removes it when done."""
    sweep_stale(prefix, parent)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def out_of_space(exc: BaseException) -> bool:
    """A write failed for want of disk space or quota (safetensors and rank errors carry it only as text)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


def size_text(n: int) -> str:
    """Bytes for a message: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
