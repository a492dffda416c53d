"""One sequence a teacher engine scores (`Engine.score_tokens`, rollwise.engine.scoring): here, below every layer,
so the engine contract and every engine (the simulator's included) speak of it."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ScoreSequence(BaseModel):
    """One sequence to score: the whole of it, and where its scored tokens start."""

    token_ids: list[int] = Field(..., min_length=2, description="the whole sequence: prompt, then the tokens to score")
    start: int = Field(..., ge=1, description="the first position scored (the prompt's length)")
