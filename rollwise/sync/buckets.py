"""The weight update every transport carries (`WeightUpdate`: a manifest and its payload), and the
in-process transport.

A weight update is a `WeightManifest` (version, tokenizer fingerprint, every tensor's name, shape,
dtype and place; rollwise.types.weights) plus the bytes, cut into ordered buckets of at most `bucket_mb`
MiB so a transport never needs a second full copy of the model in flight. A bucket travels as one
contiguous uint8 buffer (`flatten_bucket`); the receiver turns it back into typed views without copying
(`unflatten_bucket`); both, the checksums and `build_manifest` are rollwise.sync.layout's.

Receiving is two-phase and shared by all transports (rollwise.sync.receiver): stage every bucket
(`StagedUpdate`, which checks each bucket's layout and checksum as it lands), then
`WeightReceiver.commit` verifies the whole manifest against the engine (tokenizer fingerprint, names,
shapes, dtypes, nothing missing) and only then calls `engine.update_weights`. Any problem raises
`WeightUpdateError` before a single weight is written, so an engine is always on one complete
version, never a mix.

Checksum: xxh3-64 (the xxhash package; format v1 used zlib's CRC32, ~5x slower here, and both sides
hash every byte of a push). It exists to catch accidental damage (a truncated or half-copied file, a
flipped bit), not tampering, since the trainer is trusted; a cryptographic hash would buy nothing here
and is several times slower per byte. It runs over the tensors' raw bytes in manifest order, so it
does not depend on the padding of the flat layout: a file transport that stores named tensors and a
broadcast that ships flat buffers compute the same value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rollwise.sync.layout import build_manifest
from rollwise.sync.receiver import WeightReceiver, raise_if_rejected
from rollwise.types.weights import WeightManifest, WeightUpdateError


# ---------------------------------------------------------------------------- the update


@dataclass(frozen=True)
class WeightUpdate:
    """One weight update as every transport carries it: the manifest and its payload.

    The payload is the tensors themselves while the update stays in one process (views of the
    trainer's tensors: nothing is copied until the engine loads them), or a Ray ObjectRef to that
    mapping on its way through the object store. Transports that move bytes (HTTP, files,
    broadcast) re-cut the same tensors into checksummed buckets (`build_manifest(checksum=True)`)
    and rebuild a StagedUpdate on the far side; every receiver ends in `WeightReceiver.commit`."""

    manifest: WeightManifest
    payload: Any

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest.tokenizer_fingerprint

    @classmethod
    def of_state(cls, state_dict: Mapping[str, Tensor], version: int, tokenizer_fingerprint: str | None) -> WeightUpdate:
        """An in-process update of `state_dict` (detached views, zero-copy). No checksum: these bytes
        never leave this process's memory. A None fingerprint is sent as "" (a receiver that knows its
        own then refuses the update: only engines built without one accept it)."""
        state = {name: tensor.detach() for name, tensor in state_dict.items()}
        manifest = build_manifest(state, version, tokenizer_fingerprint or "", bucket_mb=None, checksum=False)
        return cls(manifest, state)

    def apply_to(self, engine: Any, tokenizer_fingerprint: str | None) -> None:
        """Load this update into `engine` (an engine, or an EngineWorker) through the checked
        two-phase commit. Engine-side code calls this instead of importing the receiver."""
        WeightReceiver(engine, tokenizer_fingerprint).receive(self)

    def with_payload(self, payload: Any) -> WeightUpdate:
        return WeightUpdate(self.manifest, payload)

    def tensors(self) -> Mapping[str, Tensor]:
        """The payload as tensors: an in-process mapping as it is, an object-store reference fetched."""
        if isinstance(self.payload, Mapping):
            return self.payload
        import ray  # only the Ray transport makes reference payloads

        fetched = ray.get(self.payload)
        if not isinstance(fetched, Mapping):
            raise WeightUpdateError(f"weight update to version {self.version}: the payload is a "
                                    f"{type(fetched).__name__}, not a mapping of tensors")
        return fetched


# ---------------------------------------------------------------------------- in-process transport


class InProcessTransport:
    """Trainer and engines in one process: the engines copy straight from the trainer's tensors.

    A mismatched model or tokenizer is refused with a clear error instead of half-loaded. No
    checksum: the bytes never leave this process's memory."""

    def __init__(self, receivers: Sequence[WeightReceiver], tokenizer_fingerprint: str) -> None:
        self.receivers = list(receivers)
        self.tokenizer_fingerprint = tokenizer_fingerprint

    def push(self, state_dict: Mapping[str, Tensor], version: int) -> WeightManifest:
        update = WeightUpdate.of_state(state_dict, version, self.tokenizer_fingerprint)
        manifest = update.manifest
        failures: list[tuple[str, WeightUpdateError]] = []
        for i, receiver in enumerate(self.receivers):
            try:
                receiver.receive(update)
            except WeightUpdateError as exc:
                failures.append((f"engine {i}", exc))
        if len(failures) == len(self.receivers) == 1:
            raise failures[0][1]  # one engine: its own error (and the field it names)
        raise_if_rejected(version, [(who, str(exc)) for who, exc in failures], len(self.receivers))
        return manifest
