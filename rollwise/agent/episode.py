"""The `step` interface: user code decides what follows each model turn.

    class MyAgent(ToolAgent):
        def step(self, turn, session):
            messages = super().step(turn, session)          # tool results (errors included)
            if messages and session.builder.turns == 3:
                messages.append({"role": "user", "content": "One turn left: answer now."})
            return messages                                  # None or [] ends the episode

    result = run_episode(session, opening_messages, MyAgent(registry))

`step` returns the messages to append (tool results, user or system turns) or None to end the
episode. A limit (turns, tokens, context) ends it too, with that reason; the trajectory is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollwise.agent.session import AgentSession, LimitReached, TurnResult
from rollwise.agent.tools import ToolRegistry, ToolResult
from rollwise.agent.trajectory import Trajectory
from rollwise.engine.retention import RetentionRequest
from rollwise.engine.retention_policy import ToolLatencies


class StepAgent(Protocol):
    def step(self, turn: TurnResult, session: AgentSession) -> list[dict[str, Any]] | None: ...


class ToolAgent:
    """Runs the turn's tool calls; a reply without any tool call ends the episode. Malformed and
    unknown calls are answered with an error tool result, so the model can correct itself."""

    def __init__(self, registry: ToolRegistry, latencies: ToolLatencies | None = None) -> None:
        self.registry = registry
        self.results: list[ToolResult] = []
        # Tool durations as measured here (sandboxed tools included): the expected latency the engine
        # weighs when it decides whether to keep the session's KV during the call (issue 21).
        self.latencies = latencies or ToolLatencies()

    def step(self, turn: TurnResult, session: AgentSession) -> list[dict[str, Any]] | None:
        if not turn.parsed.wants_tools:
            return None
        calls = [*turn.parsed.calls, *turn.parsed.errors]
        tool = getattr(calls[0], "name", None) or "tool"
        intercept(session, turn, tool, self.latencies.expected(tool))
        started = time.monotonic()
        results = [self.registry.execute(call) for call in calls]
        self.latencies.observe(tool, time.monotonic() - started)
        self.results += results
        return [r.message() for r in results]


def intercept(session: AgentSession, turn: TurnResult, tool: str, expected_latency_s: float | None) -> None:
    """Tell the engine the turn ended in a tool call (when the session's generator can)."""
    retain = getattr(session.generator, "retain", None)
    if retain is not None:
        retain(RetentionRequest(session.id, turn.completion.request_id, tool, expected_latency_s))


def end_session(session: AgentSession) -> None:
    """The episode is over: the engine may drop whatever it still holds for the session."""
    release = getattr(session.generator, "release_session", None)
    if release is not None:
        release(session.id)


@dataclass
class EpisodeResult:
    trajectory: Trajectory
    finish_reason: str  # "done" (the agent ended it) or the limit: max_turns | max_tokens | context
    turns: list[TurnResult] = field(default_factory=list)


def run_episode(session: AgentSession, messages: list[dict[str, Any]], agent: StepAgent,
                **sampling: Any) -> EpisodeResult:
    session.start(messages)
    finish = "done"
    while True:
        try:
            turn = session.generate(**sampling)
        except LimitReached as exc:
            finish = exc.reason
            break
        follow = agent.step(turn, session)
        if not follow:
            break
        session.add_messages(follow)
    session.finish_reason = finish
    end_session(session)
    return EpisodeResult(session.trajectory(), finish, list(session.turns))
