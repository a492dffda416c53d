"""`rollwise train` with an `agent:` section: rollouts are multi-turn, tool-using episodes.

AgentController offers the training loop the RolloutController's interface (next_batch, run_requests,
before/after_update, checkpoint state) for rollout.mode=sync. Each step takes the same problems the
single-turn loop would (ProblemStream), runs group_size episodes per problem concurrently on the
loop's engine worker, and returns one Sample per trajectory segment (loss mask on the sampled tokens only).
Each episode's final answer is scored by the run's Scorer as the single-turn controller scores its groups
(rollwise.rollout.group_scoring): a group goes to the scorer as soon as its episodes are done, and with the
reward pool it is scored while the other episodes run. Advantages are per episode.
Held-out evaluation runs greedy episodes with the same tools.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, as_completed
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from rollwise.agent.episode_book import EpisodeBook, episode_slot
from rollwise.agent.generator import LocalGenerator
from rollwise.agent.rollout import EpisodeOutcome, agent_episodes, episode_heads, share_head_scores
from rollwise.config import AgentConfig
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.group_scoring import GroupScoring
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
        self.scoring = GroupScoring(scorer)  # episode groups being scored (in the background for the reward pool)
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

    def _episodes(self, problems: list[Problem], group_ids: list[str], group_size: int, temperature: float,
                  seed: int, max_tokens_per_turn: int | None = None
                  ) -> AbstractContextManager[list[Future[EpisodeOutcome]]]:
        agent_cfg = self.agent_cfg
        if max_tokens_per_turn is not None:
            agent_cfg = agent_cfg.model_copy(update={"max_tokens_per_turn": max_tokens_per_turn})
        return agent_episodes(self.generator, self.tokenizer, problems, group_size, self._messages, agent_cfg,
                              temperature=temperature, top_p=self.cfg.rollout.top_p, seed=seed,
                              group_ids=group_ids, sandbox_pool=self._sandboxes)

    def _run_and_score(self, problems: list[Problem], indices: list[int], progress: Callable[[int], None] | None
                       ) -> list[EpisodeOutcome]:
        """Run the groups' episodes; each group goes to the scorer once its last episode is done (the pool scores it
        while the others run). Returns when every episode is done and scored; `score_seconds` gets the time spent
        scoring inline or waiting for scores after the last episode."""
        group_size = self.cfg.rollout.group_size
        step = indices[0] // self.cfg.rollout.prompts_per_step
        left = dict.fromkeys(indices, group_size)
        try:
            with self._episodes(problems, [f"g{i}" for i in indices], group_size, self.cfg.rollout.temperature,
                                sampling_seed(self.cfg.seed, step, 0, 1)) as futures:
                slot_of = {f: k for k, f in enumerate(futures)}  # episode k is of group indices[k // group_size]
                for future in as_completed(futures):
                    future.result()  # an episode that raised fails the step, as before
                    self.scoring.arrived()
                    if progress is not None:
                        progress(1)
                    k = slot_of[future]
                    group = indices[k // group_size]
                    left[group] -= 1
                    if left[group] == 0:
                        first = k // group_size * group_size
                        heads = episode_heads([f.result() for f in futures[first:first + group_size]])
                        self.score_seconds += self.scoring.submit(group, heads, time.monotonic())
                    self.scoring.collect()
                outcomes = [f.result() for f in futures]
            t = time.monotonic()
            while len(self.scoring):  # the trainer waits on the reward alone now
                self.scoring.wait(timeout=0.05)
                self.scoring.collect()
            self.score_seconds += time.monotonic() - t
        except BaseException:
            self.scoring.clear()
            raise
        return outcomes

    # ------------------------------------------------------------ the RolloutController interface

    def next_batch(self, progress: Callable[[int], None] | None = None) -> list[Sample]:
        batch = self.cfg.rollout.prompts_per_step
        indices = [self.next_group_index() for _ in range(batch)]
        problems = []
        for index in indices:
            step, slot = divmod(index, batch)
            problems.append(self.stream.batch(step, batch)[slot])
        outcomes = self._run_and_score(problems, indices, progress)
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
        samples = share_head_scores(outcomes)
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
            **self.scoring.step_metrics(),  # overlap of scoring with the episodes (rollwise.rollout.group_scoring)
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
        with self._episodes(problems, [f"eval-{label}-{i}" for i in range(len(problems))], 1, params.temperature,
                            0, max_tokens_per_turn=params.max_tokens) as futures:
            outcomes = [f.result() for f in futures]
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

