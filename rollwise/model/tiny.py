"""Tiny random models and a character-level tokenizer, built in code, for tests and quick benchmarks.

No hub access exists here, so tests never download anything: they build a Llama-architecture model
(or a Qwen2, Qwen3 or Mixtral one) with a few thousand parameters and a ChatML tokenizer whose
vocabulary is printable ASCII.
"""

from __future__ import annotations

import string
from typing import TypedDict, TypeVar, Unpack

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

M = TypeVar("M", bound=PreTrainedModel)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the same shape as SmolLM2's template, so tiny models exercise the real prompt path.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable ASCII character is one token."""
    chars = list(dict.fromkeys(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + ["<unk>"])}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


class DecoderShape(TypedDict, total=False):
    """The sizes every tiny decoder takes (Llama and Mixtral name them alike); DEFAULT_SHAPE fills the rest."""

    vocab_size: int | None  # None: the tiny tokenizer's
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    head_dim: int | None  # None: hidden_size // num_heads (Qwen3's config would otherwise default to 128)
    rope_parameters: dict | None  # None: default RoPE, theta 10000; else transformers' rope_parameters


DEFAULT_SHAPE: DecoderShape = {"vocab_size": None, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                               "num_kv_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 1024,
                               "head_dim": None, "rope_parameters": None}


def _decoder_fields(shape: DecoderShape) -> dict:
    """The HF config fields of a tiny decoder of this shape."""
    full = {**DEFAULT_SHAPE, **shape}
    vocab_size = full["vocab_size"]
    return {"vocab_size": len(tiny_tokenizer()) if vocab_size is None else vocab_size,
            "hidden_size": full["hidden_size"], "intermediate_size": full["hidden_size"] * 2,
            "num_hidden_layers": full["num_layers"], "num_attention_heads": full["num_heads"],
            "num_key_value_heads": full["num_kv_heads"], "max_position_embeddings": full["max_position_embeddings"],
            "head_dim": full["head_dim"] or full["hidden_size"] // full["num_heads"],
            "rope_parameters": full["rope_parameters"] or {"rope_type": "default", "rope_theta": 10000.0},
            "rms_norm_eps": 1e-5, "tie_word_embeddings": full["tie_word_embeddings"],
            "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}


def _seeded(model_class: type[M], config: PretrainedConfig, seed: int) -> M:
    """The model's random initialisation under `seed`, in eval mode."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.eval()
    return model


def tiny_llama(seed: int = 0, **shape: Unpack[DecoderShape]) -> LlamaForCausalLM:
    """A randomly initialised Llama-architecture model (fp32) sized for unit tests."""
    return _seeded(LlamaForCausalLM, LlamaConfig(**_decoder_fields(shape)), seed)


def tiny_mixtral(num_experts: int = 4, top_k: int = 2, seed: int = 0,
                 **shape: Unpack[DecoderShape]) -> MixtralForCausalLM:
    """A randomly initialised Mixtral-architecture mixture of experts (fp32) sized for unit tests:
    Llama attention, and in every layer a top-k router over `num_experts` SwiGLU experts."""
    config = MixtralConfig(num_local_experts=num_experts, num_experts_per_tok=top_k, **_decoder_fields(shape))
    return _seeded(MixtralForCausalLM, config, seed)


def _perturbed(model: M, suffixes: tuple[str, ...], low: float, high: float) -> M:
    """HF initialises biases to 0 and norm weights to 1: draw these at random too, so that a path that
    dropped them (a weight push, a reference engine) would change the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.uniform_(low, high)
    return model


def tiny_qwen2(seed: int = 0, **shape: Unpack[DecoderShape]) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 (Qwen2.5) model (fp32): Llama with q/k/v biases, drawn at random."""
    model = _seeded(Qwen2ForCausalLM, Qwen2Config(**_decoder_fields(shape)), seed)
    return _perturbed(model, ("_proj.bias",), -0.5, 0.5)


def tiny_qwen3(seed: int = 0, **shape: Unpack[DecoderShape]) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 dense model (fp32): Llama with QK-norm (q_norm/k_norm weights drawn at
    random) and an explicit head_dim."""
    model = _seeded(Qwen3ForCausalLM, Qwen3Config(**_decoder_fields(shape)), seed)
    return _perturbed(model, ("q_norm.weight", "k_norm.weight"), 0.5, 1.5)


# `tiny:<family>:<seed>` model specs (rollwise.model.loading): the family's builder; `tiny:<seed>` is Llama.
TINY_FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}
