"""The weight update every transport carries (`WeightUpdate`: a manifest and its payload), named by the
contracts (rollwise.types.contracts: `RolloutBackend.load_weights`). rollwise.sync describes the format and
moves it; the engine side's receiver (rollwise.engine.weight_receiver) checks it whole and applies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rollwise.types.bucket_layout import build_manifest
from rollwise.types.weights import WeightManifest, WeightUpdateError


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
