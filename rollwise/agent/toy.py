"""A tiny model taught to call the calculator, so checks and tests see real tool calls.

A random `tiny:SEED` model writes random characters and never produces a tool call. A few hundred
Adam steps on synthetic transcripts (user asks a sum -> assistant writes a Hermes tool call ->
tool answers -> assistant states the result) give a model that, sampled at temperature 1, makes
well-formed calls most of the time and malformed ones sometimes: both paths get exercised by a
real engine with real sampling. Seconds on a CPU; deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from rollwise.agent.template import ChatRenderer

TOY_SYSTEM = "Use the calculator."


def toy_conversation(rng: random.Random) -> tuple[list[dict[str, str]], int, int]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}})
    return [
        {"role": "system", "content": TOY_SYSTEM},
        {"role": "user", "content": f"{a}+{b}?"},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(a + b)},
        {"role": "assistant", "content": f"It is {a + b}."},
    ], a, b


def toy_question(rng: random.Random) -> list[dict[str, str]]:
    messages, _, _ = toy_conversation(rng)
    return messages[:2]


def _example(renderer: ChatRenderer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids of the whole conversation and a mask that is 1 on assistant tokens (content + end of turn)."""
    ids: list[int] = []
    mask: list[int] = []
    for k in range(len(messages)):
        upto = renderer.render(messages[: k + 1], add_generation_prompt=False)
        new = upto[len(ids):]
        if messages[k]["role"] == "assistant":
            head = renderer.render(messages[:k], add_generation_prompt=True)[len(ids):]
            mask += [0] * len(head) + [1] * (len(new) - len(head))
        else:
            mask += [0] * len(new)
        ids = upto
    return ids, mask


def teach_tool_calls(model: Any, tokenizer: Any, steps: int = 120, seed: int = 0, lr: float = 5e-3,
                     batch: int = 4) -> float:
    """Fine-tune `model` in place on toy tool-use transcripts; returns the last loss."""
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        rows = [_example(renderer, toy_conversation(rng)[0]) for _ in range(batch)]
        length = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((batch, length), pad, dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        attention = torch.zeros((batch, length), dtype=torch.long)
        for r, (ids, mask) in enumerate(rows):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            attention[r, : len(ids)] = 1
            labels[r, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def toy_tool_model(seed: int = 0, steps: int = 120, cache: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer): a tiny Llama taught the toy tool-call format. The taught weights are kept
    under the rollwise cache (a few hundred KB), so later calls load them instead of training again."""
    from safetensors.torch import load_file, save_file

    from rollwise.model.loading import cache_dir
    from rollwise.model.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=seed)
    path = cache_dir() / "toy" / f"tool-calls-seed{seed}-steps{steps}.safetensors"
    if cache and path.is_file():
        try:
            model.load_state_dict(load_file(str(path)), strict=False)
            return model.eval(), tokenizer
        except (OSError, RuntimeError, ValueError):
            pass  # unreadable or from another model version: teach again
    teach_tool_calls(model, tokenizer, steps=steps, seed=seed)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{random.randrange(1 << 30)}.tmp")
        # Tied embeddings share storage with the LM head: save the distinct tensors only.
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp))
        tmp.replace(path)
    return model, tokenizer
