"""One reading of a decoder's sizes (rollwise.types.model_shape, issue 44 item 5): the reference engine's
ModelConfig and the FLOP counter's DenseModel hold the same ModelShape, equal to the HF model's own tensors."""

import pytest
from transformers import GPT2Config

from rollwise.engine.reference.model_config import ModelConfig
from rollwise.model.tiny import tiny_llama, tiny_qwen3
from rollwise.observe.flops import DenseModel
from rollwise.types.model_shape import ModelShape


@pytest.mark.parametrize("build", [lambda: tiny_llama(num_kv_heads=2), lambda: tiny_qwen3()], ids=["llama_gqa", "qwen3"])
def test_engine_and_flop_counter_read_one_shape_that_matches_the_weights(build):
    model = build()
    shape = ModelConfig.from_hf(model.config).shape
    assert DenseModel.from_hf_config(model.config).shape == shape
    assert ModelShape.from_hf(model.config.to_dict()) == shape  # the config's dict reads the same
    attn = model.model.layers[0].self_attn
    assert (shape.num_heads * shape.head_dim, shape.hidden_size) == tuple(attn.q_proj.weight.shape)
    assert shape.num_kv_heads * shape.head_dim == attn.k_proj.weight.shape[0]
    assert (shape.vocab_size, shape.num_layers) == (model.config.vocab_size, len(model.model.layers))
    assert shape.intermediate_size == model.model.layers[0].mlp.up_proj.weight.shape[0] and shape.gated_mlp


def test_gpt2_names_are_read_and_a_missing_size_is_named():
    shape = ModelShape.from_hf(GPT2Config(n_embd=64, n_head=4, n_layer=3, vocab_size=100))
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (64, 4, 4, 16)
    assert (shape.num_layers, shape.intermediate_size, shape.gated_mlp) == (3, 256, False)
    with pytest.raises(ValueError, match="num_hidden_layers, n_layer"):
        ModelShape.from_hf({"model_type": "mystery", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10})
