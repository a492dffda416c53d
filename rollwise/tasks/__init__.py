"""Tasks: problem sources with held-out eval splits and their verifiers; `make_task` builds one from config.

    make_task({"kind": "reasoning_gym", "name": "basic_arithmetic",
               "params": {"min_terms": 2, "max_terms": 3}, "train_size": 1000, "eval_size": 200})
    make_task({"kind": "jsonl", "path": "data/qa.jsonl", "eval_fraction": 0.1})
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from rollwise.types.task import Task
from rollwise.tasks.jsonl_task import JsonlTask
from rollwise.tasks.reasoning_gym_task import ReasoningGymTask
from rollwise.tasks.openenv_task import OpenEnvArgs, OpenEnvStart
from rollwise.tasks.verifiers_task import EnvironmentTask
from rollwise.types.config_section import ConfigSection

# Sizes used for reasoning-gym when the config leaves them out (JSONL uses the whole file).
DEFAULT_RG_TRAIN_SIZE = 1000
DEFAULT_RG_EVAL_SIZE = 200
DEFAULT_ENV_EVAL_SIZE = 50  # environment tasks: eval problem i is the environment's eval row i % its length
# Task kinds whose rollouts run in environment worker processes (rollwise.environments), scored by the environment.
ENVIRONMENT_KINDS = ("verifiers", "openenv")

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
    "env": "verifiers",
    "args": "environments",  # any of ENVIRONMENT_KINDS; verifiers: load_environment's kwargs; openenv: OpenEnvArgs
    "python": "verifiers",
    "workers": "environments",
    "rollout_timeout_s": "environments",
    "describe_tools": "verifiers",
    "url": "openenv",
    "start": "openenv",
}


class TaskConfig(ConfigSection):  # no unknown keys, finite numbers (rollwise.types.config_section)

    kind: Literal["reasoning_gym", "jsonl", "verifiers", "openenv"]
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
    # kind verifiers (rollwise.environments): a classic verifiers environment run as a service
    env: str | None = Field(None, description="verifiers: the environment id given to vf.load_environment")
    args: dict[str, Any] = Field(default_factory=dict, description="verifiers: keyword arguments of load_environment")
    python: str | None = Field(None, description="verifiers: the interpreter the environment runs under (its "
                               "own virtual environment's bin/python); default: rollwise's")
    workers: int = Field(1, ge=1, le=256, description="verifiers: environment worker processes")
    rollout_timeout_s: float = Field(300.0, gt=0, description="verifiers: a rollout with no result by then fails")
    describe_tools: bool = Field(True, description="verifiers: describe the environment's tools in the prompt when "
                                 "the chat template cannot; false when the environment's own prompt shows the call format")
    # kind openenv (rollwise.tasks.openenv_task): an OpenEnv environment server, reached or started
    url: str | None = Field(None, pattern=r"^https?://", description="openenv: a running server's base URL")
    start: OpenEnvStart | None = Field(None, description="openenv: how rollwise starts the server itself")

    @model_validator(mode="after")
    def _check_kind_fields(self) -> TaskConfig:
        if self.kind == "reasoning_gym" and not self.name:
            raise ValueError("kind 'reasoning_gym' needs `name` (a reasoning_gym.factory.DATASETS key)")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("kind 'jsonl' needs `path` (a JSONL file)")
        if self.kind == "verifiers" and not self.env:
            raise ValueError("kind 'verifiers' needs `env` (the environment id, e.g. verifiers-calc-env)")
        if self.kind == "openenv":
            if (self.url is None) == (self.start is None):
                raise ValueError("kind 'openenv' needs exactly one of `url` (a running server) or `start` "
                                 "(app: 'package.module:app', or command)")
            openenv_args(self)  # its own errors name the field
        for field_name in sorted(self.model_fields_set):
            owner = _ONLY_FOR.get(field_name)
            allowed = ENVIRONMENT_KINDS if owner == "environments" else (owner,)
            if owner is not None and self.kind not in allowed:
                raise ValueError(f"`{field_name}` only applies to kind {' or '.join(map(repr, allowed))}, "
                                 f"but kind is {self.kind!r}")
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


def _build_verifiers(cfg: TaskConfig) -> Task:
    assert cfg.env is not None  # checked by TaskConfig
    return EnvironmentTask("verifiers", cfg.env, cfg.train_size if cfg.train_size is not None else DEFAULT_RG_TRAIN_SIZE,
                           cfg.eval_size if cfg.eval_size is not None else DEFAULT_ENV_EVAL_SIZE)


def openenv_args(cfg: TaskConfig) -> OpenEnvArgs:
    """task.args of an openenv task, checked (a ValueError names `args.<field>`)."""
    try:
        return OpenEnvArgs.model_validate(cfg.args)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"args.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None


def _build_openenv(cfg: TaskConfig) -> Task:
    label = cfg.name or cfg.url or (cfg.start.app if cfg.start is not None and cfg.start.app else "openenv")
    return EnvironmentTask("openenv", label, cfg.train_size if cfg.train_size is not None else DEFAULT_RG_TRAIN_SIZE,
                           cfg.eval_size if cfg.eval_size is not None else DEFAULT_ENV_EVAL_SIZE)


TASK_BUILDERS: dict[str, Callable[[TaskConfig], Task]] = {
    "reasoning_gym": _build_reasoning_gym,
    "jsonl": _build_jsonl,
    "verifiers": _build_verifiers,
    "openenv": _build_openenv,
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
    "ENVIRONMENT_KINDS",
    "DEFAULT_RG_TRAIN_SIZE",
    "TASK_BUILDERS",
    "TaskConfig",
    "make_task",
]
