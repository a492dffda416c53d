"""Synthetic tasks: repeat a word; reward 1.0 when the last answer contains it."""

import random

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon", "comet"]


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def says_the_word(self, trace: vf.Trace) -> float:
        last = trace.messages[-1] if trace.messages else None
        text = last.content if last is not None and isinstance(last.content, str) else ""
        return 1.0 if self.data.word in text.lower() else 0.0


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks to build."""
    seed: int = 0


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        rng = random.Random(self.config.seed)
        words = [rng.choice(WORDS) for _ in range(self.config.num_tasks)]
        return [EchoTask(EchoData(id=f"echo-{i}", prompt=f"Say the word: {w}", word=w)) for i, w in enumerate(words)]
