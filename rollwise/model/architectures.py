"""The model architectures rollwise runs, by the name a Hugging Face config.json gives them.

One table for every path a model takes: loading a directory (rollwise.model.loading), the reference
engine's decoder (rollwise.engine.reference.model_config), the trainer (transformers' own class for the
same name) and the weight pushes between them (Hugging Face parameter names, identical in all three).
vLLM serves each of these natively. An architecture outside the table is refused when the model is
loaded, with its name and the supported ones, before any weights are read.
"""

from __future__ import annotations

from collections.abc import Sequence

# config.json's `architectures` entry -> its `model_type`. All are Llama-shaped decoders (RMSNorm,
# RoPE, SwiGLU, grouped-query attention) whose differences the reference engine implements:
# Qwen2: q/k/v biases; Qwen3: per-head RMSNorm on q and k (QK-norm), explicit head_dim;
# Mistral: a sliding window; Mixtral: a sparse mixture of experts.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(SUPPORTED_ARCHITECTURES.values()))


def check_architecture(architectures: Sequence[str] | None, model_type: str | None,
                       source: str = "the model config") -> str:
    """The model_type, or ValueError naming the unsupported architecture and the supported ones.

    Both must be known: `architectures` (the class names config.json lists; a config built in code may
    have none) and `model_type` (what transformers and the reference engine build the model by)."""
    unknown = [name for name in architectures or [] if name not in SUPPORTED_ARCHITECTURES]
    if unknown or model_type not in SUPPORTED_MODEL_TYPES:
        shown = ", ".join(unknown) if unknown else f"of model_type {model_type!r}"
        raise ValueError(f"{source}: unsupported architecture {shown} (model_type {model_type!r}); rollwise "
                         f"supports {', '.join(SUPPORTED_ARCHITECTURES)} (model types "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    return model_type
