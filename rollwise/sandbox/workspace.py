"""Workspace directories on the host: create, copy (fork), remove, and never leak.

All workspaces of a process live under one temp root, `<tmp>/rollwise-sandbox-<pid>-<random>`
(mode 0711: a sandbox uid may enter its own workspace but not list its neighbours). The root is
removed at interpreter exit (atexit) and by `close()`; a root left behind by a process that was
SIGKILLed is swept by the next process that creates one (the pid in its name is dead).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from rollwise.sandbox.types import SandboxError

log = logging.getLogger("rollwise.sandbox")

ROOT_PREFIX = "rollwise-sandbox-"
_ROOT_RE = re.compile(rf"^{ROOT_PREFIX}(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_tree(path: Path) -> None:
    """rmtree that also gets through directories a sandboxed command made read-only (chmod 000)."""

    def fix_and_retry(func, p, _exc) -> None:
        try:
            parent = os.path.dirname(p)
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except FileNotFoundError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=fix_and_retry)


def sweep_stale_roots(tmp: Path | None = None) -> list[Path]:
    """Remove temp roots whose owning process is gone (it was killed before its atexit ran)."""
    tmp = Path(tmp or tempfile.gettempdir())
    removed = []
    for entry in tmp.glob(f"{ROOT_PREFIX}*"):
        m = _ROOT_RE.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink() and not _pid_alive(int(m.group(1))):
            try:
                remove_tree(entry)
                removed.append(entry)
            except OSError as exc:  # someone else's, or racing another sweeper: not ours to insist
                log.debug("could not sweep %s: %s", entry, exc)
    return removed


class WorkspaceRoot:
    """One temp directory holding workspaces; removing it removes them all."""

    def __init__(self, parent: Path | None = None) -> None:
        sweep_stale_roots(parent)
        self.path = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=parent))
        os.chmod(self.path, 0o711)
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        return self._closed

    def new_workspace(self, owner: tuple[int, int] | None) -> Path:
        with self._lock:
            if self._closed:
                raise SandboxError(f"workspace root {self.path} is closed")
            ws = Path(tempfile.mkdtemp(prefix="ws-", dir=self.path))
        os.chmod(ws, 0o700)
        if owner is not None:
            os.chown(ws, *owner)
        return ws

    def copy_workspace(self, src: Path, owner: tuple[int, int] | None) -> Path:
        """A new workspace with a copy of `src` (symlinks as symlinks, fifos as fifos, modes kept).

        `cp -a` rather than shutil.copytree: copytree opens a fifo the sandbox left behind and
        blocks on it forever, and does not keep ownership.
        """
        dst = self.new_workspace(owner)
        proc = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{src}/.", f"{dst}/"],
            check=False, capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0:
            remove_tree(dst)
            raise SandboxError(f"copying workspace {src} failed: {proc.stderr.strip()[:500]}")
        return dst

    def remove(self, ws: Path) -> None:
        if ws.parent != self.path:  # never remove anything that is not one of ours
            raise SandboxError(f"{ws} is not a workspace under {self.path}")
        remove_tree(ws)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        remove_tree(self.path)
        atexit.unregister(self.close)


_default_root: WorkspaceRoot | None = None
_default_lock = threading.Lock()


def default_root() -> WorkspaceRoot:
    """The process-wide workspace root (created on first use, again after a close)."""
    global _default_root
    with _default_lock:
        if _default_root is None or _default_root.closed:
            _default_root = WorkspaceRoot()
        return _default_root
