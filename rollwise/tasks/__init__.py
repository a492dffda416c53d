"""Tasks: problem sources with held-out eval splits and their verifiers; `make_task` builds one from config.

    make_task({"kind": "reasoning_gym", "name": "basic_arithmetic",
               "params": {"min_terms": 2, "max_terms": 3}, "train_size": 1000, "eval_size": 200})
    make_task({"kind": "jsonl", "path": "data/qa.jsonl", "eval_fraction": 0.1})
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, Field, model_validator

from rollwise.types.task import Task
from rollwise.tasks.jsonl_task import JsonlTask
from rollwise.tasks.reasoning_gym_task import ReasoningGymTask
from rollwise.types.config_section import ConfigSection

# Sizes used for reasoning-gym when the config leaves them out (JSONL uses the whole file).
DEFAULT_RG_TRAIN_SIZE = 1000
DEFAULT_RG_EVAL_SIZE = 200

# Fields that only one kind reads; setting them for the other kind is a config mistake, not a no-op.
_ONLY_FOR: dict[str, str] = {
    "params": "reasoning_gym",
    "strip_instructions": "reasoning_gym",
    "path": "jsonl",
    "prompt_key": "jsonl",
    "answer_key": "jsonl",
    "eval_path": "jsonl",
    "eval_fraction": "jsonl",
    "verifier": "jsonl",
}


class TaskConfig(ConfigSection):  # no unknown keys, finite numbers (rollwise.types.config_section)

    kind: Literal["reasoning_gym", "jsonl"]
    name: str | None = None  # reasoning-gym dataset name (required); for JSONL, a label (default: file stem)
    params: dict[str, Any] = Field(default_factory=dict)  # reasoning-gym generator params
    path: str | None = None  # JSONL file (required for jsonl)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    train_size: int | None = Field(default=None, ge=1)
    eval_size: int | None = Field(default=None, ge=0)
    seed: int = 0
    eval_path: str | None = None  # JSONL eval file; else eval_fraction of `path` is held out
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    strip_instructions: bool = False  # drop reasoning-gym's "give only the answer" sentences
    verifier: Literal["exact", "math_verify"] = Field(
        "exact", description="jsonl: normalized exact match, or math-verify equivalence (1/2 == 0.5 == \\frac{1}{2})"
    )

    @model_validator(mode="after")
    def _check_kind_fields(self) -> TaskConfig:
        if self.kind == "reasoning_gym" and not self.name:
            raise ValueError("kind 'reasoning_gym' needs `name` (a reasoning_gym.factory.DATASETS key)")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("kind 'jsonl' needs `path` (a JSONL file)")
        for field_name in sorted(self.model_fields_set):
            owner = _ONLY_FOR.get(field_name)
            if owner is not None and owner != self.kind:
                raise ValueError(f"`{field_name}` only applies to kind {owner!r}, but kind is {self.kind!r}")
        return self


def _build_reasoning_gym(cfg: TaskConfig) -> Task:
    assert cfg.name is not None  # checked by TaskConfig
    return ReasoningGymTask(
        name=cfg.name,
        params=cfg.params,
        train_size=cfg.train_size if cfg.train_size is not None else DEFAULT_RG_TRAIN_SIZE,
        eval_size=cfg.eval_size if cfg.eval_size is not None else DEFAULT_RG_EVAL_SIZE,
        seed=cfg.seed,
        strip_instructions=cfg.strip_instructions,
    )


def _build_jsonl(cfg: TaskConfig) -> Task:
    assert cfg.path is not None  # checked by TaskConfig
    return JsonlTask(
        path=cfg.path,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        eval_fraction=cfg.eval_fraction,
        eval_path=cfg.eval_path,
        seed=cfg.seed,
        name=cfg.name,
        train_size=cfg.train_size,
        eval_size=cfg.eval_size,
        verifier=cfg.verifier,
    )


TASK_BUILDERS: dict[str, Callable[[TaskConfig], Task]] = {
    "reasoning_gym": _build_reasoning_gym,
    "jsonl": _build_jsonl,
}


def make_task(cfg: TaskConfig | BaseModel | dict[str, Any]) -> Task:
    """Build a Task from a TaskConfig, another pydantic model with the same fields, or a plain dict."""
    if isinstance(cfg, BaseModel) and not isinstance(cfg, TaskConfig):
        cfg = cfg.model_dump(exclude_unset=True)  # unset fields stay unset for the per-kind checks
    if not isinstance(cfg, TaskConfig):
        cfg = TaskConfig.model_validate(cfg)
    return TASK_BUILDERS[cfg.kind](cfg)


__all__ = [
    "DEFAULT_RG_EVAL_SIZE",
    "DEFAULT_RG_TRAIN_SIZE",
    "TASK_BUILDERS",
    "TaskConfig",
    "make_task",
]
