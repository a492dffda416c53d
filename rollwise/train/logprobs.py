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


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of G responses that share one prompt, running the prompt through the model once.

    A GRPO group is n samples of one prompt; the padded forward computes that prompt n times.
    Here the prompt's keys/values are computed once (with grad) and repeated across the group, so
    the trained forward/backward costs P + n*R tokens instead of n*(P + R). Gradients flowing into
    the shared prompt KV are summed over the group, exactly as in the padded forward.

    prompt_ids [P], responses [G, R] right-padded, response_mask [G, R] -> flattened over the mask.
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    group, length = responses.shape
    prompt_len = prompt_ids.shape[0]
    prompt_out = backbone(input_ids=prompt_ids[None], use_cache=True)
    cache = prompt_out.past_key_values
    cache.batch_repeat_interleave(group)
    attention_mask = torch.cat([torch.ones(group, prompt_len, dtype=torch.long, device=responses.device),
                                response_mask.long()], dim=1)
    position_ids = (prompt_len + torch.arange(length, device=responses.device)).expand(group, length)
    response_hidden = backbone(
        input_ids=responses, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=cache, use_cache=True,
    ).last_hidden_state
    # The first response token is predicted by the prompt's last position, token j by response position j-1.
    last_prompt = prompt_out.last_hidden_state[:, -1:].expand(group, 1, -1)
    predictors = torch.cat([last_prompt, response_hidden[:, :-1]], dim=1)
    return lm_head_logprobs(
        predictors[response_mask], model.get_output_embeddings(), responses[response_mask],
        temperature=temperature, chunk_tokens=chunk_tokens,
    )
