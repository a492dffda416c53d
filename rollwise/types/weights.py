"""The weight-update manifest and what an engine expects: the types every weight path shares.

A weight update is a `WeightManifest` (version, tokenizer fingerprint, every tensor's name, shape,
dtype and place in its bucket) plus the bytes. The engines (the vLLM backend declares its
`ExpectedWeights`), the protocols and every transport speak these types; building manifests,
cutting buckets and the checked two-phase commit are rollwise.sync.buckets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from rollwise.types.adapter_limits import MAX_LORA_ALPHA

# v2: buckets carry an xxh3-64 checksum (v1: crc32, ~5x slower to compute, paid once per side per push)
FORMAT = "rollwise.weights/v2"
# Every tensor starts on a 64-byte boundary of its bucket, so the typed view of any dtype is aligned
# (torch requires storage_offset % itemsize == 0 for a dtype view) and sits on a cache line.
ALIGN = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def storage_key(t: Tensor) -> tuple | None:
    """Identity of a tensor's exact memory; equal keys mean the same values (tied weights)."""
    if t.numel() == 0:  # empty tensors all have data_ptr 0: never treat them as tied
        return None
    # data_ptr() is the storage's address plus the offset: the same identity as (storage, offset), without
    # building a storage object per tensor (that was most of planning a 420-tensor adapter's buckets).
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


# ---------------------------------------------------------------------------- the manifest

# A served model name that is also a plain path component ("../../x" is refused; so are "." and ".."): the
# characters of the pool's job names, which a LoRA job's adapter is renamed to.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class TensorSpec(BaseModel):
    """One tensor's place in its bucket: bytes [offset, offset + nbytes) of the flat buffer."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype without the "torch." prefix, e.g. "float32"
    offset: int
    nbytes: int


class BucketSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    nbytes: int  # the flat buffer's length, padding included
    tensors: tuple[TensorSpec, ...]
    # xxh3-64 of the bucket's tensors' bytes in manifest order (padding excluded: layout-independent);
    # None: the transport moves no bytes that could be damaged (in-process)
    checksum: int | None = None


class AdapterSpec(BaseModel):
    """A LoRA adapter update (rollwise.sync.adapters): the manifest's tensors are the adapter's
    `<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank], named by the base
    model's module names; the engine adds (x A^T) B^T * alpha / rank to each target's output and keeps
    its base weights."""

    model_config = ConfigDict(frozen=True)

    # the served adapter name (an OpenAI request's `model`); the vLLM engine also names a directory after it
    name: str
    rank: int = Field(ge=1, description="LoRA rank r (scaling alpha / r): at least 1")
    alpha: float = Field(gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False,
                         description=f"scaling = alpha / rank; finite, in (0, {MAX_LORA_ALPHA:g}]")
    target_modules: tuple[str, ...] = Field(min_length=1)
    # The policy of a single LoRA run: it serves requests that name no adapter, and its version is the
    # engine's policy version. Otherwise the adapter is served only to requests naming it.
    default: bool = False

    @field_validator("name")
    @classmethod
    def _a_plain_name(cls, name: str) -> str:
        if not ADAPTER_NAME.fullmatch(name) or not name.strip("."):
            raise ValueError(f"adapter name {name[:64]!r} must be 1-128 letters, digits, '_', '.' or '-', not only "
                             "dots (it names a served model, and a directory on disk)")
        return name

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class WeightManifest(BaseModel):
    """Everything a receiver needs to check an update before applying it."""

    model_config = ConfigDict(frozen=True)

    format: Literal["rollwise.weights/v2"] = FORMAT
    version: int
    tokenizer_fingerprint: str
    buckets: tuple[BucketSpec, ...]
    # name -> name it shares storage with on the trainer (tied embeddings): sent once, applied to both.
    aliases: dict[str, str] = {}
    total_bytes: int  # tensor bytes sent (no padding, aliases once)
    adapter: AdapterSpec | None = None  # set: a LoRA adapter, not the model's weights

    @model_validator(mode="after")
    def _consistent(self) -> WeightManifest:
        """A manifest read from disk or the wire must describe a sane layout before anyone allocates
        or slices by it."""
        names: set[str] = set()
        total = 0
        for position, bucket in enumerate(self.buckets):
            if bucket.index != position:
                raise ValueError(f"bucket {position} has index {bucket.index}")
            end = 0
            for t in bucket.tensors:
                itemsize = dtype_from_name(t.dtype).itemsize
                if t.nbytes != math.prod(t.shape) * itemsize:
                    raise ValueError(f"{t.name}: nbytes {t.nbytes} != shape {t.shape} x {itemsize} bytes")
                if t.offset < end or t.offset % ALIGN or t.offset + t.nbytes > bucket.nbytes:
                    raise ValueError(f"{t.name}: offset {t.offset} overlaps, is unaligned or leaves bucket {position}")
                if t.name in names:
                    raise ValueError(f"{t.name} appears twice")
                names.add(t.name)
                end = t.offset + t.nbytes
                total += t.nbytes
        if total != self.total_bytes:
            raise ValueError(f"total_bytes {self.total_bytes} != sum of tensor bytes {total}")
        for alias, source in self.aliases.items():
            if alias in names or source not in names:
                raise ValueError(f"alias {alias!r} -> {source!r} must name a new tensor and a sent one")
        return self

    def tensors(self) -> Iterator[TensorSpec]:
        for bucket in self.buckets:
            yield from bucket.tensors

    def spec_of(self, name: str) -> TensorSpec:
        """The spec of a sent tensor or of an alias (whose spec is its source's)."""
        name = self.aliases.get(name, name)
        return next(t for t in self.tensors() if t.name == name)


# ---------------------------------------------------------------------------- the receiving side


class WeightUpdateError(ValueError):
    """A weight update was rejected before anything was applied: the engine keeps serving its
    previous weights and version. `field`: the manifest field or tensor at fault (the HTTP servers'
    error `param`), when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ExpectedWeights:
    """What an engine's model holds: name -> (shape, dtype), and which names share memory there."""

    tensors: Mapping[str, tuple[tuple[int, ...], str]]
    ties: Mapping[str, str] = field(default_factory=dict)  # name -> earlier name with the same memory

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> ExpectedWeights:
        tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        ties: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            tensors[name] = (tuple(param.shape), dtype_name(param.dtype))
            key = storage_key(param)
            if key is not None and key in seen:
                ties[name] = seen[key]
            elif key is not None:
                seen[key] = name
        return cls(tensors, ties)
