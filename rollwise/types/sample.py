"""A trajectory as the trainer receives it: exact token ids, behaviour logprobs, policy versions."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollwise.types.compact import as_versions, logprob_array, token_array
from rollwise.types.routing import RoutedExperts

if TYPE_CHECKING:  # annotations only: the types layer imports no other rollwise package
    from rollwise.types.generation import Completion


@dataclass
class Sample:
    """Per-token fields are stored compactly (rollwise.types.compact), whatever sequence is passed in:
    prompt_ids and response_ids as array('i') (int32, exact), behaviour_logprobs as array('f') (float32:
    exact for the float32 log-probs engines return), versions as VersionRuns (run-length). They read like
    lists; they are not lists (concatenate with [*a, *b], serialise with .tolist()). A controller holds
    100,000s of waiting samples at cluster scale: ~9 bytes a token here against ~24 as lists."""

    sample_id: str  # unique: "<request id>/<sample index>"
    group_id: str  # the GRPO group (one prompt's n samples)
    problem_id: str
    prompt_ids: Sequence[int]  # array('i'); may be shared by a group's samples: never mutate in place
    response_ids: Sequence[int]  # array('i'): exactly the engine's sampled ids, never re-tokenized
    behaviour_logprobs: Sequence[float]  # array('f'): engine log-probs of response_ids
    versions: Sequence[int]  # VersionRuns: policy version that sampled each response token
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
    # MoE: the experts the engine routed every token to (prompt + response[:-1]); the trainer replays them.
    routed_experts: RoutedExperts | None = None
    # One advantage per trained token, when the trainer computes them per token (train.advantage=gae,
    # train.kl_penalty=reward: rollwise.train.token_advantages); None: `advantage` on every trained token.
    token_advantages: Sequence[float] | None = None
    # train.teacher: a reward on every trained token (the teacher's log-prob minus the sampler's, times the
    # coefficient: rollwise.control.teacher), added to the per-token rewards; None: the sample's reward alone.
    token_rewards: Sequence[float] | None = None

    def __post_init__(self) -> None:
        where = f"sample {self.sample_id}"
        self.prompt_ids = token_array(self.prompt_ids, f"{where}: prompt_ids")
        self.response_ids = token_array(self.response_ids, f"{where}: response_ids")
        self.behaviour_logprobs = logprob_array(self.behaviour_logprobs, f"{where}: behaviour_logprobs")
        self.versions = as_versions(self.versions)

    @property
    def trained_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.response_ids)

    @classmethod
    def from_completion(cls, c: Completion, *, problem_id: str, response_text: str = "",
                        sample_id: str | None = None, group_id: str | None = None,
                        prompt_ids: array | None = None, **extra) -> Sample:
        """The engine's exact ids, logprobs and versions; ids default to the completion's own.
        `prompt_ids`: the request's prompt as an array('i') the group's samples share (one copy a group,
        not one a sample); it must be the prompt the completion was generated from."""
        if prompt_ids is not None and len(prompt_ids) != len(c.prompt_ids):
            raise ValueError(f"completion {c.request_id}/{c.index}: shared prompt_ids has {len(prompt_ids)} "
                             f"tokens, the completion's prompt {len(c.prompt_ids)}")
        return cls(
            sample_id=sample_id or c.sample_id,
            group_id=group_id or c.request_id,
            problem_id=problem_id,
            prompt_ids=c.prompt_ids if prompt_ids is None else prompt_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            versions=c.versions,
            finish_reason=c.finish_reason,
            response_text=response_text,
            extra={"cached_prompt_tokens": c.cached_prompt_tokens, **extra},
            routed_experts=c.routed_experts,
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
