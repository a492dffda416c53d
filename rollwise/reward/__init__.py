"""Rewards: per-response scoring (scoring) with the strict answer format (rollwise.tasks.answer_format,
shared with the prompts that state it; re-exported here)."""

from rollwise.tasks.answer_format import (
    AnswerFormat,
    ParsedResponse,
    answers_match,
    last_number,
    normalize_text,
    parse_number,
    parse_response,
)
from rollwise.reward.scoring import OUTCOMES, Outcome, RewardConfig, RewardResult, lenient_match, score

__all__ = [
    "AnswerFormat",
    "OUTCOMES",
    "Outcome",
    "ParsedResponse",
    "RewardConfig",
    "RewardResult",
    "answers_match",
    "last_number",
    "lenient_match",
    "normalize_text",
    "parse_number",
    "parse_response",
    "score",
]
