"""The teacher of on-policy distillation as a Ray actor (`placement: ray` with train.teacher.model).

The actor builds the teacher's engine itself (rollwise.control.teacher.build_teacher_engine: the checks and sizing
of an in-process teacher), in the run's placement group on a bundle of its own (ray.teacher_cpus / ray.teacher_gpus,
rollwise.control.ray.placement.RaySession), so the teacher's weights and forwards take the cluster's resources, not
the driver's. The driver's Teacher holds a `RayTokenScorer`: each score_tokens call is one actor call. Scoring is
idempotent, so Ray restarts a dead teacher actor and retries the call (ray.max_restarts).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from rollwise.config import ConfigError, RunConfig
from rollwise.control.ray.calls import get_all, log
from rollwise.control.teacher_engine import build_teacher_engine
from rollwise.types.score import ScoreSequence
from rollwise.types.sft_config import TeacherConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class TeacherActor:
    """The teacher's engine in its own process; a ConfigError while building it is said by `info`, not raised (so
    the driver refuses the run with the train.teacher field named, not a Ray traceback)."""

    def __init__(self, teacher_data: dict, student_vocab: dict[str, int], temperature: float, max_model_len: int,
                 threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.error: str | None = None
        try:
            # its own process: no vLLM engine of the run beside it
            self.engine = build_teacher_engine(TeacherConfig.model_validate(teacher_data), student_vocab,
                                               temperature=temperature, max_model_len=max_model_len,
                                               student_engine="remote")
        except ConfigError as exc:
            self.error = str(exc)

    def info(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "engine": self.engine.describe()}

    def score_tokens(self, sequences: list[ScoreSequence], temperature: float) -> list[list[float]]:
        return self.engine.score_tokens(sequences, temperature)


class RayTokenScorer:
    """rollwise.control.teacher.TokenScorer over the teacher actor: one actor call per score_tokens."""

    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        # no timeout, as the trainer actor's train_step: a batch's forward takes what the teacher's size takes
        return ray.get(self.actor.score_tokens.remote(list(sequences), temperature))

    def close(self) -> None:
        if ray.is_initialized():  # else the session's teardown (ray.shutdown) ended the actor already
            ray.kill(self.actor)


def start_teacher_actor(cfg: RunConfig, student_tokenizer: Any) -> tuple[RayTokenScorer, str]:
    """The teacher actor on the session's teacher bundle, awaited (refused early: before any engine starts): its
    scorer (rollwise.control.teacher.Teacher scores through it) and where it runs, for the console."""
    from rollwise.control.ray.placement import session  # placement imports torch and the trainer: not at import

    teacher = cfg.train.teacher
    assert teacher is not None and teacher.model is not None
    s = session(cfg)
    try:
        actor = ray.remote(TeacherActor).options(
            num_cpus=cfg.ray.teacher_cpus, num_gpus=cfg.ray.teacher_gpus, max_restarts=cfg.ray.max_restarts,
            max_task_retries=cfg.ray.max_restarts, scheduling_strategy=s.strategy(s.teacher_bundles[0]),
        ).remote(teacher.model_dump(mode="json"), student_tokenizer.get_vocab(), cfg.rollout.temperature,
                 cfg.engine.max_model_len, cfg.threads)
        s.actors.append(actor)
        info = get_all([actor.info.remote()], cfg.ray.start_timeout_s, "the teacher actor to start")[0]
        if "error" in info:
            raise ConfigError(info["error"])
    except BaseException:
        s.close()
        raise
    log(f"teacher actor ({cfg.ray.teacher_cpus:g} CPU, {cfg.ray.teacher_gpus:g} GPU) on {info['node_ip']} pid "
        f"{info['pid']}: {info['engine']}")
    where = f"{teacher.model} on a Ray teacher actor ({info['node_ip']} pid {info['pid']}): {info['engine']}"
    return RayTokenScorer(actor), where
