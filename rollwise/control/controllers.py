"""Which rollout controller a run drives (rollwise.types.contracts.RolloutControl): an environment task's
(rollwise.environments: rollouts in environment worker processes), an agent run's (rollwise.agent: multi-turn,
tool-using episodes), or the token-level RolloutController of every other run."""

from __future__ import annotations

from collections.abc import Callable

from rollwise.config import RunConfig
from rollwise.engine.core import EngineWorker
from rollwise.rollout.controller import RolloutController
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.tasks import ENVIRONMENT_KINDS
from rollwise.types.contracts import RolloutControl, Scorer


def build_controller(cfg: RunConfig, worker: EngineWorker, tokenizer: object, encoder: PromptEncoder,
                     stream: ProblemStream, scorer: Scorer, *, policy_version: int, updates: int, start_group: int,
                     pending_groups: list[int] | None) -> tuple[RolloutControl, Callable[[], None]]:
    """The controller, and what ends it for good once the run is over (an environment's worker processes; the
    loop still evaluates after the controller's close())."""
    resumed = {"policy_version": policy_version, "start_group": start_group, "pending_groups": pending_groups}
    if cfg.task.kind in ENVIRONMENT_KINDS:
        from rollwise.environments.controller import EnvController

        if cfg.placement != "ray":
            env = EnvController(cfg, worker, tokenizer, stream, scorer, **resumed)
            return env, env.shutdown
        # placement: ray: each environment worker is an actor owning the environment's process.
        from rollwise.control.ray.env_workers import log_env_workers, ray_env_hosting

        env = EnvController(cfg, worker, tokenizer, stream, scorer, **resumed, hosting=ray_env_hosting(cfg))
        log_env_workers(env.service.places())
        return env, env.shutdown
    if cfg.agent is not None:
        from rollwise.agent.controller import AgentController

        return AgentController(cfg, worker, tokenizer, stream, scorer, **resumed), lambda: None
    return RolloutController(cfg, worker, encoder, stream, scorer, updates=updates, **resumed), lambda: None
