"""Prompts -> engine requests -> Samples; the synchronous rollout of a batch (evaluation uses it too).

Sampling seeds derive from (run seed, step, prompt slot), not from a running RNG, so a resumed run
samples exactly what the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.reward.scoring import RewardConfig
from rollwise.types.sample import Sample
from rollwise.types.task import Problem
from rollwise.tasks.prompts import build_messages, encode_prompt, PromptConfig


@dataclass
class RolloutPlan:
    """What one rollout asks of the engine: which problems, how many samples, how to sample."""

    problems: list[Problem]
    params: SamplingParams
    request_prefix: str  # e.g. "step7": request ids are "<prefix>-<slot>"
    seeds: list[int] | None = None  # one sampling seed per problem (sample i uses seed + i)
    few_shot: list[bool] | None = None  # per problem: show the prompt's few-shot examples (default: yes)


class PromptEncoder:
    """Problem -> prompt token ids through the chat template, memoised (the same eval prompts recur)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_cfg: PromptConfig, reward_cfg: RewardConfig):
        self.tokenizer = tokenizer
        self.prompt_cfg = prompt_cfg
        self.reward_cfg = reward_cfg
        self._cache: dict[tuple[str, bool], list[int]] = {}

    def __call__(self, problem: Problem, with_few_shot: bool = True) -> list[int]:
        key = (problem.id, with_few_shot)
        if key not in self._cache:
            messages = build_messages(problem, self.prompt_cfg, self.reward_cfg, with_few_shot)
            self._cache[key] = encode_prompt(self.tokenizer, messages)
        return self._cache[key]


def sampling_seed(run_seed: int, step: int, slot: int, group_size: int) -> int:
    """Distinct, reproducible seeds: sample i of slot k at step s uses this + i."""
    return (run_seed * 1_000_003 + step * 100_003 + slot * (group_size + 1)) % (2**31)


def build_requests(encoder: PromptEncoder, plan: RolloutPlan) -> list[GenerationRequest]:
    """One n-sample request per problem of the plan (request id "<prefix>-<slot>")."""
    requests = []
    for slot, problem in enumerate(plan.problems):
        params = plan.params
        if plan.seeds is not None:
            params = replace(params, seed=plan.seeds[slot])
        with_few_shot = plan.few_shot[slot] if plan.few_shot is not None else True
        requests.append(
            GenerationRequest(
                request_id=f"{plan.request_prefix}-{slot}",
                prompt_ids=encoder(problem, with_few_shot),
                params=params,
            )
        )
    return requests


def to_samples(completions: list[Completion], requests: list[GenerationRequest], problems: list[Problem],
               tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
    """Engine completions -> Samples, with the text that scoring reads decoded from the exact ids."""
    problem_by_request = {req.request_id: problem for req, problem in zip(requests, problems)}
    return [
        Sample.from_completion(c, problem_id=problem_by_request[c.request_id].id,
                               response_text=tokenizer.decode(c.token_ids, skip_special_tokens=True))
        for c in completions
    ]


def rollout(
    engine,
    encoder: PromptEncoder,
    plan: RolloutPlan,
    *,
    progress: Callable[[int], None] | None = None,
) -> list[Sample]:
    """Generate plan.params.n samples per problem on an idle engine, all groups sharing its running
    batch (continuous batching); samples come back in (problem, sample index) order."""
    requests = build_requests(encoder, plan)
    completions = engine.generate(requests, progress=progress)
    return to_samples(completions, requests, plan.problems, encoder.tokenizer)
