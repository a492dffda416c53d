"""Agentic rollouts for training: GRPO groups of multi-turn, tool-using episodes -> scored Samples.

Each problem is tried `group_size` times; every try is an episode (AgentSession + ToolAgent) with its
own tools (a sandbox per episode for python/bash). Episodes run on threads against one generator,
so the engine batches their turns continuously. The episode's final assistant text is scored by the
task's verifier; its trajectory becomes one Sample per segment (rollwise.agent.samples).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollwise.agent.episode import ToolAgent, run_episode
from rollwise.agent.generator import Generator
from rollwise.agent.samples import trajectory_samples
from rollwise.agent.session import AgentSession, SessionLimits
from rollwise.agent.tools import BashTool, CalculatorTool, PythonTool, Tool, ToolRegistry
from rollwise.config import AgentConfig
from rollwise.types.sample import Sample
from rollwise.types.task import Problem

if TYPE_CHECKING:
    from rollwise.sandbox.pool import SandboxPool
    from rollwise.sandbox.types import Sandbox


@dataclass
class EpisodeOutcome:
    problem: Problem
    group_id: str
    episode_id: str
    samples: list[Sample]
    final_text: str
    tool_calls: int
    tool_errors: int
    turns: int
    finish_reason: str


def _tools(names: list[str], sandbox: Sandbox | None) -> list[Tool]:
    made: list[Tool] = []
    for name in names:
        if name == "calculator":
            made.append(CalculatorTool())
        elif name == "python":
            made.append(PythonTool(sandbox))
        elif name == "bash":
            made.append(BashTool(sandbox))
    return made


@contextmanager
def agent_episodes(
    generator: Generator,
    tokenizer: Any,
    problems: list[Problem],
    group_size: int,
    messages_for: Callable[[Problem], list[dict[str, Any]]],
    cfg: AgentConfig,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    group_prefix: str = "agent",
    group_ids: list[str] | None = None,
    sandbox_pool: SandboxPool | None = None,
) -> Iterator[list[Future[EpisodeOutcome]]]:
    """Start all episodes of the groups on threads; yields their futures in (problem, try) order (episode k of
    problem i is `futures[i * group_size + k]`), so a caller can take each episode as it finishes (and score a
    group while others run). Leaving the block waits for every episode. python/bash tools need `sandbox_pool`."""
    needs_sandbox = any(t in ("python", "bash") for t in cfg.tools)
    if needs_sandbox and sandbox_pool is None:
        raise ValueError("agent tools python/bash need a sandbox pool (rollwise.sandbox.SandboxPool)")
    info = generator.info()
    limits = SessionLimits(max_turns=cfg.max_turns, max_tokens=cfg.max_tokens, max_tokens_per_turn=cfg.max_tokens_per_turn,
                           max_tool_calls_per_turn=cfg.max_tool_calls_per_turn)
    rng = random.Random(seed)
    group_ids = group_ids or [f"{group_prefix}-{g}" for g in range(len(problems))]
    jobs = [(p, gid, f"{gid}-{i}", rng.randrange(2**31))
            for gid, p in zip(group_ids, problems) for i in range(group_size)]

    def one(job: tuple[Problem, str, str, int]) -> EpisodeOutcome:
        problem, group_id, episode_id, episode_seed = job
        with ExitStack() as stack:
            sandbox = stack.enter_context(sandbox_pool.sandbox()) if needs_sandbox else None
            registry = ToolRegistry(_tools(cfg.tools, sandbox))
            session = AgentSession(generator, tokenizer, session_id=episode_id, limits=limits, parser=cfg.parser,
                                   temperature=temperature, top_p=top_p, seed=episode_seed, info=info,
                                   tools=registry.specs() if cfg.describe_tools else None)
            agent = ToolAgent(registry)
            result = run_episode(session, messages_for(problem), agent)
        final = result.turns[-1].text if result.turns else ""
        samples = trajectory_samples(result.trajectory, problem_id=problem.id, group_id=group_id,
                                     episode_id=episode_id, response_text=final)
        calls = sum(len(t.parsed.calls) + len(t.parsed.errors) for t in result.turns)
        errors = sum(r.error for r in agent.results)
        for s in samples:
            s.extra.update(tool_calls=calls, tool_errors=errors)
        return EpisodeOutcome(problem, group_id, episode_id, samples, final, calls, errors, len(result.turns),
                              result.finish_reason)

    with ThreadPoolExecutor(max_workers=min(cfg.concurrency, len(jobs)) or 1,
                            thread_name_prefix="agent-episode") as pool:
        yield [pool.submit(one, job) for job in jobs]


def run_agent_groups(generator: Generator, tokenizer: Any, problems: list[Problem], group_size: int,
                     messages_for: Callable[[Problem], list[dict[str, Any]]], cfg: AgentConfig,
                     **kwargs: Any) -> list[EpisodeOutcome]:
    """All episodes of the groups (agent_episodes' arguments), in (problem, try) order, once all have finished."""
    with agent_episodes(generator, tokenizer, problems, group_size, messages_for, cfg, **kwargs) as futures:
        return [f.result() for f in futures]


def score_episodes(outcomes: list[EpisodeOutcome], score: Callable[[Sample], None]) -> list[Sample]:
    """Score each episode once (on its first sample, whose response_text is the final answer) and
    copy the result to its other segments; returns all samples."""
    for head in episode_heads(outcomes):
        score(head)
    return share_head_scores(outcomes)


def episode_heads(outcomes: list[EpisodeOutcome]) -> list[Sample]:
    """The sample each episode is scored on (its first: its response_text is the final answer); none for an
    episode that sampled no turn."""
    return [ep.samples[0] for ep in outcomes if ep.samples]


def share_head_scores(outcomes: list[EpisodeOutcome]) -> list[Sample]:
    """Copy each scored head's result to its episode's other segments; returns all samples."""
    out: list[Sample] = []
    for ep in outcomes:
        if not ep.samples:
            continue
        head = ep.samples[0]
        for s in ep.samples[1:]:
            s.reward, s.outcome = head.reward, head.outcome
            s.strict_correct, s.lenient_correct = head.strict_correct, head.lenient_correct
        out += ep.samples
    return out
