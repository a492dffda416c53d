"""What a parsed JSON request body may hold beyond its fields' types: bounded nesting and real Unicode text.

Python's json parser accepts both things that crash later code: nesting a thousand levels deep (json.dumps,
chat templates and pydantic recurse on it: RecursionError) and `\\ud800`-style escapes that decode to a lone
surrogate (tokenizers and UTF-8 encoders refuse it: TypeError, UnicodeEncodeError). Request bodies are
checked whole here, before their fields are read (rollwise.serve.openai_schemas), so each is a 400 naming
the place. The walks are iterative: checking a hostile value never recurses.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # {"messages": [{"tool_calls": [{"function": {"arguments": {...: 6 levels before any argument
NOT_UNICODE = "is not valid Unicode (a lone surrogate such as \\ud800): send UTF-8 text"


def _valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


MAX_PATH_CHARS = 100  # a path into deep nesting is cut here ('a[0][0]...'): the message names where it starts


def _join(path: str, key: Any) -> str:
    if len(path) >= MAX_PATH_CHARS:
        return path if path.endswith("...") else path + "..."
    if isinstance(key, int):
        return f"{path}[{key}]"
    # A key is client text: shown escaped (a lone surrogate in an error message would fail to encode itself).
    name = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace") if not _valid_text(key) else key
    return f"{path}.{name}" if path else name


def depth_problem(max_depth: int) -> str:
    return f"nests more than {max_depth} levels deep: flatten it"


def _sound(value: Any, max_depth: int) -> bool:
    """The fast pass: level by level, no paths (a body of 200,000 messages takes tens of milliseconds)."""
    level, depth = [value], 1
    while level:
        if depth > max_depth:
            return False
        below = []
        for node in level:
            if type(node) is dict:
                for key in node:
                    if type(key) is str and not key.isascii() and not _valid_text(key):
                        return False
                node = node.values()
            for child in node:
                kind = type(child)
                if kind is str:
                    if not child.isascii() and not _valid_text(child):
                        return False
                elif kind is dict or kind is list:
                    below.append(child)
        level, depth = below, depth + 1
    return True


def _locate(value: Any, max_depth: int) -> tuple[str, str]:
    """The slow pass, for a value the fast one found unsound: where, and what."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            return path, depth_problem(max_depth)
        for key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str) and not _valid_text(key):
                return _join(path, key), "is a key that " + NOT_UNICODE
            if isinstance(child, str):
                if not _valid_text(child):
                    return _join(path, key), NOT_UNICODE
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1, _join(path, key)))
    return "", "is unsound"  # not reached: the fast pass found something


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """(path, what is wrong) for a place in a parsed JSON value that nests deeper than `max_depth` (the value
    itself is level 1) or holds text that is not valid Unicode; None when the whole value is sound. The path is
    relative to `value`, e.g. 'messages[0].content' ('' for the value itself)."""
    if isinstance(value, str):
        return None if _valid_text(value) else ("", NOT_UNICODE)
    if not isinstance(value, (dict, list)) or _sound(value, max_depth):
        return None
    return _locate(value, max_depth)


def loads_bounded(text: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, str | None]:
    """JSON text inside a field (e.g. a tool call's `arguments` string) -> (value, None), or (None, why) when it
    is JSON that nests too deeply or holds a lone surrogate; text that is not JSON at all is (text, None): such a
    field is kept as written."""
    try:
        value = json.loads(text)
    except RecursionError:
        return None, depth_problem(max_depth)
    except ValueError:  # not JSON (or an integer past Python's digit limit)
        return text, None
    problem = json_problem(value, max_depth)
    if problem is not None:
        where, what = problem
        if what.startswith("nests"):
            return None, what
        return None, f"holds JSON whose {where} {what}" if where else f"holds JSON text that {what}"
    return value, None
