"""The Tinker service's wire codecs and built-in losses (rollwise.service.datums / losses / wire_proto),
driven through the SDK's own types and converters: requests are built with `tinker.types` and
`tinker.proto.request_conv` (what the client really sends); replies are read back with
`tinker.proto.response_conv` (what the client really reads). Loss values and gradients are checked
against hand computations in plain Python floats; every malformed request is refused as a user error
naming the datum and field."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from rollwise.service.datums import decode_forward_backward, encode_forward_backward_output
from rollwise.service.errors import ServiceUserError
from rollwise.service.losses import check_loss, compute_loss
from rollwise.service.wire_proto import encode_sample_response

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def sdk_request(data, loss_fn="cross_entropy", config=None, *, forward_only=False, seq_id=3) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="model-a",
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def datum(tokens, **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def f32(*values):
    return np.asarray(values, dtype=np.float32)


def i64(*values):
    return np.asarray(values, dtype=np.int64)


# --- wire: requests in ---------------------------------------------------------------------------------


def test_decode_sdk_request_chunks_config_and_sparse():
    targets_2d = torch.zeros(3, 4, dtype=torch.int64)
    targets_2d[0, 1], targets_2d[2, 3] = 7, 9
    weights_2d = (targets_2d != 0).float() * -0.5  # negative weights travel as they are
    sparse_targets = types.TensorData.from_torch_sparse(targets_2d)
    assert sparse_targets.sparse_crow_indices is not None  # the SDK really chose CSR
    chunked = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[8])]
        ),
        loss_fn_inputs={
            "target_tokens": sparse_targets,
            "weights": types.TensorData.from_torch_sparse(weights_2d),
        },
    )
    plain = datum([1, 2], target_tokens=i64(2, 3), logprobs=f32(-1, -2), advantages=f32(0.5, 0.5))
    body = sdk_request([chunked, plain], "ppo", {"clip_low_threshold": 0.9}, forward_only=True)
    batch = decode_forward_backward(body)
    assert (batch.model_id, batch.seq_id, batch.loss_fn, batch.forward_only) == ("model-a", 3, "ppo", True)
    assert batch.loss_config == {"clip_low_threshold": 0.9}
    assert batch.data[0].tokens.tolist() == [5, 6, 8] and batch.data[0].tokens.dtype == torch.int64
    assert torch.equal(batch.data[0].inputs["target_tokens"], targets_2d)
    assert torch.equal(batch.data[0].inputs["weights"], weights_2d)
    assert batch.data[1].inputs["logprobs"].dtype == torch.float32
    assert batch.data[1].inputs["advantages"].tolist() == [0.5, 0.5]


def test_decode_int32_bfloat16_and_config_v2_wins():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="dro")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([4, 5], dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=np.asarray([1, 2], dtype="<i4").tobytes(), dtype=pb.DTYPE_INT32, shape=[2]))
    bf16 = torch.tensor([-1.5, 0.3333], dtype=torch.bfloat16)
    d.loss_fn_inputs["advantages"].CopyFrom(
        pb.Tensor(dense=bf16.view(torch.int16).numpy().tobytes(), dtype=pb.DTYPE_BFLOAT16, shape=[2]))
    msg.loss_fn_config["beta"] = 1.0
    msg.loss_fn_config_v2["beta"].number = 2.0
    batch = decode_forward_backward(msg.SerializeToString())
    assert batch.loss_config == {"beta": 2.0}
    assert batch.data[0].inputs["target_tokens"].dtype == torch.int64
    assert batch.data[0].inputs["target_tokens"].tolist() == [1, 2]
    assert torch.equal(batch.data[0].inputs["advantages"], bf16.float())
    del msg.loss_fn_config_v2["beta"]
    assert decode_forward_backward(msg.SerializeToString()).loss_config == {"beta": 1.0}


def _raw_request(**tensor_overrides) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([4, 5, 6], dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=i64(1, 2, 3).tobytes(), dtype=pb.DTYPE_INT64, shape=[3])
    )
    for name, tensor in tensor_overrides.items():
        d.loss_fn_inputs[name].CopyFrom(tensor)
    return msg


def _csr(values, crow, col, shape, dtype=pb.DTYPE_FLOAT32) -> pb.Tensor:
    t = pb.Tensor(dtype=dtype, shape=shape)
    t.sparse_csr.values = np.asarray(values, dtype="<f4").tobytes()
    t.sparse_csr.crow_indices = i64(*crow).tobytes()
    t.sparse_csr.col_indices = i64(*col).tobytes()
    return t


def _with(mutate):
    msg = _raw_request()
    mutate(msg)
    return msg.SerializeToString()


def _dense(raw: bytes, dtype=pb.DTYPE_FLOAT32, shape=(3,)) -> bytes:
    return _raw_request(weights=pb.Tensor(dense=raw, dtype=dtype, shape=list(shape))).SerializeToString()


def _image_chunk(msg):
    second = msg.data.add()
    second.model_input.add().image.data = b"\x89PNG"


MALFORMED_WIRE = {
    "bytes": (b"\xff\xff\xff", "ForwardBackwardRequest protobuf"),
    "model_id": (_with(lambda m: setattr(m, "model_id", "")), "model_id"),
    "unknown loss": (_with(lambda m: setattr(m, "loss_fn", "hinge")), "loss_fn 'hinge'"),
    "custom loss": (_with(lambda m: setattr(m, "loss_fn", "custom")), "loss_fn 'custom'"),
    "stable_reinforce": (_with(lambda m: setattr(m, "loss_fn", "stable_reinforce")), "loss_fn 'stable_reinforce'"),
    "no data": (_with(lambda m: m.ClearField("data")), "data is empty"),
    "image chunk": (_with(_image_chunk), "data[1].model_input[0] is an image chunk"),
    "token bytes": (_with(lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x02\x03")),
                    "data[0].model_input[0].encoded_text.tokens"),
    "text config": (_with(lambda m: setattr(m.loss_fn_config_v2["beta"], "text", "x")), "loss_fn_config['beta']"),
    "dense bytes": (_dense(b"\0" * 5), "data[0].loss_fn_inputs['weights']: dense data has 5 bytes"),
    "dense shape": (_dense(f32(1, 2).tobytes()), "data[0].loss_fn_inputs['weights']: 2 values do not fill shape [3]"),
    "dtype": (_dense(f32(1, 2, 3).tobytes(), dtype=9), "data[0].loss_fn_inputs['weights']: dtype 9"),
    "csr crow": (_raw_request(weights=_csr([1.0], [0, 1], [0], [3, 2])).SerializeToString(),
                 "data[0].loss_fn_inputs['weights']: sparse_csr.crow_indices has 2 entries"),
    "csr col": (_raw_request(weights=_csr([1.0], [0, 1, 1, 1], [5], [3, 2])).SerializeToString(),
                "data[0].loss_fn_inputs['weights']: sparse_csr.col_indices must lie in [0, 2)"),
    "csr dup": (_raw_request(weights=_csr([1.0, 2.0], [0, 2, 2, 2], [1, 1], [3, 2])).SerializeToString(),
                "data[0].loss_fn_inputs['weights']: invalid sparse CSR tensor"),
    "csr 1-d": (_raw_request(weights=_csr([1.0], [0, 1], [0], [3])).SerializeToString(),
                "data[0].loss_fn_inputs['weights']: a sparse CSR tensor needs a 2-D shape"),
}


@pytest.mark.parametrize("case", list(MALFORMED_WIRE))
def test_malformed_request_refused_naming_field(case):
    body, expected = MALFORMED_WIRE[case]
    with pytest.raises(ServiceUserError) as info:
        decode_forward_backward(body)
    assert expected in str(info.value)
    assert info.value.category == "user"


MALFORMED_LOSS = {
    "missing target_tokens": ("cross_entropy", None, datum([1, 2], weights=f32(1, 1)),
                              "data[1].loss_fn_inputs['target_tokens'] is missing"),
    "missing advantages": ("ppo", None, datum([1, 2], target_tokens=i64(1, 2), logprobs=f32(0, 0)),
                           "data[1].loss_fn_inputs['advantages'] is missing"),
    "extra input": ("cross_entropy", None, datum([1, 2], target_tokens=i64(1, 2), advantages=f32(1, 1)),
                    "data[1].loss_fn_inputs['advantages'] is not an input of loss 'cross_entropy'"),
    "length": ("cross_entropy", None, datum([1, 2, 3], target_tokens=i64(1, 2)),
               "data[1].loss_fn_inputs['target_tokens'] has shape [2]"),
    "weights length": ("cross_entropy", None, datum([1, 2], target_tokens=i64(1, 2), weights=f32(1, 1, 1)),
                       "data[1].loss_fn_inputs['weights'] has shape [3]"),
    "nan": ("importance_sampling", None,
            datum([1, 2], target_tokens=i64(1, 2), logprobs=f32(0, 0), advantages=f32(1, math.nan)),
            "data[1].loss_fn_inputs['advantages'] holds NaN"),
    "float targets": ("cross_entropy", None, datum([1, 2], target_tokens=f32(1, 2)),
                      "data[1].loss_fn_inputs['target_tokens'] must be int64"),
    "int weights": ("cross_entropy", None, datum([1, 2], target_tokens=i64(1, 2), weights=i64(1, 1)),
                    "data[1].loss_fn_inputs['weights'] must be float32"),
    "negative token": ("cross_entropy", None, datum([1, 2], target_tokens=i64(1, -2)),
                       "data[1].loss_fn_inputs['target_tokens'] has a negative token id"),
    "config key": ("ppo", {"clip_ratio": 0.2}, None, "loss_fn_config['clip_ratio'] is not a key of loss 'ppo'"),
    "dro beta": ("dro", None, None, "loss_fn_config['beta'] is required"),
    "clip order": ("cispo", {"clip_low_threshold": 1.5}, None, "loss_fn_config['clip_low_threshold'] (1.5) is above"),
}


@pytest.mark.parametrize("case", list(MALFORMED_LOSS))
def test_loss_inputs_refused_naming_field(case):
    loss_fn, config, bad, expected = MALFORMED_LOSS[case]
    good = datum([1, 2], target_tokens=i64(1, 2), logprobs=f32(-1, -1), advantages=f32(1, 1))
    if loss_fn == "cross_entropy":
        good = datum([1, 2], target_tokens=i64(1, 2))
    batch = decode_forward_backward(sdk_request([good, bad or good], loss_fn, config))
    with pytest.raises(ServiceUserError) as info:
        check_loss(batch.loss_fn, batch.loss_config, batch.data)
    assert expected in str(info.value)


# --- losses against hand computations ------------------------------------------------------------------

# Two datums of different lengths: sums run over tokens AND datums (a mean would differ).
LP = [[-0.5, -1.2, -0.1], [-2.0, -0.3]]  # the model's current target logprobs
Q = [[-0.7, -1.0, -0.9], [-1.0, -0.35]]  # the sampler's
ADV = [[1.0, -2.0, 0.5], [-1.0, 3.0]]
LO, HI, BETA = 0.9, 1.1, 0.3


def _batch(loss_fn, config=None, **extra):
    data = []
    for i, (lp, q, a) in enumerate(zip(LP, Q, ADV)):
        inputs = {"target_tokens": i64(*range(1, len(lp) + 1)), "logprobs": f32(*q), "advantages": f32(*a)}
        inputs.update({k: f32(*v[i]) for k, v in extra.items()})
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": inputs["target_tokens"], "weights": f32(*a)}  # negative weights too
        data.append(datum(list(range(10, 10 + len(lp))), **inputs))
    batch = decode_forward_backward(sdk_request(data, loss_fn, config))
    check_loss(batch.loss_fn, batch.loss_config, batch.data)
    return batch


def _hand(loss_fn, mask=None):
    """(loss, dloss/dlp per token) from the SDK docs' formulas, in plain floats."""
    flat = [(lp, q, a) for d in range(len(LP)) for lp, q, a in zip(LP[d], Q[d], ADV[d])]
    clip = lambda r: min(max(r, LO), HI)  # noqa: E731
    if loss_fn == "cross_entropy":
        return -sum(lp * a for lp, q, a in flat), [-a for _, _, a in flat]
    if loss_fn == "importance_sampling":
        return -sum(math.exp(lp - q) * a for lp, q, a in flat), [-math.exp(lp - q) * a for lp, q, a in flat]
    if loss_fn == "ppo":
        loss, grad = 0.0, []
        for lp, q, a in flat:
            r = math.exp(lp - q)
            unclipped = r * a <= clip(r) * a
            loss -= min(r * a, clip(r) * a)
            grad.append(-r * a if unclipped else 0.0)
        return loss, grad
    if loss_fn == "cispo":
        return (-sum(clip(math.exp(lp - q)) * lp * a for lp, q, a in flat),
                [-clip(math.exp(lp - q)) * a for lp, q, a in flat])
    if loss_fn == "dro":
        return (-sum(lp * a - 0.5 * BETA * (lp - q) ** 2 for lp, q, a in flat),
                [-(a - BETA * (lp - q)) for lp, q, a in flat])
    assert loss_fn == "gspo"
    loss, grad = 0.0, []
    for d in range(len(LP)):
        m = mask[d] if mask else [1.0 if a != 0 else 0.0 for a in ADV[d]]
        diffs = [lp - q for lp, q, k in zip(LP[d], Q[d], m) if k != 0]
        s = math.exp(sum(diffs) / len(diffs))
        for a in ADV[d]:
            loss -= min(s * a, clip(s) * a)
            grad.append(-s * a if s * a <= clip(s) * a else 0.0)
    return loss, grad


CLIP_CONFIG = {"clip_low_threshold": LO, "clip_high_threshold": HI}
CASES = {
    "cross_entropy": ({}, None),
    "importance_sampling": ({}, None),
    "ppo": (CLIP_CONFIG, None),
    "cispo": (CLIP_CONFIG, None),
    "dro": ({"beta": BETA}, None),
    "gspo": (CLIP_CONFIG, None),
    "gspo masked": (CLIP_CONFIG, [[0.0, 1.0, 1.0], [1.0, 0.0]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_value_and_gradient_match_hand_computation(case):
    loss_fn = case.split()[0]
    config, mask = CASES[case]
    batch = _batch(loss_fn, config, **({"sequence_ratio_mask": mask} if mask else {}))
    logprobs = [torch.tensor(lp, dtype=torch.float32, requires_grad=True) for lp in LP]
    loss, metrics = compute_loss(batch.loss_fn, batch.loss_config, logprobs, batch.data)
    loss.backward()
    want_loss, want_grad = _hand(loss_fn, mask)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert metrics == {"loss:sum": pytest.approx(want_loss, rel=1e-5, abs=1e-6)}
    got_grad = torch.cat([lp.grad for lp in logprobs]).tolist()
    assert got_grad == pytest.approx(want_grad, rel=1e-5, abs=1e-6)


def test_clipping_bites_and_per_token_thresholds_win():
    # The hand data really crosses the bounds (else ppo == importance_sampling would pass by accident).
    ratios = [math.exp(lp - q) for d in range(2) for lp, q in zip(LP[d], Q[d])]
    assert any(r > HI for r in ratios) and any(r < LO for r in ratios)
    # Per-token thresholds in loss_fn_inputs override the config: wide open bounds give the IS loss.
    wide = {"clip_low_threshold": [[0.0] * 3, [0.0] * 2], "clip_high_threshold": [[1e6] * 3, [1e6] * 2]}
    batch = _batch("ppo", CLIP_CONFIG, **wide)
    logprobs = [torch.tensor(lp) for lp in LP]
    loss, _ = compute_loss(batch.loss_fn, batch.loss_config, logprobs, batch.data)
    assert loss.item() == pytest.approx(_hand("importance_sampling")[0], rel=1e-5)


def test_ppo_default_thresholds_are_0_8_and_1_2():
    batch = _batch("ppo")
    explicit = _batch("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    logprobs = [torch.tensor(lp) for lp in LP]
    assert compute_loss("ppo", batch.loss_config, logprobs, batch.data)[0].item() == pytest.approx(
        compute_loss("ppo", explicit.loss_config, logprobs, explicit.data)[0].item())


def test_cross_entropy_2d_targets_and_default_weights():
    # [N, K] targets (the SDK's forward_backward_custom example): weights default to 1, logprobs [N, K].
    batch = decode_forward_backward(sdk_request([datum([1], target_tokens=[[2, 3]])]))
    check_loss(batch.loss_fn, batch.loss_config, batch.data)
    lp = torch.tensor([[-0.25, -1.5]], requires_grad=True)
    loss, _ = compute_loss(batch.loss_fn, batch.loss_config, [lp], batch.data)
    loss.backward()
    assert loss.item() == pytest.approx(1.75) and lp.grad.tolist() == [[-1.0, -1.0]]


# --- wire: replies out, read by the SDK ----------------------------------------------------------------


def test_forward_backward_output_round_trips_through_sdk():
    flat = [torch.tensor([-0.5, -1.25, -3.0]), torch.tensor([-0.1])]
    two_d = torch.tensor([[-0.5, -2.0]])
    body = encode_forward_backward_output(flat + [two_d], {"loss:sum": 4.5, "tokens:sum": 6.0})
    out = response_conv.deserialize_forward_backward_output(body)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == {"loss:sum": 4.5, "tokens:sum": 6.0}
    got = [o["logprobs"] for o in out.loss_fn_outputs]
    assert [g.dtype for g in got] == ["float32"] * 3
    assert [g.shape for g in got] == [[3], [1], [1, 2]]
    for g, want in zip(got, flat + [two_d]):
        assert np.array_equal(g.to_numpy().reshape(want.shape), want.numpy())
    with pytest.raises(ValueError, match="name:reduction"):
        encode_forward_backward_output(flat, {"loss:sum": 1.0, "loss": 1.0})
    with pytest.raises(ValueError, match="loss:sum"):
        encode_forward_backward_output(flat, {"tokens:sum": 1.0})


def test_sample_response_round_trips_through_sdk():
    body = encode_sample_response(
        [([11, 12, 2], [-0.5, -0.25, -0.125], "stop"), ([13], [-1.5], "length")],
        prompt_logprobs=[None, -1.0, float("nan"), -2.5],
    )
    out = response_conv.deserialize_sample_response(body)
    assert [s.stop_reason for s in out.sequences] == ["stop", "length"]
    assert [s.tokens for s in out.sequences] == [[11, 12, 2], [13]]
    assert [s.logprobs for s in out.sequences] == [[-0.5, -0.25, -0.125], [-1.5]]
    assert out.prompt_logprobs == [None, -1.0, None, -2.5]
    no_prompt = encode_sample_response([([1], [-0.5], "stop")])
    assert response_conv.deserialize_sample_response(no_prompt).prompt_logprobs is None
    with pytest.raises(ValueError, match="sequence 0"):
        encode_sample_response([([1, 2], [-0.5], "stop")])
