"""safetensors file transport: the trainer publishes versions into a directory, engines load them.

    <root>/v<version>/bucket_<i>.safetensors   the bucket's tensors, by HF name
    <root>/v<version>/manifest.json            written last, atomically (tmp file + os.replace)

A version exists only once its manifest.json does, so a reader never picks up a half-written
version: it either sees no manifest (and skips the directory) or a complete set of bucket files.
No fsync: a power cut that leaves the manifest but loses bucket bytes is caught by the checksums,
and the engine refuses the version. Bucket files are plain safetensors (named tensors, not the flat
buffer), so any safetensors reader, e.g. the server's /update_weights_from_disk, can read them too.

With `flat=True` a version is instead one flat checkpoint (rollwise.model.flat_format: model.flat +
model.flat.json, whose buckets are the manifest's) beside its manifest.json: the receiver reads it with
parallel reads into one buffer and stages each bucket's slice of it (checksummed as any other); the directory
is also a model directory's weights, loadable by /update_weights_from_disk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from rollwise.model.flat_format import INDEX_FILE as FLAT_INDEX_FILE
from rollwise.model.flat_format import write_flat
from rollwise.model.flat_reader import FlatCheckpointError, read_flat
from rollwise.types.bucket_layout import build_manifest, parse_manifest
from rollwise.engine.weight_receiver import StagedUpdate, WeightReceiver
from rollwise.types.weights import WeightManifest, WeightUpdateError

MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"v(\d+)")


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def bucket_file(directory: Path, index: int) -> Path:
    return directory / f"bucket_{index}.safetensors"


def latest_version(root: str | Path) -> int | None:
    """The newest complete (manifest written) version under root, or None."""
    versions = [
        int(m.group(1))
        for d in Path(root).glob("v*")
        if (m := _VERSION_DIR.fullmatch(d.name)) and (d / MANIFEST).is_file()
    ]
    return max(versions, default=None)


def _unshared(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share a storage (e.g. views into one fused matrix); copy those."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    return out


class FileTransport:
    """Trainer side: `push` writes one immutable version directory and returns its path."""

    def __init__(self, root: str | Path, tokenizer_fingerprint: str, *, bucket_mb: float = 64,
                 flat: bool = False) -> None:
        self.root = Path(root)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.bucket_mb = bucket_mb
        self.flat = flat

    def push(self, state_dict: Mapping[str, Tensor], version: int) -> Path:
        out = version_dir(self.root, version)
        if (out / MANIFEST).exists():
            raise FileExistsError(f"{out} is already published; versions are immutable, push a new version")
        out.mkdir(parents=True, exist_ok=True)  # a directory without a manifest is a crashed push: overwrite
        state = {name: t.detach() for name, t in state_dict.items()}
        manifest = build_manifest(state, version, self.tokenizer_fingerprint, self.bucket_mb)
        if self.flat:
            write_flat(state, out, manifest=manifest, fsync=False)
        else:
            for bucket in manifest.buckets:
                tensors = {t.name: state[t.name].contiguous().cpu() for t in bucket.tensors}
                save_file(_unshared(tensors), str(bucket_file(out, bucket.index)),
                          metadata={"format": manifest.format, "version": str(version), "bucket": str(bucket.index)})
        tmp = out / (MANIFEST + ".tmp")
        tmp.write_text(manifest.model_dump_json(indent=1))
        os.replace(tmp, out / MANIFEST)  # the commit point: readers see all of this version or none of it
        return out


def _stage_flat(directory: Path, manifest: WeightManifest, staged: StagedUpdate) -> None:
    """Stage a flat version's chunks as the manifest's buckets (the receiver checks their checksums)."""
    try:
        flat = read_flat(directory, verify=False)
    except FlatCheckpointError as exc:
        bad = set(exc.chunks) or set(range(len(manifest.buckets)))
        for bucket in manifest.buckets:
            staged.fail(bucket.index, str(exc) if bucket.index in bad else "not staged: the flat file was refused")
        return
    if flat.index.layout.buckets != manifest.buckets or flat.index.layout.aliases != manifest.aliases:
        for bucket in manifest.buckets:
            staged.fail(bucket.index, f"{FLAT_INDEX_FILE} describes other tensors than {MANIFEST}: a stale or "
                                      "foreign flat file in the version directory")
        return
    for bucket, offset in zip(manifest.buckets, flat.index.bucket_offsets, strict=True):
        staged.add_flat(bucket.index, flat.buffer[offset: offset + bucket.nbytes])


class FileReceiver:
    """Engine side: load a version directory, verify it whole, apply it (or raise and change nothing)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver

    def load(self, directory: str | Path) -> WeightManifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise WeightUpdateError(
                f"{directory} has no {MANIFEST}: the version is still being written (the trainer writes the "
                "manifest last) or the path is wrong; nothing was applied"
            )
        manifest = parse_manifest(path.read_text(), str(path))
        self.receiver.check(manifest)  # refuse a wrong model or tokenizer before reading the buckets
        staged = StagedUpdate(manifest)
        if (directory / FLAT_INDEX_FILE).is_file():
            _stage_flat(directory, manifest, staged)
        else:
            for bucket in manifest.buckets:
                file = bucket_file(directory, bucket.index)
                try:
                    tensors = load_file(str(file))
                except Exception as exc:  # noqa: BLE001 - missing, truncated or not safetensors at all
                    staged.fail(bucket.index, f"cannot read {file.name} ({type(exc).__name__}: {exc}): the file is "
                                              "missing, truncated or corrupt")
                    continue
                staged.add(bucket.index, tensors, source=file.name)
        self.receiver.commit(staged)
        return manifest

    def load_latest(self, root: str | Path) -> WeightManifest | None:
        """Apply the newest complete version under root if it is newer than the engine's; else None."""
        version = latest_version(root)
        current = self.receiver.policy_version
        if version is None or (current is not None and version <= current):
            return None
        return self.load(version_dir(root, version))
