"""Scoring given tokens (`Engine.score_tokens`): log p(token_ids[i] | token_ids[:i]) for i in start..len-1, under
the weights the engine serves, at a temperature: one prefill over the ids, nothing sampled. A teacher engine
scores a student's sampled response this way (on-policy distillation, rollwise.control.teacher): prompt +
response in, one log-prob per response token out.

Every engine refuses the same bad input here, before it computes anything.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class ScoreRequest(BaseModel):
    """`POST /score` on an engine server, and what `Engine.score_tokens` takes."""

    token_ids: list[int] = Field(..., min_length=2, description="the whole sequence: prompt, then the tokens to score")
    start: int = Field(..., ge=1, description="the first position scored (the prompt's length)")
    temperature: float = Field(1.0, gt=0, description="log_softmax(logits / temperature): the sampling "
                               "distribution's log-probs at this temperature")


class ScoreResponse(BaseModel):
    logprobs: list[float]  # one per token_ids[start:]


def check_score_request(token_ids: list[int], start: int, temperature: float, *, max_model_len: int,
                        vocab_size: int) -> None:
    """What every engine's score_tokens refuses, with a ValueError naming the field."""
    if not 1 <= start < len(token_ids):
        raise ValueError(f"score: start={start} must lie in [1, len(token_ids)={len(token_ids)}): the first scored "
                         "position needs a token before it, and at least one token must be scored")
    if len(token_ids) > max_model_len:
        raise ValueError(f"score: token_ids has {len(token_ids)} tokens, more than the engine's "
                         f"max_model_len={max_model_len}: raise the engine's max_model_len")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"score: token_ids must lie in [0, {vocab_size}) (the engine model's vocabulary)")
    if not temperature > 0:
        raise ValueError(f"score: temperature={temperature} must be > 0")
