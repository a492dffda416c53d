"""A trajectory as the trainer receives it: exact token ids, behaviour logprobs, policy versions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    sample_id: str  # unique: "<request id>/<sample index>"
    group_id: str  # the GRPO group (one prompt's n samples)
    problem_id: str
    prompt_ids: list[int]
    response_ids: list[int]  # exactly the engine's sampled ids, never re-tokenized
    behaviour_logprobs: list[float]  # engine log-probs of response_ids
    versions: list[int]  # policy version that sampled each response token
    finish_reason: str
    response_text: str = ""  # decoded for scoring and logs only; training never reads it
    reward: float = 0.0
    outcome: str = ""
    strict_correct: bool = False
    lenient_correct: bool = False
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)

    def staleness(self, trainer_version: int) -> list[int]:
        return [trainer_version - v for v in self.versions]
