"""Test helper: one GRPO group sampled by a real engine, with made-up rewards. Imported by the test modules
that train on an engine's samples and push the result back; not a test module itself."""

from __future__ import annotations

import random

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.types.sample import Sample


def engine_group(engine: ReferenceEngine, seed: int, n: int = 4) -> list[Sample]:
    """One GRPO group sampled by the engine, with made-up rewards (advantages +-1)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 100) for _ in range(6)]
    reqs = [GenerationRequest(f"r{seed}-{i}", prompt, SamplingParams(max_tokens=6, seed=seed * 10 + i, ignore_eos=True))
            for i in range(n)]
    return [Sample(sample_id=c.sample_id, group_id="g", problem_id="p", prompt_ids=c.prompt_ids,
                   response_ids=c.token_ids, behaviour_logprobs=c.logprobs, versions=c.versions,
                   finish_reason=c.finish_reason, advantage=1.0 if i % 2 else -1.0)
            for i, c in enumerate(engine.generate(reqs))]
