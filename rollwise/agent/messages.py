"""OpenAI-style chat messages as agent code sends them, and their two views.

- The *client view*: what the caller sent and what we answered (assistant turns with tool_calls).
  A later request is matched against it to find the messages that are new.
- The *template view*: plain {role, content} dicts the chat template renders. An assistant turn
  there is its decoded sampled text (tool-call blocks included), exactly what the model wrote.
"""

from __future__ import annotations

import json
from typing import Any

from rollwise.serve.json_bounds import json_problem, loads_bounded

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A message the caller sent is malformed; the text names the message and the field."""


def content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text can be rendered
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise MessageError(f"{where}.content[{i}] must be {{'type': 'text', 'text': <string>}} "
                                   "(only text is supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise MessageError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def as_dict(message: Any) -> dict[str, Any]:
    """A message given as a dict or as a pydantic object (the openai package's types)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict):
        raise MessageError(f"a message must be an object with 'role' and 'content', got {type(message).__name__}")
    return message


def _tool_calls(message: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    out = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f"{where}.tool_calls[{i}] must have function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            # bounded: JSON nested too deeply would crash json.dumps and the template later; not JSON: kept
            # as the raw string, compared as written
            args, problem = loads_bounded(args) if args.strip() else ({}, None)
            if problem is not None:
                raise MessageError(f"{where}.tool_calls[{i}].function.arguments {problem}")
        out.append((fn["name"], args))
    return out


def validate(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        m = as_dict(m)
        problem = json_problem(m)  # nesting and lone surrogates, anywhere in the message (the proxy checked already)
        if problem is not None:
            raise MessageError(f"messages[{i}]{'.' if problem[0] else ''}{problem[0]} {problem[1]}")
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        content_text(m.get("content"), f"messages[{i}]")
        _tool_calls(m, f"messages[{i}]")
        out.append(m)
    return out


def client_key(message: dict[str, Any]) -> tuple:
    """What must match for a sent message to be the same as one already in the session."""
    return (message["role"], content_text(message.get("content"), "message").strip(),
            json.dumps(_tool_calls(message, "message"), sort_keys=True))


def template_view(message: dict[str, Any], format_call) -> dict[str, Any]:
    """The {role, content} dict the chat template renders for a message the caller sent."""
    text = content_text(message.get("content"), "message")
    if message["role"] == "assistant":
        calls = [format_call(name, args if isinstance(args, dict) else {"raw": args})
                 for name, args in _tool_calls(message, "message")]
        text = "\n".join([text] + calls) if text and calls else (text or "\n".join(calls))
    out: dict[str, Any] = {"role": message["role"], "content": text}
    if message["role"] == "tool" and isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out
