"""The router's Prometheus metrics (GET /metrics), in a registry of its own (several routers may share
a process in tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from rollwise.router.replicas import Replica

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class _ReplicaCollector:
    """Per-replica gauges read from the live replica objects at scrape time."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]], load_cost: Callable[[Replica], float]) -> None:
        self.replicas, self.load_cost = replicas, load_cost

    def collect(self):
        gauges = {
            "in_flight": ("requests the router has in flight there", lambda r: r.in_flight),
            "max_in_flight": ("the router's in-flight cap for it", lambda r: r.max_in_flight),
            "pending_prefill_tokens": ("uncached prompt tokens of its requests in flight", lambda r: r.prefill_tokens),
            "pending_decode_tokens": ("tokens still expected from its requests in flight", lambda r: r.decode_tokens),
            "load_cost": ("load cost the policies see (prefill + weighted decode work)", self.load_cost),
            "healthy": ("1 while its /health answers", lambda r: int(r.healthy)),
            "breaker_open": ("1 while its circuit breaker is open", lambda r: int(r.breaker.state == "open")),
            "draining": ("1 while a rolling weight update drains it", lambda r: int(r.draining)),
            "policy_version": ("policy version it serves", lambda r: r.policy_version),
        }
        replicas = list(self.replicas())
        for key, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"rollwise_router_replica_{key}", doc, labels=["replica"])
            for r in replicas:
                family.add_metric([r.name], value(r))
            yield family


class Children:
    """A labelled metric's children, each looked up once: prometheus_client's labels() validates the labels,
    builds a tuple and takes a lock on every call, and the router calls it several times per request. The
    label values are few (endpoints, statuses, replicas, decision reasons), so the cache stays small."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels)
        return child


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]], load_cost: Callable[[Replica], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("rollwise_router_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("rollwise_router_request_seconds",
                                 "latency through the router until the response starts (streams: first event)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.routed = Counter("rollwise_router_routed", "requests sent to a replica, by policy decision",
                              ["replica", "reason"], registry=r)
        self.prompt_tokens = Counter("rollwise_router_prompt_tokens", "prompt tokens routed", ["replica"], registry=r)
        self.prefix_hit_tokens = Counter("rollwise_router_prefix_hit_tokens",
                                         "prompt tokens the policy expected the replica to have cached",
                                         ["replica"], registry=r)
        self.retries = Counter("rollwise_router_retries", "requests re-sent to another replica, by cause",
                               ["reason"], registry=r)
        self.failovers = Counter("rollwise_router_failovers", "requests moved off a failed replica",
                                 ["replica"], registry=r)
        self.stream_failures = Counter("rollwise_router_stream_failures",
                                       "streams ended with an error after bytes were sent (never duplicated)",
                                       ["replica"], registry=r)
        self.rejected = Counter("rollwise_router_rejected", "requests refused with 429/503, by cause", ["reason"],
                                registry=r)
        self.client_gone = Counter("rollwise_router_client_gone",
                                   "requests cancelled at their replica because the client disconnected", registry=r)
        self.idempotent_replays = Counter("rollwise_router_idempotent_replays",
                                          "client retries answered without generating again", registry=r)
        self.registry.register(_ReplicaCollector(replicas, load_cost))
        # The per-request metrics' children, cached (see Children).
        self.requests_of, self.latency_of = Children(self.requests), Children(self.latency)
        self.routed_of, self.prompt_tokens_of = Children(self.routed), Children(self.prompt_tokens)
        self.prefix_hit_tokens_of = Children(self.prefix_hit_tokens)
