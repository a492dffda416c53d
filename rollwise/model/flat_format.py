"""Loading-optimised checkpoints ("flat" directories): written once, read at the speed of the disk or memory.

A flat directory is a Hugging Face model directory (config.json, generation config, tokenizer files) whose
weights are one data file and its index instead of *.safetensors:

    model.flat        every tensor's bytes: buckets on 4 KiB boundaries of the file, each tensor on a 64-byte
                      boundary of its bucket (typed views); the gaps are zeros
    model.flat.json   the index: a `FlatIndex`, written last (the commit point: no index, no checkpoint)

The index's layout is the weight-update manifest every transport already speaks (rollwise.types.weights:
name -> bucket, offset, shape, dtype; aliased tensors such as tied embeddings stored once, as `aliases`; an
xxh3-64 checksum per bucket), so a flat directory is also a full weight push on disk, whose buckets a receiver
checks as it checks any (rollwise.sync.files). For reading, the file is also cut into fixed chunks (4 MiB by
default) with an xxh3-64 checksum each, over the file's raw bytes: a chunk is one read and is hashed as soon
as it is read (by a hasher thread beside the readers), in parallel with every other chunk, however large the
tensor it cuts through. The reader (rollwise.model.flat_reader) turns the file into tensors by views
into one buffer: no parsing, no per-tensor allocation, no copy.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rollwise.types.bucket_layout import build_manifest, flatten_bucket
from rollwise.types.weights import WeightManifest

FLAT_FORMAT = "rollwise.flat/v1"
INDEX_FILE = "model.flat.json"
DATA_FILE = "model.flat"
# Buckets and chunks start on page boundaries: page-aligned preads (and O_DIRECT, were it used).
CHUNK_ALIGN = 4096
# The read and checksum unit: small enough to stay in a core's cache between its read and its hash, and to
# spread a model over many threads; large enough that a read's fixed cost is nothing.
DEFAULT_CHUNK_MB = 4.0
BUCKET_MB = 64.0  # the layout's buckets (a push's unit in rollwise.sync; nothing in reading depends on it)
# Files of a Hugging Face directory that hold weights: not copied into the flat directory.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".flat")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", INDEX_FILE)


def align_up(offset: int, alignment: int = CHUNK_ALIGN) -> int:
    return -(-offset // alignment) * alignment


class FlatIndex(BaseModel):
    """Where every tensor of a flat data file is (the layout, and where each bucket starts in the file), and the
    checksum of every `chunk_bytes` of the file."""

    model_config = ConfigDict(frozen=True)

    format: Literal["rollwise.flat/v1"] = FLAT_FORMAT
    data_file: str = DATA_FILE
    data_bytes: int  # the data file's length: a shorter file is truncated
    layout: WeightManifest
    bucket_offsets: tuple[int, ...]
    chunk_bytes: int = Field(gt=0, multiple_of=CHUNK_ALIGN)
    checksums: tuple[int, ...]  # xxh3-64 of each chunk_bytes of the file (the last one shorter)

    @model_validator(mode="after")
    def _consistent(self) -> FlatIndex:
        """An index read from disk must describe a sane file before anyone allocates or reads by it."""
        if os.path.basename(self.data_file) != self.data_file or self.data_file in ("", ".", ".."):
            raise ValueError(f"data_file {self.data_file!r} must be a file name inside the directory")
        if len(self.bucket_offsets) != len(self.layout.buckets):
            raise ValueError(f"{len(self.bucket_offsets)} bucket offsets for {len(self.layout.buckets)} buckets")
        end = 0
        for bucket, offset in zip(self.layout.buckets, self.bucket_offsets, strict=True):
            if offset < end or offset % CHUNK_ALIGN:
                raise ValueError(f"bucket {bucket.index}: offset {offset} overlaps or is not {CHUNK_ALIGN}-aligned")
            end = offset + bucket.nbytes
        if end > self.data_bytes:
            raise ValueError(f"buckets end at byte {end}, past data_bytes {self.data_bytes}")
        if len(self.checksums) != -(-self.data_bytes // self.chunk_bytes):
            raise ValueError(f"{len(self.checksums)} checksums for {self.data_bytes} bytes in chunks of "
                             f"{self.chunk_bytes}")
        return self

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.data_bytes)

    def names_in(self, chunks: list[int]) -> list[str]:
        """The tensors with bytes in these chunks, and the aliases that read them: what bad chunks spoil."""
        ranges = [self.chunk_range(c) for c in chunks]
        hit = [t.name for bucket, base in zip(self.layout.buckets, self.bucket_offsets, strict=True)
               for t in bucket.tensors
               if any(base + t.offset < b and a < base + t.offset + t.nbytes for a, b in ranges)]
        held = set(hit)
        return hit + [alias for alias, source in self.layout.aliases.items() if source in held]


def is_flat_dir(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def write_flat(state: Mapping[str, Tensor], out_dir: str | Path, *, chunk_mb: float = DEFAULT_CHUNK_MB,
               version: int = 0, tokenizer_fingerprint: str = "", manifest: WeightManifest | None = None,
               fsync: bool = True) -> FlatIndex:
    """Write `state` (its order; tensors sharing memory stored once) as out_dir's model.flat + model.flat.json.
    `manifest`: state's manifest, already built (with checksums) by a weight push; else built here. fsync=False:
    a transport whose readers' checksums catch what a power cut loses (rollwise.sync.files) skips the flush.

    The data file is written under a temporary name and renamed, then the index is written and renamed last:
    a crash leaves either the previous checkpoint or none, never an index describing bytes that are not there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu() for name, t in state.items()}
    if manifest is None:
        manifest = build_manifest(state, version, tokenizer_fingerprint, BUCKET_MB)
    offsets, end = [], 0
    for bucket in manifest.buckets:
        offsets.append(align_up(end))
        end = offsets[-1] + bucket.nbytes
    data_bytes, chunk_bytes = align_up(end), max(CHUNK_ALIGN, align_up(int(chunk_mb * 2**20)))
    tmp = out / (DATA_FILE + ".tmp")
    with tmp.open("w+b") as f:
        f.truncate(data_bytes)  # the gaps between buckets read as zeros
        for bucket, offset in zip(manifest.buckets, offsets, strict=True):
            buf = flatten_bucket(bucket, state).numpy()
            written = 0
            while written < len(buf):
                written += os.pwrite(f.fileno(), buf[written:], offset + written)
        checksums = _chunk_checksums(f.fileno(), data_bytes, chunk_bytes)  # of the bytes as the file holds them
        if fsync:
            os.fsync(f.fileno())
    index = FlatIndex(data_bytes=data_bytes, layout=manifest, bucket_offsets=tuple(offsets), chunk_bytes=chunk_bytes,
                      checksums=checksums)
    os.replace(tmp, out / DATA_FILE)
    tmp_index = out / (INDEX_FILE + ".tmp")
    tmp_index.write_text(index.model_dump_json())
    os.replace(tmp_index, out / INDEX_FILE)
    return index


def _chunk_checksums(fd: int, data_bytes: int, chunk_bytes: int) -> tuple[int, ...]:
    buf = bytearray(chunk_bytes)
    sums = []
    for start in range(0, data_bytes, chunk_bytes):
        n = os.preadv(fd, [memoryview(buf)[: min(chunk_bytes, data_bytes - start)]], start)
        sums.append(xxhash.xxh3_64_intdigest(memoryview(buf)[:n]))
    return tuple(sums)


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """Copy src's non-weight files (config, generation config, tokenizer, chat template) into dst."""
    copied = []
    for file in sorted(src.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name not in WEIGHT_INDEXES:
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied
