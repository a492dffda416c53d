"""Hostile input to the agent proxy (issue 43): every request is refused with a 4xx naming the field, at once and
with bounded memory, and the session it was sent to is unchanged (same trajectory, still open, a normal turn
still served afterwards).

- bodies over --max-request-bytes (a flood of messages, one huge message, chunked) get 413 naming `messages`
  before they are read; a conversation under the limit that cannot fit the engine's context is refused before
  it is tokenized (429 `context`);
- nesting past 64 levels (inside tool-call arguments, as a JSON string or as JSON, or anywhere in the body),
  lone surrogates, `tool_calls: 5` and token counts past int32 are 400s naming the place, never a 500;
- a non-finite reward at finish is a 400 naming `reward`, and the session stays open.

A real proxy over a real engine server (the tiny reference model), both on loopback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from rollwise.agent.generator import HTTPGenerator
from rollwise.agent.proxy import create_proxy_app
from rollwise.agent.session import SessionLimits
from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import tokenizer_fingerprint

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny:0"
LIMIT = 1024 * 1024  # the proxy's --max-request-bytes here (8 MiB by default; the mechanism is the same)
SESSION = "hostile"
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    """A proxy whose session SESSION has one turn."""
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=128, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, MODEL)) as (engine_url, _):
        upstream = HTTPGenerator(engine_url)
        app = create_proxy_app(upstream, tokenizer, model_name=MODEL, limits=SessionLimits(max_turns=8),
                               fingerprint=tokenizer_fingerprint(tokenizer), max_request_bytes=LIMIT)
        with serve_in_thread(app) as (url, _):
            assert _chat(url, {"messages": [USER], "max_tokens": 3, "seed": 1}).status_code == 200
            yield url
        upstream.close()


def _chat(url: str, body: dict | bytes | Iterator[bytes], session: str = SESSION, **kw) -> httpx.Response:
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def _trajectory(url: str) -> dict:
    r = httpx.get(f"{url}/sessions/{SESSION}/trajectory", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _history(call: dict) -> bytes:
    """The session's conversation so far plus an assistant tool call `call` (raw JSON) and a tool result."""
    return (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
            b'"tool_calls": [' + json.dumps(call).encode() + b']}, {"role": "tool", "content": "1"}]}')


def _deep_call(depth: int) -> bytes:  # arguments as real JSON, nested `depth` levels
    return (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": '
            b'[{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": '
            + _nested(depth).encode() + b'}}}]}, {"role": "tool", "content": "1"}]}')


ARGS = "messages[1].tool_calls[0].function.arguments"
# (label, raw body, param the 400 names (None: the body could not even be parsed), words in the message)
REFUSED = [
    ("arguments string nested 10,000 deep", _history({"id": "c", "type": "function", "function": {
        "name": "f", "arguments": _nested(10_000)}}), ARGS, "nests more than 64 levels"),
    ("arguments string nested 990 deep", _history({"id": "c", "type": "function", "function": {
        "name": "f", "arguments": _nested(990)}}), ARGS, "nests more than 64 levels"),
    ("arguments string holding a lone surrogate", _history({"id": "c", "type": "function", "function": {
        "name": "f", "arguments": '{"x": "\\ud800"}'}}), ARGS, "not valid Unicode"),
    ("arguments JSON nested 100 deep", _deep_call(100), ARGS + ".a", "nests more than 64 levels"),
    ("arguments JSON nested 10,000 deep", _deep_call(10_000), None, "nests too deeply to parse"),
    ("lone surrogate in content", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content", "not valid Unicode"),
    ("lone surrogate in a tool name", _history({"id": "c", "type": "function", "function": {
        "name": "f\ud800", "arguments": "{}"}}), "messages[1].tool_calls[0].function.name", "not valid Unicode"),
    ("lone surrogate in an unknown field's name", b'{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}',
     "\\udfff", "not valid Unicode"),
    ("tool_calls: 5", b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}',
     "messages[0].tool_calls", "must be a list"),
    ("tool_calls: [5]", b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": [5]}]}',
     "messages[0].tool_calls[0]", "must be a JSON object"),
    ("tools nested 100 deep", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": '
     + _nested(100).encode() + b"}]}", "tools[0].x", "nests more than 64 levels"),
    ("max_tokens 2**64", json.dumps({"messages": [USER], "max_tokens": 2**64}).encode(), "max_tokens",
     "must be <= 2147483647"),
]


@pytest.mark.parametrize("label, raw, param, words", REFUSED, ids=[case[0] for case in REFUSED])
def test_malformed_input_is_a_400_naming_the_place(proxy: str, label: str, raw: bytes, param: str | None,
                                                   words: str):
    before = _trajectory(proxy)
    t = time.perf_counter()
    r = _chat(proxy, raw)
    assert time.perf_counter() - t < 2, label
    assert r.status_code == 400, (label, r.text)
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param) if param else error["param"] is None, r.text
    assert words in error["message"] and (param is None or param in error["message"]), r.text
    assert _trajectory(proxy) == before  # nothing recorded, the session still open


def _rss() -> int:
    return psutil.Process().memory_info().rss  # the proxy serves from a thread of this process


@pytest.mark.parametrize("label, body", [
    ("100,000 messages", {"messages": [USER] * 100_000}),
    ("one 2 MB message", {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}),
], ids=["many messages", "one huge message"])
def test_oversized_bodies_are_refused_before_they_are_read(proxy: str, label: str, body: dict):
    before = _trajectory(proxy)
    raw = json.dumps(body).encode()
    assert len(raw) > LIMIT
    rss = _rss()
    t = time.perf_counter()
    declared = _chat(proxy, raw)
    chunked = _chat(proxy, iter([raw[i:i + 65536] for i in range(0, len(raw), 65536)]))  # no Content-Length
    elapsed = time.perf_counter() - t
    for r in (declared, chunked):
        assert r.status_code == 413, (label, r.text)
        error = r.json()["error"]
        assert error["param"] == "messages" and "messages" in error["message"], r.text
        assert "--max-request-bytes" in error["message"] and str(LIMIT) in error["message"], r.text
    assert f"of {len(raw)} bytes" in declared.json()["error"]["message"]
    # Parsing 100,000 messages would take a second and ~300 MB here (1,000,000 took 35 s and 3.2 GB before).
    assert elapsed < 2, f"{label}: refused in {elapsed:.1f}s"
    assert _rss() - rss < 64 * 2**20, f"{label}: the proxy's memory grew by {(_rss() - rss) >> 20} MB"
    assert _trajectory(proxy) == before


@pytest.mark.parametrize("label, messages", [
    ("20,000 short messages", [USER] * 20_000),
    ("one long message", [{"role": "user", "content": "y" * 500_000}]),
], ids=["many messages", "one long message"])
def test_a_conversation_that_cannot_fit_is_refused_before_tokenizing(proxy: str, label: str, messages: list):
    before = _trajectory(proxy)
    t = time.perf_counter()
    r = _chat(proxy, {"messages": messages})
    elapsed = time.perf_counter() - t
    assert r.status_code == 429 and r.json()["error"]["code"] == "context", r.text
    assert "max_model_len=128" in r.json()["error"]["message"], r.text
    assert elapsed < 2, f"{label}: refused in {elapsed:.1f}s (tokenizing it takes several)"
    after = _trajectory(proxy)
    assert after == before and after["finish_reason"] is None  # not marked finished: the session goes on


@pytest.mark.parametrize("reward", [b"NaN", b"1e999", b"-Infinity", b"Infinity"])
def test_a_non_finite_reward_is_refused_naming_it(proxy: str, reward: bytes):
    before = _trajectory(proxy)
    r = httpx.post(f"{proxy}/sessions/{SESSION}/finish", content=b'{"reward": ' + reward + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reward" and "finite" in r.json()["error"]["message"], r.text
    after = _trajectory(proxy)
    assert after == before and not after["finished"]


def test_the_session_still_serves_after_all_that(proxy: str):
    """Run last: the session the hostile requests went to takes its next turn and finishes normally."""
    before = _trajectory(proxy)
    reply = before["messages"][-1]
    r = _chat(proxy, {"messages": [USER, reply, {"role": "user", "content": "again"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    after = _trajectory(proxy)
    assert after["turns"] == before["turns"] + 1 and after["splits"] == before["splits"]
    done = httpx.post(f"{proxy}/sessions/{SESSION}/finish", json={"reward": 0.5}, timeout=30).json()
    assert done["finished"] and done["reward"] == 0.5
    again = httpx.post(f"{proxy}/sessions/{SESSION}/finish", json={"reward": 0.5}, timeout=30)
    assert again.status_code == 200 and again.json()["reward"] == 0.5  # a retried finish is answered again
    other = httpx.post(f"{proxy}/sessions/{SESSION}/finish", json={"reward": 1.0}, timeout=30)
    assert other.status_code == 409 and other.json()["error"]["param"] == "reward", other.text
    assert _trajectory(proxy)["reward"] == 0.5  # the reward given first stays
