"""Token sampling: min_tokens, penalties, temperature, top-k, top-p, with one torch.Generator per sequence.

`process_logits` applies min_tokens and the penalties (vLLM's order and formulas); `sample` then
samples from log_softmax(logits / T) (T = 1 for greedy). The logprob reported for a token is that of
the processed, temperature-scaled distribution *before* top-k/top-p truncation: the behaviour
policy's logprob (with no penalties, exactly what the trainer recomputes). Each row draws from its
own generator, so a seeded sequence samples the same tokens whichever other sequences share its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollwise.types.generation import SamplingParams


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


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.min_tokens or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty)


def process_logits(
    logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], stop_ids: set[int]
) -> Tensor:
    """One row of fp32 logits [vocab] after min_tokens and the penalties, as vLLM's sampler applies them:
    - min_tokens: while fewer tokens were generated, the stop tokens (EOS, stop_token_ids) get -inf;
    - repetition_penalty r: a token seen in the prompt or the output has its logit divided by r if
      positive, multiplied by r otherwise;
    - frequency_penalty f, presence_penalty p: logit -= f * count_in_output + p * (count_in_output > 0)."""
    vocab = logits.shape[-1]
    logits = logits.clone()
    if len(output_ids) < params.min_tokens and stop_ids:
        logits[[t for t in stop_ids if t < vocab]] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[list(prompt_ids) + list(output_ids)] = True
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def scaled_logprobs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """log_softmax(logits / T) per row (T = 1 for greedy rows): the distribution sampled from."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    return torch.log_softmax(logits / temps[:, None], dim=-1)


def top_logprobs(logprobs: Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of one row of `scaled_logprobs`, best first."""
    if k <= 0:
        return []
    best = logprobs.topk(min(k, logprobs.shape[-1]))
    return list(zip(best.indices.tolist(), best.values.tolist()))


def sample(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of fp32 `logits` [batch, vocab] (already through `process_logits`);
    return (token ids, their logprobs)."""
    logprobs = scaled_logprobs(logits, params)
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


def _sampling_probs(logprobs: Tensor, params: SamplingParams) -> Tensor:
    """The distribution `sample` draws from for one row of `scaled_logprobs` (top-k/top-p applied,
    unnormalised)."""
    probs = logprobs.exp()
    if params.top_k or params.top_p < 1.0:
        probs = truncate(probs, params.top_k, params.top_p)
    return probs


def _draw(probs: Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from unnormalised probs [vocab], as `sample` does it (fp64 CDF)."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    picked = int(torch.searchsorted(cdf, u * cdf[-1:], right=True)[0])
    return min(picked, probs.shape[-1] - 1)


def verify_draft_token(
    logprobs: Tensor, params: SamplingParams, draft: int, generator: torch.Generator
) -> tuple[int, bool]:
    """Speculative sampling for a draft that comes with no draft probabilities (a deterministic
    proposal, e.g. from rollout history). `logprobs` is one row of `scaled_logprobs`. Returns (the
    token to emit, whether it is the draft).

    Let p be the distribution `sample` would draw from. Accept the draft x with probability p(x);
    otherwise draw from p with x removed and renormalised. Then P(emit x) = p(x) and, for y != x,
    P(emit y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y): exactly p, whatever the draft was. (The
    general rule accepts with min(1, p(x) / q(x)) and resamples from (p - q)+; for a point-mass
    proposal q = 1_x that is the same thing.) Greedy rows: the draft is kept iff it is the argmax."""
    if params.temperature <= 0:
        best = int(logprobs.argmax())
        return best, best == draft
    probs = _sampling_probs(logprobs, params)
    total = float(probs.double().sum())
    p_draft = float(probs[draft]) / total if 0 <= draft < probs.shape[-1] else 0.0
    if float(torch.rand(1, generator=generator, dtype=torch.float64)) < p_draft:
        return draft, True
    residual = probs.clone()
    if 0 <= draft < residual.shape[-1]:
        residual[draft] = 0.0
    return _draw(residual, generator), False


def sample_one(logprobs: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row of `scaled_logprobs`, the way `sample` draws it."""
    if params.temperature <= 0:
        return int(logprobs.argmax())
    return _draw(_sampling_probs(logprobs, params), generator)
