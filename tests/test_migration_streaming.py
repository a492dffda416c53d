"""Live migration of streamed requests (issue 42 item 3): a request whose tokens stream to its client (stream=true,
stop strings) migrates like the others. The source keeps its client's stream open and relays the target's tokens
into it as they are sampled: the client sees one stream whose tokens, text and logprobs equal the same request's
unmigrated (greedy), a stop string stops it where it stops unmigrated, and a client gone aborts it on the target."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from test_migration_wiring import LONG, SPEC, _prompt, _router, _wait_running, servers, tiny  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOKENS = LONG  # long enough to be still running when the test pauses the source, whatever the load


def _body(seed: int, stream: bool, max_tokens: int = TOKENS, stop: list[str] | None = None) -> dict:
    return {"model": SPEC, "prompt": _prompt(seed), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, **({"stop": stop} if stop else {}),
            **({"stream_options": {"include_usage": True}} if stream else {})}


def _events(lines) -> list[dict | str]:
    """Each SSE event, parsed."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _joined(events: list[dict | str]) -> dict:
    """The streamed choice, put together as a non-streamed answer has it."""
    chunks = [c for c in events if isinstance(c, dict)]
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks), chunks[-3:]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(finishes) == 1 and choices[-1]["finish_reason"] is not None  # once, at the end
    return {"text": "".join(c["text"] for c in choices), "token_ids": [t for c in choices for t in c["token_ids"]],
            "logprobs": [x for c in choices for x in c["logprobs"]["token_logprobs"]],
            "finish_reason": finishes[0], "usage": chunks[-1]["usage"]}


def _twin(url: str, body: dict) -> dict:
    """The same request, not streamed and not migrated."""
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    [choice] = answer["choices"]
    return {"text": choice["text"], "token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
            "finish_reason": choice["finish_reason"], "usage": answer["usage"]}


def _assert_same(streamed: dict, twin: dict) -> None:
    assert streamed["token_ids"] == twin["token_ids"] and streamed["text"] == twin["text"]
    assert streamed["logprobs"] == pytest.approx(twin["logprobs"], abs=1e-4)
    assert streamed["finish_reason"] == twin["finish_reason"] and streamed["usage"] == twin["usage"]


def _generated(url: str) -> float:
    """The tokens the engine server's engine has sampled, in all (its /metrics)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith("rollwise_engine_generated_tokens_total ")))


def _stream_and_move(source: str, body: dict, move) -> tuple[list[dict | str], httpx.Response]:
    """Stream `body` from `source`; once it runs, pause the source (so it is surely still running, a tiny model
    decodes fast), `move()` it, and resume. Returns (every event of the stream, what the move answered)."""
    with httpx.stream("POST", source + "/v1/completions", json=body, timeout=120) as response:
        _wait_running(source, 1)
        httpx.post(source + "/pause")
        try:
            moved = move()
        finally:
            httpx.post(source + "/resume")
        return _events(response.iter_lines()), moved


def _chunks_past(events: list[dict | str], tokens: int) -> int:
    """How many chunks carry tokens sampled after the first `tokens` (the target's, once it moved)."""
    seen, past = 0, 0
    for chunk in [c for c in events if isinstance(c, dict) and c["choices"]]:
        seen += len(chunk["choices"][0]["token_ids"])
        past += seen > tokens
    return past


def test_streamed_request_migrated_mid_stream_equals_the_unmigrated_one(servers):
    a, b = servers
    events, moved = _stream_and_move(a, _body(700, True), lambda: httpx.post(a + "/migrate", json={"target": b},
                                                                             timeout=60))
    assert moved.status_code == 200, moved.text
    report = moved.json()
    [tokens_then] = report["migrated"].values()  # the source reports it migrated, streamed as it is
    assert report["still_here"] == 0 and 0 < tokens_then < TOKENS  # mid-stream
    _assert_same(_joined(events), _twin(b, _body(700, False)))
    assert _chunks_past(events, tokens_then) >= 1  # the target's tokens came through the same stream
    assert httpx.get(a + "/health").json()["running"] == 0 and httpx.get(b + "/health").json()["running"] == 0


def test_streamed_request_with_a_stop_string_stops_where_the_unmigrated_one_does(servers):
    """Moved by the router's planned removal of its replica; the stop string (checked on the source, where the
    client's stream is) ends it on the target, where it runs by then."""
    a, b = servers
    whole = _twin(b, _body(701, False))
    stop = whole["text"][:len(whole["text"]) // 2]  # (a tiny random model repeats itself: a long stop string)
    twin = _twin(b, _body(701, False, stop=[stop]))
    assert twin["finish_reason"] == "stop" and 0 < len(twin["token_ids"]) < TOKENS
    before = _generated(b)
    with _router([a, b]) as (router, _):
        events, removed = _stream_and_move(
            a, _body(701, True, stop=[stop]),
            lambda: httpx.post(router + "/replicas/remove", json={"url": a, "drain_timeout_s": 0}, timeout=60))
    assert removed.status_code == 200, removed.text
    migration = removed.json()["migration"]
    assert removed.json()["migration_refused"] is None and migration["target"] == b
    [tokens_then] = migration["migrated"].values()
    assert 0 < tokens_then < len(twin["token_ids"])  # it moved before the stop string was complete
    _assert_same(_joined(events), twin)
    assert _chunks_past(events, tokens_then) >= 1
    deadline = time.monotonic() + 10
    while httpx.get(b + "/health").json()["running"]:
        assert time.monotonic() < deadline, "the request still runs on the target after its stop string"
        time.sleep(0.02)
    # the stop string aborted it where it ran: the target sampled fewer tokens than max_tokens would have had it
    assert _generated(b) - before < TOKENS - tokens_then


def test_client_gone_during_the_relay_aborts_the_request_on_the_target(servers):
    a, b = servers
    httpx.post(b + "/pause")  # so it is still running there when its client goes
    try:
        with httpx.stream("POST", a + "/v1/completions", json=_body(702, True), timeout=60):
            _wait_running(a, 1)
            httpx.post(a + "/pause")
            try:
                moved = httpx.post(a + "/migrate", json={"target": b}, timeout=60).json()
            finally:
                httpx.post(a + "/resume")
            running_there = httpx.get(b + "/health").json()["running"]
        # the client closed its stream
        deadline = time.monotonic() + 10
        while httpx.get(b + "/health").json()["running"]:
            assert time.monotonic() < deadline, "the target still runs the request its client left"
            time.sleep(0.02)
    finally:
        httpx.post(b + "/resume")
    assert len(moved["migrated"]) == 1 and running_there == 1, moved
    assert httpx.get(a + "/health").json()["running"] == 0


def _polls(url: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return float(next(line.split()[1] for line in lines
                      if line.startswith("rollwise_engine_migration_result_polls_total ")))


LONGEST = 480  # tokens: what the servers' max_model_len allows, so the three are surely still running when moved


def test_several_streamed_requests_share_one_relay_poll(servers):
    """Three streams moved by one /migrate: their tokens come back through one long poll at a time (all three's
    news in each), not one poll per request, and each stream equals its unmigrated twin."""
    import threading

    a, b = servers
    seeds = (710, 711, 712)
    streams: dict[int, list] = {}

    def stream(seed: int) -> None:
        with httpx.stream("POST", a + "/v1/completions", json=_body(seed, True, LONGEST), timeout=120) as response:
            streams[seed] = _events(response.iter_lines())

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in seeds]
    httpx.post(a + "/pause")  # all three queued first, so they run together
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(a + "/health").json()["waiting"] < len(seeds):
            assert time.monotonic() < deadline, "the streams never reached the engine"
            time.sleep(0.005)
        httpx.post(a + "/resume")
        _wait_running(a, len(seeds))
        httpx.post(a + "/pause")  # (so they are surely still running)
        polls = _polls(b)
        moved = httpx.post(a + "/migrate", json={"target": b}, timeout=60)
    finally:
        httpx.post(a + "/resume")
    for t in threads:
        t.join(timeout=120)
    assert moved.status_code == 200 and len(moved.json()["migrated"]) == len(seeds), moved.text
    past = 0
    for seed in seeds:
        _assert_same(_joined(streams[seed]), _twin(b, _body(seed, False, LONGEST)))
        past += _chunks_past(streams[seed], min(moved.json()["migrated"].values()))
    # one poll carries the three's tokens: fewer polls than the chunks they filled (one per request's poll before)
    assert 1 <= _polls(b) - polls < past
