"""Token sampling: temperature, top-k, top-p, with one torch.Generator per sequence.

The logprob reported for a token is log_softmax(logits / T) *before* top-k/top-p truncation (T = 1
for greedy), which is what the trainer recomputes. Each row draws from its own generator, so a
seeded sequence samples the same tokens whichever other sequences share its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollwise.engine.types import SamplingParams


def truncate(probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """Zero out everything outside top-k, then outside the top-p nucleus of what is left (vLLM's
    order). Returns unnormalised probabilities (the sampler renormalises); never empties a row."""
    if 0 < top_k < probs.shape[-1]:
        kept = probs.topk(top_k)
        probs = torch.zeros_like(probs).scatter_(-1, kept.indices, kept.values)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Drop a token once the tokens ranked above it already cover top_p; the top token always stays.
        drop = mass_before >= top_p * sorted_probs.sum()
        drop[0] = False
        probs = probs.scatter(-1, order[drop], 0.0)
    return probs


def sample(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of fp32 `logits` [batch, vocab]; return (token ids, their logprobs)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logprobs.argmax(dim=-1)  # greedy rows keep this
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        probs = logprobs[rows].exp()
        for j, i in enumerate(rows):
            if params[i].top_k or params[i].top_p < 1.0:
                probs[j] = truncate(probs[j], params[i].top_k, params[i].top_p)
        # Inverse-CDF sampling: one uniform draw per row from that row's own generator, then a
        # batched search (much cheaper than a multinomial call per row). fp64 keeps the CDF exact
        # enough over a 50k vocabulary; zero-probability tokens can never be picked because the
        # CDF does not rise across them.
        cdf = probs.double().cumsum(dim=-1)
        u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in rows])
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[rows] = picked.clamp_(max=logits.shape[-1] - 1)  # u * total rounding up to total
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
