"""POST /replicas/remove {url, drain_timeout_s?}: a planned removal of one replica (scale-in, maintenance), with its
requests in flight moved to another replica by live migration (issue 42 item 3) instead of waiting for them.

1. The replica stops getting new requests (draining).
2. If it is healthy, the router asks it to migrate its requests in flight (POST /migrate {target}) to the routable
   replica with the fewest requests in flight: its engine hands each request over to the target's, which continues
   it from its tokens (nothing lost or generated twice). The replica keeps its clients' connections and answers
   them with the target's samples (a streamed request's tokens as the target samples them), so a relayed request
   never notices; its engine is empty once /migrate answers.
3. The router waits (up to drain_timeout_s) for the replica's relayed requests to be answered, then removes it:
   it is never routed to or probed again (GET /health lists it as removed).

Fallback, explicit in the answer: a replica that cannot migrate (an engine without live migration answers 409
migration_unsupported; or no other replica fits) is drained by waiting for its requests to finish, as a rolling
update drains ("migration_refused" says why, "drained" whether they all finished in time). Requests still running
at the deadline are left to finish on the replica (a removed replica's process may still answer them); a caller
that cannot wait aborts them (POST /abort) and resubmits, and their tokens are generated again.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from rollwise.router.core import Router
from rollwise.router.requests import RouterError, parse_object
from rollwise.router.upstream import upstream_url


class PlannedRemoval:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.log: list[dict[str, Any]] = []  # every removal's answer (what moved, what waited)

    async def run(self, raw: bytes) -> dict[str, Any]:
        router = self.router
        body = parse_object(raw)
        url = body.get("url")
        if not isinstance(url, str) or url.rstrip("/") not in router.pool.replicas:
            raise RouterError(404, f"url {url!r} is not one of this router's replicas "
                                   f"({sorted(router.pool.replicas)}); name one as GET /health lists it", "url")
        drain = body.get("drain_timeout_s", router.config.drain_timeout_s)
        if not isinstance(drain, (int, float)) or isinstance(drain, bool) or not 0 <= drain < float("inf"):
            raise RouterError(400, "drain_timeout_s must be a finite number >= 0", "drain_timeout_s")
        replica = router.pool.get(url.rstrip("/"))
        if replica.removed:
            raise RouterError(409, f"replica {replica.url} was removed already", "url", code="replica_removed")
        started = time.monotonic()
        replica.draining = True  # no new requests from here on
        migration: dict[str, Any] | None = None
        refused: str | None = None
        targets = sorted((r for r in router.pool if r is not replica and r.routable()),
                         key=lambda r: (r.in_flight, r.name))
        # Asked even when none of the router's own requests is there: a replica may have clients of its own.
        if not replica.healthy:
            refused = "the replica is not healthy (it answers no /migrate)"
        elif not targets:
            refused = "no other routable replica to migrate to"
        else:
            migration, refused = await self._migrate(replica.url, targets[0].url)
        deadline = started + float(drain)
        while replica.in_flight and time.monotonic() < deadline:
            await router.pool.wait(min(0.2, max(deadline - time.monotonic(), 0.0)))
        answer = {"removed": replica.url, "migration": migration, "migration_refused": refused,
                  "drained": replica.in_flight == 0, "in_flight_left": replica.in_flight,
                  "seconds": round(time.monotonic() - started, 3)}
        replica.removed, replica.healthy = True, False
        router.forget_cache(replica)
        router.pool.notify()
        self.log.append(answer)
        return answer

    async def _migrate(self, source: str, target: str) -> tuple[dict[str, Any] | None, str | None]:
        """(what moved, None), or (None, why not): the replica's 409 (it cannot migrate, or the target refused)."""
        replica = self.router.pool.get(source)
        try:
            response = await self.router.http.post(upstream_url(replica, "/migrate"), json={"target": target},
                                                   timeout=120)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if response.status_code >= 400:
            try:
                return None, str(response.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                return None, f"HTTP {response.status_code}: {response.text[:300]}"
        return response.json(), None
