"""Read a flat checkpoint (rollwise.model.flat_format) into one pre-allocated buffer, in parallel, and hand out
tensors that are views into it: no deserialisation, no per-tensor allocation, no copy.

Reading and checking are a pipeline: reader threads issue os.preadv of the file's chunks (4 MiB by default)
straight into their slices of the buffer, back to back, and hand each finished chunk to hasher threads (xxh3).
A reader never hashes, so the disk always has as many reads in flight as there are readers (the same I/O as a
plain parallel read), where a reader that hashed its own chunk left a read slot empty while it hashed or waited
for a core to hash on. Both preadv and xxh3 release the GIL (python-xxhash 4.1: a thread hashing 1 GiB leaves
the interpreter free), so all of them overlap. Hashing is a small part of a read's CPU (xxh3: ~25 GB/s on one
core; a cold 2.5 GB read spends ~0.09 thread-seconds hashing against 1.2-2 s of its readers' kernel time copying
pages and faulting the buffer in); as many hashers as readers by default, fewer (`hashers`) is measured by
`rollwise bench load`'s diagnostic arm. Only when
every chunk has been read whole and matched its checksum are tensors made; a truncated or damaged chunk raises
`FlatCheckpointError` naming the tensors with bytes in it, and nothing is handed out.

Onto a GPU (`device=`), each chunk is copied from the pinned read buffer into one device buffer as soon as it has
matched its checksum, asynchronously, while later chunks are still being read: the host-to-device transfer overlaps
the reads instead of following them (ServerlessLLM's pipeline), so a load costs about the slower of the disk and
the PCIe link, not their sum. Tensors are views of the device buffer, made only after every chunk matched.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from pydantic import ValidationError
from torch import Tensor

from rollwise.model.flat_format import INDEX_FILE, FlatIndex
from rollwise.types.bucket_layout import unflatten_bucket

SHOWN_NAMES = 8


class FlatCheckpointError(ValueError):
    """A flat checkpoint that cannot be used as it is (index unreadable, file truncated, a chunk damaged).
    `tensors`: the tensors it spoils, `chunks`: the chunks (empty when the index itself is bad); nothing was
    handed out."""

    def __init__(self, message: str, tensors: list[str] | None = None, chunks: list[int] | None = None) -> None:
        super().__init__(message)
        self.tensors = tensors or []
        self.chunks = chunks or []


def _named(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > SHOWN_NAMES else ""
    return ", ".join(names[:SHOWN_NAMES]) + more


def read_index(directory: str | Path) -> FlatIndex:
    path = Path(directory) / INDEX_FILE
    try:
        return FlatIndex.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise FlatCheckpointError(f"{path}: cannot read the flat checkpoint's index ({exc})") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "index"
        raise FlatCheckpointError(f"{path}: not a valid flat checkpoint index ({where}: {first['msg']}); "
                                  "write it again with `rollwise model flatten`") from None


@dataclass
class FlatWeights:
    """Every tensor of a flat checkpoint (aliases included, as the same tensor), all views into `buffer`."""

    state: dict[str, Tensor]
    buffer: Tensor
    index: FlatIndex
    seconds: float  # wall time of the read (and verification)

    @property
    def nbytes(self) -> int:
        return self.index.layout.total_bytes


def default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def allocate(nbytes: int, pin: bool) -> Tensor:
    """The destination buffer; pinned (page-locked, for fast copies to a GPU) only when asked and CUDA exists."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())


def read_flat(directory: str | Path, *, threads: int | None = None, verify: bool = True, pin: bool = False,
              buffer: Tensor | None = None, hashers: int | None = None,
              device: torch.device | str | None = None) -> FlatWeights:
    """Read directory's flat checkpoint. `threads`: reader threads (default_threads()); `hashers`: checksum threads
    (as many as readers). `buffer`: a uint8 CPU tensor of at least index.data_bytes to read into (a caller's
    reused pool); else one is allocated. verify=False skips the checksums (a caller that checks them itself, or a
    benchmark's arm). `device`: the tensors' device; each verified chunk is copied there while the others are read
    (the returned buffer is the device's; the host buffer is only staging, pinned when CUDA exists)."""
    start = time.perf_counter()
    readers = threads or default_threads()
    hashers = hashers or readers
    if readers < 1 or hashers < 1:
        raise ValueError(f"threads ({readers}) and hashers ({hashers}) must be at least 1")
    index = read_index(directory)
    path = Path(directory) / index.data_file
    if buffer is not None and (buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < index.data_bytes):
        raise ValueError(f"buffer must be a flat uint8 tensor of at least {index.data_bytes} bytes")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise FlatCheckpointError(f"{path}: cannot open the flat checkpoint's data ({exc})",
                                  index.names_in(list(range(len(index.checksums)))),
                                  list(range(len(index.checksums)))) from exc
    try:
        _check_length(index, path, os.fstat(fd).st_size)  # before allocating what the index claims
        if buffer is None:
            buffer = allocate(index.data_bytes, pin or device is not None)
        target = None if device is None else torch.empty(index.data_bytes, dtype=torch.uint8, device=device)
        bad = _read_chunks(index, fd, path, buffer, readers, hashers if verify else 0, target)
        if target is not None and target.is_cuda:
            torch.cuda.synchronize(target.device)  # every chunk's copy landed before the staging buffer goes
    finally:
        os.close(fd)
    if bad:
        names = index.names_in(bad)
        raise FlatCheckpointError(f"{path}: chunk(s) {bad[:SHOWN_NAMES]} do not match their checksums (damaged on "
                                  f"disk or in a copy), spoiling {_named(names)}; nothing was loaded: write the "
                                  "checkpoint again (`rollwise model flatten`)", names, bad)
    if target is not None:
        buffer = target
    return FlatWeights(tensors_of(index, buffer), buffer, index, time.perf_counter() - start)


def tensors_of(index: FlatIndex, buffer: Tensor) -> dict[str, Tensor]:
    """Every tensor of `index` as a typed view of `buffer` (the data file's bytes, on any device); aliases are
    the same tensor as their source."""
    state: dict[str, Tensor] = {}
    for bucket, offset in zip(index.layout.buckets, index.bucket_offsets, strict=True):
        state.update(unflatten_bucket(bucket, buffer[offset: offset + bucket.nbytes]))
    for alias, source in index.layout.aliases.items():
        state[alias] = state[source]
    return state


def _check_length(index: FlatIndex, path: Path, size: int) -> None:
    short = [c for c in range(len(index.checksums)) if index.chunk_range(c)[1] > size]
    if short:
        names = index.names_in(short)
        raise FlatCheckpointError(f"{path}: truncated ({size} of {index.data_bytes} bytes): chunk(s) "
                                  f"{short[:SHOWN_NAMES]} are cut off, spoiling {_named(names)}; nothing was loaded: "
                                  "copy or write the checkpoint again", names, short)


def _read_chunks(index: FlatIndex, fd: int, path: Path, buffer: Tensor, readers: int, hashers: int,
                 target: Tensor | None = None) -> list[int]:
    """Read every chunk into its place in buffer (`readers` threads) and, unless hashers is 0, check each on one
    of `hashers` threads as soon as it is read; the chunks whose checksum does not match (after all are checked).
    `target`: a device buffer each good chunk is copied into (asynchronously from pinned memory on a GPU) once it
    is read and, when hashing, matched."""
    view = memoryview(buffer.numpy())
    chunks = range(len(index.checksums))

    def copy_out(chunk: int) -> None:
        if target is not None:
            a, b = index.chunk_range(chunk)
            target[a:b].copy_(buffer[a:b], non_blocking=target.is_cuda)

    def read(chunk: int) -> None:
        a, b = index.chunk_range(chunk)
        while a < b:
            n = os.preadv(fd, [view[a:b]], a)
            if n == 0:  # the file shrank after its length was checked
                names = index.names_in([chunk])
                raise FlatCheckpointError(f"{path}: truncated while reading chunk {chunk}, spoiling {_named(names)}; "
                                          "nothing was loaded", names, [chunk])
            a += n

    def matches(chunk: int) -> bool:
        a, b = index.chunk_range(chunk)
        good = xxhash.xxh3_64_intdigest(view[a:b]) == index.checksums[chunk]
        if good:
            copy_out(chunk)
        return good

    def read_and_copy(chunk: int) -> None:
        read(chunk)
        copy_out(chunk)

    if not hashers:
        with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="flat-read") as reading:
            list(reading.map(read_and_copy, chunks))
        return []
    with ThreadPoolExecutor(max_workers=hashers, thread_name_prefix="flat-hash") as hashing:

        def read_then_check(chunk: int) -> Future[bool]:
            read(chunk)
            return hashing.submit(matches, chunk)

        with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="flat-read") as reading:
            checks = list(reading.map(read_then_check, chunks))  # a read's error is raised here
        ok = [check.result() for check in checks]
    return [chunk for chunk, good in zip(chunks, ok, strict=True) if not good]
