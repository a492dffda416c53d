"""Model FLOPs of an RL loop: generation, training and evaluation, counted from token counts.

The count is of *model* FLOPs (the work the algorithm needs, as in MFU), not of what the hardware
happened to execute: padding, recomputation (activation checkpointing) and regenerated samples
are not counted, and work the loop legitimately avoids is not counted either (prefix-cache hits,
a group's shared prompt computed once, zero-advantage samples the trainer skips).

One forward over a token position t of a dense decoder costs
    2 · N_body                          every weight matrix of the layers, once per position
  + 4 · layers · heads · head_dim · (t + 1)   attention scores and values against t + 1 keys (causal)
  + 2 · hidden · vocab                  the LM head, only at positions whose next-token logits are used
A backward costs twice its forward, so a trained position costs 3x its forward (the "6N" rule).

Where logits are needed: generation samples one token per position it computes logits for (the
last prompt position, then every decode step), and the trainer applies the LM head only at the
positions that predict trained tokens (rollwise.train.logprobs). The last token of a sequence is
never fed forward (nothing is predicted from it), so a sequence of P + R tokens needs positions
0 .. P + R - 2.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollwise.types.model_shape import ModelShape, config_field
from rollwise.types.microbatch import MicroBatchSettings, chunk_samples, prompt_groups
from rollwise.types.sample import Sample

# Config fields that mark a mixture of experts: the dense formula would overcount its MLP work.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class DenseModel:
    """A dense decoder-only transformer's shape, with the FLOPs its forwards cost."""

    shape: ModelShape

    @classmethod
    def from_hf_config(cls, config: Any) -> DenseModel:
        """From a Hugging Face model config (an object with attributes, or its to_dict())."""
        get = config_field(config)
        for field in _MOE_FIELDS:
            if get(field):
                raise ValueError(f"model config has {field}={get(field)!r}: a mixture of experts is not a dense "
                                 "model, and rollwise.observe.flops counts dense decoders only")
        return cls(ModelShape.from_hf(config))

    @property
    def body_params(self) -> int:
        """Weights of the layers' matrix multiplies (norms and biases are negligible and not counted)."""
        m = self.shape
        attention = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)  # q, o; k, v
        mlp = (3 if m.gated_mlp else 2) * m.hidden_size * m.intermediate_size
        return m.num_layers * (attention + mlp)

    @property
    def head_params(self) -> int:
        return self.shape.hidden_size * self.shape.vocab_size

    def forward_flops(self, start: int, end: int, logits: int) -> float:
        """One forward over positions start .. end - 1 of a sequence (keys 0 .. end - 1 are in the
        KV cache or computed alongside), with the LM head at `logits` of those positions."""
        return sum(self.forward_parts(start, end, logits))

    def forward_parts(self, start: int, end: int, logits: int) -> tuple[float, float]:
        """forward_flops as (weight matmuls, attention): their backwards differ when weights are frozen."""
        weights = 2.0 * self.head_params * logits
        if end <= start:
            return weights, 0.0
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum of (t + 1) over the positions
        m = self.shape
        return weights + 2.0 * self.body_params * (end - start), 4.0 * m.num_layers * m.num_heads * m.head_dim * keys


@dataclass
class Flops:
    """Model FLOPs by phase (what a step, an evaluation or a run did)."""

    generate: float = 0.0
    train: float = 0.0
    eval: float = 0.0

    @property
    def total(self) -> float:
        return self.generate + self.train + self.eval

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.generate + other.generate, self.train + other.train, self.eval + other.eval)


def generation_flops(model: DenseModel, samples: Iterable[Sample]) -> float:
    """Prefill of each sample's uncached prompt tokens and one decode forward per sampled token.

    A multi-turn sample's template and tool tokens (loss mask 0) are prefilled, not sampled: they are
    among the positions computed but take no logits."""
    total = 0.0
    for s in samples:
        cached = int(s.extra.get("cached_prompt_tokens", 0) or 0)
        end = len(s.prompt_ids) + len(s.response_ids) - 1  # the last sampled token is not fed forward
        total += model.forward_flops(min(cached, end), end, logits=s.trained_tokens)
    return total


def trained_samples(samples: list[Sample], skip_zero_advantage: bool) -> list[Sample]:
    """The samples the trainer computes on (rollwise.train.trainer.GRPOTrainer.train_step): where a
    zero-advantage sample adds nothing to the gradient (TrainConfig.skips_zero_advantage), it is skipped."""
    return [s for s in samples if not skip_zero_advantage or s.advantage != 0.0]


def _group_spans(group: list[Sample]) -> list[tuple[int, int, int]]:
    prompt = len(group[0].prompt_ids)
    # the prompt's last position predicts the first response token: its logits count with the response
    return [(0, prompt, 0)] + [(prompt, prompt + len(s.response_ids) - 1, s.trained_tokens) for s in group]


def _micro_batch_forward(model: DenseModel, share: bool, chunk: list[Sample]) -> tuple[float, float]:
    """One forward over a micro-batch, (weight matmuls, attention): a shared prompt once, or each
    sample's whole sequence."""
    if share:  # one group, or several (train.pack_groups): each prompt once
        spans = [span for group in prompt_groups(chunk) for span in _group_spans(group)]
    else:
        spans = [(0, len(s.prompt_ids) + len(s.response_ids) - 1, s.trained_tokens) for s in chunk]
    parts = [model.forward_parts(*span) for span in spans]
    return sum(w for w, _ in parts), sum(a for _, a in parts)


def training_flops(model: DenseModel, samples: list[Sample], settings: MicroBatchSettings, *,
                   updates: int = 1, kl_reference: bool = False, frozen_weights: bool = False,
                   skip_zero_advantage: bool | None = None) -> float:
    """Forward + backward (3x the forward) per optimizer update over the trained samples, plus the
    extra forwards: the frozen reference model's (KL term) per update, or, when no sample carries a
    gradient, the one no-grad forward the trainer still runs to measure entropy and mismatch.

    frozen_weights (LoRA: the base model's weights take no gradient): the backward of a weight matmul
    is then the input gradient alone (1x its forward, not 2x); attention's backward stays 2x. The
    adapters' own FLOPs (rank << hidden) are not counted."""
    skip = not kl_reference if skip_zero_advantage is None else skip_zero_advantage  # TrainConfig.skips_zero_advantage
    trained = trained_samples(samples, skip)
    if not trained:
        share, chunks = chunk_samples(samples, settings)
        return sum(_micro_batch_forward(model, share, chunks[0])) if chunks else 0.0
    share, chunks = chunk_samples(trained, settings)
    parts = [_micro_batch_forward(model, share, chunk) for chunk in chunks]
    weights, attention = sum(w for w, _ in parts), sum(a for _, a in parts)
    per_update = (2.0 if frozen_weights else 3.0) * weights + 3.0 * attention
    if kl_reference:
        per_update += weights + attention
    return updates * per_update


def utilisation(flops: float, seconds: float, peak_flops: float) -> float | None:
    """Model-FLOPs utilisation: FLOPs done per second over the peak; None when no time passed."""
    if seconds <= 0 or peak_flops <= 0:
        return None
    return flops / (seconds * peak_flops)
