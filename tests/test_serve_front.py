"""The serving front (rollwise.serve.front), tested once on a minimal app: API keys (401 naming what to send),
the per-key in-flight bound (429 + Retry-After), the error envelope, /health and /ready, request metrics, the
flags' checks, and the drain on SIGTERM (a real process: the in-flight request finishes, a new one gets 503, exit
0). Then each real server (engine, router, pool, agent proxy) shows it stands on the same front: the same flags,
401 without a key when keys are set, the same error envelope, the probes open.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from rollwise.agent.generator import HTTPGenerator
from rollwise.agent.proxy import create_proxy_app
from rollwise.agent.proxy import main as proxy_main
from rollwise.cli import main as rollwise_main
from rollwise.engine.server import build_engine
from rollwise.engine.server import create_app as create_engine_app
from rollwise.local_server import serve_in_thread
from rollwise.model.tiny import tiny_tokenizer
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.app import create_app as create_pool_app
from rollwise.router.config import RouterConfig
from rollwise.router.app import bind_socket
from rollwise.router.app import create_app as create_router_app
from rollwise.serve.auth import ApiKeys
from rollwise.serve.front import Front, install_front
from rollwise.serve.settings import FLAGS, FrontSettings

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KEY, OTHER = "front-key-alice-0123456789", "front-key-bob-0123456789ab"
MODEL = "tiny:0"
ENVELOPE = {"message", "type", "param", "code"}


def _keys() -> ApiKeys:
    return ApiKeys([KEY, OTHER], "--api-keys keys.txt")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _assert_envelope(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ENVELOPE
    for word in words:
        assert word in error["message"], error["message"]
    return error


def minimal_app(front: Front, release: threading.Event | None = None) -> FastAPI:
    app = FastAPI()
    release = release or threading.Event()
    ready = SimpleNamespace(ok=True)

    @app.post("/work")
    async def work(body: dict) -> dict:
        return {"echo": body}

    @app.post("/hold")
    async def hold() -> dict:  # in flight until released (bounded)
        import asyncio

        for _ in range(200):
            if release.is_set():
                break
            await asyncio.sleep(0.02)
        return {"held": True}

    install_front(app, front, ready=lambda: ready.ok)
    app.state.ready = ready
    return app


@pytest.fixture(scope="module")
def minimal() -> Iterator[SimpleNamespace]:
    release = threading.Event()
    front = Front(FrontSettings(max_in_flight_per_key=1, max_request_bytes=4096), _keys())
    app = minimal_app(front, release)
    with serve_in_thread(app) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        yield SimpleNamespace(url=url, http=http, release=release, app=app)


# ==================================================================== the front, once


@pytest.mark.parametrize("sent", [None, "Bearer wrong-key-0123456789abcdef", "Basic abc"])
def test_every_route_needs_a_key_and_the_401_says_what_to_send(minimal, sent):
    headers = {"Authorization": sent} if sent else {}
    error = _assert_envelope(minimal.http.post("/work", json={"a": 1}, headers=headers), 401,
                             "Authorization: Bearer KEY", "--api-keys keys.txt", "ROLLWISE_API_KEY")
    assert error["type"] == "authentication_error" and error["param"] == "authorization"
    assert KEY not in error["message"] and OTHER not in error["message"]
    assert minimal.http.post("/work", json={"a": 1}, headers=_bearer(KEY)).json() == {"echo": {"a": 1}}


def test_probes_need_no_key_and_ready_follows_the_app(minimal):
    assert minimal.http.get("/health").json() == {"status": "ok"}
    assert minimal.http.get("/ready").json() == {"ready": True}
    assert 'rollwise_http_requests_total{route="/health",status="200"}' in minimal.http.get("/metrics").text
    minimal.app.state.ready.ok = False
    try:
        error = _assert_envelope(minimal.http.get("/ready"), 503, "not ready")
        assert error["code"] == "not_ready"
    finally:
        minimal.app.state.ready.ok = True


def test_the_in_flight_bound_is_per_key_with_retry_after(minimal):
    minimal.release.clear()
    held = threading.Thread(target=lambda: minimal.http.post("/hold", headers=_bearer(KEY)))
    held.start()
    try:
        deadline = time.monotonic() + 10
        while minimal.app.state.front.gate.by_key == {} and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = minimal.http.post("/work", json={}, headers=_bearer(KEY))
        error = _assert_envelope(refused, 429, "--max-in-flight-per-key=1")
        assert error["type"] == "rate_limit_error" and refused.headers["Retry-After"] == "1"
        # another key is not held back by this one's requests
        assert minimal.http.post("/work", json={"b": 2}, headers=_bearer(OTHER)).status_code == 200
    finally:
        minimal.release.set()
        held.join()
    assert minimal.http.post("/work", json={}, headers=_bearer(KEY)).status_code == 200  # freed


def test_errors_share_the_envelope(minimal):
    auth = _bearer(KEY)
    _assert_envelope(minimal.http.post("/work", content=b"{not json", headers={**auth, "content-type":
                                                                              "application/json"}), 400, "JSON")
    _assert_envelope(minimal.http.get("/nowhere", headers=auth), 404, "/nowhere")
    error = _assert_envelope(minimal.http.post("/work", json={"x": "y" * 5000}, headers=auth), 413,
                             "--max-request-bytes")
    assert error["code"] == "request_too_large"


def test_metrics_count_requests_by_route_template_and_status():
    from prometheus_client import CollectorRegistry, generate_latest

    app = FastAPI()
    registry = CollectorRegistry()

    @app.get("/items/{name}")
    async def item(name: str) -> dict:
        return {"name": name}

    front = install_front(app, Front(), registry=registry)
    with serve_in_thread(app) as (url, _):
        for name in ("a", "b", "c"):
            httpx.get(f"{url}/items/{name}")
        httpx.get(f"{url}/nowhere/at/all")
    text = generate_latest(registry).decode()
    assert 'rollwise_http_requests_total{route="/items/{name}",status="200"} 3.0' in text
    assert 'rollwise_http_requests_total{route="other",status="404"} 1.0' in text
    assert 'rollwise_http_request_seconds_count{route="/items/{name}"} 3.0' in text
    assert front.metrics is not None


@pytest.mark.parametrize("values, words", [
    ({"port": 70000}, "--port"), ({"max_request_bytes": 0}, "--max-request-bytes"),
    ({"max_in_flight_per_key": 0}, "--max-in-flight-per-key"), ({"drain_timeout_s": -1}, "--drain-timeout"),
])
def test_bad_settings_are_refused_naming_the_flag(values, words):
    with pytest.raises(ValueError, match=words):
        FrontSettings.checked(**values)


def test_no_keys_only_on_loopback_unless_insecure(monkeypatch):
    monkeypatch.delenv("ROLLWISE_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="--host 0.0.0.0 accepts connections from other machines"):
        Front.from_settings(FrontSettings(host="0.0.0.0"))
    assert "WARNING" in Front.from_settings(FrontSettings(host="0.0.0.0", insecure_no_auth=True)).who_may_call()
    monkeypatch.setenv("ROLLWISE_API_KEYS", KEY)
    front = Front.from_settings(FrontSettings(host="0.0.0.0"))
    assert front.keys is not None and "ROLLWISE_API_KEYS" in front.who_may_call()
    with pytest.raises(ValueError, match="choose one"):
        Front.from_settings(FrontSettings(insecure_no_auth=True))


DRAIN_SERVER = """
import asyncio, socket
from fastapi import FastAPI
from rollwise.serve.drain import serve_app
from rollwise.serve.front import Front, install_front
from rollwise.serve.settings import FrontSettings
app = FastAPI()

@app.post("/work")
async def work() -> dict:
    return {}

@app.post("/hold")
async def hold() -> dict:
    await asyncio.sleep(3)
    return {"held": True}

front = install_front(app, Front(FrontSettings(drain_timeout_s=20)))
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
serve_app(app, front, sockets=[sock])
print("exited cleanly", flush=True)
"""


def test_sigterm_drains_in_flight_finishes_new_gets_503_exit_0():
    proc = subprocess.Popen([sys.executable, "-c", DRAIN_SERVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = f"http://127.0.0.1:{proc.stdout.readline().strip()}"
        with httpx.Client(base_url=url, timeout=30) as probe, httpx.Client(base_url=url, timeout=30) as slow:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if probe.get("/ready").status_code == 200:  # also opens the probe's keep-alive connection
                        break
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.05)
            answer: list[httpx.Response] = []
            held = threading.Thread(target=lambda: answer.append(slow.post("/hold")))  # ~4 s, never released
            held.start()
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.4)  # the server notices on its next tick (0.1 s)
            refused = probe.post("/work", json={})
            error = _assert_envelope(refused, 503, "draining")
            assert refused.headers["Retry-After"] and error["code"] == "draining"
            with contextlib.suppress(httpx.TransportError):  # the probe's connection may be closed by now
                ready = probe.get("/ready")
                assert ready.status_code == 503
            held.join(timeout=30)
        assert answer and answer[0].status_code == 200 and answer[0].json() == {"held": True}
        assert proc.wait(timeout=30) == 0
        assert "exited cleanly" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ==================================================================== every server stands on it


def test_every_server_takes_the_same_front_flags(capsys):
    helps = {}
    for name, run in {"engine": lambda: rollwise_main(["serve", "engine", "--help"]),
                      "router": lambda: rollwise_main(["serve", "router", "--help"]),
                      "pool": lambda: rollwise_main(["serve", "pool", "--help"]),
                      "proxy": lambda: proxy_main(["--help"])}.items():
        with pytest.raises(SystemExit):
            run()
        helps[name] = capsys.readouterr().out
    for name, text in helps.items():
        for flag in FLAGS.values():
            assert flag in text, f"{name} lacks {flag}"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[str, str]]]:
    """Each real server with keys: name -> (url, a route that needs a key)."""
    with contextlib.ExitStack() as stack:
        engine, tokenizer = build_engine(MODEL, max_num_seqs=2, max_model_len=64, seed=0)
        engine_url, _ = stack.enter_context(serve_in_thread(
            create_engine_app(engine, tokenizer, MODEL, front=Front(keys=_keys()))))
        router_app = create_router_app(RouterConfig(replicas=[engine_url], upstream_api_key=KEY,
                                                    health_interval_s=0.2), front=Front(keys=_keys()))
        router_url, _ = stack.enter_context(serve_in_thread(router_app, bind_socket("127.0.0.1", 0, False)))
        pool_url, _ = stack.enter_context(serve_in_thread(
            create_pool_app(EnginePool(1, max_num_seqs=2, max_model_len=64), front=Front(keys=_keys()))))
        proxy = create_proxy_app(HTTPGenerator(engine_url, headers=_bearer(KEY)), tiny_tokenizer(), model_name=MODEL,
                                 front=Front(keys=_keys()))
        proxy_url, _ = stack.enter_context(serve_in_thread(proxy))
        yield {"engine": (engine_url, "/v1/models"), "router": (router_url, "/v1/models"),
               "pool": (pool_url, "/state"), "proxy": (proxy_url, "/sessions")}


@pytest.mark.parametrize("name", ["engine", "router", "pool", "proxy"])
def test_each_server_uses_the_front(servers, name):
    url, route = servers[name]
    with httpx.Client(base_url=url, timeout=30) as http:
        error = _assert_envelope(http.get(route), 401, "Authorization: Bearer KEY", "--api-keys keys.txt")
        assert error["type"] == "authentication_error"
        assert http.get(route, headers=_bearer(KEY)).status_code == 200  # the router reached its engine with its key
        _assert_envelope(http.get("/no/such/route", headers=_bearer(KEY)), 404)
        for probe in ("/health", "/ready", "/metrics"):
            assert http.get(probe).status_code == 200, probe
        assert "rollwise_http_requests_total" in http.get("/metrics").text
        _assert_envelope(http.post(route if name != "pool" else "/jobs", content=b"x" * (9 * 2**20),
                                   headers=_bearer(KEY)), 413, "--max-request-bytes")
