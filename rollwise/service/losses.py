"""The Tinker API's built-in losses, exactly as the SDK documents them: SUMS over tokens and datums,
never means. With lp = the current logprob of each target token (what the model computes, with grad),
q = the `logprobs` input (the sampler's), A = `advantages`, r = exp(lp - q):

- cross_entropy        -sum(w * lp)             w = `weights` (any float: forward_backward_custom sends
                                                    w = -dC/dlp, often negative), default 1
- importance_sampling  -sum(r * A)
- ppo                  -sum(min(r * A, clip(r, lo, hi) * A))       lo/hi = clip_low/high_threshold
- cispo                -sum(sg(clip(r, lo, hi)) * lp * A)
- dro                  -sum(lp * A - beta/2 * (lp - q)^2)
- gspo                 GSPO-token (tinker-docs "GSPO"): per datum, s = exp(mean over the masked tokens of
                       sg(lp) - q); every token's ratio r_t = exp(log s + lp - sg(lp)) (value s, the
                       gradient of its own lp); then PPO's min/clip on r_t. An empty mask gives s = 1.

`check_loss` refuses (ServiceUserError, naming datum and field) everything a request can get wrong before
any forward runs; `compute_loss` assumes it passed. Log-ratios are bounded at train.policy_loss's
MAX_LOG_RATIO, so a token the sampler gave ~0 probability yields a finite loss instead of inf/NaN."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rollwise.service.datums import Datum
from rollwise.service.errors import ServiceUserError
from rollwise.service.loss_specs import INT_INPUTS, LossSpec, loss_spec
from rollwise.train.policy_loss import MAX_LOG_RATIO


def resolved_config(loss_fn: str, loss_config: dict[str, float]) -> dict[str, float]:
    """The loss's config with defaults filled in; unknown, missing or non-finite keys are user errors."""
    spec = loss_spec(loss_fn)
    unknown = sorted(set(loss_config) - set(spec.config))
    if unknown:
        takes = ", ".join(spec.config) or "no keys"
        raise ServiceUserError(f"loss_fn_config[{unknown[0]!r}] is not a key of loss {loss_fn!r}; it takes {takes}")
    config: dict[str, float] = {}
    for key, default in spec.config.items():
        value = loss_config.get(key, default)
        if value is None:
            raise ServiceUserError(f"loss_fn_config[{key!r}] is required for loss {loss_fn!r}")
        if not math.isfinite(value):
            raise ServiceUserError(f"loss_fn_config[{key!r}] is {value}; it must be a finite number")
        config[key] = float(value)
    if config.get("clip_low_threshold", 0.0) > config.get("clip_high_threshold", math.inf):
        raise ServiceUserError(
            f"loss_fn_config['clip_low_threshold'] ({config['clip_low_threshold']}) is above "
            f"loss_fn_config['clip_high_threshold'] ({config['clip_high_threshold']}); they bound the ratio"
        )
    return config


def check_loss(loss_fn: str, loss_config: dict[str, float], data: list[Datum]) -> None:
    """Everything a forward(_backward) request can get wrong about its loss, before anything is computed:
    unknown loss or config key, missing/extra input, wrong dtype, length or shape mismatch, NaN/inf."""
    spec = loss_spec(loss_fn)
    resolved_config(loss_fn, loss_config)
    for i, datum in enumerate(data):
        _check_datum(loss_fn, spec, datum, f"data[{i}]")


def _check_datum(loss_fn: str, spec: LossSpec, datum: Datum, where: str) -> None:
    names = set(datum.inputs)
    missing = [n for n in spec.required if n not in names]
    if missing:
        raise ServiceUserError(
            f"{where}.loss_fn_inputs[{missing[0]!r}] is missing; loss {loss_fn!r} takes {spec.describe_inputs()}"
        )
    extra = sorted(names - set(spec.required) - set(spec.optional))
    if extra:
        raise ServiceUserError(
            f"{where}.loss_fn_inputs[{extra[0]!r}] is not an input of loss {loss_fn!r}; "
            f"it takes {spec.describe_inputs()}"
        )
    n_tokens = int(datum.tokens.numel())
    targets = datum.inputs["target_tokens"]
    field = f"{where}.loss_fn_inputs['target_tokens']"
    if targets.dtype != torch.int64:
        raise ServiceUserError(f"{field} must be int64 (or int32) token ids, got {_dtype_name(targets)}")
    if targets.dim() not in (1, 2) or targets.shape[0] != n_tokens:
        raise ServiceUserError(
            f"{field} has shape {list(targets.shape)}; it needs [N] or [N, K] with N = {n_tokens}, "
            f"the length of {where}.model_input (position i predicts token i + 1)"
        )
    if targets.numel() and int(targets.min()) < 0:
        raise ServiceUserError(f"{field} has a negative token id ({int(targets.min())})")
    for name, value in datum.inputs.items():
        if name in INT_INPUTS:
            continue
        field = f"{where}.loss_fn_inputs[{name!r}]"
        if value.dtype != torch.float32:
            raise ServiceUserError(f"{field} must be float32 (or bfloat16), got {_dtype_name(value)}")
        if value.shape != targets.shape:
            raise ServiceUserError(
                f"{field} has shape {list(value.shape)}; it must match target_tokens' {list(targets.shape)}"
            )
        if not bool(torch.isfinite(value).all()):
            raise ServiceUserError(f"{field} holds NaN or inf; every value must be a finite number")
    if "clip_low_threshold" in names and "clip_high_threshold" in names:
        if bool((datum.inputs["clip_low_threshold"] > datum.inputs["clip_high_threshold"]).any()):
            raise ServiceUserError(
                f"{where}.loss_fn_inputs['clip_low_threshold'] is above 'clip_high_threshold' at some token"
            )


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def compute_loss(
    loss_fn: str, loss_config: dict[str, float], logprobs: list[Tensor], data: list[Datum]
) -> tuple[Tensor, dict[str, float]]:
    """The scalar loss (sum over tokens and datums) and its metrics (`loss:sum`). `logprobs[i]`: float32,
    the shape of data[i]'s target_tokens, log p(target_tokens[i][t] | tokens[i][:t+1]), with grad."""
    if len(logprobs) != len(data):
        raise ValueError(f"{len(logprobs)} logprob tensors for {len(data)} datums")
    for i, (lp, datum) in enumerate(zip(logprobs, data, strict=True)):
        if lp.shape != datum.inputs["target_tokens"].shape:
            raise ValueError(f"logprobs[{i}] has shape {list(lp.shape)}, target_tokens "
                             f"{list(datum.inputs['target_tokens'].shape)}")
    config = resolved_config(loss_fn, loss_config)
    if not data:
        zero = torch.zeros((), dtype=torch.float32)
        return zero, {"loss:sum": 0.0}
    lp = torch.cat([t.reshape(-1) for t in logprobs])
    inputs = _FlatInputs(data, lp)
    loss = _LOSSES[loss_fn](lp, inputs, config)
    return loss, {"loss:sum": float(loss.detach())}


class _FlatInputs:
    """The datums' float inputs flattened and concatenated in the logprobs' order, on their device."""

    def __init__(self, data: list[Datum], lp: Tensor) -> None:
        self._data = data
        self._device = lp.device
        self.sizes = [int(d.inputs["target_tokens"].numel()) for d in data]

    def get(self, name: str, default: float | None = None) -> Tensor:
        parts = []
        for datum, size in zip(self._data, self.sizes, strict=True):
            value = datum.inputs.get(name)
            if value is None:
                if default is None:
                    raise KeyError(name)
                value = torch.full((size,), default, dtype=torch.float32)
            parts.append(value.reshape(-1).to(torch.float32))
        return torch.cat(parts).to(self._device)

    def per_datum(self, name: str, fallback: str) -> list[Tensor]:
        """Each datum's `name` input flattened, or its `fallback` input where it has no `name`."""
        return [d.inputs.get(name, d.inputs[fallback]).reshape(-1) for d in self._data]


def _ratio(lp: Tensor, q: Tensor) -> Tensor:
    return torch.exp(torch.clamp(lp - q, max=MAX_LOG_RATIO))


def _clip_bounds(inputs: _FlatInputs, config: dict[str, float]) -> tuple[Tensor, Tensor]:
    # Per-token thresholds (loss_fn_inputs) win over the config's; check_loss allows them per datum.
    return (
        inputs.get("clip_low_threshold", config["clip_low_threshold"]),
        inputs.get("clip_high_threshold", config["clip_high_threshold"]),
    )


def _cross_entropy(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    return -(lp * inputs.get("weights", 1.0)).sum()


def _importance_sampling(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    return -(_ratio(lp, inputs.get("logprobs")) * inputs.get("advantages")).sum()


def _ppo_objective(ratio: Tensor, adv: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    return torch.minimum(ratio * adv, clipped * adv)


def _ppo(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    lo, hi = _clip_bounds(inputs, config)
    return -_ppo_objective(_ratio(lp, inputs.get("logprobs")), inputs.get("advantages"), lo, hi).sum()


def _cispo(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    lo, hi = _clip_bounds(inputs, config)
    ratio = _ratio(lp, inputs.get("logprobs"))
    clipped = torch.minimum(torch.maximum(ratio, lo), hi).detach()
    return -(clipped * lp * inputs.get("advantages")).sum()


def _dro(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    q, adv = inputs.get("logprobs"), inputs.get("advantages")
    return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()


def _gspo(lp: Tensor, inputs: _FlatInputs, config: dict[str, float]) -> Tensor:
    q, adv = inputs.get("logprobs"), inputs.get("advantages")
    # Per datum: the masked tokens (sequence_ratio_mask != 0; without it, the non-zero advantages).
    in_ratio = torch.cat(inputs.per_datum("sequence_ratio_mask", "advantages")).ne(0).to(lp.device)
    segment = torch.repeat_interleave(
        torch.arange(len(inputs.sizes), device=lp.device), torch.tensor(inputs.sizes, device=lp.device)
    )
    token_log_ratio = torch.where(in_ratio, lp.detach() - q, torch.zeros_like(lp))
    sums = torch.zeros(len(inputs.sizes), dtype=lp.dtype, device=lp.device).index_add(0, segment, token_log_ratio)
    counts = torch.zeros_like(sums).index_add(0, segment, in_ratio.to(lp.dtype))
    seq_log_ratio = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    log_ratio = torch.clamp(seq_log_ratio[segment], max=MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio + lp - lp.detach())
    lo = torch.full_like(lp, config["clip_low_threshold"])
    hi = torch.full_like(lp, config["clip_high_threshold"])
    return -_ppo_objective(ratio, adv, lo, hi).sum()


_LOSSES = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
}
