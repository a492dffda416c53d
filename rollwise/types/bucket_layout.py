"""The bucket layout of a weight update: how tensors are cut into ordered buckets of at most
`bucket_mb` MiB, packed into one contiguous uint8 buffer each and checksummed, and the manifest that
describes them. The format itself is described in rollwise.sync.buckets.

A types-layer module (pure: torch, xxhash and rollwise.types only) because two layers build on it: the
weight transports (rollwise.sync) and the model layer's
loading-optimised checkpoints (rollwise.model.flat_format), whose chunks are these buckets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import xxhash
from pydantic import ValidationError
from torch import Tensor

from rollwise.types.weights import (
    ALIGN,
    FORMAT,
    BucketSpec,
    TensorSpec,
    WeightManifest,
    WeightUpdateError,
    dtype_from_name,
    dtype_name,
    storage_key,
)


MIB = 2**20


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


def bucket_checksum(spec: BucketSpec, tensors: Mapping[str, Tensor]) -> int:
    """xxh3-64 over the bucket's tensors' raw bytes in manifest order (layout-independent: the same for the
    trainer's tensors and for the views into a received flat buffer). xxh3 rather than zlib's crc32: ~12 vs
    ~2.2 GB/s here, and both sides hash every byte of every push that leaves the process."""
    hasher = xxhash.xxh3_64()
    for t in spec.tensors:
        hasher.update(_as_bytes(tensors[t.name]).cpu().numpy())  # numpy exposes the bytes without a copy on CPU
    return hasher.intdigest()


# The last few layouts built, by everything a layout depends on (names, shapes, strides, dtypes, which
# tensors share memory): a trainer pushes the same tensors every step, and planning a few hundred
# tensors' buckets and validating the manifest was most of a small (LoRA adapter) push's time.
_LAYOUTS: dict[tuple, WeightManifest] = {}
_MAX_LAYOUTS = 8


def _layout(state: Mapping[str, Tensor], tokenizer_fingerprint: str, bucket_mb: float | None) -> WeightManifest:
    """The manifest of `state` at version 0 without checksums (cached)."""
    key = (bucket_mb, tokenizer_fingerprint, tuple((name, storage_key(t)) for name, t in state.items()))
    manifest = _LAYOUTS.get(key)
    if manifest is None:
        buckets, aliases = plan_buckets(state, bucket_mb)
        manifest = WeightManifest(
            version=0, tokenizer_fingerprint=tokenizer_fingerprint, buckets=tuple(buckets), aliases=aliases,
            total_bytes=sum(t.nbytes for b in buckets for t in b.tensors),
        )
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = manifest
    return manifest


def build_manifest(state: Mapping[str, Tensor], version: int, tokenizer_fingerprint: str,
                   bucket_mb: float | None, *, checksum: bool = True) -> WeightManifest:
    """The manifest of pushing `state` as `version`. checksum=False skips the checksum pass (one read of
    every byte) for transports whose bytes cannot be damaged on the way (in-process)."""
    layout = _layout(state, tokenizer_fingerprint, bucket_mb)
    update: dict = {"version": version}
    if checksum:
        update["buckets"] = tuple(b.model_copy(update={"checksum": bucket_checksum(b, state)}) for b in layout.buckets)
    return layout.model_copy(update=update)  # frozen, validated once when the layout was built


def parse_manifest(text: str, source: str) -> WeightManifest:
    """The manifest, validated (layout, adapter spec); WeightUpdateError naming the first bad field."""
    try:
        return WeightManifest.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise WeightUpdateError(f"{source}: not a valid {FORMAT} manifest ({exc.error_count()} problems: "
                                f"{where or 'manifest'}: {first['msg']}); the update was not applied",
                                field=where or None) from None
