"""Loading-optimised checkpoints ("flat" directories): written once, read at the speed of the disk or memory.

A flat directory is a Hugging Face model directory (config.json, generation config, tokenizer files) whose
weights are one data file and its index instead of *.safetensors:

    model.flat        every tensor's bytes, in chunks; each chunk starts on a 4 KiB boundary of the file
                      (page-aligned reads), each tensor on a 64-byte boundary of its chunk (typed views)
    model.flat.json   the index: a `FlatIndex`, written last (the commit point: no index, no checkpoint)

The index's layout is the weight-update manifest every transport already speaks (rollwise.types.weights:
name -> chunk, offset, shape, dtype; aliased tensors such as tied embeddings stored once, as `aliases`; an
xxh3-64 checksum per chunk, rollwise.sync.layout.bucket_checksum). So a flat directory is also a full
weight push on disk: its chunks are the push's buckets, and a receiver checks them as it checks any.
The reader (rollwise.model.flat_reader) turns the file into tensors by views into one buffer: no parsing,
no per-tensor allocation, no copy.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator
from torch import Tensor

from rollwise.types.bucket_layout import build_manifest, flatten_bucket
from rollwise.types.weights import WeightManifest

FLAT_FORMAT = "rollwise.flat/v1"
INDEX_FILE = "model.flat.json"
DATA_FILE = "model.flat"
# Chunks start on page boundaries: a chunk is read with page-aligned preads (and could be with O_DIRECT).
CHUNK_ALIGN = 4096
# The checksum unit (a tensor larger than this is a chunk of its own); reads are split finer than chunks.
DEFAULT_CHUNK_MB = 16.0
# Files of a Hugging Face directory that hold weights: not copied into the flat directory.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".flat")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", INDEX_FILE)


def align_up(offset: int, alignment: int = CHUNK_ALIGN) -> int:
    return -(-offset // alignment) * alignment


class FlatIndex(BaseModel):
    """Where every tensor of a flat data file is: the layout, and where each chunk (bucket) starts in the file."""

    model_config = ConfigDict(frozen=True)

    format: Literal["rollwise.flat/v1"] = FLAT_FORMAT
    data_file: str = DATA_FILE
    data_bytes: int  # the data file's length: a shorter file is truncated
    layout: WeightManifest  # chunks = the layout's buckets, with their checksums
    chunk_offsets: tuple[int, ...]

    @model_validator(mode="after")
    def _consistent(self) -> FlatIndex:
        """An index read from disk must describe a sane file before anyone allocates or reads by it."""
        if os.path.basename(self.data_file) != self.data_file or self.data_file in ("", ".", ".."):
            raise ValueError(f"data_file {self.data_file!r} must be a file name inside the directory")
        if len(self.chunk_offsets) != len(self.layout.buckets):
            raise ValueError(f"{len(self.chunk_offsets)} chunk offsets for {len(self.layout.buckets)} chunks")
        end = 0
        for bucket, offset in zip(self.layout.buckets, self.chunk_offsets, strict=True):
            if offset < end or offset % CHUNK_ALIGN:
                raise ValueError(f"chunk {bucket.index}: offset {offset} overlaps or is not {CHUNK_ALIGN}-aligned")
            if bucket.checksum is None:
                raise ValueError(f"chunk {bucket.index} has no checksum")
            end = offset + bucket.nbytes
        if end > self.data_bytes:
            raise ValueError(f"chunks end at byte {end}, past data_bytes {self.data_bytes}")
        return self

    def chunk_names(self, index: int) -> list[str]:
        """The tensors stored in chunk `index`, and the aliases that read them: what a bad chunk spoils."""
        stored = [t.name for t in self.layout.buckets[index].tensors]
        held = set(stored)
        return stored + [alias for alias, source in self.layout.aliases.items() if source in held]


def is_flat_dir(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def write_flat(state: Mapping[str, Tensor], out_dir: str | Path, *, chunk_mb: float = DEFAULT_CHUNK_MB,
               version: int = 0, tokenizer_fingerprint: str = "") -> FlatIndex:
    """Write `state` (its order; tensors sharing memory stored once) as out_dir's model.flat + model.flat.json.

    The data file is written under a temporary name and renamed, then the index is written and renamed last:
    a crash leaves either the previous checkpoint or none, never an index describing bytes that are not there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu() for name, t in state.items()}
    manifest = build_manifest(state, version, tokenizer_fingerprint, chunk_mb)
    offsets, end = [], 0
    for bucket in manifest.buckets:
        offsets.append(align_up(end))
        end = offsets[-1] + bucket.nbytes
    index = FlatIndex(data_bytes=align_up(end), layout=manifest, chunk_offsets=tuple(offsets))
    tmp = out / (DATA_FILE + ".tmp")
    with tmp.open("wb") as f:
        f.truncate(index.data_bytes)  # the padding between chunks reads as zeros
        for bucket, offset in zip(manifest.buckets, offsets, strict=True):
            buf = flatten_bucket(bucket, state).numpy()
            written = 0
            while written < len(buf):
                written += os.pwrite(f.fileno(), buf[written:], offset + written)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / DATA_FILE)
    tmp_index = out / (INDEX_FILE + ".tmp")
    tmp_index.write_text(index.model_dump_json())
    os.replace(tmp_index, out / INDEX_FILE)
    return index


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """Copy src's non-weight files (config, generation config, tokenizer, chat template) into dst."""
    copied = []
    for file in sorted(src.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name not in WEIGHT_INDEXES:
            shutil.copy2(file, dst / file.name)
            copied.append(file.name)
    return copied
