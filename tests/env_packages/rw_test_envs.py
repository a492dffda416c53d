"""Classic-verifiers environments for tests/test_env_verifiers.py, written as a third party would (no rollwise
import): a single-turn one, a well-behaved multi-turn one (`clean`, reporting the `openai` version it imports),
and a multi-turn one (the environment answers every reply, so every rollout has `max_turns` model turns) whose
rows each behave in one way an environment can: row i's `answer` is its mode."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import verifiers as vf
from datasets import Dataset

MODES = ["ok", "ok", "raise", "garbage", "bad_state", "flood", "crash", "hang"]


def length_reward(completion, **kwargs) -> float:
    """A reward rollouts can differ on: 1.0 for a short last reply."""
    text = completion[-1].content if completion else ""
    return 1.0 if len(text or "") < 20 else 0.0


def shortest_in_group(completions, **kwargs) -> list[float]:
    """A group reward function (verifiers scores the group together): 1.0 for the group's shortest last reply."""
    lengths = [len(c[-1].content or "") if c else 0 for c in completions]
    return [1.0 if n == min(lengths) else 0.0 for n in lengths]


def mode_reward(completion, answer, **kwargs):
    if answer == "raise":
        raise RuntimeError("reward function exploded")
    if answer == "garbage":
        return "lots"  # not a number
    return length_reward(completion)


class ModeRubric(vf.Rubric):
    async def score_rollout(self, state, **kwargs):
        await super().score_rollout(state, **kwargs)
        if state["answer"] == "bad_state":
            state["reward"] = "lots"  # the rollout's output carries a reward that is not a number


class Echo(vf.MultiTurnEnv):
    """Answers every model reply with a user message (or misbehaves, as the row says)."""

    async def env_response(self, messages, state, **kwargs):
        mode = state["answer"]
        if mode == "crash":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)  # blocks the worker's event loop: only a restart ends it
        if mode == "slow":
            await asyncio.sleep(3600)
        if mode == "flood":
            for _ in range(2000):
                print("x" * 500)
                sys.stderr.write("y" * 500 + "\n")
        return [{"role": "user", "content": "Go on."}]


def openai_major(**kwargs) -> float:
    """A zero-weight metric: the major version of the `openai` this environment's interpreter imports."""
    import openai

    return float(openai.__version__.split(".")[0])


def load_environment(kind: str = "multi", max_turns: int = 3) -> vf.Environment:
    if kind == "clean":  # multi-turn, every row well-behaved: what a training run's tests train on
        rows = Dataset.from_list([{"question": f"{i}+{i}?", "answer": "ok"} for i in range(8)])
        return Echo(dataset=rows, system_prompt="Use the calculator.", max_turns=max_turns,
                    rubric=vf.Rubric(funcs=[length_reward, openai_major], weights=[1.0, 0.0]))
    data = Dataset.from_list([{"question": f"{i}+{i}?", "answer": mode} for i, mode in enumerate(MODES)])
    if kind == "single":
        return vf.SingleTurnEnv(dataset=data, system_prompt="Use the calculator.",
                                rubric=vf.Rubric(funcs=[shortest_in_group], weights=[1.0]))
    return Echo(dataset=data, system_prompt="Use the calculator.", max_turns=max_turns,
                rubric=ModeRubric(funcs=[mode_reward], weights=[1.0]))
