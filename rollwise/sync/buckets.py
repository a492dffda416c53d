"""The weight-update format every transport speaks, and the receiving side's two-phase apply.

A weight update is a `WeightManifest` (version, tokenizer fingerprint, every tensor's name, shape,
dtype and place) plus the bytes, cut into ordered buckets of at most `bucket_mb` MiB so a transport
never needs a second full copy of the model in flight. A bucket travels as one contiguous uint8
buffer (`flatten_bucket`); the receiver turns it back into typed views without copying
(`unflatten_bucket`).

Receiving is two-phase and shared by all transports: stage every bucket (`StagedUpdate`, which
checks each bucket's layout and checksum as it lands), then `WeightReceiver.commit` verifies the
whole manifest against the engine (tokenizer fingerprint, names, shapes, dtypes, nothing missing)
and only then calls `engine.update_weights`. Any problem raises `WeightUpdateError` before a single
weight is written, so an engine is always on one complete version, never a mix.

Checksum: CRC32 (zlib). It exists to catch accidental damage (a truncated or half-copied file, a
flipped bit), not tampering, since the trainer is trusted; a cryptographic hash would buy nothing here
and is several times slower per byte. The CRC is chained over the tensors' raw bytes in manifest
order, so it does not depend on the padding of the flat layout: a file transport that stores named
tensors and a broadcast that ships flat buffers compute the same value.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

# The manifest and the expected-weights types live in the types layer (rollwise.types.weights): the
# engines read them too. Imported here for this module and re-exported for the transports' importers.
from rollwise.types.weights import (
    ALIGN,
    FORMAT,
    BucketSpec,
    ExpectedWeights,
    TensorSpec,
    WeightManifest,
    WeightUpdateError,
    dtype_from_name,
    dtype_name,
    storage_key,
)

__all__ = [
    "ALIGN", "FORMAT", "IGNORED_SUFFIXES", "MIB", "BucketSpec", "ExpectedWeights", "InProcessTransport",
    "StagedUpdate", "TensorSpec", "WeightManifest", "WeightReceiver", "WeightUpdate", "WeightUpdateError",
    "build_manifest", "bucket_crc32", "dtype_from_name", "dtype_name", "flatten_bucket", "parse_manifest",
    "plan_buckets", "raise_if_rejected", "unflatten_bucket",
]

MIB = 2**20
# Non-learned buffers some checkpoints carry; the engine's load_weights skips them too.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------- bucket layout


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def plan_buckets(state: Mapping[str, Tensor], bucket_mb: float | None) -> tuple[list[BucketSpec], dict[str, str]]:
    """Cut `state` (in its order) into buckets of at most bucket_mb MiB, padding included; a tensor
    larger than that gets a bucket of its own. None: one bucket. Tensors sharing memory with an
    earlier one are returned as aliases instead of being sent twice."""
    limit = math.inf if bucket_mb is None else bucket_mb * MIB
    if limit <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    buckets: list[BucketSpec] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    current: list[TensorSpec] = []
    end = 0

    def close() -> None:
        nonlocal current, end
        if current:
            buckets.append(BucketSpec(index=len(buckets), nbytes=end, tensors=tuple(current)))
        current, end = [], 0

    for name, tensor in state.items():
        key = storage_key(tensor)
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        nbytes = tensor.numel() * tensor.element_size()
        if current and _align(end) + nbytes > limit:
            close()
        offset = _align(end)
        current.append(TensorSpec(name=name, shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                                  offset=offset, nbytes=nbytes))
        end = offset + nbytes
    close()
    return buckets, aliases


def _as_bytes(t: Tensor) -> Tensor:
    """A tensor's raw bytes as a flat uint8 tensor (a view when it is already contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def flatten_bucket(spec: BucketSpec, state: Mapping[str, Tensor], out: Tensor | None = None,
                   device: torch.device | str = "cpu") -> Tensor:
    """Copy the bucket's tensors into one contiguous uint8 buffer (`out[:spec.nbytes]` if given, so a
    sender can reuse its buffers). Padding is zeroed so the buffer's bytes are deterministic."""
    if out is not None:
        if out.dtype != torch.uint8 or out.numel() < spec.nbytes:
            raise ValueError(f"out must be a uint8 buffer of at least {spec.nbytes} bytes")
        buf = out[: spec.nbytes]
    else:
        buf = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    cursor = 0
    for t in spec.tensors:
        tensor = state[t.name]
        if tuple(tensor.shape) != t.shape or dtype_name(tensor.dtype) != t.dtype:
            raise ValueError(f"{t.name} changed since the manifest was built: {tuple(tensor.shape)} "
                             f"{dtype_name(tensor.dtype)} != {t.shape} {t.dtype}")
        if t.offset > cursor:
            buf[cursor : t.offset].zero_()
        buf[t.offset : t.offset + t.nbytes].copy_(_as_bytes(tensor))
        cursor = t.offset + t.nbytes
    if spec.nbytes > cursor:
        buf[cursor:].zero_()
    return buf


def unflatten_bucket(spec: BucketSpec, buf: Tensor) -> dict[str, Tensor]:
    """Typed views into `buf` (no copy): the buffer must stay alive while the tensors are used."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != spec.nbytes:
        raise ValueError(f"bucket {spec.index}: expected a flat uint8 buffer of {spec.nbytes} bytes, "
                         f"got {buf.dtype} {tuple(buf.shape)}")
    return {
        t.name: buf[t.offset : t.offset + t.nbytes].view(dtype_from_name(t.dtype)).view(t.shape)
        for t in spec.tensors
    }


def bucket_crc32(spec: BucketSpec, tensors: Mapping[str, Tensor]) -> int:
    """CRC32 chained over the bucket's tensors' raw bytes in manifest order (layout-independent)."""
    crc = 0
    for t in spec.tensors:
        # zlib releases the GIL on large buffers; numpy exposes the bytes without a copy on CPU.
        crc = zlib.crc32(_as_bytes(tensors[t.name]).cpu().numpy(), crc)
    return crc


def build_manifest(state: Mapping[str, Tensor], version: int, tokenizer_fingerprint: str,
                   bucket_mb: float | None, *, checksum: bool = True) -> WeightManifest:
    """The manifest of pushing `state` as `version`. checksum=False skips the CRC pass (one read of
    every byte) for transports whose bytes cannot be damaged on the way (in-process)."""
    buckets, aliases = plan_buckets(state, bucket_mb)
    if checksum:
        buckets = [b.model_copy(update={"crc32": bucket_crc32(b, state)}) for b in buckets]
    return WeightManifest(
        version=version, tokenizer_fingerprint=tokenizer_fingerprint, buckets=tuple(buckets), aliases=aliases,
        total_bytes=sum(t.nbytes for b in buckets for t in b.tensors),
    )


def parse_manifest(text: str, source: str) -> WeightManifest:
    try:
        return WeightManifest.model_validate_json(text)
    except ValidationError as exc:
        raise WeightUpdateError(f"{source}: not a valid {FORMAT} manifest ({exc.error_count()} problems: "
                                f"{exc.errors()[0]['msg']}); the update was not applied") from None


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


# ---------------------------------------------------------------------------- receiving


def _shown(problems: Sequence[str], limit: int = 8) -> str:
    more = f"; ... ({len(problems)} problems in all)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


class StagedUpdate:
    """Phase one: the buckets of one update as they arrive. Problems are recorded, not raised, so a
    collective transport keeps receiving (every rank must join every broadcast) and the error names
    everything that went wrong at once."""

    def __init__(self, manifest: WeightManifest) -> None:
        self.manifest = manifest
        self.tensors: dict[str, Tensor] = {}
        self.problems: list[str] = []
        self._received: set[int] = set()

    def add_flat(self, index: int, buf: Tensor) -> None:
        spec = self.manifest.buckets[index]
        try:
            tensors = unflatten_bucket(spec, buf)
        except ValueError as exc:
            self.fail(index, str(exc))
            return
        self.add(index, tensors, source=f"bucket {index}")

    def add(self, index: int, tensors: Mapping[str, Tensor], source: str) -> None:
        """Stage bucket `index`, checking its names, shapes, dtypes and checksum against the manifest."""
        spec = self.manifest.buckets[index]
        self._received.add(index)
        wanted = {t.name: t for t in spec.tensors}
        problems = [f"{source}: unexpected tensor {n!r}" for n in tensors if n not in wanted]
        problems += [f"{source}: missing tensor {n!r}" for n in wanted if n not in tensors]
        for name, t in wanted.items():
            got = tensors.get(name)
            if got is not None and (tuple(got.shape) != t.shape or dtype_name(got.dtype) != t.dtype):
                problems.append(f"{source}: {name} is {tuple(got.shape)} {dtype_name(got.dtype)}, "
                                f"the manifest says {t.shape} {t.dtype}")
        if not problems and spec.crc32 is not None:
            crc = bucket_crc32(spec, tensors)
            if crc != spec.crc32:
                problems.append(f"{source}: checksum mismatch (crc32 {crc:08x}, manifest {spec.crc32:08x}): "
                                "the bytes were damaged in transit or on disk")
        if problems:
            self.problems += problems
        else:
            self.tensors.update(tensors)

    def fail(self, index: int, message: str) -> None:
        self._received.add(index)
        self.problems.append(message)

    def missing_buckets(self) -> list[int]:
        return [b.index for b in self.manifest.buckets if b.index not in self._received]


def _current_version(engine: Any) -> int | None:
    version = getattr(engine, "policy_version", None)
    if version is None:  # an EngineWorker: the engine it wraps knows
        version = getattr(getattr(engine, "engine", None), "policy_version", None)
    return version


class WeightReceiver:
    """The engine side shared by all transports: check a manifest, then apply a staged update whole.

    `engine` is anything with update_weights(state_dict, version): a ReferenceEngine, or an
    EngineWorker (then the apply runs on its thread between two steps). `tokenizer_fingerprint` is
    the engine's own tokenizer's (rollwise.model.loading.tokenizer_fingerprint); None only for an
    engine built without one (tests, benchmarks): then the fingerprint is the one thing not checked."""

    def __init__(self, engine: Any, tokenizer_fingerprint: str | None,
                 expected: ExpectedWeights | None = None) -> None:
        self.engine = engine
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.expected = expected if expected is not None else ExpectedWeights.of_engine(engine)

    @property
    def policy_version(self) -> int | None:
        return _current_version(self.engine)

    def _reject(self, version: int, problems: Sequence[str], hint: str) -> WeightUpdateError:
        return WeightUpdateError(
            f"weight update to version {version} rejected; the engine keeps serving version "
            f"{self.policy_version}: {_shown(problems)}. {hint}"
        )

    def check(self, manifest: WeightManifest) -> None:
        """Reject a manifest this engine cannot take, before any bytes are read."""
        version, current = manifest.version, self.policy_version
        if current is not None and version < current:
            raise self._reject(version, [f"the engine is already at version {current}"],
                               "Versions only move forward (re-pushing the current version is allowed, as a retry).")
        if self.tokenizer_fingerprint is not None and manifest.tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise self._reject(
                version,
                [f"tokenizer fingerprint {manifest.tokenizer_fingerprint[:16]}... != the engine's "
                 f"{(self.tokenizer_fingerprint or '')[:16]}..."],
                "The trainer and the engine tokenize differently: start both from the same model/tokenizer.",
            )
        problems: list[str] = []
        sent: set[str] = set()
        for t in manifest.tensors():
            sent.add(t.name)
            if t.name.endswith(IGNORED_SUFFIXES):
                continue
            if t.name not in self.expected.tensors:
                problems.append(f"unexpected weight {t.name!r}")
                continue
            shape, dtype = self.expected.tensors[t.name]
            if t.shape != shape:
                problems.append(f"{t.name}: shape {t.shape} != the engine's {shape}")
            if t.dtype != dtype:
                problems.append(f"{t.name}: dtype {t.dtype} != the engine's {dtype}")
        for alias, source in manifest.aliases.items():
            sent.add(alias)
            if alias not in self.expected.tensors:
                problems.append(f"unexpected weight {alias!r} (tied to {source!r})")
            elif self.expected.tensors[alias][0] != manifest.spec_of(source).shape:
                problems.append(f"{alias}: shape {manifest.spec_of(source).shape} != the engine's "
                                f"{self.expected.tensors[alias][0]}")
        # A name tied to another inside the engine is loaded through that other one.
        problems += [f"missing weight {n!r}" for n in self.expected.tensors
                     if n not in sent and self.expected.ties.get(n) not in sent]
        if problems:
            raise self._reject(version, problems,
                               "The trainer's model does not match the engine's: load the same model spec "
                               "(and dtype) on both sides.")

    def commit(self, staged: StagedUpdate) -> None:
        """Phase two: verify everything, then apply the whole update at once (or nothing)."""
        manifest = staged.manifest
        self.check(manifest)
        problems = list(staged.problems)
        problems += [f"bucket {i} never arrived" for i in staged.missing_buckets()]
        if problems:
            raise self._reject(manifest.version, problems, "Nothing was applied; push the version again.")
        state = dict(staged.tensors)
        for alias, source in manifest.aliases.items():
            # Skip names the engine already ties to the source: loading one updates both.
            if self.expected.ties.get(alias) != source and self.expected.ties.get(source) != alias:
                state[alias] = state[source]
        try:
            self.engine.update_weights(state, manifest.version)
        except ValueError as exc:  # the engine's own validation; it also leaves the weights untouched
            raise self._reject(manifest.version, [str(exc)], "Nothing was applied.") from exc

    def receive(self, update: WeightUpdate) -> None:
        """The one entry every transport ends in: stage the update's tensors, check it whole, apply it."""
        self.apply_state(update.manifest, update.tensors())

    def apply_state(self, manifest: WeightManifest, state: Mapping[str, Tensor]) -> None:
        """Stage tensors that are already in memory (one process) and commit them."""
        staged = StagedUpdate(manifest)
        for bucket in manifest.buckets:
            staged.add(bucket.index, {t.name: state[t.name] for t in bucket.tensors if t.name in state},
                       source=f"bucket {bucket.index}")
        self.commit(staged)


def raise_if_rejected(version: int, failures: Sequence[tuple[str, str]], total: int) -> None:
    """Trainer side: one error naming every engine that rejected `version` (the others applied it)."""
    if failures:
        details = " | ".join(f"{who}: {message}" for who, message in failures)
        others = " (the others applied it)" if len(failures) < total else ""
        raise WeightUpdateError(f"version {version} was rejected by {len(failures)} of {total} engines{others}: "
                                f"{details}")


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
        failures: list[tuple[str, str]] = []
        for i, receiver in enumerate(self.receivers):
            try:
                receiver.receive(update)
            except WeightUpdateError as exc:
                failures.append((f"engine {i}", str(exc)))
        if len(failures) == len(self.receivers) == 1:
            raise WeightUpdateError(failures[0][1])
        raise_if_rejected(version, failures, len(self.receivers))
        return manifest
