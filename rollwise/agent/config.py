"""The `agent:` section of a run config: train on multi-turn, tool-using episodes (rollwise.agent)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ToolName = Literal["calculator", "python", "bash"]


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[ToolName] = Field(default_factory=lambda: ["calculator"],
                                  description="calculator; python/bash run in a sandbox per episode")
    max_turns: int = Field(3, ge=1, description="engine turns per episode")
    max_tokens: int = Field(256, ge=1, description="sampled tokens per episode (all turns)")
    max_tokens_per_turn: int = Field(64, ge=1)
    parser: str = Field("hermes", description="tool-call format (rollwise.agent.toolcalls)")
    describe_tools: bool = Field(True, description="tell the model about the tools in the system message")
    concurrency: int = Field(64, ge=1, description="episodes running at once")
    demo: list[dict[str, str]] = Field(
        default_factory=list,
        description="a worked episode shown before the question (after the system message), as chat "
        "messages, e.g. user -> assistant tool call -> tool -> assistant answer: a format hint for models "
        "that never call tools unprompted; {answer_open}/{answer_close} are the reward's tags")
