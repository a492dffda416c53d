"""forward / forward_backward on the wire: the SDK's protobuf `ForwardBackwardRequest` (as
`tinker.proto.request_conv` writes it) -> a `ForwardBackwardBatch` of dense torch datums, and per-datum
logprobs + metrics -> the `ForwardBackwardOutput` bytes `tinker.proto.response_conv` reads.

A datum's `model_input` is a list of chunks; only `encoded_text` chunks (int32 token bytes) are taken,
concatenated in order. `loss_fn_inputs` are densified (sparse CSR: unlisted entries 0, as the SDK's own
`to_torch`), int32 widened to int64 and bfloat16 to float32; which inputs a loss needs, and their shapes
and values, are `losses.check_loss`'s business. Every malformed part is a `ServiceUserError` naming the
datum index and field, raised before anything runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from rollwise.service.errors import ServiceUserError
from rollwise.service.loss_specs import loss_spec
from rollwise.service.tensor_wire import decode_tensor, encode_batched_float32

# The SDK merges chunked outputs by the metric's reduction suffix (`name:reduction`).
METRIC_REDUCTIONS = frozenset({"sum", "mean", "min", "max", "slack", "hash2", "unique"})


@dataclass
class Datum:
    tokens: torch.Tensor  # int64 [N]: the model_input's encoded_text chunks concatenated
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs by name, dense, float32 or int64, shape as sent


@dataclass
class ForwardBackwardBatch:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float]  # loss_fn_config_v2 preferred over loss_fn_config
    forward_only: bool
    data: list[Datum]


def decode_forward_backward(body: bytes) -> ForwardBackwardBatch:
    """Parse a serialized `pb.ForwardBackwardRequest`. The loss name is checked here (an unknown one is
    refused as the request arrives); inputs against the loss are checked by `losses.check_loss`."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ServiceUserError(f"request body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if not msg.model_id:
        raise ServiceUserError("model_id is empty; send the model_id that create_model returned")
    loss_spec(msg.loss_fn)
    if not msg.data:
        raise ServiceUserError("data is empty; send at least one datum")
    return ForwardBackwardBatch(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_config=_loss_config(msg),
        forward_only=bool(msg.forward_only),
        data=[_datum(d, i) for i, d in enumerate(msg.data)],
    )


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    # The SDK dual-writes numbers into both maps and text into v2 only; v2 wins whenever it is set.
    if not msg.loss_fn_config_v2:
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    config: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise ServiceUserError(
                f"loss_fn_config[{key!r}] must be a number for loss {msg.loss_fn!r}, got {value.text!r}"
            )
        config[key] = float(value.number)
    return config


def _datum(msg: pb.Datum, index: int) -> Datum:
    where = f"data[{index}]"
    parts: list[np.ndarray] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            what = f"an {kind} chunk" if kind else "an empty chunk"
            raise ServiceUserError(
                f"{where}.model_input[{j}] is {what}; this server takes text (encoded_text chunks) only"
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ServiceUserError(
                f"{where}.model_input[{j}].encoded_text.tokens has {len(raw)} bytes, not whole int32 tokens"
            )
        parts.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")
    if tokens.size == 0:
        raise ServiceUserError(f"{where}.model_input has no tokens; each datum needs at least one")
    if tokens.min() < 0:
        raise ServiceUserError(f"{where}.model_input has a negative token id ({int(tokens.min())})")
    inputs = {
        name: decode_tensor(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        for name, tensor in msg.loss_fn_inputs.items()
    }
    return Datum(tokens=torch.from_numpy(tokens.astype(np.int64)), inputs=inputs)


def encode_forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """Serialize a `pb.ForwardBackwardOutput`: loss_fn_output_type "ArrayRecord", the per-datum `logprobs`
    as float32 BatchedTensors (one ArrayRecord per run of datums sharing a trailing shape: 2-D targets
    give [N, K] logprobs), and `metrics` (keys `name:reduction`, `loss:sum` always). A wrong key is a
    server bug: ValueError."""
    for key, value in metrics.items():
        name, sep, reduction = key.rpartition(":")
        if not sep or not name or ":" in name or reduction not in METRIC_REDUCTIONS:
            raise ValueError(f"metric {key!r} must be 'name:reduction' with one of {sorted(METRIC_REDUCTIONS)}")
        if not math.isfinite(value):
            raise ValueError(f"metric {key!r} is {value}, not a finite number")
    if "loss:sum" not in metrics:
        raise ValueError("metrics must include 'loss:sum'")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for run in _runs_by_trailing_shape(logprobs):
        record = msg.loss_fn_outputs.add(num_datums=len(run))
        record.fields["logprobs"].CopyFrom(encode_batched_float32(run))
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def _runs_by_trailing_shape(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    runs: list[list[torch.Tensor]] = []
    for t in tensors:
        if runs and tuple(runs[-1][-1].shape[1:]) == tuple(t.shape[1:]):
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs
