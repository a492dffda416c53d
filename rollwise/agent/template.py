"""Rendering a conversation through the tokenizer's chat template, as token ids.

The trajectory builder never tokenizes model output: it renders *canonical* conversations and
compares them with each other to find the template tokens a new message adds (see trajectory.py).
This module is the one place that calls `apply_chat_template`, so every comparison uses exactly the
same rendering (same tools, same flags).
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def _ids(out: Any) -> list[int]:
    """apply_chat_template's result as a flat list of ids, whatever transformers version returned it."""
    if not isinstance(out, list) and hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        if len(out) != 1:
            raise ValueError(f"expected one rendered conversation, got a batch of {len(out)}")
        out = out[0]
    return [int(t) for t in out]


class ChatRenderer:
    """Renders messages (plain dicts with role/content) to token ids with one tokenizer.

    `tools` (OpenAI function specs) go to the template when it knows about tools (it mentions
    `tools`); otherwise the caller puts their description into the system message (toolcalls.py).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; agent sessions need one")
        self.tokenizer = tokenizer
        self.chat_template = template
        self.template_handles_tools = "tools" in template

    def render(self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        kwargs: dict[str, Any] = {}
        if tools and self.template_handles_tools:
            kwargs["tools"] = tools
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            chat_template=self.chat_template, **kwargs,
        )
        return _ids(out)

    def render_text(self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """For logs and reports only; never used to build a trajectory."""
        kwargs: dict[str, Any] = {"tools": tools} if tools and self.template_handles_tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self.chat_template, **kwargs,
        )
