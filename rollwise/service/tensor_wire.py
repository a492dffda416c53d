"""The SDK's protobuf tensors <-> torch tensors. Read side: a `pb.Tensor` (dense or sparse CSR; float32,
bfloat16, int32 or int64, little-endian raw bytes) becomes a dense float32 or int64 tensor, exactly as
the SDK's own `TensorData.to_torch` would densify it (unlisted CSR entries are 0). Write side: per-datum
float32 tensors become one `pb.BatchedTensor` (concatenated bytes, int64 BYTE offsets), which
`tinker.proto.response_conv` slices back per datum. Anything malformed is a `ServiceUserError` naming
`where` (the datum and field) and what is wrong."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from rollwise.service.errors import ServiceUserError

# Wire dtype -> (numpy dtype of the raw bytes, torch dtype handed on). bfloat16 travels as uint16 (the
# upper half of a float32) and int32 is widened: the public dtypes are float32 and int64 only.
_WIRE_DTYPES: dict[int, tuple[np.dtype, torch.dtype]] = {
    pb.DTYPE_FLOAT32: (np.dtype("<f4"), torch.float32),
    pb.DTYPE_BFLOAT16: (np.dtype("<u2"), torch.float32),
    pb.DTYPE_INT64: (np.dtype("<i8"), torch.int64),
    pb.DTYPE_INT32: (np.dtype("<i4"), torch.int64),
}
_DTYPE_NAMES = "float32 (1), int64 (2), int32 (3) or bfloat16 (4)"


def _array(raw: bytes, dtype: np.dtype, where: str, part: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise ServiceUserError(
            f"{where}: {part} has {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte elements"
        )
    return np.frombuffer(raw, dtype=dtype)


def _to_torch(values: np.ndarray, wire_dtype: int) -> torch.Tensor:
    if wire_dtype == pb.DTYPE_BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    target = _WIRE_DTYPES[wire_dtype][1]
    return torch.from_numpy(values.copy()).to(target)


def decode_tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    """One `pb.Tensor` -> a dense tensor (float32 or int64) of the shape sent. No shape sent: 1-D."""
    if msg.dtype not in _WIRE_DTYPES:
        raise ServiceUserError(f"{where}: dtype {msg.dtype} is not one of {_DTYPE_NAMES}")
    np_dtype = _WIRE_DTYPES[msg.dtype][0]
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise ServiceUserError(f"{where}: shape {shape} has a negative dimension")
    if msg.HasField("sparse_csr"):
        return _decode_csr(msg, np_dtype, shape, where)
    values = _array(msg.dense, np_dtype, where, "dense data")
    if not shape:
        shape = [values.size]
    if values.size != math.prod(shape):
        raise ServiceUserError(
            f"{where}: {values.size} values do not fill shape {shape} ({math.prod(shape)} expected)"
        )
    return _to_torch(values, msg.dtype).reshape(shape)


def _decode_csr(msg: pb.Tensor, np_dtype: np.dtype, shape: list[int], where: str) -> torch.Tensor:
    csr = msg.sparse_csr
    if len(shape) != 2:
        raise ServiceUserError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    values = _array(csr.values, np_dtype, where, "sparse_csr.values")
    crow = _array(csr.crow_indices, np.dtype("<i8"), where, "sparse_csr.crow_indices")
    col = _array(csr.col_indices, np.dtype("<i8"), where, "sparse_csr.col_indices")
    if len(crow) != rows + 1:
        raise ServiceUserError(
            f"{where}: sparse_csr.crow_indices has {len(crow)} entries; shape {shape} needs {rows + 1}"
        )
    if len(col) != len(values):
        raise ServiceUserError(
            f"{where}: sparse_csr has {len(values)} values but {len(col)} col_indices (one per value)"
        )
    if crow[0] != 0 or crow[-1] != len(values) or np.any(np.diff(crow) < 0):
        raise ServiceUserError(
            f"{where}: sparse_csr.crow_indices must rise from 0 to the number of values ({len(values)})"
        )
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise ServiceUserError(f"{where}: sparse_csr.col_indices must lie in [0, {cols})")
    try:
        # torch checks what is left (column order and uniqueness within a row), as the SDK's to_torch does.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            with torch.sparse.check_sparse_tensor_invariants():
                sparse = torch.sparse_csr_tensor(
                    torch.from_numpy(crow.copy()),
                    torch.from_numpy(col.copy()),
                    _to_torch(values, msg.dtype),
                    (rows, cols),
                    check_invariants=True,
                )
                return sparse.to_dense()
    except RuntimeError as exc:
        raise ServiceUserError(f"{where}: invalid sparse CSR tensor: {str(exc).splitlines()[0]}") from exc


def encode_batched_float32(tensors: list[torch.Tensor]) -> pb.BatchedTensor:
    """Per-datum tensors of one trailing shape (all dims after the first) -> a float32 BatchedTensor."""
    trailing = {tuple(t.shape[1:]) for t in tensors}
    if len(trailing) > 1:
        raise ValueError(f"one BatchedTensor holds one trailing shape, got {sorted(trailing)}")
    arrays = [t.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4") for t in tensors]
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    msg = pb.BatchedTensor()
    msg.dtype = pb.DTYPE_FLOAT32
    msg.data = b"".join(a.tobytes() for a in arrays)
    msg.offsets = offsets.tobytes()
    msg.trailing_shape.extend(next(iter(trailing), ()))
    return msg
