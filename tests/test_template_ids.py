"""apply_chat_template's result in every shape transformers returns, read as one flat list of ids
(rollwise.model.template_ids: the engine's prompts, the agent's turns and the router's keys share it)."""

from __future__ import annotations

import pytest
import torch
from transformers import BatchEncoding

from rollwise.model.template_ids import flat_token_ids
from rollwise.model.tiny import tiny_tokenizer


@pytest.mark.parametrize("out", [
    [5, 6, 7],
    BatchEncoding({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}),
    torch.tensor([[5, 6, 7]]),
    [[5, 6, 7]],
], ids=["list", "batch_encoding", "tensor", "batch_of_one"])
def test_every_shape_reads_as_the_same_ids(out):
    ids = flat_token_ids(out)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)


def test_a_batch_of_two_is_refused_not_truncated():
    with pytest.raises(ValueError, match="got a batch of 2"):
        flat_token_ids([[1, 2], [3, 4]])


def test_the_three_readers_agree_on_a_real_template():
    from rollwise.agent.template import ChatRenderer
    from rollwise.router.tokens import prompt_tokens
    from rollwise.tasks.prompts import encode_prompt

    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    engine_ids = encode_prompt(tok, messages)
    assert prompt_tokens("/v1/chat/completions", {"messages": messages}, tok) == engine_ids
    assert ChatRenderer(tok).render(messages, add_generation_prompt=True) == engine_ids
