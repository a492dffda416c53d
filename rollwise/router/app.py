"""`rollwise serve router`: an HTTP gateway in front of N engine replicas (`rollwise serve engine`,
or any server speaking the same contract).

It serves the engine's API: POST /v1/completions, /v1/chat/completions (stream=true too), /generate;
GET /v1/models, /model_info; plus /health, /metrics, and the control endpoints fanned out to every
replica: /pause, /resume, /abort, /flush_cache, and /update_weights_from_disk as a rolling update
(one replica drained, paused, updated and resumed at a time while the others serve).

Request bodies are forwarded byte for byte and responses come back byte for byte: JSON fields the
router does not know (engine extras such as token_ids or routed experts) pass through both ways.
The router reads a body only to route it, and removes only its own fields:

    session_id / header X-Session-Id            a multi-turn session: its turns stick to one replica
    group_id / header X-Group-Id                a GRPO group: its samples share a prompt
    min_policy_version / X-Min-Policy-Version   only replicas serving at least this version
    header Idempotency-Key                      a retry with the same key never generates twice
                                                (the openai client sends one with every POST)

Failures: a replica that refuses connections or answers 5xx gets the request again on another
replica (its partial work never reaches the client, so nothing is duplicated); a stream that
already sent bytes is not restarted elsewhere (that would duplicate tokens): it ends with an SSE
error event naming the replica. No replica with room -> 429 after --queue-timeout; no healthy
replica, or none at the required policy version -> 503. Every error is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollwise.router.metrics import RouterMetrics
from rollwise.router.policies import (
    Decision,
    LoadCost,
    PrefixAware,
    RouteRequest,
    make_policy,
)
from rollwise.router.replicas import Replica, ReplicaPool
from rollwise.router.sessions import (
    AffinityTable,
    IdempotencyCache,
    IdempotencyConflict,
    StoredResponse,
    read_state,
    write_state,
)
from rollwise.router.tokens import load_tokenizer, prompt_tokens

log = logging.getLogger("rollwise.router")

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")
CONTROL_ENDPOINTS = ("/pause", "/resume", "/flush_cache")
# Every path the router ever calls on a replica. Upstream URLs are built only by _upstream(), which refuses
# anything else: no byte of a client request may choose the host or the path of an upstream call.
UPSTREAM_PATHS = frozenset(GENERATION_ENDPOINTS + CONTROL_ENDPOINTS
                           + ("/abort", "/update_weights_from_disk", "/v1/models", "/model_info"))


def _upstream(replica: Replica, path: str) -> str:
    if path not in UPSTREAM_PATHS:
        raise RouterError(500, f"internal error: refusing to call replica path {path!r} (not an upstream path)",
                          kind="internal_error")
    return replica.url + path


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "prefix"
    model: str | None = None  # tokenizer spec; None: ask a replica's /model_info
    auth_token: str | None = None
    max_in_flight: int | None = None  # per replica; None: 2 x the replica's max_num_seqs
    queue_timeout_s: float = 30.0  # how long a request waits for a replica with room
    max_queue: int = 4096  # requests waiting beyond this are refused at once (429)
    max_attempts: int = 3  # replicas one request may be tried on
    health_interval_s: float = 1.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    default_max_tokens: int = 256  # decode-work estimate for requests that set no max_tokens
    drain_timeout_s: float = 60.0  # rolling update: how long to wait for a replica's requests to finish
    upstream_timeout_s: float = 600.0
    state_file: Path | None = None
    load_cost: LoadCost = field(default_factory=LoadCost)


class RouterError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class _Meta:
    """What the router reads from a generation request."""

    session: str | None
    group: str | None
    min_version: int
    stream: bool
    forward: bytes  # the body to send on


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise RouterError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _key_field(body: dict[str, Any], headers: Any, name: str, header: str) -> str | None:
    value = body.pop(name, None)
    if value is not None and (not isinstance(value, str) or not value):
        raise RouterError(400, f"{name} must be a non-empty string, got {value!r}", name)
    return value or headers.get(header) or None


def _read_meta(raw: bytes, headers: Any) -> tuple[dict[str, Any], _Meta]:
    body = _parse_object(raw)
    had = {k for k in ("session_id", "group_id", "min_policy_version") if k in body}
    session = _key_field(body, headers, "session_id", "x-session-id")
    group = _key_field(body, headers, "group_id", "x-group-id")
    version: Any = body.pop("min_policy_version", None)
    if version is None:
        header = headers.get("x-min-policy-version")
        if header is not None:
            try:
                version = int(header)
            except ValueError:
                raise RouterError(400, f"X-Min-Policy-Version header must be an integer, got {header!r}",
                                  "X-Min-Policy-Version") from None
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise RouterError(400, f"min_policy_version must be an integer >= 0, got {version!r}", "min_policy_version")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RouterError(400, f"stream must be true or false, got {stream!r}", "stream")
    # Untouched bytes unless a router field had to come out (the engine rejects fields it does not know).
    forward = json.dumps(body).encode() if had else raw
    return body, _Meta(session, group, version or 0, stream, forward)


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (each ending in a blank line), so an error event is never spliced
    into the middle of a half-relayed one."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while True:
            cut = buffer.find(b"\n\n")
            if cut < 0:
                break
            yield buffer[: cut + 2]
            buffer = buffer[cut + 2:]
    if buffer.strip():
        yield buffer


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()


class Router:
    """The gateway's logic; create_app wires it to HTTP."""

    def __init__(self, config: RouterConfig, tokenizer: Any | None = None) -> None:
        if not config.replicas:
            raise ValueError("at least one --replica URL is required")
        for url in config.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica must be an http(s) URL, got {url!r}")
        self.config = config
        self.policy = make_policy(config.policy, config.load_cost)
        self.pool = ReplicaPool(config.replicas, config.max_in_flight, config.health_interval_s,
                                config.breaker_threshold, config.breaker_cooldown_s)
        self.pool.on_down = self._replica_down
        self.pool.on_up = self._replica_up
        self.tokenizer = tokenizer
        self._tokenizer_task: asyncio.Task | None = None
        self.affinity = AffinityTable()
        self.idempotency = IdempotencyCache()
        self.metrics = RouterMetrics(lambda: list(self.pool), lambda r: self.policy.load(r.load()))
        self.http: httpx.AsyncClient | None = None
        self._waiting = 0
        self._updating = asyncio.Lock()
        self._state_task: asyncio.Task | None = None
        self._state_written = -1
        self._changes = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.upstream_timeout_s, connect=5.0),
                                      limits=limits)
        if self.config.state_file is not None:
            self._load_state(self.config.state_file)
        await self.pool.probe_all(self.http)
        if self._tokenizer_task is not None:  # a replica answered: its model tells the tokenizer
            await self._tokenizer_task
        self.pool.start(self.http)
        if self.config.state_file is not None:
            self._state_task = asyncio.get_running_loop().create_task(self._save_periodically())

    async def close(self) -> None:
        await self.pool.close()
        if self._state_task is not None:
            self._state_task.cancel()
        if self.config.state_file is not None:
            self._save_state(self.config.state_file)
        if self.http is not None:
            await self.http.aclose()

    async def _find_tokenizer(self) -> Any | None:
        spec = self.config.model
        if spec is None:
            for replica in self.pool:
                try:
                    spec = (await self.http.get(_upstream(replica, "/model_info"), timeout=5)).json()["model"]
                    break
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
        if spec is None:
            log.warning("no replica answered /model_info and no --model was given: routing prompts by bytes")
            return None
        try:
            return await asyncio.to_thread(load_tokenizer, spec)
        except Exception as exc:  # noqa: BLE001 - the router still works, with byte prefixes
            log.warning("cannot load the tokenizer of %r (%s): routing prompts by bytes; pass --model", spec, exc)
            return None

    # ------------------------------------------------------------ state that survives a restart

    def _load_state(self, path: Path) -> None:
        state = read_state(path)
        if not state:
            return
        known = {r.name for r in self.pool}
        self.affinity.load({k: r for k, r in state.get("affinity", {}).items() if r in known})
        self.idempotency.load(state.get("idempotency", []))
        if isinstance(self.policy, PrefixAware):
            self.policy.tree.load([e for e in state.get("prefix_tree", []) if e["replica"] in known])
        log.info("loaded router state from %s: %d sessions/groups", path, len(self.affinity))

    def _save_state(self, path: Path) -> None:
        state: dict[str, Any] = {"affinity": self.affinity.export(), "idempotency": self.idempotency.export(64)}
        if isinstance(self.policy, PrefixAware):
            state["prefix_tree"] = self.policy.tree.export()[-4096:]
        try:
            write_state(path, state)
            self._state_written = self._changes
        except OSError as exc:
            log.warning("cannot write router state to %s: %s", path, exc)

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._changes != self._state_written:
                self._save_state(self.config.state_file)

    # ------------------------------------------------------------ choosing a replica

    def _replica_up(self, replica: Replica) -> None:
        """The first replica to come up (replicas often start after the router) tells the tokenizer."""
        if self.tokenizer is None and self._tokenizer_task is None and self.http is not None:
            self._tokenizer_task = asyncio.get_running_loop().create_task(self._adopt_tokenizer())

    async def _adopt_tokenizer(self) -> None:
        tokenizer = await self._find_tokenizer()
        if tokenizer is not None:
            self.tokenizer = tokenizer
            for replica in self.pool:  # prefixes learnt as bytes do not match token prefixes
                self.policy.forget(replica.name)
        else:
            self._tokenizer_task = None  # try again when another replica comes up

    def _replica_down(self, replica: Replica) -> None:
        """Its engine cache is gone (dead or restarted): forget its prefixes; its sessions move."""
        self.policy.forget(replica.name)
        self.affinity.drop_replica(replica.name)
        self._changes += 1

    async def _acquire(self, route: RouteRequest, min_version: int, tried: set[str],
                       last_error: str | None) -> tuple[Replica, Decision]:
        cfg = self.config
        if self._waiting >= cfg.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise RouterError(429, f"the router's queue is full ({cfg.max_queue} requests waiting); retry later",
                              kind="rate_limit_error", code="queue_full", retry_after=1)
        deadline = time.monotonic() + cfg.queue_timeout_s
        self._waiting += 1
        try:
            while True:
                replicas = [r for r in self.pool if r.name not in tried]
                if not any(r.healthy for r in replicas):
                    self.metrics.rejected.labels("no_healthy_replica").inc()
                    if tried:
                        raise RouterError(502, f"the request failed on {len(tried)} replica(s) and no other is "
                                          f"healthy (last error: {last_error}); nothing was returned, so retrying "
                                          "it is safe", kind="server_error", code="replicas_failed", retry_after=1)
                    states = "; ".join(f"{r.url}: {r.last_error or 'not answering yet'}" for r in self.pool)
                    raise RouterError(503, f"no healthy replica ({states})", kind="server_error",
                                      code="no_healthy_replica", retry_after=1)
                routable = [r for r in replicas if r.routable() and r.policy_version >= min_version]
                room = [r for r in routable if r.has_room()]
                if room:
                    decision = self.policy.choose(route, [r.load() for r in room])
                    return self.pool.get(decision.replica), decision
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    versions = sorted({r.policy_version for r in replicas if r.healthy})
                    if min_version and not any(v >= min_version for v in versions):
                        self.metrics.rejected.labels("policy_version").inc()
                        raise RouterError(503, f"no replica serves policy version >= {min_version} (healthy replicas "
                                          f"serve {versions}); retry after the weight update",
                                          "min_policy_version", "server_error", "policy_version_unavailable",
                                          retry_after=1)
                    self.metrics.rejected.labels("busy").inc()
                    caps = sorted({r.max_in_flight for r in replicas})
                    raise RouterError(429, f"all replicas are busy (in-flight cap {caps} each) or draining for "
                                      f"{cfg.queue_timeout_s:g} s; retry later", kind="rate_limit_error",
                                      code="replicas_busy", retry_after=1)
                await self.pool.wait(min(remaining, 1.0))
        finally:
            self._waiting -= 1

    def _begin(self, replica: Replica, decision: Decision, route: RouteRequest) -> tuple[int, int]:
        prefill = max(len(route.tokens) - decision.matched_tokens, 0)
        decode = route.samples * route.max_tokens
        replica.start(prefill, decode)
        self.policy.on_routed(route, decision, time.monotonic())
        if route.affinity_key is not None:
            self.affinity.set(route.affinity_key, replica.name)
        self._changes += 1
        self.metrics.routed.labels(replica.name, decision.reason).inc()
        self.metrics.prompt_tokens.labels(replica.name).inc(len(route.tokens))
        self.metrics.prefix_hit_tokens.labels(replica.name).inc(decision.matched_tokens)
        return prefill, decode

    def _end(self, replica: Replica, account: tuple[int, int]) -> None:
        replica.finish(*account)
        self.pool.notify()

    def _failed(self, replica: Replica, error: str, connection: bool) -> None:
        replica.mark_failed(error)
        self.metrics.failovers.labels(replica.name).inc()
        if connection and replica.healthy:  # refused / reset: treat it as down until a probe says otherwise
            replica.healthy = False
            self._replica_down(replica)
        self.pool.notify()

    def _route_request(self, endpoint: str, body: dict[str, Any], meta: _Meta) -> RouteRequest:
        tokens = prompt_tokens(endpoint, body, self.tokenizer)
        n = body.get("n", 1)
        n = n if isinstance(n, int) and n > 0 else 1
        prompts = body.get("prompt") if endpoint == "/v1/completions" else None
        if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
            n *= len(prompts)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            max_tokens = self.config.default_max_tokens
        key = meta.session or meta.group
        return RouteRequest(tokens, meta.session, meta.group, self.affinity.get(key), n, max_tokens)

    # ------------------------------------------------------------ generation

    async def generate(self, endpoint: str, request: Request) -> Response:
        raw = await request.body()
        body, meta = _read_meta(raw, request.headers)
        route = self._route_request(endpoint, body, meta)
        key = request.headers.get("idempotency-key")
        if meta.stream:
            return await self._stream(endpoint, route, meta, key)
        if key:
            before = self.idempotency.replays
            stored = await self.idempotency.run(key, lambda: self._unary(endpoint, route, meta))
            if self.idempotency.replays != before:
                self.metrics.idempotent_replays.inc()
        else:
            stored = await self._unary(endpoint, route, meta)
        return Response(stored.body, stored.status, headers=stored.headers, media_type=stored.media_type)

    async def _unary(self, endpoint: str, route: RouteRequest, meta: _Meta) -> StoredResponse:
        tried: set[str] = set()
        last_error: str | None = None
        for _ in range(self.config.max_attempts):
            replica, decision = await self._acquire(route, meta.min_version, tried, last_error)
            account = self._begin(replica, decision, route)
            try:
                response = await self.http.post(_upstream(replica, endpoint), content=meta.forward,
                                                headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                last_error = f"{replica.url}: {type(exc).__name__}: {exc}"
                self._failed(replica, last_error, connection=True)
                tried.add(replica.name)
                self.metrics.retries.labels("connection").inc()
                continue
            finally:
                self._end(replica, account)
            if response.status_code >= 500:
                last_error = f"{replica.url} answered HTTP {response.status_code}: {response.text[:300]}"
                self._failed(replica, last_error, connection=False)
                tried.add(replica.name)
                self.metrics.retries.labels(f"http_{response.status_code}").inc()
                continue
            replica.breaker.record_success()
            if response.status_code < 300 and self.policy.learns_outputs:
                self._learn(route, replica, response.content)
            return StoredResponse(response.status_code, response.headers.get("content-type", "application/json"),
                                  response.content, {"x-rollwise-replica": replica.url})
        raise RouterError(502, f"the request failed on {len(tried)} replica(s) (last error: {last_error}); "
                          "nothing was returned, so retrying it is safe", kind="server_error", code="replicas_failed",
                          retry_after=1)

    def _learn(self, route: RouteRequest, replica: Replica, content: bytes) -> None:
        """prompt + output of each choice into the prefix tree: the engine caches them on finish."""
        if not route.tokens:
            return
        try:
            choices = json.loads(content).get("choices") or []
            outputs = [c["token_ids"] for c in choices if isinstance(c.get("token_ids"), list)]
        except (ValueError, AttributeError, TypeError):
            return
        self.policy.on_finished(route, replica.name, outputs[:8], time.monotonic())

    async def _stream(self, endpoint: str, route: RouteRequest, meta: _Meta, key: str | None) -> Response:
        if key:
            stored = self.idempotency.lookup(key)
            if stored is not None:
                self.metrics.idempotent_replays.inc()
                return Response(stored.body, stored.status, headers=stored.headers, media_type=stored.media_type)
            try:
                self.idempotency.begin_stream(key)
            except IdempotencyConflict:
                raise RouterError(409, "a streamed request with this Idempotency-Key is still running; wait for it "
                                  "to finish, then retry to get its stored result", "Idempotency-Key",
                                  code="idempotency_conflict", retry_after=1) from None
        try:
            return await self._open_stream(endpoint, route, meta, key)
        except BaseException:
            if key:
                self.idempotency.end_stream(key, None)
            raise

    async def _open_stream(self, endpoint: str, route: RouteRequest, meta: _Meta, key: str | None) -> Response:
        tried: set[str] = set()
        last_error: str | None = None
        for _ in range(self.config.max_attempts):
            replica, decision = await self._acquire(route, meta.min_version, tried, last_error)
            account = self._begin(replica, decision, route)
            upstream: httpx.Response | None = None
            try:
                upstream = await self.http.send(
                    self.http.build_request("POST", _upstream(replica, endpoint), content=meta.forward,
                                            headers={"content-type": "application/json"}),
                    stream=True,
                )
                if upstream.status_code != 200:
                    content = await upstream.aread()
                    await upstream.aclose()
                    self._end(replica, account)
                    if upstream.status_code >= 500:
                        last_error = f"{replica.url} answered HTTP {upstream.status_code}: {content[:300]!r}"
                        self._failed(replica, last_error, connection=False)
                        tried.add(replica.name)
                        self.metrics.retries.labels(f"http_{upstream.status_code}").inc()
                        continue
                    if key:
                        self.idempotency.end_stream(key, None)
                    return Response(content, upstream.status_code,
                                    media_type=upstream.headers.get("content-type", "application/json"))
                events = _sse_events(upstream.aiter_raw())
                first = await events.__anext__()  # nothing sent to the client yet: a failure here is retried
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                if upstream is not None:
                    await upstream.aclose()
                self._end(replica, account)
                last_error = f"{replica.url}: {type(exc).__name__}: {exc}"
                self._failed(replica, last_error, connection=True)
                tried.add(replica.name)
                self.metrics.retries.labels("connection").inc()
                continue
            return StreamingResponse(self._relay(first, events, upstream, replica, account, key),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "x-rollwise-replica": replica.url})
        raise RouterError(502, f"the stream could not start on {len(tried)} replica(s) (last error: {last_error}); "
                          "nothing was sent, so retrying it is safe", kind="server_error", code="replicas_failed",
                          retry_after=1)

    async def _relay(self, first: bytes, events: AsyncIterator[bytes], upstream: httpx.Response, replica: Replica,
                     account: tuple[int, int], key: str | None) -> AsyncIterator[bytes]:
        sent = [first]
        ok = False
        try:
            yield first
            async for event in events:
                sent.append(event)
                yield event
            ok = True
            replica.breaker.record_success()
        except httpx.HTTPError as exc:
            message = (f"replica {replica.url} failed mid-stream ({type(exc).__name__}: {exc}) after "
                       f"{len(sent)} event(s) were sent; the output is incomplete and was not restarted elsewhere "
                       "(that would duplicate tokens): retry the request")
            self._failed(replica, message, connection=True)
            self.metrics.stream_failures.labels(replica.name).inc()
            yield _sse_error(message, "replica_failed_mid_stream")
        finally:
            await upstream.aclose()
            self._end(replica, account)
            if key:
                self.idempotency.end_stream(
                    key, StoredResponse(200, "text/event-stream", b"".join(sent), {}) if ok else None)

    # ------------------------------------------------------------ control endpoints

    async def _fan_out(self, path: str, raw: bytes | None = None) -> dict[str, Any]:
        async def one(replica: Replica) -> tuple[str, Any]:
            try:
                r = await self.http.post(_upstream(replica, path), content=raw or b"{}",
                                         headers={"content-type": "application/json"}, timeout=30)
                return replica.url, {"status": r.status_code, "body": r.json()}
            except (httpx.HTTPError, ValueError) as exc:
                return replica.url, {"status": None, "error": f"{type(exc).__name__}: {exc}"}

        return dict(await asyncio.gather(*(one(r) for r in self.pool if r.healthy)))

    async def broadcast(self, path: str) -> dict[str, Any]:
        results = await self._fan_out(path)
        if path == "/flush_cache":
            for replica in self.pool:
                self.policy.forget(replica.name)
        return {"replicas": results}

    async def abort(self, raw: bytes) -> JSONResponse:
        body = _parse_object(raw)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise RouterError(400, "request_id must be a non-empty string", "request_id")
        results = await self._fan_out("/abort", raw)
        aborted = sum(r["body"].get("aborted_samples", 0) for r in results.values() if r.get("status") == 200)
        if not any(r.get("status") == 200 for r in results.values()):
            raise RouterError(404, f"no request with request_id {rid!r} is in flight on any replica", "request_id",
                              kind="not_found_error")
        return JSONResponse({"request_id": rid, "aborted_samples": aborted})

    async def forward_get(self, path: str) -> Response:
        for replica in sorted(self.pool, key=lambda r: not r.healthy):
            try:
                r = await self.http.get(_upstream(replica, path), timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        raise RouterError(503, "no replica answered", kind="server_error", code="no_healthy_replica", retry_after=1)

    async def rolling_update(self, raw: bytes) -> dict[str, Any]:
        """Replica by replica: drain (no new requests; wait for those in flight, up to drain_timeout_s),
        pause, update, resume. The others keep serving throughout."""
        body = _parse_object(raw)
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RouterError(400, "version must be an integer >= 0", "version")
        if not isinstance(body.get("path"), str) or not body["path"]:
            raise RouterError(400, "path must be a non-empty string (a path on the replicas' machine)", "path")
        drain = body.pop("drain_timeout_s", self.config.drain_timeout_s)
        if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
            raise RouterError(400, "drain_timeout_s must be a number >= 0", "drain_timeout_s")
        forward = json.dumps(body).encode()
        if self._updating.locked():
            raise RouterError(409, "a rolling weight update is already running; wait for it to finish",
                              code="update_in_progress", retry_after=5)
        async with self._updating:
            updated: list[dict[str, Any]] = []
            skipped = [r.url for r in self.pool if not r.healthy]
            for replica in sorted((r for r in self.pool if r.healthy), key=lambda r: r.name):
                updated.append(await self._update_one(replica, forward, version, float(drain), updated))
            return {"policy_version": version, "updated": updated, "skipped_unhealthy": skipped}

    async def _update_one(self, replica: Replica, forward: bytes, version: int, drain_s: float,
                          done: list[dict[str, Any]]) -> dict[str, Any]:
        started = time.monotonic()
        replica.draining = True
        try:
            deadline = started + drain_s
            while replica.in_flight and time.monotonic() < deadline:
                await self.pool.wait(min(0.2, deadline - time.monotonic()))
            drained = replica.in_flight == 0
            try:
                await self.http.post(_upstream(replica, "/pause"), timeout=30)
                response = await self.http.post(_upstream(replica, "/update_weights_from_disk"), content=forward,
                                                headers={"content-type": "application/json"})
                await self.http.post(_upstream(replica, "/resume"), timeout=30)
            except httpx.HTTPError as exc:
                self._failed(replica, f"{type(exc).__name__}: {exc}", connection=True)
                raise RouterError(502, f"replica {replica.url} failed during the weight update ({exc}); "
                                  f"{_done_note(done, version)}", kind="server_error", code="update_failed") from exc
            if response.status_code >= 400:
                try:
                    error = response.json()["error"]
                    message, param = error["message"], error.get("param")
                except (ValueError, KeyError, TypeError):
                    message, param = response.text[:300], None
                raise RouterError(response.status_code if response.status_code < 500 else 502,
                                  f"replica {replica.url} refused the update: {message}; {_done_note(done, version)}",
                                  param, code="update_failed")
            replica.policy_version = version
            self._replica_down_cache(replica)
            return {"replica": replica.url, "drained": drained, "seconds": round(time.monotonic() - started, 3)}
        finally:
            replica.draining = False
            self.pool.notify()

    def _replica_down_cache(self, replica: Replica) -> None:
        """New weights: the engine dropped its prefix cache, so the tree's view of it is stale."""
        self.policy.forget(replica.name)

    def health(self) -> JSONResponse:
        replicas = [r.describe() for r in self.pool]
        healthy = sum(r.healthy for r in self.pool)
        status = "ok" if healthy == len(replicas) else ("degraded" if healthy else "unavailable")
        body = {"status": status, "policy": self.policy.name, "healthy_replicas": healthy, "replicas": replicas,
                "waiting": self._waiting, "sessions": len(self.affinity)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    def metrics_response(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _done_note(done: list[dict[str, Any]], version: int) -> str:
    if not done:
        return "no replica was changed"
    return (f"already at version {version}: {', '.join(d['replica'] for d in done)}; the others still serve "
            "their old version")


def _generation_handler(router: Router, endpoint: str):
    async def handler(request: Request) -> Response:
        return await router.generate(endpoint, request)

    return handler


def _control_handler(router: Router, path: str):
    async def control() -> dict[str, Any]:
        return await router.broadcast(path)

    return control


def create_app(config: RouterConfig, tokenizer: Any | None = None) -> FastAPI:
    router = Router(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="rollwise router", summary="prefix-, session- and load-aware routing over engine replicas",
                  lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return exc.response()

    @app.middleware("http")
    async def _auth_and_metrics(request: Request, call_next):
        path = request.url.path
        token = config.auth_token
        if token and path != "/health":
            sent = request.headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                return RouterError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                   "(the router's --auth-token)", kind="authentication_error").response()
        started = time.monotonic()
        response = await call_next(request)
        if path in GENERATION_ENDPOINTS:
            router.metrics.requests.labels(path, str(response.status_code)).inc()
            router.metrics.latency.labels(path).observe(time.monotonic() - started)
        return response

    # Each route's upstream path is bound by a factory closure, never by a handler parameter: FastAPI turns
    # every parameter (defaults included) into a query parameter, and a client-chosen suffix appended to
    # replica.url could name another host ("@evil/...") or another endpoint ("/pause" -> "/sleep").
    for endpoint in GENERATION_ENDPOINTS:
        app.add_api_route(endpoint, _generation_handler(router, endpoint), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.forward_get("/v1/models")

    @app.get("/model_info")
    async def model_info() -> Response:
        return await router.forward_get("/model_info")

    @app.get("/health")
    async def health() -> JSONResponse:
        return router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return router.metrics_response()

    for path in CONTROL_ENDPOINTS:
        app.add_api_route(path, _control_handler(router, path), methods=["POST"])

    @app.post("/abort")
    async def abort(request: Request) -> JSONResponse:
        return await router.abort(await request.body())

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> dict[str, Any]:
        return await router.rolling_update(await request.body())

    return app


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The listening socket. With reuse_port, a new router can bind the same port while the old one
    still serves; the old one then drains (SIGTERM) and no client ever sees a refused connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: RouterConfig, host: str = "127.0.0.1", port: int = 8080, reuse_port: bool = False,
          log_level: str = "info") -> None:
    import uvicorn

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if not _is_loopback(host) and not config.auth_token:
        raise ValueError(f"--auth-token is required to bind the non-loopback address {host!r}: the router can pause "
                         "engines and load weights from paths, so it must not be open to the network")
    app = create_app(config)  # validates the config before binding
    sock = bind_socket(host, port, reuse_port)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
