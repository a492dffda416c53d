"""Scoring given tokens (`Engine.score_tokens`): for each sequence, log p(token_ids[i] | token_ids[:i]) for i in
start..len-1, under the weights the engine serves, at a temperature: a prefill over the ids, nothing sampled. A
teacher engine scores a batch of a student's sampled responses this way (on-policy distillation,
rollwise.control.teacher): prompt + response in, one log-prob per response token out, for many sequences per call
(the reference engine runs them packed in one forward per SCORE_BATCH_TOKENS).

Every engine refuses the same bad input here, before it computes anything; `score_batches` is how a caller splits
its sequences into calls the engine server accepts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field, field_validator

from rollwise.types.score import ScoreSequence

# POST /score takes at most this many sequences (a longer batch: 400, split it with score_batches); the body's
# bytes are bounded apart, by the server's --max-request-bytes (413, rollwise.serve.limits).
MAX_SCORE_SEQUENCES = 256
# Tokens in one scoring forward (the reference engine packs a call's sequences into forwards of at most this many;
# a longer sequence runs alone), and in one call of rollwise.control.teacher: memory bounded, matmuls large.
SCORE_BATCH_TOKENS = 8192


class ScoreRequest(BaseModel):
    """`POST /score` on an engine server, and what `Engine.score_tokens` takes."""

    sequences: list[ScoreSequence] = Field(..., min_length=1, description=f"the sequences to score, at most "
                                           f"{MAX_SCORE_SEQUENCES} a request (send more as several requests)")
    temperature: float = Field(1.0, gt=0, description="log_softmax(logits / temperature): the sampling "
                               "distribution's log-probs at this temperature")

    @field_validator("sequences")
    @classmethod
    def _bounded(cls, sequences: list[ScoreSequence]) -> list[ScoreSequence]:
        if len(sequences) > MAX_SCORE_SEQUENCES:  # the 400 names the field and the fix (a plain max_length would not)
            raise ValueError(f"has {len(sequences)} sequences, more than the {MAX_SCORE_SEQUENCES} one request may "
                             "carry: send them as several requests (rollwise.engine.scoring.score_batches splits them)")
        return sequences


class ScoreResponse(BaseModel):
    logprobs: list[list[float]]  # per sequence, in request order: one per token_ids[start:]


def check_score_request(sequences: Sequence[ScoreSequence], temperature: float, *, max_model_len: int,
                        vocab_size: int) -> None:
    """What every engine's score_tokens refuses, with a ValueError naming the field (`sequences[i].start`...)."""
    if not sequences:
        raise ValueError("score: sequences must not be empty: give at least one sequence to score")
    for i, seq in enumerate(sequences):
        ids, start = seq.token_ids, seq.start
        if not 1 <= start < len(ids):
            raise ValueError(f"score: sequences[{i}].start={start} must lie in [1, len(token_ids)={len(ids)}): the "
                             "first scored position needs a token before it, and at least one token must be scored")
        if len(ids) > max_model_len:
            raise ValueError(f"score: sequences[{i}].token_ids has {len(ids)} tokens, more than the engine's "
                             f"max_model_len={max_model_len}: raise the engine's max_model_len")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"score: sequences[{i}].token_ids must lie in [0, {vocab_size}) (the engine model's "
                             "vocabulary)")
    if not temperature > 0:
        raise ValueError(f"score: temperature={temperature} must be > 0")


def score_batches(lengths: Sequence[int], max_tokens: int = SCORE_BATCH_TOKENS,
                  max_sequences: int = MAX_SCORE_SEQUENCES) -> list[list[int]]:
    """The indices of sequences of these lengths split into batches of at most `max_tokens` tokens and
    `max_sequences` sequences (a sequence longer than max_tokens alone), longest first: sequences of like length
    share a batch, so a packed forward's rows waste little."""
    batches: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if not batches or tokens + lengths[i] > max_tokens or len(batches[-1]) >= max_sequences:
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += lengths[i]
    return batches


def prefix_batches(sequences: Sequence[ScoreSequence], max_tokens: int = SCORE_BATCH_TOKENS,
                   max_sequences: int = MAX_SCORE_SEQUENCES) -> list[list[int]]:
    """score_batches, with the sequences that share a prefix (token_ids[:start]: a GRPO group's prompt) kept in one
    batch where they fit (else split by score_batches), so the reference engine's packed forward computes the prefix
    once for them all (rollwise.engine.reference.scoring). Whole pieces go next fit, longest first, by the same
    bounds (tokens counted whole: a shared prefix only lowers a batch's cost)."""
    lengths = [len(s.token_ids) for s in sequences]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(sequences):
        groups.setdefault(tuple(s.token_ids[: s.start]), []).append(i)
    pieces = [[members[j] for j in batch] for members in groups.values()
              for batch in score_batches([lengths[i] for i in members], max_tokens, max_sequences)]
    batches: list[list[int]] = []
    tokens = 0
    for piece in sorted(pieces, key=lambda p: -lengths[p[0]]):  # a piece's first is its longest (score_batches)
        size = sum(lengths[i] for i in piece)
        if not batches or tokens + size > max_tokens or len(batches[-1]) + len(piece) > max_sequences:
            batches.append([])
            tokens = 0
        batches[-1].extend(piece)
        tokens += size
    return batches
