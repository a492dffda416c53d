"""Tool-call parsing: model text -> tool calls, in the model's own chat-template format.

Pluggable: a parser turns an assistant turn's text into (content, calls, errors) and says how to
describe tools to a model whose chat template has no tool support. The default is the Hermes/Qwen
format the Qwen2.5/Hermes templates teach:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>

Model output is untrusted: a block that is not JSON, lacks a name, has non-object arguments, is
unclosed, huge or nested too deeply becomes a ToolCallError with a message written for the model (it
is sent back as the tool result), never an exception. Sessions go through `parse_reply`, which also
turns a failing parser into an error result and caps the calls run per turn. Scanning for the tags is
linear in the text's length.
"""

from __future__ import annotations

import json
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


MAX_CALLS_PER_TURN = 16  # default cap on tool calls run for one assistant turn (SessionLimits sets it)
MAX_ARGUMENT_DEPTH = 32  # nesting of a call's JSON: deeper is refused (later json.dumps/pydantic recurse)


def _call_error(body: str, message: str, name: str | None = None) -> ToolCallError:
    return ToolCallError(body[:200], message, name=name)


def _loads(body: str) -> tuple[Any, str | None]:
    """json.loads that never raises: (value, None) or (None, why). Besides JSONDecodeError, hostile
    text raises RecursionError (deep nesting) and a plain ValueError (integers past Python's
    int-string conversion limit, which has no .msg/.colno)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at column {exc.colno}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:
        return None, str(exc).split(";")[0][:200]


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return deepest


def parse_call_json(raw: str) -> ToolCall | ToolCallError:
    """One call's JSON body ({"name": ..., "arguments": {...}}) -> a ToolCall, or the error the model sees."""
    body = raw.strip()
    if len(body) > MAX_CALL_CHARS:
        return _call_error(body, f"error: the tool call is {len(body)} characters; the limit is {MAX_CALL_CHARS}")
    obj, problem = _loads(body)
    if problem:
        return _call_error(body, f"error: the tool call is not valid JSON ({problem}); "
                           "expected {\"name\": <tool name>, \"arguments\": {...}}")
    if not isinstance(obj, dict):
        return _call_error(body, f"error: the tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _call_error(body, "error: the tool call has no \"name\" string")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded, as OpenAI does
        arguments, problem = _loads(arguments)
        if problem:
            return _call_error(body, f"error: \"arguments\" of {name} is a string that is not JSON ({problem})",
                               name=name)
    if not isinstance(arguments, dict):
        return _call_error(body, f"error: \"arguments\" of {name} must be a JSON object, got "
                           f"{type(arguments).__name__}", name=name)
    if _depth(arguments) > MAX_ARGUMENT_DEPTH:
        return _call_error(body, f"error: \"arguments\" of {name} are nested more than {MAX_ARGUMENT_DEPTH} "
                           "levels deep", name=name)
    return ToolCall(name, arguments, raw=body)


def cap_calls(parsed: ParsedReply, max_calls: int) -> ParsedReply:
    """At most `max_calls` tool results for one turn (calls first, then errors); the rest are answered
    by one error result naming the cap, so a reply with thousands of calls cannot flood the context."""
    if len(parsed.calls) + len(parsed.errors) <= max_calls:
        return parsed
    calls = parsed.calls[:max_calls]
    errors = parsed.errors[: max_calls - len(calls)]
    dropped = len(parsed.calls) + len(parsed.errors) - len(calls) - len(errors)
    errors.append(ToolCallError("", f"error: {dropped} more tool call(s) were not run: at most {max_calls} tool "
                                "calls are run per turn"))
    return ParsedReply(parsed.content, calls, errors)


def parse_reply(parser: "ToolCallParser", text: str, max_calls: int = MAX_CALLS_PER_TURN) -> ParsedReply:
    """What a session calls: the parser's reading of `text`, capped, and never an exception. A parser
    that fails (a custom one, or a hostile input nobody foresaw) becomes an error result the model
    sees; the episode, and the training step, go on."""
    try:
        parsed = parser.parse(text)
    except Exception as exc:  # noqa: BLE001 - model output must never abort a training step
        parsed = ParsedReply(text.strip(), [], [ToolCallError(
            text[:200], f"error: the tool calls in this reply could not be read ({type(exc).__name__})")])
    return cap_calls(parsed, max_calls)


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedReply: ...

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """How to call `tools` (OpenAI function specs), for a system message."""
        ...


class HermesToolParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedReply:
        # str.find, not a regex: `<tool_call>(.*?)</tool_call>` rescans to the end of the text from
        # every unclosed opening tag, which is quadratic on a reply full of them.
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content: list[str] = []
        pos = 0
        while True:
            opened = text.find(self.OPEN, pos)
            if opened < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:opened])
            body_start = opened + len(self.OPEN)
            closed = text.find(self.CLOSE, body_start)
            if closed < 0:  # an unclosed block (often a reply cut at max_tokens)
                errors.append(ToolCallError(text[opened:][:200], "error: the tool call was not closed with "
                                            "</tool_call>; write the whole call: <tool_call>{\"name\": ..., "
                                            "\"arguments\": {...}}</tool_call>"))
                break
            result = parse_call_json(text[body_start:closed])
            (calls if isinstance(result, ToolCall) else errors).append(result)
            pos = closed + len(self.CLOSE)
        return ParsedReply("".join(content).strip(), calls, errors)

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
