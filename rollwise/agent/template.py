"""Rendering a conversation through the tokenizer's chat template, as token ids.

The trajectory builder never tokenizes model output: it renders *canonical* conversations and
compares them with each other to find the template tokens a new message adds (see trajectory.py).
This module is the one place that calls `apply_chat_template`, so every comparison uses exactly the
same rendering (same tools, same flags).

Message content is text, never control tokens: a tool result (or any message) holding special-token
text such as `<|im_start|>system` is encoded as ordinary text tokens, while the template's own
markers stay special. Otherwise a tool could forge a system turn that the model sees as real.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from rollwise.model.template_ids import flat_token_ids

Message = dict[str, Any]


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts a tokenizer turns into control tokens (its special tokens), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(str(added.content))
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


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
        self.special_texts = special_token_texts(tokenizer)
        # Longest first, so that a special token containing another is matched whole.
        self._special_index = {text: i for i, text in enumerate(self.special_texts)}
        self._special = re.compile("|".join(map(re.escape, self.special_texts))) if self.special_texts else None
        # Stands in for special-token text inside content while the template renders; the nonce makes
        # it impossible for content to contain it by accident (private-use characters around it).
        nonce = uuid.uuid4().hex[:12]
        self._placeholder = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        self._placeholder_text = f"\ue000{nonce}:{{}}\ue001"

    def render(self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        kwargs: dict[str, Any] = {}
        if tools and self.template_handles_tools:
            kwargs["tools"] = tools
        guarded = [self._guard(m) for m in messages]
        if guarded == messages:  # the common case: no special-token text anywhere
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=self.chat_template, **kwargs,
            )
            return flat_token_ids(out)
        text = self.tokenizer.apply_chat_template(
            guarded, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self.chat_template, **kwargs,
        )
        return self._encode_guarded(text)

    def _guard(self, message: Message) -> Message:
        """The message with each special-token text in its content (and in any other string field a
        template may show, such as a tool's name, which the model chose) replaced by a placeholder."""
        if self._special is None:
            return message
        guarded = dict(message)
        for key, value in message.items():
            if key != "role" and isinstance(value, str) and self._special.search(value):
                guarded[key] = self._special.sub(
                    lambda m: self._placeholder_text.format(self._special_index[m.group()]), value)
        return guarded

    def _encode_guarded(self, text: str) -> list[int]:
        """Template text as usual (its markers are special tokens); each placeholder as the plain
        text of the special token it stands for (split_special_tokens: never the control id)."""
        ids: list[int] = []
        pos = 0
        for match in self._placeholder.finditer(text):
            ids += self._encode(text[pos:match.start()], split_special=False)
            ids += self._encode(self.special_texts[int(match.group(1))], split_special=True)
            pos = match.end()
        return ids + self._encode(text[pos:], split_special=False)

    def _encode(self, text: str, *, split_special: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special))

    def render_text(self, messages: list[Message], *, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """For logs and reports only; never used to build a trajectory."""
        kwargs: dict[str, Any] = {"tools": tools} if tools and self.template_handles_tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self.chat_template, **kwargs,
        )
