"""Host-side file access inside a workspace that untrusted code has written.

The sandboxed command may have left a symlink `notes.txt -> /etc/shadow` or `d -> /`. Resolving
paths and then opening them would follow those links out of the workspace with the host's
privileges. So every path is walked one component at a time from a directory fd, with O_NOFOLLOW:
a symlink anywhere on the path is refused, whatever it points at. The walk happens between
commands (a sandbox runs one thing at a time), so nothing swaps components under us.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath

from rollwise.sandbox.types import FileInfo, SandboxError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_path(path: str, workdir: str) -> list[str]:
    """Components of `path` relative to the workspace root; accepts paths as the sandbox sees them
    (`/workspace/a/b`) or relative ones (`a/b`). Refuses `..` and anything outside."""
    p = PurePosixPath(path)
    if p.is_absolute():
        try:
            p = p.relative_to(workdir)
        except ValueError:
            raise SandboxError(f"path {path!r} is outside the workspace {workdir}") from None
    parts = [c for c in p.parts if c not in ("", ".")]
    if ".." in parts:
        raise SandboxError(f"path {path!r} contains '..'; give a path inside the workspace")
    return parts


@contextmanager
def _dir_fd(root: str, parts: list[str], *, create: bool = False, owner: tuple[int, int] | None = None) -> Iterator[int]:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, name in enumerate(parts):
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise SandboxError(f"no such directory: {'/'.join(parts[: i + 1])}") from None
                os.mkdir(name, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal(parts[: i + 1], exc) from None
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _refusal(parts: list[str], exc: OSError) -> SandboxError:
    where = "/".join(parts)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return SandboxError(f"{where} is a symlink or not a directory; host-side file access never follows symlinks")
    return SandboxError(f"{where}: {exc.strerror}")


def read_file(root: str, path: str, workdir: str, max_bytes: int) -> bytes:
    parts = split_path(path, workdir)
    if not parts:
        raise SandboxError("read_file needs a file path, got the workspace root")
    with _dir_fd(root, parts[:-1]) as dfd:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            raise SandboxError(f"no such file: {path}") from None
        except OSError as exc:
            raise _refusal(parts, exc) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # fifos, devices: reading could block or never end
                raise SandboxError(f"{path} is not a regular file")
            if st.st_size > max_bytes:
                raise SandboxError(f"{path} is {st.st_size} bytes, more than max_bytes={max_bytes}")
            return f.read(max_bytes + 1)[:max_bytes]


def write_file(root: str, path: str, workdir: str, data: bytes, owner: tuple[int, int] | None) -> None:
    parts = split_path(path, workdir)
    if not parts:
        raise SandboxError("write_file needs a file path, got the workspace root")
    with _dir_fd(root, parts[:-1], create=True, owner=owner) as dfd:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dfd)
        except OSError as exc:
            raise _refusal(parts, exc) from None
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SandboxError(f"{path} exists and is not a regular file")
            f.write(data)
            if owner is not None:
                os.fchown(f.fileno(), *owner)


def list_dir(root: str, path: str, workdir: str) -> list[FileInfo]:
    parts = split_path(path, workdir)
    with _dir_fd(root, parts) as dfd:
        out = []
        for name in sorted(os.listdir(dfd)):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
            out.append(FileInfo(path="/".join([*parts, name]), kind=kind, size=st.st_size))
        return out
