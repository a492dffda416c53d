"""The replicas behind the router: health, circuit breakers, in-flight caps and pending work.

A replica takes new requests only while it is healthy (its last /health probe answered), its
circuit breaker is closed (or half-open, letting one trial request through), it is not draining for
a weight update, and it has fewer requests in flight than its cap. The router's own accounting of
what it sent (prompt tokens not cached there, expected decode tokens) is the load the policies see:
it is exact for what this router sent and needs no polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from rollwise.router.policies import ReplicaLoad

log = logging.getLogger("rollwise.router")


@dataclass
class CircuitBreaker:
    """Closed -> open after `threshold` consecutive failures; open for `cooldown_s`, then half-open:
    one trial request, whose success closes it again and whose failure re-opens it."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if time.monotonic() - self.opened_at >= self.cooldown_s else "open"

    def allows(self) -> bool:
        state = self.state
        return state == "closed" or (state == "half_open" and not self.trial_in_flight)

    def on_dispatch(self) -> bool:
        """True when this request is the half-open trial."""
        if self.state == "half_open":
            self.trial_in_flight = True
            return True
        return False

    def end_trial(self) -> None:
        """The trial ended without a verdict (its client left, or it was refused as a bad request): let
        the next request be the trial instead of leaving the replica shut forever."""
        self.trial_in_flight = False

    def half_open_now(self) -> None:
        """The replica answers its health probe again (e.g. restarted): its next request is the trial,
        without waiting out the rest of the cooldown."""
        if self.opened_at is not None:
            self.opened_at = time.monotonic() - self.cooldown_s
            self.trial_in_flight = False

    def record_success(self) -> None:
        self.failures, self.opened_at, self.trial_in_flight = 0, None, False

    def record_failure(self) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.failures >= self.threshold or self.opened_at is not None:
            self.opened_at = time.monotonic()


@dataclass
class Replica:
    url: str
    max_in_flight: int = 32
    healthy: bool = False  # until the first probe answers
    draining: bool = False  # a rolling weight update is waiting for it to empty
    removed: bool = False  # a planned removal took it out of the pool (rollwise.router.removal): never routed again
    paused: bool = False
    policy_version: int = 0
    last_error: str | None = None
    probe_failures: int = 0  # consecutive failed /health probes
    last_answer: float = field(default_factory=time.monotonic)  # when /health last answered well
    in_flight: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def name(self) -> str:
        return self.url

    def routable(self) -> bool:
        """Could take requests if it had room (in-flight caps aside)."""
        return self.healthy and not self.draining and not self.removed and self.breaker.allows()

    def has_room(self) -> bool:
        return self.in_flight < self.max_in_flight

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.name, self.in_flight, self.prefill_tokens, self.decode_tokens)

    def start(self, prefill_tokens: int, decode_tokens: int) -> bool:
        """Account for a request sent here; True when it is the circuit breaker's trial."""
        self.in_flight += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        return self.breaker.on_dispatch()

    def finish(self, prefill_tokens: int, decode_tokens: int) -> None:
        self.in_flight -= 1
        self.prefill_tokens -= prefill_tokens
        self.decode_tokens -= decode_tokens

    def mark_failed(self, error: str) -> None:
        self.last_error = error
        self.breaker.record_failure()

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "breaker": self.breaker.state, "draining": self.draining,
                "removed": self.removed,
                "paused": self.paused, "policy_version": self.policy_version, "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight, "pending_prefill_tokens": self.prefill_tokens,
                "pending_decode_tokens": self.decode_tokens, "last_error": self.last_error}


class ReplicaPool:
    """The replicas and a background health prober. `on_down(replica)` runs when one stops answering
    (the router then forgets its cached prefixes: a restarted engine's cache is empty)."""

    def __init__(self, urls: list[str], max_in_flight: int | None, health_interval_s: float = 1.0,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0, health_grace_s: float = 30.0) -> None:
        self.replicas = {
            u.rstrip("/"): Replica(u.rstrip("/"), breaker=CircuitBreaker(breaker_threshold, breaker_cooldown_s))
            for u in urls
        }
        self.fixed_cap = max_in_flight
        self.health_interval_s = health_interval_s
        self.health_grace_s = health_grace_s
        self.on_down = lambda replica: None
        self.on_up = lambda replica: None
        self._waiters: list[asyncio.Future] = []  # requests waiting for capacity, health or a version
        self._tasks: list[asyncio.Task] = []

    def __iter__(self):
        return iter(self.replicas.values())

    def get(self, name: str) -> Replica:
        return self.replicas[name]

    def notify(self) -> None:
        """Capacity, health or versions may have changed: wake every waiting request to look again."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass

    async def probe(self, http: aiohttp.ClientSession, replica: Replica) -> None:
        refused = False
        timeout = aiohttp.ClientTimeout(total=max(5.0, self.health_interval_s * 2))
        try:  # aiohttp: probes run all the time, and cost the router far less CPU than with httpx
            async with http.get(f"{replica.url}/health", timeout=timeout) as response:
                status = response.status
                info = await response.json(content_type=None) if status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            info, error = None, f"{type(exc).__name__}: {exc}"
            refused = isinstance(exc, aiohttp.ClientConnectorError)
        else:
            if not isinstance(info, dict):
                info = None
            error = None if info is not None else f"/health answered HTTP {status}"
        if replica.removed:  # removed while the probe was out (rollwise.router.removal): it stays out
            return
        was_healthy = replica.healthy
        if info is None:
            replica.probe_failures += 1
            replica.last_error = error
            # A refused connection means the process is gone. A slow or failed answer may be a busy engine
            # (one huge request can hold its event loop for seconds): it is written off (which drops its
            # sessions and prefixes) only after health_grace_s without a good answer, and 3 failures.
            silent_s = time.monotonic() - replica.last_answer
            if was_healthy and not refused and (replica.probe_failures < 3 or silent_s < self.health_grace_s):
                return
            replica.healthy = False
            if was_healthy:
                log.warning("replica %s is down: %s", replica.url, error)
                self.on_down(replica)
        else:
            replica.healthy, replica.probe_failures, replica.last_answer = True, 0, time.monotonic()
            replica.paused = bool(info.get("paused", False))
            replica.policy_version = int(info.get("policy_version", replica.policy_version))
            if self.fixed_cap is None and info.get("max_num_seqs"):
                # Queue up to one batch more than the engine runs at once: it never idles for lack of
                # work, and what waits beyond that waits here, where it can still go elsewhere.
                replica.max_in_flight = 2 * int(info["max_num_seqs"])
            elif self.fixed_cap is not None:
                replica.max_in_flight = self.fixed_cap
            if not was_healthy:
                log.info("replica %s is up (policy version %d)", replica.url, replica.policy_version)
                replica.breaker.half_open_now()
                self.on_up(replica)
        self.notify()

    async def probe_all(self, http: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(http, r) for r in self))

    def start(self, http: aiohttp.ClientSession) -> None:
        """One probe loop per replica: a replica slow to answer never delays the probes of the others."""
        async def loop(replica: Replica) -> None:
            while not replica.removed:
                await asyncio.sleep(self.health_interval_s)
                await self.probe(http, replica)

        self._tasks = [asyncio.get_running_loop().create_task(loop(r)) for r in self]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
