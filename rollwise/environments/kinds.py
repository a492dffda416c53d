"""Which worker process runs an environment task of each kind: `WORKER_KINDS[kind](task_config) -> WorkerSpec`.

A kind's worker is a standalone script (it imports nothing of rollwise) run under the task's interpreter
(`task.python`, e.g. the environment's own virtual environment's bin/python; default: this one), speaking
rollwise.environments.protocol. Another kind (OpenEnv) adds its function here.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from rollwise.config import ConfigError
from rollwise.environments.workers import WorkerSpec
from rollwise.tasks import TaskConfig, make_task, openenv_args
from rollwise.tasks.openenv_task import worker_config

_HERE = Path(__file__).resolve().parent


def interpreter(cfg: TaskConfig) -> str:
    """task.python as a path that runs; refused by name when it does not exist."""
    return find_python(cfg.python, "task.python")


def find_python(python: str | None, field: str) -> str:
    """`python` (the config's `field`) as a path that runs, default this interpreter; refused by name if missing."""
    if python is None:
        return sys.executable
    found = shutil.which(python)
    if found is None:
        raise ConfigError(f"{field}={python}: no such interpreter (give the environment's virtual "
                          "environment's bin/python)")
    return found


def verifiers_spec(cfg: TaskConfig) -> WorkerSpec:
    config = json.dumps({"env": cfg.env, "args": cfg.args})
    return WorkerSpec(argv=[interpreter(cfg), str(_HERE / "verifiers_worker.py"), config], label=f"verifiers:{cfg.env}")


def openenv_spec(cfg: TaskConfig) -> WorkerSpec:
    """The OpenEnv worker runs under rollwise's interpreter (it needs only aiohttp); the environment server it
    drives runs under `task.start.python`, the environment's own."""
    start = cfg.start
    if start is not None:
        start = start.model_copy(update={"python": find_python(start.python, "task.start.python")})
    task = make_task(cfg)  # its sizes: episode i of a split is the environment reset with seed i (OpenEnvArgs)
    config = worker_config(cfg.url, start, openenv_args(cfg), len(task.problems("train")), len(task.problems("eval")))
    label = f"openenv:{cfg.url or (start.app if start is not None and start.app else 'server')}"
    return WorkerSpec(argv=[sys.executable, str(_HERE / "openenv_worker.py"), json.dumps(config)], label=label)


WORKER_KINDS: dict[str, Callable[[TaskConfig], WorkerSpec]] = {
    "verifiers": verifiers_spec,
    "openenv": openenv_spec,
}


def worker_spec(cfg: TaskConfig) -> WorkerSpec | None:
    """The worker of an environment task; None for a task rollwise scores itself (reasoning_gym, jsonl)."""
    make = WORKER_KINDS.get(cfg.kind)
    return make(cfg) if make is not None else None
