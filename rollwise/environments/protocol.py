"""The wire protocol between rollwise and an environment worker process: one JSON object per line.

rollwise writes requests to the worker's stdin; the worker writes replies to its *original* stdout (it points
its own fd 1 at stderr first, so whatever the environment prints never mixes with replies). Every reply is
checked here: a reply that does not parse, or carries a non-finite reward, fails that rollout only.
See /work/notes/env_contract.md (and the README's "Bring your own environment") for the worker's side.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# A reply line longer than this is not read as a reply (an environment flooding its metrics): that rollout fails.
MAX_REPLY_BYTES = 1 << 20


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = Field(256, ge=1)


class RolloutRequest(BaseModel):
    """One rollout: dataset row `index % len(split)`, its model calls sent to `base_url` (a proxy session)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["rollout"] = "rollout"
    id: str
    split: Literal["train", "eval"] = "train"
    index: int = Field(ge=0)
    base_url: str
    model: str
    sampling: Sampling = Field(default_factory=Sampling)
    seed: int = 0
    # The rollout's GRPO group: an environment whose rubric scores groups (verifiers' group reward functions)
    # waits for `group_size` requests of the group, runs and scores them together. All go to one worker.
    group: str | None = None
    group_size: int = Field(1, ge=1)


class Hello(BaseModel):
    """The worker's first line: the environment loaded (and its dataset sizes), or why not."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["hello"]
    ok: bool
    train_size: int = Field(0, ge=0)
    eval_size: int = Field(0, ge=0)
    group_rollouts: bool = False  # the environment scores whole groups (it waits for every member)
    error: str | None = None


class RolloutReply(BaseModel):
    """What a rollout gives back besides its tokens (which the proxy recorded): the environment's reward and
    metrics, or why it failed. `ok=False` replies are also made by rollwise itself (crash, timeout, garbage)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    type: Literal["result"] = "result"
    id: str
    ok: bool
    reward: float = 0.0
    metrics: dict[str, float] = Field(default_factory=dict)
    turns: int = Field(0, ge=0)
    final_text: str = ""
    error: str | None = None

    @classmethod
    def failure(cls, rollout_id: str, reason: str) -> RolloutReply:
        return cls(id=rollout_id, ok=False, error=reason)
