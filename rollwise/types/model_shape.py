"""The sizes of a decoder-only transformer, read once from a Hugging Face config.

Two readers need the same facts from the same config: the reference engine builds its decoder from them
(rollwise.engine.reference.model_config.ModelConfig holds one), and the FLOP counter counts their work
(rollwise.observe.flops.DenseModel holds one). Both go through `ModelShape.from_hf`, so the defaults a
config may leave out (key/value heads = heads, head_dim = hidden / heads) are filled in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "config_field"]

# Architectures whose MLP is two matrices (up, down) rather than gated (gate, up, down).
NON_GATED_MLP = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "phi", "falcon", "starcoder2"})


def config_field(config: Any) -> Callable[..., Any]:
    """get(name, default=None) over a Hugging Face config, an object with attributes or its to_dict()."""
    if isinstance(config, Mapping):
        return config.get
    return lambda name, default=None: getattr(config, name, default)


@dataclass(frozen=True)
class ModelShape:
    """Layers, widths, heads and vocabulary of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gated_mlp: bool = True

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        """From a Hugging Face model config (an object with attributes, or its to_dict()); the GPT-2 style
        names (n_embd, n_head, n_layer, n_inner) are read too. A ValueError names the missing fields."""
        get = config_field(config)
        model_type = get("model_type", "") or ""

        def need(*names: str) -> int:
            for name in names:
                if get(name) is not None:
                    return int(get(name))
            raise ValueError(f"model config ({model_type or 'unknown type'}) has none of {', '.join(names)}: "
                             "rollwise cannot read this architecture's shape")

        hidden = need("hidden_size", "n_embd", "d_model")
        heads = need("num_attention_heads", "n_head")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size") or get("n_inner") or 4 * hidden),
            num_layers=need("num_hidden_layers", "n_layer"),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            gated_mlp=model_type not in NON_GATED_MLP,
        )
