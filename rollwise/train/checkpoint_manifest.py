"""What makes a checkpoint whole: its manifest (every file's size and xxh3-64 checksum), its state.json,
and files that parse. Checked before a run resumes from it, so a damaged checkpoint is never loaded.

The manifest (`manifest.json`) is written last into the hidden partial folder, after every file of the
checkpoint (the sharded ranks' DCP shards included), and the folder is then renamed into place
(rollwise.train.checkpoint.write_checkpoint): a checkpoint whose manifest is missing was never finished.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from safetensors import SafetensorError, safe_open

from rollwise.config import RunError
from rollwise.types.checksum import file_checksum

MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
RNG_FILE = "rng.pt"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RunError):
    """A checkpoint that is not whole: `file` (relative to the checkpoint) and what is wrong with it.
    The message says what to do; a run resuming with checkpoint.resume=auto skips the checkpoint instead."""

    def __init__(self, ckpt: Path, file: str, problem: str) -> None:
        self.ckpt, self.file, self.problem = ckpt, file, problem
        super().__init__(f"checkpoint {ckpt} is damaged: {file} {problem}. Resume from an earlier checkpoint "
                         "(checkpoint.resume=auto takes the newest whole one, skipping damaged ones) or start "
                         "the run again")


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: StrictInt = Field(ge=0)
    xxh3_64: str = Field(pattern=r"^[0-9a-f]{16}$")


class CheckpointManifest(BaseModel):
    """manifest.json: every file of the checkpoint (paths relative to it, '/'-separated) but itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: StrictInt = MANIFEST_FORMAT
    files: dict[str, FileEntry]


class CheckpointState(BaseModel):
    """state.json. The loop's own fields (tokenizer fingerprint, data position, log sizes) ride along;
    those a resume relies on are typed here."""

    model_config = ConfigDict(extra="allow")

    step: StrictInt = Field(ge=0)  # completed training steps
    policy_version: StrictInt = Field(ge=0)  # versions never go backwards (invariant 2)
    problems_consumed: StrictInt | None = Field(default=None, ge=0)
    next_group: StrictInt | None = Field(default=None, ge=0)
    pending_groups: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list)
    log_sizes: dict[str, Annotated[StrictInt, Field(ge=0)]] | None = None  # bytes of each run log when the checkpoint was written


def _files(folder: Path) -> dict[str, Path]:
    """Every file under `folder` but the manifest, by '/'-separated relative path."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_FILE}


def write_manifest(folder: Path) -> CheckpointManifest:
    """Hash every file of the (finished) checkpoint folder and write manifest.json, atomically."""
    manifest = CheckpointManifest(files={
        name: FileEntry(size=path.stat().st_size, xxh3_64=file_checksum(path)) for name, path in _files(folder).items()
    })
    tmp = folder / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(manifest.model_dump_json(indent=1))
    os.replace(tmp, folder / MANIFEST_FILE)
    return manifest


def state_record(step: int, version: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The state.json a checkpoint gets, checked as resume will check it (a bad value is refused when
    written, not when resumed)."""
    record = {"step": step, "policy_version": version, **extra}
    try:
        CheckpointState.model_validate(record)
    except ValidationError as exc:
        raise ValueError(f"checkpoint step_{step:06d} not written: its {STATE_FILE} would hold invalid values "
                         f"({_problems(exc)})") from exc
    return record


# Checkpoints verified by this process, by folder, with their manifest's (inode, size, mtime): a resume
# verifies when it picks the checkpoint and again when the trainer loads it, and hashing a model's GBs
# twice a few seconds apart would double the wait for nothing.
_VERIFIED: dict[Path, tuple[int, int, int]] = {}
_MAX_VERIFIED = 8


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check `ckpt` is whole before anything loads from it: the manifest lists exactly its files, each of
    the listed size and checksum; state.json holds valid values; the model and optimizer files parse.
    Returns state.json; raises CheckpointError naming the first file that is not right."""
    stamp = _manifest_stamp(ckpt)
    if stamp is not None and _VERIFIED.get(ckpt.resolve()) == stamp:
        return read_state(ckpt)
    _verify(ckpt)
    if stamp is not None:
        if len(_VERIFIED) >= _MAX_VERIFIED:
            _VERIFIED.pop(next(iter(_VERIFIED)))
        _VERIFIED[ckpt.resolve()] = stamp
    return read_state(ckpt)


def _manifest_stamp(ckpt: Path) -> tuple[int, int, int] | None:
    try:
        st = (ckpt / MANIFEST_FILE).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _verify(ckpt: Path) -> None:
    manifest = _read_manifest(ckpt)
    present = _files(ckpt)
    # Compared as names before any listed path is opened: a manifest's names never reach outside `ckpt`.
    missing, unlisted = sorted(set(manifest.files) - set(present)), sorted(set(present) - set(manifest.files))
    if missing:
        raise CheckpointError(ckpt, missing[0], "is missing (the manifest lists it)")
    if unlisted:
        raise CheckpointError(ckpt, unlisted[0], "is not in the manifest (added after the checkpoint was written)")
    for name, entry in manifest.files.items():  # sizes first: a truncated file is found without hashing the rest
        size = present[name].stat().st_size
        if size != entry.size:
            raise CheckpointError(ckpt, name, f"is {size} bytes, the manifest says {entry.size} (truncated or rewritten)")
    for name, entry in manifest.files.items():
        if file_checksum(present[name]) != entry.xxh3_64:
            raise CheckpointError(ckpt, name, "does not match its checksum in the manifest (its bytes changed after "
                                              "the checkpoint was written)")
    read_state(ckpt)
    for name, path in present.items():  # cheap structural checks: the formats' headers
        if name.endswith(".safetensors"):
            with reading(ckpt, name):
                with safe_open(path, framework="pt") as f:
                    f.keys()
        elif name.endswith(".pt"):
            with reading(ckpt, name):
                if not zipfile.is_zipfile(path):
                    raise ValueError("not a torch.save archive")


def _read_manifest(ckpt: Path) -> CheckpointManifest:
    path = ckpt / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(ckpt, MANIFEST_FILE, "is missing: the checkpoint was never finished, or was written by "
                                                   "a rollwise that wrote no manifests")
    with reading(ckpt, MANIFEST_FILE):
        manifest = CheckpointManifest.model_validate_json(path.read_bytes())
    if manifest.format != MANIFEST_FORMAT:
        raise CheckpointError(ckpt, MANIFEST_FILE, f"has format {manifest.format}; this rollwise reads {MANIFEST_FORMAT}")
    return manifest


def read_state(ckpt: Path) -> dict[str, Any]:
    """state.json, checked (non-negative step and policy version; the step its folder is named after)."""
    with reading(ckpt, STATE_FILE):
        state = json.loads((ckpt / STATE_FILE).read_text())
        if not isinstance(state, dict):
            raise ValueError("is not a JSON object")
        CheckpointState.model_validate(state)
    named = _STEP_DIR.fullmatch(ckpt.name)
    if named is not None and int(named.group(1)) != state["step"]:
        raise CheckpointError(ckpt, STATE_FILE, f"says step {state['step']}, but the folder is {ckpt.name}")
    return state


# What the readers of these formats raise on a truncated or garbled file (JSON, safetensors, torch.save's zip
# and the pickle inside it); wrap only reading, never applying a state (a model mismatch is not damage).
_UNREADABLE = (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, AttributeError, IndexError,
               pickle.UnpicklingError, zipfile.BadZipFile, SafetensorError)


@contextmanager
def reading(ckpt: Path, file: str) -> Iterator[None]:
    """Any failure to read or parse `file` of `ckpt` becomes a one-line CheckpointError naming it."""
    try:
        yield
    except CheckpointError:
        raise
    except ValidationError as exc:
        raise CheckpointError(ckpt, file, f"holds invalid values ({_problems(exc)})") from exc
    except _UNREADABLE as exc:
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(ckpt, file, f"cannot be read ({detail})") from exc


def _problems(exc: ValidationError) -> str:
    """The first few problems, each with its field: `policy_version: Input should be greater than ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()[:3])


__all__ = ["CheckpointError", "CheckpointManifest", "CheckpointState", "FileEntry", "MANIFEST_FILE", "RNG_FILE",
           "STATE_FILE", "read_state", "reading", "state_record", "verify_checkpoint", "write_manifest"]
