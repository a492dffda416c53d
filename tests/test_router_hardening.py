"""The router under outside probes (issue 24, items 2, 3, 5 and 6), over real engine replicas on loopback.

- a 10 MB body gets 413 naming --max-request-bytes at once; a 2 MB prompt under the limit is parsed and
  (its start) tokenized off the event loop: the router's /health stays fast and the busy replica stays up;
- a client that leaves a non-streamed request: the engine stops generating it within seconds;
- the OpenAPI schema lists the status codes the router answers; the README tells how to send an
  Idempotency-Key with the openai client (which sends none by itself);
- a new router takes no connection before it can serve; a replica back from the dead gets traffic again
  within a few health intervals, and a breaker trial that ends without a verdict does not shut it forever.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from engine_processes import engine_processes, engine_subprocess, wait_healthy

from rollwise.cli import main
from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import free_port, serve_in_thread
from rollwise.router.config import RouterConfig
from rollwise.router.app import bind_socket
from rollwise.router.app import create_app as create_router_app
from rollwise.router.core import Router
from rollwise.router.policies import Decision, RouteRequest

MODEL = "tiny:0"
README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _serve(app):
    return serve_in_thread(app, bind_socket("127.0.0.1", 0, reuse_port=False))


def _router(replicas: list[str], **overrides):
    config = RouterConfig(replicas=replicas, health_interval_s=0.2, queue_timeout_s=5.0, model=MODEL, **overrides)
    return _serve(create_router_app(config))


# ================================================================== item 2: huge requests


def test_huge_requests_never_stall_health_or_mark_a_busy_replica_down():
    with engine_processes(1) as (_, _, urls), _router(urls) as (router, _):
        latencies, states, stop = [], [], threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=router, timeout=30) as c:
                while not stop.is_set():
                    started = time.monotonic()
                    r = c.get("/health")
                    latencies.append(time.monotonic() - started)
                    states.append(r.json()["replicas"][0]["healthy"])
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            with httpx.Client(base_url=router, timeout=120) as c:
                # Over the limit: refused before anything reads it, naming the setting.
                started = time.monotonic()
                big = c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
                             headers={"content-type": "application/json"})
                assert big.status_code == 413, big.text
                assert "--max-request-bytes" in big.json()["error"]["message"]
                assert time.monotonic() - started < 5
                # Under the limit: 2 MB of prompt (seconds of tokenizing) reaches the engine, which names
                # the problem; meanwhile the router keeps answering and keeps its replica.
                for _ in range(3):
                    long = c.post("/v1/completions", json={"prompt": "hello world " * 180_000, "max_tokens": 1})
                    assert long.status_code == 400 and "prompt" in long.json()["error"]["message"]
                ok = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
                assert ok.status_code == 200, ok.text
        finally:
            stop.set()
            prober.join()
    latencies.sort()
    assert len(latencies) >= 10
    assert latencies[int(len(latencies) * 0.99)] < 0.1, latencies[-5:]
    assert all(states), "the router marked a busy replica down"


def test_max_request_bytes_flag():
    assert main(["serve", "router", "--replica", "http://127.0.0.1:1", "--max-request-bytes", "0"]) == 2
    with _router(["http://127.0.0.1:1"], max_request_bytes=1000) as (router, _):
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]


# ================================================================== item 3: abandoned requests


def test_a_client_leaving_stops_the_generation_at_the_engine():
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=8192, seed=0)
    with _serve(create_app(engine, tokenizer, MODEL)) as (replica, _), _router([replica]) as (router, _):
        host, port = router.removeprefix("http://").split(":")
        body = b'{"prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": true}'
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 30
            while engine.num_running == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            time.sleep(0.3)  # generating now; the client leaves
        left = time.monotonic()
        while engine.num_running > 0:
            assert time.monotonic() - left < 5, "the engine kept generating for a client that left"
            time.sleep(0.05)
        metrics = httpx.get(f"{router}/metrics").text
        assert "rollwise_router_client_gone_total 1.0" in metrics
        # The replica is not blamed for it, and serves the next request.
        r = httpx.post(f"{router}/v1/completions", json={"prompt": "next", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


# ================================================================== item 5: honest schema and docs


def test_openapi_lists_the_status_codes_the_router_answers():
    paths = create_router_app(RouterConfig(replicas=["http://127.0.0.1:1"])).openapi()["paths"]
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/generate"):
        codes = set(paths[endpoint]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "429", "502", "503"} <= codes, (endpoint, codes)
        assert "422" not in codes  # the router never answers FastAPI's validation error
    assert {"400", "404", "413"} <= set(paths["/abort"]["post"]["responses"])
    assert "503" in paths["/health"]["get"]["responses"]


def test_readme_says_how_to_send_an_idempotency_key():
    text = README.read_text()
    section = text[text.index("## Routing across engine replicas"):text.index("## Agents")]
    assert "client sends one" not in section
    assert 'extra_headers={"Idempotency-Key"' in section and "default_headers" in section
    assert "--max-request-bytes" in section


# ================================================================== item 6: handover and recovery


def _slow_health_replica(delay_s: float) -> FastAPI:
    """A replica whose first /health answer takes `delay_s` (a stand-in for a slow starter)."""
    app, calls = FastAPI(), []

    @app.get("/health")
    async def health():
        calls.append(1)
        if len(calls) == 1:
            import asyncio

            await asyncio.sleep(delay_s)
        return {"status": "ok", "policy_version": 0}

    return app


def test_a_new_router_takes_no_connection_before_it_can_serve(tmp_path: Path):
    with _serve(_slow_health_replica(3.0)) as (replica, _):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollwise.cli", "serve", "router", "--replica", replica, "--port", str(port),
             "--model", MODEL, "--state-file", str(tmp_path / "state.json"), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "the router exited"
                assert time.monotonic() < deadline, "the router never listened"
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.02)
            # The port takes connections: the router answers at once, not after its start-up.
            started = time.monotonic()
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
            assert r.status_code == 200 and time.monotonic() - started < 1.0
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_a_replica_back_from_the_dead_gets_its_share_again():
    with engine_processes(2) as (ports, procs, urls):
        # A long cooldown: only the successful health probe of the restarted replica may reopen it.
        with _router(urls, policy="round_robin", breaker_threshold=1, breaker_cooldown_s=60.0) as (router, _):
            with httpx.Client(base_url=router, timeout=60) as c:
                def spread(n: int) -> dict[str, int]:
                    placed: dict[str, int] = {}
                    for i in range(n):
                        r = c.post("/v1/completions", json={"prompt": f"q{i} {time.monotonic()}", "max_tokens": 2})
                        assert r.status_code == 200, r.text
                        placed[r.headers["x-rollwise-replica"]] = placed.get(r.headers["x-rollwise-replica"], 0) + 1
                    return placed

                assert set(spread(4)) == set(urls)
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait(timeout=10)
                assert spread(4) == {urls[1]: 4}  # failed over; the dead replica's breaker is open
                procs[0] = engine_subprocess(ports[0])  # back, on the same port
                wait_healthy(urls[0], procs[0])
                time.sleep(1.0)  # a few health intervals
                placed = spread(10)
                assert placed.get(urls[0], 0) >= 4, placed


def test_a_breaker_trial_without_a_verdict_does_not_shut_the_replica():
    """A half-open trial whose client left (or that got a 4xx stream) must let the next request try."""
    router = Router(RouterConfig(replicas=["http://127.0.0.1:1"], breaker_threshold=1, breaker_cooldown_s=0.0))
    replica = next(iter(router.pool))
    replica.healthy = True
    replica.mark_failed("connection refused")  # open; with no cooldown, half-open at once
    assert replica.routable()
    ticket = router.begin(replica, Decision(replica.name, "explore", 0), RouteRequest())
    assert not replica.routable()  # the trial is in flight
    router.end(replica, ticket)  # ...and ends without success or failure
    assert replica.routable()
