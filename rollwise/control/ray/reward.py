"""Reward workers as Ray actors (`placement: ray`): each finished group is scored on one of them.

Kept apart from rollwise.control.ray.placement so a reward actor imports no torch: scoring needs the
task and the verifiers only, and the actor starts in a fraction of an engine's time.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray

from rollwise.config import RunConfig, dump_config
from rollwise.types.sample import Sample

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class RewardActor:
    """Scores finished groups as a local run does (rollwise.reward.pool_scorer.make_scorer): with `reward.executor:
    pool` in the actor's own reward worker processes, so a reward that hangs or crashes costs its sample, not the
    actor; with `inprocess` in the actor."""

    def __init__(self, cfg_data: dict) -> None:
        from rollwise.tasks import make_task

        self.cfg = RunConfig.model_validate(cfg_data)
        self.task = make_task(self.cfg.task)
        # The same problems the driver holds (tasks are deterministic: resume relies on it too); built
        # here, not shipped, so a restarted actor needs nothing from the object store.
        self.problems = {p.id: p for p in self.task.problems("train") + self.task.problems("eval")[: self.cfg.eval.size]}
        from rollwise.reward.pool_scorer import make_scorer

        self.scorer = make_scorer(self.problems, self.task, self.cfg.task.model_dump(mode="json", exclude_unset=True),
                                  self.cfg.reward)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

    def score(self, samples: list[Sample]) -> list[dict[str, Any]]:
        from rollwise.reward.batch import REWARD_ERROR, REWARD_ERROR_KIND
        from rollwise.reward.pool import REWARD_WORKER_PID

        self.scorer.score(samples)
        return [{"reward": s.reward, "outcome": s.outcome, "strict_correct": s.strict_correct,
                 "lenient_correct": s.lenient_correct,
                 "extra": {k: s.extra[k] for k in (REWARD_ERROR, REWARD_ERROR_KIND, REWARD_WORKER_PID) if k in s.extra}}
                for s in samples]


class RayScorer:
    """The controller's Scorer on Ray (rollwise.types.contracts.ConcurrentScorer): a finished group is scored on a
    reward actor (round robin) in the background, and the results are written into the samples in place, as
    rollwise.reward.batch.score_samples does. Scoring is idempotent: Ray retries a call on a restarted actor
    (max_task_retries); a call that still fails gives its samples the error reward (kind `actor`), not the step."""

    def __init__(self, actors: list[ActorHandle], error_reward: float = 0.0) -> None:
        self.actors, self.error_reward = actors, error_reward
        self.info_refs = [a.info.remote() for a in actors]  # awaited with the engines (place_on_ray)
        self._next = 0

    def submit(self, group: list[Sample]) -> Future[None]:
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        done: Future[None] = Future()
        call = actor.score.remote(group).future()
        call.add_done_callback(lambda f: self._apply(group, f, done))
        return done

    def _apply(self, group: list[Sample], call: Future, done: Future[None]) -> None:
        from rollwise.reward.batch import REWARD_ERROR, REWARD_ERROR_KIND

        try:
            results = call.result()
        except Exception as exc:  # noqa: BLE001 -- the actor died past its restarts: the samples fail, the run goes on
            for s in group:
                s.reward, s.outcome, s.strict_correct, s.lenient_correct = self.error_reward, "unparseable", False, False
                s.extra[REWARD_ERROR], s.extra[REWARD_ERROR_KIND] = f"reward actor failed: {exc}"[:500], "actor"
        else:
            for s, r in zip(group, results):
                s.reward, s.outcome = r["reward"], r["outcome"]
                s.strict_correct, s.lenient_correct = r["strict_correct"], r["lenient_correct"]
                s.extra.update(r["extra"])
        done.set_result(None)

    def score(self, group: list[Sample]) -> None:
        self.submit(group).result()


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
    s.scorer = RayScorer(actors, error_reward=cfg.reward.unparseable)
    return s.scorer
