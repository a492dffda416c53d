"""The router's state and decisions: its replicas, which one takes a request, what survives a restart,
and the calls fanned out to every replica. HTTP wiring is in app.py, request relaying in relay.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollwise.router.config import RouterConfig
from rollwise.router.metrics import RouterMetrics
from rollwise.router.policies import Decision, PrefixAware, RouteRequest, make_policy
from rollwise.router.replicas import Replica, ReplicaPool
from rollwise.router.requests import RequestReader, RouterError, parse_object
from rollwise.router.sessions import AffinityTable, IdempotencyCache, read_state, write_state
from rollwise.router.tokens import load_tokenizer
from rollwise.router.upstream import upstream_url

log = logging.getLogger("rollwise.router")
# Idle upstream connections are dropped before the engines' servers drop them (uvicorn's keep-alive, as in
# `rollwise serve engine` and `vllm serve`, is 5 s): reusing one the server has just closed would fail a
# request and write a healthy replica off.
UPSTREAM_KEEPALIVE_S = 4.0


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
                                config.breaker_threshold, config.breaker_cooldown_s, config.health_grace_s)
        self.pool.on_down = self._replica_down
        self.pool.on_up = self._replica_up
        self.tokenizer = tokenizer
        self.reader = RequestReader(config.max_route_chars, config.default_max_tokens)
        self._tokenizer_task: asyncio.Task | None = None
        self.affinity = AffinityTable()
        self.idempotency = IdempotencyCache()
        self.metrics = RouterMetrics(lambda: list(self.pool), lambda r: self.policy.load(r.load()))
        self.http: httpx.AsyncClient | None = None
        self.upstream: aiohttp.ClientSession | None = None
        self.started = False
        self._waiting = 0
        self._state_task: asyncio.Task | None = None
        self._state_written = -1
        self._changes = 0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Everything serving needs (state, first probes, tokenizer). `serve` runs this before it binds
        the port, so a new router never accepts connections it cannot serve yet. Idempotent."""
        if self.started:
            return
        self.started = True
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        key = self.config.upstream_api_key  # replicas with API keys: every upstream call carries the router's
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.upstream_timeout_s, connect=5.0),
                                      limits=limits, headers=auth)
        # Non-streamed generations (the hot path) and health probes go through aiohttp (keep-alive HTTP/1.1,
        # no connection cap); streams and control calls through httpx.
        self.upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=5.0),
            # No cookie jar: a cookie one engine answer set must never ride along on other clients' requests
            # (and the jar's per-request filtering is CPU for nothing).
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            headers=auth)
        await self.pool.probe_all(self.upstream)
        if self._tokenizer_task is not None:  # a replica answered: its model tells the tokenizer
            await self._tokenizer_task
        # After the tokenizer: adopting one forgets the prefixes learnt without it, not the saved ones.
        if self.config.state_file is not None:
            await self._load_state(self.config.state_file)
        self.pool.start(self.upstream)
        if self.config.state_file is not None:
            self._state_task = asyncio.get_running_loop().create_task(self._save_periodically())

    async def close(self) -> None:
        if not self.started or self.http is None:
            return
        await self.pool.close()
        if self._state_task is not None:
            self._state_task.cancel()
        if self.config.state_file is not None:
            self._save_state(self.config.state_file)
        await self.http.aclose()
        self.http = None
        await self.upstream.close()
        self.upstream = None
        self.reader.close()

    async def _find_tokenizer(self) -> Any | None:
        spec = self.config.model
        if spec is None:
            for replica in self.pool:
                try:
                    spec = (await self.http.get(upstream_url(replica, "/model_info"), timeout=5)).json()["model"]
                    break
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
        if spec is None:
            log.warning("no replica answered /model_info and no --model was given: routing prompts by bytes")
            return None
        try:
            return await self.reader.run(load_tokenizer, spec)
        except Exception as exc:  # noqa: BLE001 - the router still works, with byte prefixes
            log.warning("cannot load the tokenizer of %r (%s): routing prompts by bytes; pass --model", spec, exc)
            return None

    # ------------------------------------------------------------ state that survives a restart

    async def _load_state(self, path: Path) -> None:
        state = await asyncio.to_thread(read_state, path)
        if not state:
            return
        known = {r.name for r in self.pool}
        self.affinity.load({k: r for k, r in state.get("affinity", {}).items() if r in known})
        self.idempotency.load(state.get("idempotency", []))
        if isinstance(self.policy, PrefixAware):
            self.policy.tree.load([e for e in state.get("prefix_tree", []) if e["replica"] in known])
        log.info("loaded router state from %s: %d sessions/groups", path, len(self.affinity))

    def _export_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"affinity": self.affinity.export(), "idempotency": self.idempotency.export(64)}
        if isinstance(self.policy, PrefixAware):
            state["prefix_tree"] = self.policy.tree.export()[-4096:]
        return state

    def _save_state(self, path: Path) -> None:
        try:
            write_state(path, self._export_state())
            self._state_written = self._changes
        except OSError as exc:
            log.warning("cannot write router state to %s: %s", path, exc)

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._changes != self._state_written:
                changes, state = self._changes, self._export_state()
                try:  # encoding and writing off the event loop; the snapshot was taken on it
                    await asyncio.to_thread(write_state, self.config.state_file, state)
                    self._state_written = changes
                except OSError as exc:
                    log.warning("cannot write router state to %s: %s", self.config.state_file, exc)

    # ------------------------------------------------------------ replicas coming and going

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

    # ------------------------------------------------------------ choosing a replica

    async def acquire(self, route: RouteRequest, min_version: int, tried: set[str],
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
                    raise self._no_healthy_replica(tried, last_error)
                routable = [r for r in replicas if r.routable() and r.policy_version >= min_version]
                room = [r for r in routable if r.has_room()]
                if room:
                    decision = self.policy.choose(route, [r.load() for r in room])
                    return self.pool.get(decision.replica), decision
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._nothing_free(replicas, min_version)
                await self.pool.wait(min(remaining, 1.0))
        finally:
            self._waiting -= 1

    def _no_healthy_replica(self, tried: set[str], last_error: str | None) -> RouterError:
        self.metrics.rejected.labels("no_healthy_replica").inc()
        if tried:
            return RouterError(502, f"the request failed on {len(tried)} replica(s) and no other is healthy (last "
                               f"error: {last_error}); nothing was returned, so retrying it is safe",
                               kind="server_error", code="replicas_failed", retry_after=1)
        states = "; ".join(f"{r.url}: {r.last_error or 'not answering yet'}" for r in self.pool)
        return RouterError(503, f"no healthy replica ({states})", kind="server_error", code="no_healthy_replica",
                           retry_after=1)

    def _nothing_free(self, replicas: list[Replica], min_version: int) -> RouterError:
        versions = sorted({r.policy_version for r in replicas if r.healthy})
        if min_version and not any(v >= min_version for v in versions):
            self.metrics.rejected.labels("policy_version").inc()
            return RouterError(503, f"no replica serves policy version >= {min_version} (healthy replicas serve "
                               f"{versions}); retry after the weight update", "min_policy_version", "server_error",
                               "policy_version_unavailable", retry_after=1)
        self.metrics.rejected.labels("busy").inc()
        caps = sorted({r.max_in_flight for r in replicas})
        return RouterError(429, f"all replicas are busy (in-flight cap {caps} each) or draining for "
                           f"{self.config.queue_timeout_s:g} s; retry later", kind="rate_limit_error",
                           code="replicas_busy", retry_after=1)

    def begin(self, replica: Replica, decision: Decision, route: RouteRequest) -> tuple[int, int, bool]:
        """Account for a request sent to `replica`; the returned ticket goes back to end()."""
        prefill = max(len(route.tokens) - decision.matched_tokens, 0)
        decode = route.samples * route.max_tokens
        trial = replica.start(prefill, decode)
        self.policy.on_routed(route, decision, time.monotonic())
        if route.affinity_key is not None:
            self.affinity.set(route.affinity_key, replica.name)
        self._changes += 1
        self.metrics.routed_of(replica.name, decision.reason).inc()
        self.metrics.prompt_tokens_of(replica.name).inc(len(route.tokens))
        self.metrics.prefix_hit_tokens_of(replica.name).inc(decision.matched_tokens)
        return prefill, decode, trial

    def end(self, replica: Replica, ticket: tuple[int, int, bool]) -> None:
        prefill, decode, trial = ticket
        replica.finish(prefill, decode)
        if trial:  # no verdict was recorded (client gone, 4xx): the next request may be the trial
            replica.breaker.end_trial()
        self.pool.notify()

    def failed(self, replica: Replica, error: str, connection: bool) -> None:
        replica.mark_failed(error)
        self.metrics.failovers.labels(replica.name).inc()
        if connection and replica.healthy:  # refused / reset: treat it as down until a probe says otherwise
            replica.healthy = False
            self._replica_down(replica)
        self.pool.notify()

    # ------------------------------------------------------------ control endpoints

    async def fan_out(self, path: str, raw: bytes | None = None) -> dict[str, Any]:
        async def one(replica: Replica) -> tuple[str, Any]:
            try:
                r = await self.http.post(upstream_url(replica, path), content=raw or b"{}",
                                         headers={"content-type": "application/json"}, timeout=30)
                return replica.url, {"status": r.status_code, "body": r.json()}
            except (httpx.HTTPError, ValueError) as exc:
                return replica.url, {"status": None, "error": f"{type(exc).__name__}: {exc}"}

        return dict(await asyncio.gather(*(one(r) for r in self.pool if r.healthy)))

    async def broadcast(self, path: str) -> dict[str, Any]:
        results = await self.fan_out(path)
        if path == "/flush_cache":
            for replica in self.pool:
                self.policy.forget(replica.name)
        return {"replicas": results}

    async def abort(self, raw: bytes) -> JSONResponse:
        body = parse_object(raw)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise RouterError(400, "request_id must be a non-empty string", "request_id")
        results = await self.fan_out("/abort", raw)
        aborted = sum(_aborted(r["body"]) for r in results.values() if r.get("status") == 200)
        if not any(r.get("status") == 200 for r in results.values()):
            raise RouterError(404, f"no request with request_id {rid!r} is in flight on any replica", "request_id",
                              kind="not_found_error")
        return JSONResponse({"request_id": rid, "aborted_samples": aborted})

    async def forward_get(self, path: str) -> Response:
        for replica in sorted(self.pool, key=lambda r: not r.healthy):
            try:
                r = await self.http.get(upstream_url(replica, path), timeout=10)
            except httpx.HTTPError:
                continue
            if r.status_code >= 500:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        raise RouterError(503, "no replica answered", kind="server_error", code="no_healthy_replica", retry_after=1)

    def forget_cache(self, replica: Replica) -> None:
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


def _aborted(body: Any) -> int:
    count = body.get("aborted_samples", 0) if isinstance(body, dict) else 0
    return count if isinstance(count, int) else 0
