"""File checksums: xxh3-64 (the xxhash package), the hash the weight-update format uses for its buckets
(rollwise.types.bucket_layout), here over a file's bytes: checkpoint manifests (rollwise.train.checkpoint_manifest)."""

from __future__ import annotations

from pathlib import Path

import xxhash

CHUNK = 8 << 20  # read a file 8 MiB at a time: a multi-GB model file is never held whole


def file_checksum(path: Path) -> str:
    """xxh3-64 of the file's bytes, as 16 hex digits."""
    hasher = xxhash.xxh3_64()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()
