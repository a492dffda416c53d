"""What each built-in loss of the Tinker API takes: its `loss_fn_inputs` (required and optional) and its
`loss_fn_config` keys with their defaults. The one table both the request decoder (unknown loss, text
config values: refused as the request arrives) and `losses.check_loss` (inputs, shapes, values) read.

Inputs and keys follow the SDK 0.38 docs (tinker-docs "Loss functions"); where the SDK leaves a default
open, the choice is written here and in the README:
- ppo, cispo, gspo: `clip_low_threshold` / `clip_high_threshold` are ratio bounds (not epsilons), default
  0.8 / 1.2 (the SDK's documented PPO default). ppo and cispo also take them per token as
  `loss_fn_inputs` (the SDK's Datum types them as float32 inputs), which win over the config.
- dro: `beta` has no documented default, so it is required.
- gspo: `sequence_ratio_mask` marks the tokens whose mean log-ratio makes the sequence ratio; without it,
  the tokens with a non-zero advantage (the sampled ones, in the cookbook's datums)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollwise.service.errors import ServiceUserError

CLIP_DEFAULTS: dict[str, float | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")
RL_INPUTS = ("target_tokens", "logprobs", "advantages")
INT_INPUTS = frozenset({"target_tokens"})  # every other input is float32


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)  # key -> default; None: required

    def describe_inputs(self) -> str:
        opt = f" (optional: {', '.join(self.optional)})" if self.optional else ""
        return ", ".join(self.required) + opt


LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(required=("target_tokens",), optional=("weights",)),
    "importance_sampling": LossSpec(required=RL_INPUTS),
    "ppo": LossSpec(required=RL_INPUTS, optional=CLIP_INPUTS, config=CLIP_DEFAULTS),
    "cispo": LossSpec(required=RL_INPUTS, optional=CLIP_INPUTS, config=CLIP_DEFAULTS),
    "dro": LossSpec(required=RL_INPUTS, config={"beta": None}),
    "gspo": LossSpec(required=RL_INPUTS, optional=("sequence_ratio_mask",), config=CLIP_DEFAULTS),
}

# Names the SDK accepts that this server does not implement, with what the caller can do instead.
_NOT_IMPLEMENTED = {
    "stable_reinforce": "it needs sampling stability info recorded by the server, which rollwise does not keep",
    "custom": "server-side custom losses (create_custom_loss) are not supported; "
    "forward_backward_custom with a local Python loss function works",
}


def loss_spec(loss_fn: str) -> LossSpec:
    """The spec of a built-in loss; anything else is a user error that lists the supported ones."""
    spec = LOSS_SPECS.get(loss_fn)
    if spec is not None:
        return spec
    known = ", ".join(LOSS_SPECS)
    why = _NOT_IMPLEMENTED.get(loss_fn)
    reason = f"not supported by this server: {why}" if why else "unknown"
    raise ServiceUserError(f"loss_fn {loss_fn!r} is {reason}; use one of: {known}")
