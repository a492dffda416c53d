"""The reward pool as the rollout controller's Scorer (rollwise.types.contracts.ConcurrentScorer): every sample of
a finished group is one call in the pool's worker processes (rollwise.reward.pool), and `submit` returns at once,
so the controller goes on taking completions and starting groups while the group is scored.

Which function runs: `reward.function` (a `package.module:function` or `file.py:function` with the pool's call
contract) when set, else the task's own verifier (rollwise.reward.task_reward). A call that raises, hangs, kills
its worker or returns garbage costs that sample only: the error reward (`reward.unparseable`), with the reason
and kind in its extra (rollwise.reward.pool.apply_pool_reward).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from rollwise.reward.batch import ENV_ERROR, ENV_REWARD, InProcessScorer, ScoredSample, apply_env_reward
from rollwise.reward.pool import (
    PoolReward, RewardFnError, RewardPool, apply_pool_reward, load_reward_fn, run_reward_fn,
)
from rollwise.reward.scoring import RewardConfig
from rollwise.reward.task_reward import TASK_VERIFIER, verifier_imports
from rollwise.types.task import Problem, Task


def reward_call(cfg: RewardConfig, task_cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The pool function a run's samples are scored with, and the keyword arguments each call carries."""
    if cfg.function is not None:
        return cfg.function, {}
    return TASK_VERIFIER, {"task": task_cfg, "reward": cfg.model_dump(mode="json")}


def make_pool(cfg: RewardConfig, preload: tuple[str, ...] = ()) -> RewardPool:
    """`reward.workers` processes, each call bounded by `reward.timeout_s`, each worker by `reward.memory_mb`. The
    task verifier's imports (the tasks, reasoning-gym, math-verify) happen as a worker starts, not in a call."""
    return RewardPool(workers=cfg.workers, timeout_s=cfg.timeout_s,
                      memory_bytes=cfg.memory_mb * 1024**2 if cfg.memory_mb is not None else None,
                      error_reward=cfg.unparseable,
                      preload=preload)


class PoolScorer:
    """Scores samples in a RewardPool. `task_cfg`: the run's task section as set (model_dump(exclude_unset=True))."""

    def __init__(self, problems: dict[str, Problem], task_cfg: dict[str, Any], cfg: RewardConfig,
                 pool: RewardPool | None = None) -> None:
        self.problems, self.cfg = problems, cfg
        self.fn, self.kwargs = reward_call(cfg, task_cfg)
        self.pool = pool if pool is not None else make_pool(cfg, () if cfg.function else verifier_imports(task_cfg))

    def submit(self, samples: Sequence[ScoredSample]) -> Future[None]:
        """Start scoring `samples`; the future resolves (never with an exception) once every one is filled in."""
        done: Future[None] = Future()
        pending = []
        for s in samples:
            if ENV_REWARD in s.extra:  # scored by its environment service already: nothing to run
                apply_env_reward(s, s.extra[ENV_REWARD], s.extra.get(ENV_ERROR), self.cfg)
            else:
                pending.append(s)
        if not pending:
            done.set_result(None)
            return done
        left = [len(pending)]
        lock = threading.Lock()

        def finished(s: ScoredSample, call: Future[PoolReward]) -> None:
            apply_pool_reward(s, call.result())  # a pool call resolves to a PoolReward, never an exception
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done.set_result(None)

        for s in pending:
            call = self.pool.submit(self.fn, self.problems[s.problem_id], s.response_text, s.finish_reason,
                                    key=s.problem_id, kwargs=self.kwargs)
            call.add_done_callback(lambda f, s=s: finished(s, f))
        return done

    def score(self, samples: Sequence[ScoredSample]) -> None:
        self.submit(samples).result()

    def close(self) -> None:
        self.pool.close()


class InProcessFunctionScorer:
    """`reward.executor: inprocess` with a `reward.function`: the function called in this process (for a debugger;
    no timeout, no isolation), its failures recorded as the pool records them."""

    def __init__(self, problems: dict[str, Problem], cfg: RewardConfig) -> None:
        assert cfg.function is not None
        self.problems, self.cfg, self.path = problems, cfg, cfg.function
        self.fn = load_reward_fn(cfg.function)  # a RewardFnError (a config error) before the run starts

    def score(self, samples: Sequence[ScoredSample]) -> None:
        for s in samples:
            if ENV_REWARD in s.extra:
                apply_env_reward(s, s.extra[ENV_REWARD], s.extra.get(ENV_ERROR), self.cfg)
                continue
            status, value, detail = run_reward_fn(self.path, self.fn, (self.problems[s.problem_id], s.response_text,
                                                                      s.finish_reason), {})
            if status == "ok":
                apply_pool_reward(s, PoolReward(s.problem_id, self.path, value, detail))
            else:
                apply_pool_reward(s, PoolReward(s.problem_id, self.path, self.cfg.unparseable, None, detail, value))

    def close(self) -> None:
        return None


ScorerWithClose = PoolScorer | InProcessScorer | InProcessFunctionScorer  # a placement closes it with the run


def make_scorer(problems: dict[str, Problem], task: Task, task_cfg: dict[str, Any],
                cfg: RewardConfig) -> ScorerWithClose:
    """The run's Scorer by `reward.executor`. A `reward.function` that cannot be loaded raises RewardFnError (naming
    it) before the run starts: the pool loads it in a worker (importing user code may hang), not here."""
    if cfg.executor == "inprocess":
        return InProcessFunctionScorer(problems, cfg) if cfg.function is not None else InProcessScorer(problems, task, cfg)
    scorer = PoolScorer(problems, task_cfg, cfg)
    error = scorer.pool.check(scorer.fn) if cfg.function is not None else None
    if error is not None:
        scorer.close()
        raise RewardFnError(error)
    return scorer
