"""Per-token log-probabilities of given target tokens, without materialising full fp32 logits.

The LM head is applied only at the positions that are trained (response tokens), a chunk of rows
at a time, and each chunk runs under activation checkpointing: its [chunk, vocab] logits are freed
after the forward and recomputed in the backward. Peak memory for logits is one chunk, not
batch x length x vocab (4 GB for 8 x 2048 x 64k in fp32).

`fused=True` (train.fused_logprobs) runs the same math as one autograd function (FusedLogprobs):
log-softmax, the sampled token's log-prob and the entropy from one logits buffer per chunk, and a
backward that writes d(logp)/d(logits) = g * (onehot - softmax) in place, with no [rows, vocab]
scatter for the gather, no second entropy pass and no autograd graph over the softmax. It keeps
each chunk's softmax for the backward (no recomputed LM-head matmul) while the micro-batch's
probabilities fit `keep_mib`, and recomputes them chunk by chunk beyond that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from rollwise.types.train_config import TrainConfig

__all__ = ["DEFAULT_OPTIONS", "KEEP_PROBS_MIB", "RECOMPUTE_SHARE", "FusedLogprobs", "LogprobOptions", "lm_head_logprobs",
           "sequence_hidden", "sequence_logprobs", "shared_prompt_hidden", "shared_prompt_logprobs"]

# A group's prompt is recomputed for each of its unpadded rows (no attention mask, see shared_prompt_logprobs and
# rollwise.train.packing.unmasked_rows) while that adds at most 1/RECOMPUTE_SHARE of the rows' tokens
RECOMPUTE_SHARE = 8
KEEP_PROBS_MIB = 512  # fused path: softmax kept for the backward up to this size (else recomputed)


@dataclass(frozen=True)
class LogprobOptions:
    """How every log-prob function here computes: the temperature the log-probs are of (<= 0, greedy: the
    untempered distribution), LM-head rows at once (bounds fp32 logits), and the fused autograd function or not."""

    temperature: float = 1.0
    chunk_tokens: int = 1024
    fused: bool = False
    # False: the log-probs alone, without a graph (the frozen reference's forward: its entropy is never read);
    # the entropy returned is then zeros
    entropy: bool = True

    @classmethod
    def of(cls, cfg: TrainConfig, temperature: float) -> LogprobOptions:
        """The trainer's: the rollout's sampling temperature, train.logprob_chunk_tokens, train.fused_logprobs."""
        return cls(temperature, cfg.logprob_chunk_tokens, cfg.fused_logprobs)


DEFAULT_OPTIONS = LogprobOptions()


def _chunk_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float):
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _softmax_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                   temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (softmax [n, V], logp of targets [n], entropy [n]), every [n, V] step in place."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # now log-softmax
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = logits.exp()
    # entropy = -sum p log p, as a batched row dot product (no [n, V] temporary)
    entropy = -torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)
    return probs, logp, entropy


def _fused_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                   chunk_tokens: int, keep: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(logp [N], entropy [N], each chunk's softmax when `keep`)."""
    logps, entropies, kept = [], [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        probs, logp, entropy = _softmax_stats(hidden[start : start + chunk_tokens], weight, bias,
                                              targets[start : start + chunk_tokens], temperature)
        logps.append(logp)
        entropies.append(entropy)
        if keep:
            kept.append(probs)
    return torch.cat(logps), torch.cat(entropies), kept


class FusedLogprobs(torch.autograd.Function):
    """(hidden [N, H], LM head weight [V, H], bias, targets [N]) -> (logp [N], entropy [N]).

    The math of `_chunk_logprobs` (tested to 1e-5), with the gradient of the log-prob written by
    hand: d logp_i / d logits_i = (onehot(t_i) - softmax_i) / temperature. Entropy is a reported
    metric: no gradient flows through it."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                temperature: float, chunk_tokens: int, keep_mib: float) -> tuple[Tensor, Tensor]:
        keep = hidden.shape[0] * weight.shape[0] * 4 <= keep_mib * 2**20
        logp, entropy, kept = _fused_forward(hidden, weight, bias, targets, temperature, chunk_tokens, keep)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.kept, ctx.temperature, ctx.chunk_tokens = kept, temperature, chunk_tokens
        # Under torch.autocast (train.compute_dtype) the LM-head matmuls ran in its dtype; the backward,
        # which autocast does not reach, runs its two matmuls in the same dtype.
        device = hidden.device.type
        ctx.compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        kept, chunk, temperature = ctx.kept, ctx.chunk_tokens, ctx.temperature
        ctx.kept = []  # overwritten below (a second backward would be wrong): free them as we go
        if ctx.compute_dtype is not None:
            return _mixed_precision_backward(ctx, hidden, weight, bias, targets, kept, grad_logp)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight: Tensor | None = None  # the first chunk's product, then the others added in place
        wants_bias = bias is not None and ctx.needs_input_grad[2]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None
        for i, start in enumerate(range(0, hidden.shape[0], chunk)):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            g = (grad_logp[start : start + chunk] / temperature).float().unsqueeze(-1)
            probs = kept[i] if kept else _softmax_stats(h, weight, bias, t, temperature)[0]
            if kept:
                kept[i] = None  # type: ignore[call-overload]
            # d loss / d logits = g * (onehot - softmax) / temperature, built in the softmax's buffer
            grad_logits = probs.mul_(-g)
            grad_logits.scatter_add_(-1, t.unsqueeze(-1), g)
            if grad_hidden is not None:
                torch.mm(grad_logits.to(hidden.dtype), weight, out=grad_hidden[start : start + chunk])
            if ctx.needs_input_grad[1]:
                if grad_weight is None:
                    grad_weight = torch.mm(grad_logits.t(), h.float())
                else:
                    grad_weight.addmm_(grad_logits.t(), h.float())
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _mixed_precision_backward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                              kept: list[Tensor], grad_logp: Tensor) -> tuple[Tensor | None, ...]:
    """FusedLogprobs.backward when its forward ran under autocast: the same gradient, its matmuls in
    the autocast dtype (float32 accumulation of the weight gradient over chunks)."""
    chunk, temperature, dtype = ctx.chunk_tokens, ctx.temperature, ctx.compute_dtype
    weight_c = weight.to(dtype)
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
    for i, start in enumerate(range(0, hidden.shape[0], chunk)):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        g = (grad_logp[start : start + chunk] / temperature).float().unsqueeze(-1)
        if kept:
            probs, kept[i] = kept[i], None  # type: ignore[call-overload]
        else:
            with torch.autocast(hidden.device.type, dtype=dtype):
                probs = _softmax_stats(h, weight, bias, t, temperature)[0]
        grad_logits = probs.mul_(-g)
        grad_logits.scatter_add_(-1, t.unsqueeze(-1), g)
        grad_logits_c = grad_logits.to(dtype)
        if grad_hidden is not None:
            grad_hidden[start : start + chunk] = torch.mm(grad_logits_c, weight_c)
        if grad_weight is not None:
            grad_weight.add_(torch.mm(grad_logits_c.t(), h.to(dtype)))
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0))
    grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None


def lm_head_logprobs(
    hidden: Tensor,
    lm_head: nn.Linear,
    targets: Tensor,
    options: LogprobOptions = DEFAULT_OPTIONS,
) -> tuple[Tensor, Tensor]:
    """hidden [N, H] (the positions that predict `targets` [N]) -> (logprobs [N], entropy [N])."""
    temperature, chunk_tokens, fused = options.temperature, options.chunk_tokens, options.fused
    if temperature <= 0:
        temperature = 1.0  # greedy sampling reports logprobs of the untempered distribution
    if not options.entropy:
        logp = _logprobs_only(hidden, lm_head, targets, float(temperature), chunk_tokens)
        return logp, torch.zeros_like(logp)
    if fused and torch.is_grad_enabled() and hidden.requires_grad:
        return FusedLogprobs.apply(hidden, lm_head.weight, lm_head.bias, targets, float(temperature),
                                   chunk_tokens, KEEP_PROBS_MIB)
    if fused:  # no graph to build (reference model, measurement): the same math, nothing kept
        with torch.no_grad():
            logp, entropy, _ = _fused_forward(hidden, lm_head.weight, lm_head.bias, targets, float(temperature),
                                              chunk_tokens, keep=False)
        return logp, entropy
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


@torch.no_grad()
def _logprobs_only(hidden: Tensor, lm_head: nn.Linear, targets: Tensor, temperature: float,
                   chunk_tokens: int) -> Tensor:
    """The sampled tokens' log-probs, chunk by chunk, no graph and no entropy (one logsumexp per row)."""
    out = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = F.linear(hidden[start : start + chunk_tokens], lm_head.weight, lm_head.bias).float()
        if temperature != 1.0:
            logits.div_(temperature)
        picked = logits.gather(-1, targets[start : start + chunk_tokens].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(logits, dim=-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def backbone_of(model: nn.Module) -> nn.Module:
    """A Hugging Face causal LM's decoder stack (hidden states out, no LM head); a model without
    get_decoder() keeps it at .model."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    target_mask: Tensor,
    options: LogprobOptions = DEFAULT_OPTIONS,
) -> tuple[Tensor, Tensor]:
    """Log-probs of input_ids[:, t] for every t where target_mask[:, t] is set (flattened, row-major).

    `model` is a Hugging Face causal LM: its backbone gives hidden states, its output embedding
    is the LM head. Position t is predicted by the hidden state at t - 1.
    """
    hidden, targets = sequence_hidden(backbone_of(model), input_ids, attention_mask, target_mask)
    return lm_head_logprobs(hidden, model.get_output_embeddings(), targets, options)


def sequence_hidden(backbone: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                    target_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden states [N, H] at the positions that predict the target tokens, those tokens [N]) of right-padded
    rows, flattened row-major: what an LM head (sequence_logprobs) or a value head (rollwise.train.critic) reads."""
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    predict_mask = target_mask[:, 1:]
    return hidden[:, :-1][predict_mask], input_ids[:, 1:][predict_mask]


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    options: LogprobOptions = DEFAULT_OPTIONS,
) -> tuple[Tensor, Tensor]:
    """Log-probs of G responses that share one prompt, running the prompt through the model once.

    A GRPO group is n samples of one prompt; the padded forward computes that prompt n times.
    Here the prompt's keys/values are computed once (with grad) and repeated across the group, so
    the trained forward/backward costs P + n*R tokens instead of n*(P + R). Gradients flowing into
    the shared prompt KV are summed over the group, exactly as in the padded forward.

    prompt_ids [P], responses [G, R] right-padded, response_mask [G, R] -> flattened over the mask.
    """
    hidden, targets = shared_prompt_hidden(backbone_of(model), prompt_ids, responses, response_mask)
    return lm_head_logprobs(hidden, model.get_output_embeddings(), targets, options)


def shared_prompt_hidden(backbone: nn.Module, prompt_ids: Tensor, responses: Tensor,
                         response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """shared_prompt_logprobs' forward: (hidden states [N, H] that predict the response tokens, those tokens [N]),
    flattened over `response_mask` row-major."""
    group, length = responses.shape
    prompt_len = prompt_ids.shape[0]
    if response_mask.all() and (group - 1) * prompt_len * RECOMPUTE_SHARE <= group * length:
        # No padding: each response after the prompt as one causal sequence, no attention mask (SDPA's
        # is_causal kernel). Over the prompt's KV cache the queries are offset from the keys and need a
        # [G, 1, R, P + R] mask, which SDPA copies to float per layer: memory growing with length squared.
        # The same values; the prompt's gradient sums over the rows as through the shared KV.
        hidden = backbone(input_ids=torch.cat([prompt_ids.expand(group, prompt_len), responses], dim=1),
                          use_cache=False).last_hidden_state
        return hidden[:, prompt_len - 1 : -1][response_mask], responses[response_mask]
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
    return predictors[response_mask], responses[response_mask]
