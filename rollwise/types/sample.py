"""A trajectory as the trainer receives it: exact token ids, behaviour logprobs, policy versions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the types layer imports no other rollwise package
    from rollwise.engine.types import Completion


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
    # Multi-turn (rollwise.agent): 1 on tokens the engine sampled, 0 on template / tool-result tokens
    # between turns, which are in response_ids only as context. None: every response token is sampled.
    loss_mask: list[int] | None = None

    @property
    def trained_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.response_ids)

    @classmethod
    def from_completion(cls, c: Completion, *, problem_id: str, response_text: str = "",
                        sample_id: str | None = None, group_id: str | None = None, **extra) -> Sample:
        """The engine's exact ids, logprobs and versions; ids default to the completion's own."""
        return cls(
            sample_id=sample_id or c.sample_id,
            group_id=group_id or c.request_id,
            problem_id=problem_id,
            prompt_ids=list(c.prompt_ids),
            response_ids=list(c.token_ids),
            behaviour_logprobs=list(c.logprobs),
            versions=list(c.versions),
            finish_reason=c.finish_reason,
            response_text=response_text,
            extra={"cached_prompt_tokens": c.cached_prompt_tokens, **extra},
        )

    def staleness(self, trainer_version: int) -> list[int]:
        """Per trained token (tokens with loss mask 0 were sampled by no policy)."""
        return [trainer_version - v for v, m in zip(self.versions, self.trained_mask) if m]


def group_samples(samples: list[Sample]) -> dict[str, list[Sample]]:
    """Samples by GRPO group, each group's in the order given."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return groups
