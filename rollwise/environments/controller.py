"""`rollwise train` with an environment task (`task.kind: verifiers`): rollouts run in environment workers.

EnvController offers the training loop the RolloutController's interface (as rollwise.agent.controller's
AgentController does) for rollout.mode=sync. Each step takes the problems the loop would (ProblemStream: an
environment task's problems are dataset positions), runs group_size rollouts of each in the environment's
workers (rollwise.environments.workers), every model call through a proxy session on the loop's engine, and
returns one Sample per trajectory segment with the environment's reward. A rollout that failed (crash,
timeout, garbage, a reward function that raised) gets the failure reward and its reason (extra env_error,
metric env_failed_rollouts and env_fail/<reason> counts); it never fails the step.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollwise.agent.generator import LocalGenerator
from rollwise.agent.session import SessionLimits
from rollwise.environments.kinds import worker_spec
from rollwise.environments.protocol import Sampling
from rollwise.environments.runner import EnvRunner, RolloutJob, RolloutResult
from rollwise.environments.workers import LOCAL, EnvService, WorkerError, WorkerHosting
from rollwise.config import RunError
from rollwise.reward.batch import apply_env_reward
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.sync_rollout import sampling_seed
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.agent.episode_book import EpisodeBook
from rollwise.types.sample import Sample
from rollwise.types.task import Problem

if TYPE_CHECKING:
    from rollwise.config import RunConfig
    from rollwise.engine.core import EngineWorker
    from rollwise.types.contracts import Scorer


def failure_kind(error: str) -> str:
    """A short metric name for a failure reason: 'timeout', 'exited', 'garbage', ..."""
    for word in ("timeout", "exited", "garbage", "over", "reward", "gone", "replaced"):
        if word in error:
            return word
    return re.sub(r"[^a-z_]", "", error.split(":")[0].lower().replace(" ", "_"))[:24] or "error"


class EnvController(EpisodeBook):
    def __init__(self, cfg: RunConfig, worker: EngineWorker, tokenizer: Any, stream: ProblemStream,
                 scorer: Scorer, *, policy_version: int = 0, start_group: int = 0,
                 pending_groups: list[int] | None = None, hosting: WorkerHosting = LOCAL) -> None:
        # hosting: where the workers run (processes of this one, or Ray actors under placement: ray).
        if cfg.rollout.mode != "sync":
            raise RunError(f"task.kind={cfg.task.kind}: environment rollouts need rollout.mode=sync (set rollout.mode=sync)")
        if cfg.agent is not None:
            raise RunError(f"task.kind={cfg.task.kind}: the environment runs its own turns and tools; remove the "
                           "`agent:` section")
        spec = worker_spec(cfg.task)
        assert spec is not None  # the loop builds this controller for environment kinds only
        self.cfg, self.tokenizer, self.stream, self.scorer = cfg, tokenizer, stream, scorer
        super().__init__(policy_version=policy_version, start_group=start_group, pending_groups=pending_groups)
        self.score_seconds = 0.0
        self._evals = 0
        self.service = EnvService(spec, workers=cfg.task.workers, rollout_timeout_s=cfg.task.rollout_timeout_s,
                                  host=hosting.make)
        try:
            self.hello = self.service.start()
        except WorkerError as exc:
            raise RunError(f"task.kind={cfg.task.kind}: {exc}") from None
        max_tokens = cfg.rollout.max_tokens
        limits = SessionLimits(max_turns=64, max_tokens=max(max_tokens * 16, 4096), max_tokens_per_turn=max_tokens)
        self.runner = EnvRunner(LocalGenerator(worker=worker), tokenizer, self.service, limits=limits,
                                concurrency=max(cfg.rollout.prompts_per_step * cfg.rollout.group_size, 1),
                                describe_tools=cfg.task.describe_tools, proxy_host=hosting.proxy_host)

    def _score(self, results: list[RolloutResult]) -> None:
        for r in results:
            for s in r.samples:
                apply_env_reward(s, r.reply.reward, None if r.reply.ok else (r.reply.error or "failed"), self.cfg.reward)
                s.extra.update(env_turns=r.reply.turns)

    # ------------------------------------------------------------ the RolloutController interface

    def next_batch(self, progress: Callable[[int], None] | None = None) -> list[Sample]:
        batch, group_size = self.cfg.rollout.prompts_per_step, self.cfg.rollout.group_size
        indices = [self.next_group_index() for _ in range(batch)]
        step = indices[0] // batch
        seed = sampling_seed(self.cfg.seed, step, 0, 1)
        sampling = Sampling(temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
                            max_tokens=self.cfg.rollout.max_tokens)
        jobs = []
        for index in indices:
            s, slot = divmod(index, batch)
            problem = self.stream.batch(s, batch)[slot]
            self.ledger.add_group(index, group_size)
            jobs += [RolloutJob(f"g{index}-{i}", f"g{index}", problem.id, problem.metadata["index"], "train",
                                sampling, seed + 7919 * i) for i in range(group_size)]
        results = self.runner.run(jobs)
        if progress is not None:
            progress(len(results))
        self._score(results)
        for r in results:
            slot = (int(r.job.group_id[1:]), int(r.job.rollout_id.rsplit("-", 1)[1]))
            self.ledger.move(slot, "running")
            if r.samples:
                self.ledger.move(slot, "finished")
                self.ledger.move(slot, "batched")
            else:
                self.ledger.move(slot, "dropped", r.reply.error or "the environment never called the model")
        samples = [s for r in results for s in r.samples]
        failures = Counter(failure_kind(r.reply.error or "") for r in results if not r.reply.ok)
        if not samples:
            raise RuntimeError(f"no rollout of this step called the model (failures: {dict(failures)}; first: "
                               f"{next((r.reply.error for r in results if r.reply.error), None)})")
        n = len(results)
        metrics: dict[str, Any] = {
            "env_failed_rollouts": sum(not r.reply.ok for r in results) / n,
            "env_turns_mean": sum(r.reply.turns for r in results) / n,
            "env_rollouts_without_turns": sum(not r.samples for r in results),
            "env_worker_restarts": self.service.restarts,
            **{f"env_fail_{k}": v for k, v in failures.items()},
        }
        places = self.service.places()
        # Where the workers run (lists, as reward_worker_pids): the host is this process, or an actor per worker.
        metrics["env_worker_pids"] = sorted(p.worker_pid for p in places if p.worker_pid is not None)
        metrics["env_worker_host_pids"] = sorted(p.host_pid for p in places)
        metrics["env_worker_nodes"] = sorted({p.node for p in places})
        names = {k for r in results if r.reply.ok for k in r.reply.metrics}
        for k in sorted(names):
            values = [r.reply.metrics[k] for r in results if r.reply.ok and k in r.reply.metrics]
            metrics[f"env_{k}"] = sum(values) / len(values)
        self.last_metrics = metrics
        return samples

    def evaluate_problems(self, problems: list[Problem], params: SamplingParams, label: str,
                          progress: Callable[[int], None] | None = None) -> list[Sample]:
        """One rollout per problem at the eval sampling; one sample each (its final text in response_text)."""
        self._evals += 1
        sampling = Sampling(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens)
        jobs = [RolloutJob(f"eval{self._evals}-{label}-{i}", f"eval{self._evals}-{label}-{i}", p.id,
                           p.metadata["index"], "eval", sampling, 0) for i, p in enumerate(problems)]
        results = self.runner.run(jobs)
        if progress is not None:
            progress(len(results))
        self._score(results)
        out = []
        for r in results:
            if r.samples:
                head = r.samples[0]
            else:
                head = Sample(r.job.rollout_id, r.job.group_id, r.job.problem_id, [], [], [], [],
                              "error" if not r.reply.ok else "stop")
                apply_env_reward(head, r.reply.reward, None if r.reply.ok else (r.reply.error or "failed"),
                                 self.cfg.reward)
            head.response_text = r.reply.final_text
            out.append(head)
        return out

    def run_requests(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
                     ) -> list[Completion]:
        raise RunError("environment tasks generate through their environment; this loop feature needs a built-in task")

    def close(self, reason: str = "the run ended") -> None:
        # The loop evaluates after close(): the workers and the proxy stay until the process ends (daemon
        # threads; the workers are killed at exit by their pipes closing).
        pass

    def shutdown(self) -> None:
        self.runner.close()
        self.service.close()
