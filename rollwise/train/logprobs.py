"""Per-token log-probabilities of given target tokens, without materialising full fp32 logits.

The LM head is applied only at the positions that are trained (response tokens), a chunk of rows
at a time, and each chunk runs under activation checkpointing: its [chunk, vocab] logits are freed
after the forward and recomputed in the backward. Peak memory for logits is one chunk, not
batch x length x vocab (4 GB for 8 x 2048 x 64k in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float):
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def lm_head_logprobs(
    hidden: Tensor,
    lm_head: nn.Linear,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """hidden [N, H] (the positions that predict `targets` [N]) -> (logprobs [N], entropy [N])."""
    if temperature <= 0:
        temperature = 1.0  # greedy sampling reports logprobs of the untempered distribution
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            logp, ent = checkpoint(
                _chunk_logprobs, h, lm_head.weight, lm_head.bias, t, temperature, use_reentrant=False
            )
        else:
            logp, ent = _chunk_logprobs(h, lm_head.weight, lm_head.bias, t, temperature)
        logps.append(logp)
        entropies.append(ent.detach())  # entropy is reported, not trained on
    return torch.cat(logps), torch.cat(entropies)


def sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    target_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of input_ids[:, t] for every t where target_mask[:, t] is set (flattened, row-major).

    `model` is a Hugging Face causal LM: its backbone gives hidden states, its output embedding
    is the LM head. Position t is predicted by the hidden state at t - 1.
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    predict_mask = target_mask[:, 1:]
    selected_hidden = hidden[:, :-1][predict_mask]
    targets = input_ids[:, 1:][predict_mask]
    return lm_head_logprobs(
        selected_hidden, model.get_output_embeddings(), targets, temperature=temperature, chunk_tokens=chunk_tokens
    )
