"""One tenant of `rollwise bench service`: the arithmetic RL loop written against the unmodified `tinker` SDK,
as a tinker-cookbook user writes it (sample a group per problem from an ephemeral sampler, reward the right
sum, importance_sampling step on group-centred advantages, AdamW step), timing every call.

Run as its own process (`python -m rollwise.bench.service_tenant --url ... --api-key ... --json OUT`) so N
tenants are N clients, as they are in production; the orchestrator (rollwise/bench/service.py) reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tinker
from tinker import types

FEW_SHOT = "Q: 3 + 4 =\nA: 7\nQ: 12 + 30 =\nA: 42\n"
FIRST_INT = re.compile(r"-?\d+")


@dataclass
class TenantResult:
    steps: int
    samples: int = 0
    train_tokens: int = 0
    wall_s: float = 0.0
    sample_latency_s: list[float] = field(default_factory=list)
    forward_backward_latency_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"{FEW_SHOT}Q: {a} + {b} =\nA:", a + b


def reward(text: str, answer: int) -> float:
    found = FIRST_INT.search(text)
    return 1.0 if found is not None and int(found.group()) == answer else 0.0


def datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """Position i predicts token i+1: inputs are every token but the last, targets every token but the first;
    the prompt's targets carry no advantage (the loss is only on sampled tokens)."""
    tokens = prompt + completion
    n_prompt_targets = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt_targets + list(logprobs),
            "advantages": [0.0] * n_prompt_targets + [advantage] * len(completion),
        },
    )


def run_tenant(url: str, api_key: str, model: str, *, steps: int, groups: int, group_size: int, max_tokens: int,
               seed: int, learning_rate: float, lora_rank: int) -> TenantResult:
    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    # attention + MLP projections, as `rollwise train`'s train.lora (the SDK's default also adapts the LM head)
    trainer = service.create_lora_training_client(base_model=model, rank=lora_rank, seed=seed, train_unembed=False)
    tokenizer = trainer.get_tokenizer()
    rng = random.Random(seed)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=["\n"], seed=seed)
    result = TenantResult(steps=steps)
    start = time.perf_counter()
    for _ in range(steps):
        step_start = time.perf_counter()
        sampler = trainer.save_weights_and_get_sampling_client()
        batch = [problem(rng) for _ in range(groups)]
        prompts = [tokenizer.encode(text) for text, _ in batch]
        submitted = time.perf_counter()
        futures = [sampler.sample(types.ModelInput.from_ints(p), group_size, params) for p in prompts]
        data: list[types.Datum] = []
        rewards: list[float] = []
        for prompt, (_, answer), future in zip(prompts, batch, futures):
            response = future.result()
            result.sample_latency_s.append(time.perf_counter() - submitted)
            group = [reward(tokenizer.decode(s.tokens), answer) for s in response.sequences]
            mean = sum(group) / len(group)
            for seq, r in zip(response.sequences, group):
                data.append(datum(prompt, list(seq.tokens), list(seq.logprobs or []), r - mean))
                result.train_tokens += len(prompt) + len(seq.tokens) - 1
            rewards.extend(group)
            result.samples += len(group)
        fb_start = time.perf_counter()
        fb = trainer.forward_backward(data, "importance_sampling")
        optim = trainer.optim_step(types.AdamParams(learning_rate=learning_rate))
        fb.result()
        result.forward_backward_latency_s.append(time.perf_counter() - fb_start)
        optim.result()
        result.step_s.append(time.perf_counter() - step_start)
        result.reward_mean.append(sum(rewards) / len(rewards))
    result.wall_s = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    result = run_tenant(args.url, args.api_key, args.model, steps=args.steps, groups=args.groups,
                        group_size=args.group_size, max_tokens=args.max_tokens, seed=args.seed,
                        learning_rate=args.learning_rate, lora_rank=args.lora_rank)
    args.json.write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
