"""The pool's `/metrics`: a prometheus_client collector over `EnginePool.state()`, rendered by generate_latest.

Counters are exposed the way prometheus_client writes them, with the `_total` suffix (as the engine
server's are): `rollwise_pool_job_engine_seconds_total{job="a"}`. The hand-written text this replaces
wrote them without it, which the exposition format's counters should not do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

# (name, type, help, the state's per-job report key)
_PER_JOB = (
    ("rollwise_pool_job_engine_seconds", "counter", "engine time held for a job (allocated)",
     "engine_seconds_allocated"),
    ("rollwise_pool_job_busy_engine_seconds", "counter", "engine time with the job's samples running",
     "engine_seconds_busy"),
    ("rollwise_pool_job_queued_samples", "gauge", "samples queued in the pool", "queued_samples"),
    ("rollwise_pool_job_running_samples", "gauge", "samples on engines", "running_samples"),
    ("rollwise_pool_job_generated_tokens", "counter", "tokens sampled for the job", "tokens"),
)


def _family(name: str, kind: str, doc: str, samples: list[tuple[dict[str, str], float]]) -> Metric:
    labels = sorted({k for sample_labels, _ in samples for k in sample_labels}) or None
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=labels)
    for sample_labels, value in samples:
        family.add_metric([sample_labels[k] for k in labels or []], value)
    return family


class PoolCollector:
    """Reads the pool's state at each scrape (`state` returns EnginePool.state()'s dict)."""

    def __init__(self, state: Callable[[], dict[str, Any]]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:  # the prometheus_client collector protocol
        state = self.state()
        jobs = state["jobs"]
        yield _family("rollwise_pool_engines", "gauge", "engines (slots) in the pool", [({}, state["engines"])])
        for name, kind, doc, key in _PER_JOB:
            yield _family(name, kind, doc, [({"job": job}, report[key]) for job, report in jobs.items()])
        costs = state["transition_costs"]
        yield _family("rollwise_pool_transitions", "counter", "engine state transitions by kind",
                      [({"kind": k}, c["count"]) for k, c in costs.items()])
        yield _family("rollwise_pool_transition_seconds", "counter", "time spent in transitions by kind",
                      [({"kind": k}, c["total_s"]) for k, c in costs.items()])
        yield _family("rollwise_pool_isolation_violations", "counter", "admissions refused by the isolation check",
                      [({}, len(state["isolation"]["violations"]))])


def metrics_registry(state: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own per app (never the process-wide default: tests run several pools)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(state))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of a scrape."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
