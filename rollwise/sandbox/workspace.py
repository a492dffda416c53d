"""Workspace directories on the host: create, copy (fork), remove, and never leak.

All workspaces of a process live under one temp root, `<tmp>/rollwise-sandbox-<pid>-<random>`
(mode 0711: a sandbox uid may enter its own workspace but not list its neighbours). The root is
removed at interpreter exit (atexit) and by `close()`; a root left behind by a process that was
SIGKILLed is swept by the next process that creates one (the pid in its name is dead).

Quota: where this process may mount (root), each workspace is its own tmpfs with `size=` (bytes)
and `nr_inodes=` (files), so a sandbox cannot fill the host's disk or inode table, and removing
it is one unmount. Elsewhere it is a plain directory with no quota (`quota_in_force()` says which).

Removal never raises for what sandboxed code left behind (read-only directories, trees deeper
than Python's recursion limit or PATH_MAX, odd modes): it walks the tree iteratively through
directory fds and returns what it could not remove, for the caller to log.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import os
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from rollwise.scratch import sweep_stale
from rollwise.sandbox.types import SandboxError

log = logging.getLogger("rollwise.sandbox")

ROOT_PREFIX = "rollwise-sandbox-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


# -- removal ----------------------------------------------------------------------------------------
def _clear_dir(fd: int, problems: list[str], where: str) -> list[str]:
    """Unlink every non-directory in the directory `fd`; return the names of its subdirectories."""
    subdirs = []
    for entry in os.scandir(fd):
        try:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append(f"{where}/{entry.name}: {exc.strerror}")
    return subdirs


def _chmod_dir(name: str, fd: int) -> None:
    try:  # sandboxed code may have made it 000; Linux chmods only through the name (a dir, not a link)
        os.chmod(name, stat.S_IRWXU, dir_fd=fd)
    except OSError:
        pass


def _remove_contents(top_fd: int, top: str) -> list[str]:
    """Empty the directory `top_fd` depth-first with one open fd at a time (no recursion, no long
    paths): descend into each subdirectory, and once it is empty go back up through '..' and
    rmdir it. Nothing runs in the sandbox any more, so the tree does not change under the walk."""
    problems: list[str] = []
    names: list[str] = []  # path from `top` to the current directory
    fd = os.dup(top_fd)
    pending = [_clear_dir(fd, problems, top)]  # per level: subdirectories still to remove
    try:
        while True:
            where = "/".join([top, *names])
            if pending[-1]:
                name = pending[-1].pop()
                _chmod_dir(name, fd)
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    problems.append(f"{where}/{name}: {exc.strerror}")
                    continue
                os.close(fd)
                fd = child
                names.append(name)
                pending.append(_clear_dir(fd, problems, f"{where}/{name}"))
                continue
            if not names:
                return problems
            pending.pop()
            name = names.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"{where}: {exc.strerror}")
    finally:
        os.close(fd)


def remove_tree(path: Path) -> list[str]:
    """Remove `path` and everything under it; returns what could not be removed (empty when done).

    Never raises for the tree's contents: read-only dirs, a 1,500-deep tree, odd permissions."""
    path = Path(path)
    if not os.path.lexists(path):
        return []
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            os.unlink(path)
            return []
        except OSError as exc:
            return [f"{path}: {exc.strerror}"]
    try:
        os.chmod(path, stat.S_IRWXU)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    try:
        problems = _remove_contents(fd, str(path))
    except OSError as exc:  # the walk itself failed (e.g. out of fds): say so, do not raise
        problems = [f"{path}: {exc.strerror or exc}"]
    finally:
        os.close(fd)
    _unmount(path)  # a tmpfs workspace: its contents went with the walk, the mount goes now
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        problems.append(f"{path}: {exc.strerror}")
    return problems


# -- quota (tmpfs per workspace) ---------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount_tmpfs(path: Path, size_bytes: int, max_files: int, owner: tuple[int, int] | None) -> None:
    uid, gid = owner or (os.geteuid(), os.getegid())
    opts = f"size={size_bytes},nr_inodes={max_files},mode=0700,uid={uid},gid={gid}".encode()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def _unmount(path: Path) -> None:
    if os.path.ismount(path):
        # MNT_DETACH: never EBUSY; nothing of the sandbox runs any more when we get here.
        _libc.umount2(str(path).encode(), _MNT_DETACH)


_quota_lock = threading.Lock()
_quota_state: dict[str, str | None] = {}


def quota_in_force(parent: Path | None = None) -> str | None:
    """None if workspaces get a tmpfs quota here (tried once for real), else why not."""
    with _quota_lock:
        if "why_not" not in _quota_state:
            _quota_state["why_not"] = _try_quota(Path(parent or tempfile.gettempdir()))
        return _quota_state["why_not"]


def _try_quota(parent: Path) -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot mount a size- and inode-limited tmpfs per workspace"
    probe = Path(tempfile.mkdtemp(prefix="rollwise-quota-probe-", dir=parent))
    try:
        _mount_tmpfs(probe, 1 << 20, 64, None)
    except OSError as exc:
        return f"mounting a tmpfs was refused ({exc.strerror})"
    finally:
        _unmount(probe)
        os.rmdir(probe)
    return None


# -- roots -----------------------------------------------------------------------------------------
def _remove_root(root: Path) -> list[str]:
    """A temp root: each workspace first (each may be a mount), then the root itself."""
    problems: list[str] = []
    try:
        children = list(root.iterdir())
    except OSError:
        children = []
    for ws in children:
        problems += remove_tree(ws)
    return problems + remove_tree(root)


def sweep_stale_roots(tmp: Path | None = None) -> list[Path]:
    """Remove temp roots whose owning process is gone (it was killed before its atexit ran)."""
    return sweep_stale(ROOT_PREFIX, tmp, remove=_remove_root)


class WorkspaceRoot:
    """One temp directory holding workspaces; removing it removes them all."""

    def __init__(self, parent: Path | None = None) -> None:
        sweep_stale_roots(parent)  # with their workspaces' tmpfs mounts, which a plain tree removal cannot undo
        self.path = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=parent))
        os.chmod(self.path, 0o711)
        self.quota = quota_in_force(parent) is None  # workspaces are size/inode-limited tmpfs mounts
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        return self._closed

    def new_workspace(self, owner: tuple[int, int] | None, *, disk_bytes: int = 1 << 30,
                      max_files: int = 100_000) -> Path:
        """A fresh workspace owned by `owner`; a tmpfs of `disk_bytes` / `max_files` where quotas work."""
        with self._lock:
            if self._closed:
                raise SandboxError(f"workspace root {self.path} is closed")
            ws = Path(tempfile.mkdtemp(prefix="ws-", dir=self.path))
        if self.quota:
            try:
                _mount_tmpfs(ws, disk_bytes, max_files, owner)
            except OSError as exc:
                os.rmdir(ws)
                raise SandboxError(f"could not mount the workspace quota on {ws}: {exc}") from exc
        os.chmod(ws, 0o700)
        if owner is not None:
            os.chown(ws, *owner)
        return ws

    def copy_workspace(self, src: Path, owner: tuple[int, int] | None, *, disk_bytes: int = 1 << 30,
                       max_files: int = 100_000) -> Path:
        """A new workspace with a copy of `src` (symlinks as symlinks, fifos as fifos, modes kept).

        `cp -a` rather than shutil.copytree: copytree opens a fifo the sandbox left behind and
        blocks on it forever, and does not keep ownership.
        """
        dst = self.new_workspace(owner, disk_bytes=disk_bytes, max_files=max_files)
        proc = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{src}/.", f"{dst}/"],
            check=False, capture_output=True, text=True, timeout=600,
        )
        if proc.returncode != 0:
            remove_tree(dst)
            raise SandboxError(f"copying workspace {src} failed: {proc.stderr.strip()[:500]}")
        return dst

    def remove(self, ws: Path) -> list[str]:
        """Remove one workspace; returns what could not be removed (logged, never raised)."""
        if ws.parent != self.path:  # never remove anything that is not one of ours
            raise SandboxError(f"{ws} is not a workspace under {self.path}")
        problems = remove_tree(ws)
        if problems:
            log.warning("workspace %s: %d entries could not be removed: %s", ws, len(problems), problems[:5])
        return problems

    def close(self) -> list[str]:
        with self._lock:
            if self._closed:
                return []
            self._closed = True
        problems = _remove_root(self.path)
        atexit.unregister(self.close)
        if problems:
            log.warning("workspace root %s: %d entries could not be removed: %s",
                        self.path, len(problems), problems[:5])
        return problems


_default_root: WorkspaceRoot | None = None
_default_lock = threading.Lock()


def default_root() -> WorkspaceRoot:
    """The process-wide workspace root (created on first use, again after a close)."""
    global _default_root
    with _default_lock:
        if _default_root is None or _default_root.closed:
            _default_root = WorkspaceRoot()
        return _default_root
