"""Reward workers as Ray actors (`placement: ray`): each finished group is scored on one of them.

Kept apart from rollwise.control.ray.placement so a reward actor imports no torch: scoring needs the
task and the verifiers only, and the actor starts in a fraction of an engine's time.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from rollwise.config import RunConfig, dump_config
from rollwise.types.sample import Sample

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class RewardActor:
    """Scores finished groups with the task's verifier (rollwise.reward.batch.score_samples)."""

    def __init__(self, cfg_data: dict) -> None:
        from rollwise.tasks import make_task

        self.cfg = RunConfig.model_validate(cfg_data)
        self.task = make_task(self.cfg.task)
        # The same problems the driver holds (tasks are deterministic: resume relies on it too); built
        # here, not shipped, so a restarted actor needs nothing from the object store.
        self.problems = {p.id: p for p in self.task.problems("train") + self.task.problems("eval")[: self.cfg.eval.size]}

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

    def score(self, samples: list[Sample]) -> list[dict[str, Any]]:
        from rollwise.reward.batch import score_samples

        score_samples(samples, self.problems, self.task, self.cfg.reward)
        return [{"reward": s.reward, "outcome": s.outcome, "strict_correct": s.strict_correct,
                 "lenient_correct": s.lenient_correct, "reward_error": s.extra.get("reward_error")} for s in samples]


class RayScorer:
    """The controller's Scorer on Ray (rollwise.types.contracts.Scorer): a finished group is scored on a reward actor (round robin), and
    the results are written into the samples in place, as rollwise.reward.batch.score_samples does.
    Scoring is idempotent: Ray retries a call on a restarted actor (max_task_retries)."""

    def __init__(self, actors: list[ActorHandle]) -> None:
        self.actors = actors
        self.info_refs = [a.info.remote() for a in actors]  # awaited with the engines (place_on_ray)
        self._next = 0

    def score(self, group: list[Sample]) -> None:
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        for s, r in zip(group, ray.get(actor.score.remote(group))):
            s.reward, s.outcome = r["reward"], r["outcome"]
            s.strict_correct, s.lenient_correct = r["strict_correct"], r["lenient_correct"]
            if r["reward_error"]:
                s.extra["reward_error"] = r["reward_error"]


def start_reward_workers(cfg: RunConfig) -> RayScorer:
    """`ray.reward_workers` reward actors in the run's placement group (not awaited: they start with the engines)."""
    from rollwise.control.ray.placement import session

    s = session(cfg)
    actors = [
        ray.remote(RewardActor).options(
            num_cpus=cfg.ray.reward_cpus, max_restarts=cfg.ray.max_restarts, max_task_retries=cfg.ray.max_restarts,
            scheduling_strategy=s.strategy(bundle),
        ).remote(dump_config(cfg))
        for bundle in s.reward_bundles
    ]
    s.actors += actors
    s.scorer = RayScorer(actors)
    return s.scorer
