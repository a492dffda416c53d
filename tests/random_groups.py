"""Test helper: made-up GRPO groups with prompts and responses of unequal lengths (ranks and micro-batches
get unequal token counts). Imported by the trainer test modules; not a test module itself."""

from __future__ import annotations

import random
from typing import Literal

from rollwise.types.sample import Sample


def random_groups(seed: int, score: Literal["advantage", "reward"], groups: int = 3, group_size: int = 3,
                  zero_groups: int = 0, random_behaviour: bool = False) -> list[Sample]:
    """`groups` groups of `group_size` samples, random token ids in [3, 90).

    score: "advantage" sets each sample's advantage in [-1, 1] (the trainer uses it as is); "reward" sets
    its reward in [0, 1] (the caller assigns advantages from it). The first `zero_groups` groups get 0 and
    draw nothing. random_behaviour: behaviour log-probs drawn in [-6, -2] per token, else all -4.5.
    The draws happen in one fixed order (prompt, then per sample response, score, behaviour) so a seed
    always gives the same samples."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randint(2, 9))]
        for i in range(group_size):
            response = [rng.randrange(3, 90) for _ in range(rng.randint(1, 12))]
            if g < zero_groups:
                value = 0.0
            else:
                value = rng.uniform(-1, 1) if score == "advantage" else rng.random()
            behaviour = [rng.uniform(-6, -2) for _ in response] if random_behaviour else [-4.5] * len(response)
            out.append(Sample(sample_id=f"{g}/{i}", group_id=str(g), problem_id=str(g), prompt_ids=prompt,
                              response_ids=response, behaviour_logprobs=behaviour,
                              versions=[0] * len(response), finish_reason="stop", **{score: value}))
    return out


def fixed_groups() -> list[Sample]:
    """Three groups (prompts of different lengths), responses of unequal lengths, rewards in [0, 1]: the same
    samples every call, written out (no draws)."""
    out = []
    for g, prompt in enumerate([(5, 6, 7, 8, 9), (10, 11, 12), (13, 14, 15, 16)]):
        for i in range(3):
            n = 2 + (g + 2 * i) % 4
            out.append(Sample(sample_id=f"{g}/{i}", group_id=f"g{g}", problem_id="p", prompt_ids=list(prompt),
                              response_ids=[(7 * g + 3 * i + t) % 50 + 3 for t in range(n)],
                              behaviour_logprobs=[-1.5 - 0.2 * t for t in range(n)], versions=[0] * n,
                              finish_reason="stop", reward=[1.0, 0.0, 0.4][(g + i) % 3]))
    return out
