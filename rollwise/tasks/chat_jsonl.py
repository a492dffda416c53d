"""Chat conversations for supervised fine-tuning: OpenAI chat-format JSONL, tokenized by the model's chat
template, with a loss mask on the assistant's tokens only.

One line: {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}.

The mask is found by rendering prefixes of the conversation through the template, never by searching the
text: an assistant turn's tokens are those between the render of the conversation before it with the
generation prompt (`<|im_start|>assistant\\n` in ChatML) and the render through it, cut after the
tokenizer's end-of-turn token (EOS) when the template adds glue after it (ChatML's newline): exactly what
the model generates for that turn, its stop token included. A template that does not render a conversation
as a prefix of its continuation cannot be masked this way and is refused, naming the line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollwise.model.template_ids import flat_token_ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: carried by the template if it reads them

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatExample(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(..., min_length=1)


@dataclass
class TokenizedChat:
    """One conversation as the trainer sees it."""

    line: int  # its line in the file (errors and logs)
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (the model's own turns), 0 elsewhere

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


def read_chat_jsonl(path: str | Path, field: str = "sft.data") -> list[tuple[int, ChatExample]]:
    """(line number, conversation) per non-blank line; a ValueError naming `field`, the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field}={str(path)!r}: " + ("a directory, not a file" if path.is_dir() else "file not found")
                         + " (a chat JSONL file: one {\"messages\": [...]} per line)")
    rows: list[tuple[int, ChatExample]] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{field}: {path}:{line_no}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text: save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            try:
                example = ChatExample.model_validate(obj)
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = ".".join(str(p) for p in first["loc"]) or "the line"
                raise ValueError(f"{where}: {loc}: {first['msg']} (expected {{\"messages\": [{{\"role\": "
                                 "\"user\", \"content\": \"...\"}, {\"role\": \"assistant\", ...}]})") from None
            if not any(m.role == "assistant" for m in example.messages):
                raise ValueError(f"{where}: no assistant message: nothing to train on (the loss is on assistant "
                                 "turns only)")
            rows.append((line_no, example))
    if not rows:
        raise ValueError(f"{field}={str(path)!r}: the file holds no conversations")
    return rows


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    return flat_token_ids(tokenizer.apply_chat_template(messages, tokenize=True,
                                                        add_generation_prompt=generation_prompt))


def tokenize_chat(tokenizer: Any, example: ChatExample, line: int = 0, where: str = "") -> TokenizedChat:
    """The conversation's token ids and assistant-only loss mask (see the module doc)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer has no chat template: sft data is rendered with the model's own; use a "
                         "chat (instruct) model, or set tokenizer.chat_template in its tokenizer_config.json")
    messages = [{"role": m.role, "content": m.content} for m in example.messages]
    full = _render(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(full)
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise ValueError(f"{where}line {line}: the chat template does not render this conversation as a prefix "
                             f"of its continuation (at message {i}), so its assistant tokens cannot be told apart: "
                             "use a model whose template appends each turn")
        end = len(through)
        turn = through[len(before):]
        if eos is not None and eos in turn:  # cut the template's glue after the stop token the model samples
            end = len(before) + len(turn) - turn[::-1].index(eos)
        mask[len(before):end] = [1] * (end - len(before))
    return TokenizedChat(line=line, input_ids=full, loss_mask=mask)


def load_chats(tokenizer: Any, path: str | Path, field: str = "sft.data") -> list[TokenizedChat]:
    where = f"{field}: {path}:"
    chats = [tokenize_chat(tokenizer, ex, line, where) for line, ex in read_chat_jsonl(path, field)]
    return [c for c in chats if c.trained_tokens]


def split_chats(chats: list[TokenizedChat], held_out_fraction: float, seed: int) -> tuple[list[TokenizedChat],
                                                                                         list[TokenizedChat]]:
    """(train, held out): a seeded share of the conversations held out (at least one when the share is > 0 and
    more than one conversation exists)."""
    order = list(range(len(chats)))
    random.Random(seed).shuffle(order)
    n_eval = round(len(chats) * held_out_fraction)
    if held_out_fraction > 0 and len(chats) > 1:
        n_eval = min(max(n_eval, 1), len(chats) - 1)
    held = set(order[:n_eval])
    return [c for i, c in enumerate(chats) if i not in held], [c for i, c in enumerate(chats) if i in held]
