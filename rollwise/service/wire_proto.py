"""Encode sampling results as the SDK's protobuf `SampleResponse` (the bytes `retrieve_future` returns
when the client asks for `application/x-protobuf`). Arrays are little-endian raw bytes: tokens int32,
logprobs float32, exactly what `tinker.proto.response_conv.deserialize_sample_response` reads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

StopReason = Literal["stop", "length"]

_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class SampledSequenceOut(NamedTuple):
    """One sampled sequence: its tokens (incl. the stop token / stop-string tokens that ended it), the
    sampled logprob of each token, and why it ended. A plain 3-tuple in this order works too."""

    tokens: Sequence[int]
    logprobs: Sequence[float]
    stop_reason: StopReason


def encode_sample_response(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], StopReason]],
    prompt_logprobs: Sequence[float | None] | None = None,
) -> bytes:
    """Serialize a `pb.SampleResponse`. `prompt_logprobs` (when asked for): one value per prompt token,
    None or NaN where undefined (position 0); it goes on the wire as NaN, which the SDK reads back as NaN.
    A wrong internal value (length mismatch, unknown stop reason) is a server bug: ValueError."""
    msg = pb.SampleResponse()
    for i, (tokens, logprobs, stop_reason) in enumerate(sequences):
        if len(tokens) != len(logprobs):
            raise ValueError(
                f"sequence {i}: {len(tokens)} tokens but {len(logprobs)} logprobs (one per token expected)"
            )
        if stop_reason not in _STOP_REASON:
            raise ValueError(f"sequence {i}: stop_reason {stop_reason!r} is not 'stop' or 'length'")
        seq = msg.sequences.add()
        seq.stop_reason = _STOP_REASON[stop_reason]
        seq.tokens = np.asarray(tokens, dtype="<i4").tobytes()
        seq.logprobs = np.asarray(logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        values = [math.nan if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return msg.SerializeToString()
