"""Tiny random models and a character-level tokenizer, built in code, for tests and quick benchmarks.

No hub access exists here, so tests never download anything: they build a Llama-architecture model
with a few thousand parameters and a ChatML tokenizer whose vocabulary is printable ASCII.
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


DEFAULT_SHAPE: DecoderShape = {"vocab_size": None, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                               "num_kv_heads": 2, "tie_word_embeddings": True, "max_position_embeddings": 1024}


def _decoder_fields(shape: DecoderShape) -> dict:
    """The HF config fields of a tiny decoder of this shape."""
    full = {**DEFAULT_SHAPE, **shape}
    vocab_size = full["vocab_size"]
    return {"vocab_size": len(tiny_tokenizer()) if vocab_size is None else vocab_size,
            "hidden_size": full["hidden_size"], "intermediate_size": full["hidden_size"] * 2,
            "num_hidden_layers": full["num_layers"], "num_attention_heads": full["num_heads"],
            "num_key_value_heads": full["num_kv_heads"], "max_position_embeddings": full["max_position_embeddings"],
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": full["tie_word_embeddings"],
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
