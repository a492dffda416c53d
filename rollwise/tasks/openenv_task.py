"""`task: {kind: openenv, url: ... | start: {...}, args: {...}}`: an OpenEnv environment server.

The environment is a server (OpenEnv's reset/step/state API) that rollwise either reaches at `url` or starts
itself from `start` (an ASGI app run by uvicorn, or a command), under the environment's own interpreter
(`start.python`), so its dependencies never have to fit the trainer's. rollwise.environments.openenv_worker
drives it: one WebSocket session per rollout, the policy's text as each action, the environment's rewards.
Train episode i resets with seed i, eval episode i with seed `args.eval_seed_offset + i` (held out).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class OpenEnvStart(_Strict):
    """How rollwise starts the environment server (one per environment worker, on a free loopback port)."""

    app: str | None = Field(None, pattern=r"^[\w.]+:[\w.]+$",
                            description="the server's ASGI app, 'package.module:app' (run with uvicorn)")
    command: list[str] | None = Field(None, min_length=1,
                                      description="or a command that serves on port '{port}' (replaced)")
    python: str | None = Field(None, description="the interpreter of `app` (the environment's own virtual "
                                                 "environment's bin/python); default: rollwise's")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the server")
    cwd: str | None = None

    @model_validator(mode="after")
    def _one_way(self) -> OpenEnvStart:
        if (self.app is None) == (self.command is None):
            raise ValueError("give exactly one of `app` ('package.module:app') or `command` (serving on '{port}')")
        if self.command is not None and not any("{port}" in a for a in self.command):
            raise ValueError("`command` must contain '{port}' (the port rollwise chose for the server)")
        return self


class OpenEnvArgs(_Strict):
    """How an episode is played (task.args for kind openenv)."""

    max_turns: int = Field(8, ge=1, le=256, description="policy turns before the episode is cut")
    system_prompt: str | None = None
    action_field: str = Field("message", min_length=1, description="the action field the policy's text goes in")
    observation_field: str | None = Field(None, description="the observation's text field shown to the policy "
                                          "(default: its only text field, else the observation as JSON)")
    reward: Literal["sum", "last"] = "sum"
    reset: dict[str, str | int | float | bool] = Field(default_factory=dict,
                                                       description="extra keyword arguments of reset()")
    step_timeout_s: float = Field(60.0, gt=0, description="an answer to reset/step later than this fails the rollout")
    start_timeout_s: float = Field(60.0, gt=0, description="the server must be healthy within this")
    eval_seed_offset: int = Field(1_000_000, ge=0, description="eval episode i resets with this + i")


def worker_config(url: str | None, start: OpenEnvStart | None, args: OpenEnvArgs, train_size: int,
                  eval_size: int) -> dict[str, object]:
    """The JSON the worker script reads (rollwise.environments.openenv_worker)."""
    return {"url": url, "start": start.model_dump(exclude_none=True) if start is not None else None,
            **args.model_dump(), "train_size": train_size, "eval_size": eval_size}
