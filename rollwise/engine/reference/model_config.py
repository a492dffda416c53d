"""The architecture facts the reference decoder needs, normalised from a Hugging Face config.

Which architectures exist is rollwise.model.architectures' table; this module turns one config of them
into the switches the decoder (rollwise.engine.reference.model) reads: biases, QK-norm, tied embeddings,
experts, and RoPE's inverse frequencies.

RoPE scaling as configured: the inverse frequencies and the cos/sin scale (YaRN's attention factor) come
from transformers' own RoPE functions for the config's type, so they equal the trainer's bit for bit.
Types whose frequencies change with the sequence length during a forward (`dynamic`, `longrope`) are
refused: a KV cache holds keys rotated at the frequencies of the step that wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rollwise.model.architectures import check_architecture
from rollwise.types.model_shape import ModelShape

# RoPE types computed once from the config (transformers' names); "default" is plain RoPE.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the decoder needs, normalised from an HF config."""

    model_type: str
    shape: ModelShape  # layers, widths, heads, vocabulary: read as the FLOP counter reads them
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # Mistral's window; caches longer than it are refused
    num_experts: int = 0  # Mixtral: experts per layer (0: a dense MLP)
    top_k: int = 0  # Mixtral: experts each token is routed to
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # RoPE as configured: inverse frequencies (head_dim / 2 of them; None: default RoPE from rope_theta)
    # and the factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_scaling: float = 1.0

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        model_type = check_architecture(getattr(config, "architectures", None), getattr(config, "model_type", None),
                                        "the reference engine")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; only 'silu' is implemented")
        if model_type in ("qwen2", "qwen3"):
            layer_types = getattr(config, "layer_types", None) or []
            if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
                raise ValueError(f"{model_type} with sliding-window attention layers is not supported by the "
                                 "reference engine (config use_sliding_window / layer_types)")
        attention_bias = bool(getattr(config, "attention_bias", False))
        theta, inv_freq, scaling = _rope(config)
        return cls(
            model_type=model_type,
            shape=ModelShape.from_hf(config),
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta,
            # Qwen2 always has q/k/v biases and no o_proj bias; attention_bias (Llama, Qwen3) covers all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=model_type == "llama" and bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=getattr(config, "sliding_window", None) if model_type in ("mistral", "mixtral") else None,
            num_experts=getattr(config, "num_local_experts", 0) if model_type == "mixtral" else 0,
            top_k=getattr(config, "num_experts_per_tok", 0) if model_type == "mixtral" else 0,
            qk_norm=model_type == "qwen3",
            rope_inv_freq=inv_freq,
            rope_attention_scaling=scaling,
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies [head_dim / 2] in fp32, by HF's formula for the configured type."""
        if self.rope_inv_freq is not None:
            return torch.tensor(self.rope_inv_freq, dtype=torch.float)
        dim = self.shape.head_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _rope(config: Any) -> tuple[float, tuple[float, ...] | None, float]:
    """(rope_theta, inverse frequencies or None for default RoPE, cos/sin scale) from transformers 5
    (`rope_parameters`) or older configs (`rope_theta`/`rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r} (config rope_parameters / rope_scaling); the reference "
                         f"engine implements {', '.join(STATIC_ROPE_TYPES)}: frequencies that change with the "
                         "sequence length would differ between the keys in its cache and the trainer's")
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (config partial_rotary_factor) are not supported by the "
                         "reference engine")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    if rope_type == "default":
        return float(theta), None, 1.0
    if not params:
        raise ValueError(f"RoPE type {rope_type!r} needs the config's rope_parameters (transformers 5 configs "
                         "have them); load the config with transformers' AutoConfig")
    # fp32 values survive the round trip through Python floats exactly.
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return float(theta), tuple(inv_freq.float().tolist()), float(attention_scaling)
