"""The requests every rollwise server answers, as Prometheus metrics: count by route and status, latency by route.

Routes are named by their template (`/jobs/{job}/requests`, never a job's name), so the label values stay few:
a request the app routed carries its route in the ASGI scope (Starlette puts it there); one it did not route is
named by its path when that is one of the app's fixed paths (the router answers its generation routes before
routing), else `other` (unknown paths, refusals before routing). The metrics live in a registry of their own
and join the app's /metrics through `collector()` (several servers may share a process in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _Joined(Collector):
    """Another registry's metrics, collected as part of the app's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Any]:
        return self.registry.collect()


class FrontMetrics:
    def __init__(self, fixed_paths: Callable[[], frozenset[str]] = frozenset) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("rollwise_http_requests", "HTTP requests answered, by route template and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("rollwise_http_request_seconds",
                                 "time until the response starts (streams: their first bytes), by route template",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.fixed_paths = fixed_paths
        self._fixed: frozenset[str] | None = None
        self._children: dict[tuple[str, ...], Any] = {}  # labels() validates and locks on every call: cache

    def route_of(self, scope: MutableMapping[str, Any]) -> str:
        route = scope.get("route")
        template = getattr(route, "path", None)
        if isinstance(template, str):
            return template
        if self._fixed is None:
            self._fixed = self.fixed_paths()
        return scope["path"] if scope["path"] in self._fixed else "other"

    def observe_start(self, scope: MutableMapping[str, Any], status: int, seconds: float) -> None:
        route = self.route_of(scope)
        key = (route, str(status))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (self.requests.labels(route, key[1]), self.latency.labels(route))
        child[0].inc()
        child[1].observe(seconds)

    def collector(self) -> Collector:
        """Register this in the app's registry: its /metrics then shows the front's metrics too."""
        return _Joined(self.registry)
