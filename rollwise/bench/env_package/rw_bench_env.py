"""The classic-verifiers environment `rollwise bench environments` runs as an environment service (issue 40): written
as a third party would (it imports nothing of rollwise), loaded by the environment worker with
`vf.load_environment("rw-bench-env", ...)` once the bench puts this directory on the workers' PYTHONPATH.

    kind="single"  a vf.SingleTurnEnv over `rows` (each a chat `prompt` and its `answer`: the bench passes the default
                   run's problems, prompted as the built-in task prompts them) with a regex rubric, the rubric of
                   rollwise.bench.env_rewards:regex_reward (the last <answer>...</answer> holds the answer)
    kind="calc"    the tool environment: examples/verifiers_calc_env's vf.ToolEnv (2-digit multiplication with a
                   calculator tool; its own regex rubric), `calc_args` passed to its load_environment
    slow=True      the same rubric plus a 0-weight reward function that waits SLOW_S (asynchronously: the worker's
                   other rollouts go on, as the reward pool's workers wait without computing)
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import verifiers as vf
from datasets import Dataset

SLOW_S = 0.1
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_reply(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else None
    content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
    return content or ""


def regex_reward(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 when the last <answer>...</answer> of the last reply holds the reference answer, else 0.0."""
    found = _ANSWER.findall(_last_reply(completion))
    return 1.0 if found and found[-1].strip() == str(answer).strip() else 0.0


async def wait_slow(**kwargs: Any) -> float:
    """A verifier's wait (a model call, a test run): SLOW_S. Weight 0: the reward is the regex's; its value 1.0 shows
    in the rollout's metrics (rollwise: env_wait_slow) that it ran."""
    await asyncio.sleep(SLOW_S)
    return 1.0


def load_environment(kind: str = "single", slow: bool = False, rows: list[dict[str, Any]] | None = None,
                     calc_args: dict[str, Any] | None = None) -> vf.Environment:
    if kind == "single":
        if not rows:
            raise ValueError("kind=single needs rows: [{prompt: [chat messages], answer: str}, ...]")
        env: vf.Environment = vf.SingleTurnEnv(dataset=Dataset.from_list(rows),
                                               rubric=vf.Rubric(funcs=[regex_reward], weights=[1.0]))
    elif kind == "calc":
        import verifiers_calc_env  # examples/verifiers_calc_env (pip install --no-deps -e, or on PYTHONPATH)

        env = verifiers_calc_env.load_environment(**(calc_args or {}))
    else:
        raise ValueError(f"kind={kind!r}: use single or calc")
    if slow:
        env.rubric.add_reward_func(wait_slow, weight=0.0)
    return env
