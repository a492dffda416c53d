"""The format of the weight update every transport carries (`WeightUpdate`, rollwise.types.weight_update:
a manifest and its payload), the in-process transport, and the trainer side's report of refusals.

A weight update is a `WeightManifest` (version, tokenizer fingerprint, every tensor's name, shape,
dtype and place; rollwise.types.weights) plus the bytes, cut into ordered buckets of at most `bucket_mb`
MiB so a transport never needs a second full copy of the model in flight. A bucket travels as one
contiguous uint8 buffer (`flatten_bucket`); the receiver turns it back into typed views without copying
(`unflatten_bucket`); both, the checksums and `build_manifest` are rollwise.types.bucket_layout's.

Receiving is two-phase and shared by all transports (rollwise.engine.weight_receiver, the engine side's): stage every bucket
(`StagedUpdate`, which checks each bucket's layout and checksum as it lands), then
`WeightReceiver.commit` verifies the whole manifest against the engine (tokenizer fingerprint, names,
shapes, dtypes, nothing missing) and only then calls `engine.apply_weights`. Any problem raises
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

from torch import Tensor

from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.weights import WeightManifest, WeightUpdateError


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


def raise_if_rejected(version: int, failures: Sequence[tuple[str, str]], total: int) -> None:
    """Trainer side: one error naming every engine that rejected `version` (the others applied it)."""
    if failures:
        details = " | ".join(f"{who}: {message}" for who, message in failures)
        others = " (the others applied it)" if len(failures) < total else ""
        raise WeightUpdateError(f"version {version} was rejected by {len(failures)} of {total} engines{others}: "
                                f"{details}")
