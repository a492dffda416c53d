"""Sparse upcycling: a dense Llama-architecture model -> a Mixtral mixture of experts with its language ability.

Each layer's MLP is copied into `num_experts` experts, each with a small multiplicative perturbation (so the
experts can drift apart in training), and a top-k router initialised near uniform (tiny random weights): at
the start every token's output is the mean of k near-copies of the dense MLP, so the MoE speaks like the
dense model. Attention, norms and embeddings are copied unchanged.

Mixtral is the target format because its attention is Llama's (the bundled SmolLM2 is Llama) and both
transformers (`MixtralForCausalLM`) and vLLM load it; `save_pretrained` writes the standard per-expert
checkpoint names (`block_sparse_moe.experts.N.w1/w2/w3`).

A model in, a model out: building one from a model spec (and the command line, `python -m rollwise.model.moe
--model SPEC --out DIR`) is rollwise.model.moe's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

UPCYCLE_ARCHITECTURES = ("llama", "mistral")


def mixtral_config(dense: object, num_experts: int, top_k: int) -> MixtralConfig:
    """The Mixtral config with the dense model's attention, sizes, RoPE and token ids."""
    model_type = getattr(dense, "model_type", None)
    if model_type not in UPCYCLE_ARCHITECTURES:
        raise ValueError(f"cannot upcycle model_type {model_type!r}: supported dense architectures are "
                         f"{', '.join(UPCYCLE_ARCHITECTURES)} (Mixtral's attention is theirs)")
    if getattr(dense, "attention_bias", False) or getattr(dense, "mlp_bias", False):
        raise ValueError("cannot upcycle a model with attention or MLP biases: Mixtral has none")
    if not 1 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [2, num_experts={num_experts}] (with top-1 the renormalised gate "
                         f"weight is always 1 and the router would get no gradient), got {top_k}")
    return MixtralConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers, num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=getattr(dense, "num_key_value_heads", None) or dense.num_attention_heads,
        head_dim=getattr(dense, "head_dim", None), hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings, rms_norm_eps=dense.rms_norm_eps,
        rope_parameters=dict(getattr(dense, "rope_parameters", None) or {"rope_type": "default",
                                                                        "rope_theta": dense.rope_theta}),
        tie_word_embeddings=bool(getattr(dense, "tie_word_embeddings", False)),
        sliding_window=getattr(dense, "sliding_window", None),
        bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id,
        num_local_experts=num_experts, num_experts_per_tok=top_k,
        output_router_logits=False,  # the load-balancing loss is off in RL by default
    )


def drop_reinit(gate_up: Tensor, down: Tensor, drop: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Drop-Upcycling's diversity re-initialisation (Nakamura et al., ICLR 2025, arXiv 2502.19261): a random
    `drop` share of the intermediate neurons (rows of gate/up, columns of down) re-drawn from a normal with each
    matrix's own mean and std, so the experts differ in a share of their neurons, not by a little everywhere."""
    if not 0.0 <= drop <= 1.0:
        raise ValueError(f"drop must be in [0, 1] (the share of each expert's intermediate neurons re-drawn), got {drop}")
    intermediate = down.shape[1]
    if round(drop * intermediate) == 0:  # draw nothing: the plain upcycle's random stream stays as it was
        return gate_up, down
    chosen = torch.randperm(intermediate, generator=generator)[: round(drop * intermediate)]
    gate_up, down = gate_up.clone(), down.clone()
    for half in (0, intermediate):  # gate rows, then up rows
        block = gate_up[half: half + intermediate]
        block[chosen] = block.mean() + block.std() * torch.randn((len(chosen), block.shape[1]), generator=generator)
    down[:, chosen] = down.mean() + down.std() * torch.randn((down.shape[0], len(chosen)), generator=generator)
    return gate_up, down


@torch.no_grad()
def upcycle(dense: PreTrainedModel, num_experts: int = 4, top_k: int = 2, noise: float = 0.01,
            router_std: float = 1e-3, seed: int = 0, drop: float = 0.0) -> MixtralForCausalLM:
    """A Mixtral MoE (fp32) whose experts are perturbed copies of `dense`'s MLPs (see the module docstring):
    each weight times (1 + `noise` x N(0, 1)), and with `drop` > 0 that share of each expert's neurons re-drawn
    (`drop_reinit`)."""
    if noise < 0:
        raise ValueError(f"noise must be >= 0 (the std of each expert weight's multiplicative perturbation), got {noise}")
    config = mixtral_config(dense.config, num_experts, top_k)
    moe = MixtralForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    source = dense.state_dict()
    target = moe.state_dict()
    for name, tensor in target.items():
        if ".mlp." not in name:
            tensor.copy_(source[name])
    for i, layer in enumerate(moe.model.layers):
        prefix = f"model.layers.{i}.mlp."
        gate_up = torch.cat([source[prefix + "gate_proj.weight"], source[prefix + "up_proj.weight"]]).float()
        down = source[prefix + "down_proj.weight"].float()
        experts = layer.mlp.experts
        for e in range(num_experts):
            expert_gate_up, expert_down = drop_reinit(gate_up, down, drop, generator)
            experts.gate_up_proj[e] = expert_gate_up * (1 + noise * torch.randn(gate_up.shape, generator=generator))
            experts.down_proj[e] = expert_down * (1 + noise * torch.randn(down.shape, generator=generator))
        layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator) * router_std)
    if config.tie_word_embeddings:
        moe.tie_weights()
    moe.eval()
    return moe


def checkpoint_items(state_dict: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """A Mixtral state dict under transformers' in-memory names (`mlp.gate`, 3-D `mlp.experts.gate_up_proj` /
    `down_proj`) as the per-expert checkpoint names vLLM loads (`block_sparse_moe.gate`,
    `block_sparse_moe.experts.N.w1/w3/w2.weight`: w1 the gate half, w3 the up half), as views (no copies).
    Other names pass through; a state dict already in checkpoint names passes through unchanged."""
    for name, tensor in state_dict.items():
        if name.endswith(".mlp.gate.weight"):
            yield name.replace(".mlp.gate.", ".block_sparse_moe.gate."), tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts."
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.w1.weight", gate[e]
                yield f"{base}{e}.w3.weight", up[e]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts."
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.w2.weight", tensor[e]
        else:
            yield name, tensor


def write_upcycled(dense: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, num_experts: int = 4,
                   top_k: int = 2, seed: int = 0, noise: float = 0.01, drop: float = 0.0) -> Path:
    """Upcycle `dense` and save it with `tokenizer` as a Hugging Face Mixtral directory (atomically: written
    to a temporary folder beside `out_dir`, then renamed)."""
    moe = upcycle(dense, num_experts=num_experts, top_k=top_k, seed=seed, noise=noise, drop=drop)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    moe.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
