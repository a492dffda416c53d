"""`rollwise train` with an `agent:` section: rollouts are multi-turn, tool-using episodes.

AgentController offers the training loop the RolloutController's interface (next_batch, run_requests,
before/after_update, checkpoint state) for rollout.mode=sync. Each step takes the same problems the
single-turn loop would (ProblemStream), runs group_size episodes per problem concurrently on the
loop's engine worker, scores each episode's final answer with the task's verifier, and returns one
Sample per trajectory segment (loss mask on the sampled tokens only). Advantages are per episode.
Held-out evaluation runs greedy episodes with the same tools.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollwise.agent.episode_book import EpisodeBook, episode_slot
from rollwise.agent.generator import LocalGenerator
from rollwise.agent.rollout import EpisodeOutcome, run_agent_groups, score_episodes
from rollwise.config import AgentConfig
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.rollout.data import ProblemStream
from rollwise.types.contracts import Scorer
from rollwise.rollout.sync_rollout import sampling_seed
from rollwise.types.sample import Sample
from rollwise.engine.core import EngineWorker
from rollwise.types.task import Problem
from rollwise.tasks.prompts import build_messages

if TYPE_CHECKING:
    from rollwise.config import RunConfig
    from rollwise.sandbox.pool import SandboxPool


class AgentController(EpisodeBook):
    def __init__(self, cfg: RunConfig, worker: EngineWorker, tokenizer: Any, stream: ProblemStream,
                 scorer: Scorer, *, policy_version: int = 0, start_group: int = 0,
                 pending_groups: list[int] | None = None) -> None:
        if cfg.rollout.mode != "sync":
            raise ValueError("agent: training on episodes needs rollout.mode=sync (set rollout.mode=sync)")
        self.cfg = cfg
        self.agent_cfg: AgentConfig = cfg.agent
        self.tokenizer = tokenizer
        self.stream = stream
        self.scorer = scorer
        super().__init__(policy_version=policy_version, start_group=start_group, pending_groups=pending_groups)
        self.generator = LocalGenerator(worker=worker)
        self.score_seconds = 0.0
        self._sandboxes = self._new_sandboxes()
        self._sandboxes_closed = False

    def _new_sandboxes(self) -> SandboxPool | None:
        """A sandbox per episode when a tool runs code (python, bash); None when no tool needs one."""
        if not any(t in ("python", "bash") for t in self.agent_cfg.tools):
            return None
        from rollwise.sandbox.pool import SandboxPool

        return SandboxPool(max_sandboxes=self.agent_cfg.concurrency, max_concurrent_runs=2)

    def _messages(self, problem: Problem) -> list[dict[str, Any]]:
        messages = build_messages(problem, self.cfg.prompt, self.cfg.reward, with_few_shot=True)
        if self.agent_cfg.demo:
            tags = {"{answer_open}": self.cfg.reward.answer_open, "{answer_close}": self.cfg.reward.answer_close}
            demo = []
            for m in self.agent_cfg.demo:
                content = m.get("content", "")
                for key, value in tags.items():
                    content = content.replace(key, value)
                demo.append({**m, "content": content})
            at = 1 if messages and messages[0]["role"] == "system" else 0
            messages = messages[:at] + demo + messages[at:]
        return messages

    def _run(self, problems: list[Problem], group_ids: list[str], group_size: int, temperature: float,
             seed: int, max_tokens_per_turn: int | None = None) -> list[EpisodeOutcome]:
        agent_cfg = self.agent_cfg
        if max_tokens_per_turn is not None:
            agent_cfg = agent_cfg.model_copy(update={"max_tokens_per_turn": max_tokens_per_turn})
        return run_agent_groups(self.generator, self.tokenizer, problems, group_size, self._messages, agent_cfg,
                                temperature=temperature, top_p=self.cfg.rollout.top_p, seed=seed,
                                group_ids=group_ids, sandbox_pool=self._sandboxes)

    # ------------------------------------------------------------ the RolloutController interface

    def next_batch(self, progress: Callable[[int], None] | None = None) -> list[Sample]:
        batch = self.cfg.rollout.prompts_per_step
        indices = [self.next_group_index() for _ in range(batch)]
        problems = []
        for index in indices:
            step, slot = divmod(index, batch)
            problems.append(self.stream.batch(step, batch)[slot])
        step = indices[0] // batch
        outcomes = self._run(problems, [f"g{i}" for i in indices], self.cfg.rollout.group_size,
                             self.cfg.rollout.temperature, sampling_seed(self.cfg.seed, step, 0, 1))
        if progress is not None:
            progress(len(outcomes))
        for index in indices:  # one ledger slot per episode: (group index, episode index)
            self.ledger.add_group(index, self.cfg.rollout.group_size)
        for o in outcomes:
            slot = episode_slot(o.episode_id)
            self.ledger.move(slot, "running")
            if o.samples:
                self.ledger.move(slot, "finished")
                self.ledger.move(slot, "batched")
            else:
                self.ledger.move(slot, "dropped", f"no turn sampled (ended by {o.finish_reason})")
        if not any(o.samples for o in outcomes):
            reasons = sorted({o.finish_reason for o in outcomes})
            raise RuntimeError(f"no episode of this step sampled a single turn (ended by {reasons}); with "
                               "'context' the opening prompt does not fit: raise engine.max_model_len")
        t = time.monotonic()
        samples = score_episodes(outcomes, lambda s: self.scorer.score([s]))
        self.score_seconds += time.monotonic() - t
        n = max(len(outcomes), 1)
        calls = sum(o.tool_calls for o in outcomes)
        self.last_metrics = {
            "agent_turns_mean": sum(o.turns for o in outcomes) / n,
            "agent_tool_calls_per_episode": calls / n,
            "agent_tool_error_rate": sum(o.tool_errors for o in outcomes) / max(calls, 1),
            "agent_episodes_with_tool_result": sum(o.tool_calls > o.tool_errors for o in outcomes) / n,
            "agent_split_segments": sum(max(len(o.samples) - 1, 0) for o in outcomes),
            # e.g. the opening prompt did not fit max_model_len: recorded here, nothing to train on
            "agent_episodes_without_turns": sum(not o.samples for o in outcomes),
        }
        return samples

    def evaluate_problems(self, problems: list[Problem], params: SamplingParams, label: str,
                          progress: Callable[[int], None] | None = None) -> list[Sample]:
        """Greedy episodes, one per problem; one sample each (its final answer in response_text)."""
        if self._sandboxes_closed:
            # The loop evaluates "after" once close() has ended training (and its sandboxes): this eval's
            # episodes get sandboxes of their own, closed when it ends.
            self._sandboxes, self._sandboxes_closed = self._new_sandboxes(), False
            try:
                return self.evaluate_problems(problems, params, label, progress)
            finally:
                self.close()
        outcomes = self._run(problems, [f"eval-{label}-{i}" for i in range(len(problems))], 1, params.temperature,
                             0, max_tokens_per_turn=params.max_tokens)
        if progress is not None:
            progress(len(outcomes))
        out = []
        for o in outcomes:
            if o.samples:
                head = o.samples[0]
            else:
                head = Sample(o.episode_id, o.group_id, o.problem.id, [], [], [], [], o.finish_reason)
            head.response_text = o.final_text
            head.extra.update(tool_calls=o.tool_calls, tool_errors=o.tool_errors)
            out.append(head)
        return out

    def run_requests(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
                     ) -> list[Completion]:
        futures = self.generator.submit(requests)
        done: list[Completion] = []
        for future in futures:
            done += future.result()
            if progress is not None:
                progress(len(done))
        return done

    def close(self, reason: str = "the run ended") -> None:
        # The generator stays: the loop evaluates after close(); its router ends with the worker.
        if self._sandboxes is not None:
            self._sandboxes.close()
            self._sandboxes_closed = True

