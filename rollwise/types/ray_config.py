"""The `ray:` section of the run config (placement: ray): how many engine, trainer and reward actors, what each
reserves, how they are placed, or a plan from `rollwise sim plan` that chooses the split. rollwise.config
composes it into RunConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from rollwise.types.config_section import ConfigSection


class RayConfig(ConfigSection):
    """placement: ray — engines, the trainer and reward workers as Ray actors (rollwise.control.ray.placement)."""

    address: str = Field("auto", description="Ray cluster to join: 'auto' (a running `ray start` cluster, else a "
                         "local one started for this run) or HOST:PORT")
    num_engines: int = Field(1, ge=1, description="engine actors; a GRPO group stays on one engine")
    engine_cpus: float = Field(1.0, ge=0, description="CPUs reserved per engine actor")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved per engine actor")
    trainer_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the trainer actor")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the trainer actor")
    trainer_ranks: int = Field(1, ge=1, description="trainer actors: N > 1 shards the trainer (FSDP2) over N actors, "
                               "one process group, each with ray.trainer_cpus / ray.trainer_gpus")
    reward_workers: int = Field(1, ge=1, description="reward actors scoring finished groups")
    max_restarts: int = Field(3, ge=0, description="times Ray restarts a dead actor (engines re-sync to the current policy)")
    reward_cpus: float = Field(0.25, ge=0, description="CPUs reserved per reward actor")
    env_cpus: float = Field(0.25, ge=0, description="CPUs reserved per environment worker actor (an environment "
                            "task's task.workers, each one actor owning the environment's process)")
    teacher_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the teacher actor (train.teacher.model: "
                                "on-policy distillation's teacher engine, rollwise.control.ray.teacher_actor)")
    teacher_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the teacher actor")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the run's bundles (engines, trainer, reward workers)")
    start_timeout_s: float = Field(300.0, gt=0, description="wait this long for the placement group and the actors")
    restart_timeout_s: float = Field(300.0, gt=0, description="wait this long for Ray to bring a dead engine back")
    # Issue 26: the split chosen by `rollwise sim plan SCENARIO --out PLAN.yaml` replaces num_engines and
    # engine_gpus (its engine replicas, GPUs per engine), trainer_ranks and trainer_gpus (one GPU per rank).
    plan: str | None = Field(None, description="a plan file written by `rollwise sim plan --out`")

    @model_validator(mode="after")
    def _take_plan(self) -> RayConfig:
        if self.plan is None:
            return self
        try:
            choice = (yaml.safe_load(Path(self.plan).read_text()) or {})["choice"]
            split = {"num_engines": int(choice["engine_replicas"]), "engine_gpus": float(choice["gpus_per_engine"]),
                     "trainer_ranks": int(choice["trainer_gpus"]), "trainer_gpus": 1.0}
        except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"ray.plan={self.plan!r}: not a readable plan ({exc!r}); write one with "
                             "`rollwise sim plan SCENARIO --out PLAN.yaml`") from exc
        for key, value in split.items():
            object.__setattr__(self, key, value)
        return self
