"""Tool-call parsing: model text -> tool calls, in the model's own chat-template format.

Pluggable: a parser turns an assistant turn's text into (content, calls, errors) and says how to
describe tools to a model whose chat template has no tool support. The default is the Hermes/Qwen
format the Qwen2.5/Hermes templates teach:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Model output is untrusted: a block that is not JSON, lacks a name, has non-object arguments, is
unclosed or huge becomes a ToolCallError with a message written for the model (it is sent back as
the tool result), never an exception.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_CALL_CHARS = 16_384  # a tool call larger than this is refused (the model is looping or flooding)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")
    raw: str = ""


@dataclass
class ToolCallError:
    """A tool call the model tried to make but got wrong; `message` goes back to it as the tool result."""

    raw: str
    message: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")
    name: str | None = None  # when the name could be read


@dataclass
class ParsedReply:
    content: str  # the text outside tool-call blocks
    calls: list[ToolCall]
    errors: list[ToolCallError]

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedReply: ...

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """How to call `tools` (OpenAI function specs), for a system message."""
        ...


class HermesToolParser:
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for match in self._BLOCK.finditer(text):
            result = self._one(match.group(1))
            (calls if isinstance(result, ToolCall) else errors).append(result)
        content = self._BLOCK.sub("", text)
        opened = content.find("<tool_call>")
        if opened >= 0:  # an unclosed block (often a reply cut at max_tokens)
            errors.append(ToolCallError(content[opened:][:200], "error: the tool call was not closed with "
                                        "</tool_call>; write the whole call: <tool_call>{\"name\": ..., "
                                        "\"arguments\": {...}}</tool_call>"))
            content = content[:opened]
        return ParsedReply(content.strip(), calls, errors)

    def _one(self, raw: str) -> ToolCall | ToolCallError:
        body = raw.strip()
        if len(body) > MAX_CALL_CHARS:
            return ToolCallError(body[:200], f"error: the tool call is {len(body)} characters; the limit is "
                                 f"{MAX_CALL_CHARS}")
        try:
            obj = json.loads(body)
        except ValueError as exc:
            return ToolCallError(body, f"error: the tool call is not valid JSON ({exc.msg} at column {exc.colno}); "
                                 "expected {\"name\": <tool name>, \"arguments\": {...}}")
        if not isinstance(obj, dict):
            return ToolCallError(body, f"error: the tool call must be a JSON object, got {type(obj).__name__}")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCallError(body, "error: the tool call has no \"name\" string")
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded, as OpenAI does
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return ToolCallError(body, f"error: \"arguments\" of {name} is a string that is not JSON", name=name)
        if not isinstance(arguments, dict):
            return ToolCallError(body, f"error: \"arguments\" of {name} must be a JSON object, got "
                                 f"{type(arguments).__name__}", name=name)
        return ToolCall(name, arguments, raw=body)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        return ("You can call tools. Available tools:\n" + specs + "\nTo call a tool, write "
                "<tool_call>{\"name\": <tool name>, \"arguments\": {<arguments>}}</tool_call>; its result comes "
                "back in a tool message.")


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesToolParser}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Add a parser for another model family's tool-call format."""
    _PARSERS[name] = factory


def get_parser(name: str | ToolCallParser) -> ToolCallParser:
    if not isinstance(name, str):
        return name
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; available: {sorted(_PARSERS)} "
                         "(add one with rollwise.agent.toolcalls.register_parser)")
    return _PARSERS[name]()


def format_hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """A past tool call in the Hermes format (for assistant messages a client sends as history)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
