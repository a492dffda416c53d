"""The engine server's `/metrics`: a prometheus_client collector over a snapshot taken on the engine thread."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollwise.engine.speculation.counters import POSITION_PREFIX

if TYPE_CHECKING:
    from rollwise.engine.frontend import EngineFrontend


class EngineCollector:
    """Prometheus collector over a snapshot taken on the engine thread just before each scrape."""

    def __init__(self, frontend: EngineFrontend) -> None:
        self.frontend = frontend
        self.snapshot: dict[str, Any] = {
            "running": 0, "waiting": 0, "paused": False, "policy_version": 0,
            "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
        }

    def collect(self):  # noqa: ANN201 - the prometheus_client protocol
        s = self.snapshot
        yield GaugeMetricFamily("rollwise_engine_running", "sequences generating now", value=s["running"])
        yield GaugeMetricFamily("rollwise_engine_waiting", "samples queued for a KV-cache slot", value=s["waiting"])
        yield GaugeMetricFamily("rollwise_engine_paused", "1 while the engine is paused", value=int(s["paused"]))
        yield GaugeMetricFamily("rollwise_engine_policy_version", "policy version sampling now",
                                value=s["policy_version"])
        for key, doc in (
            ("generated_tokens", "tokens sampled"),
            ("prompt_tokens", "prompt tokens of admitted samples (computed or reused)"),
            ("cached_prompt_tokens", "prompt tokens whose KV was reused, not recomputed"),
            ("steps", "engine steps"),
            ("step_seconds", "seconds spent in engine steps (busy time)"),
            ("prefix_cache_hit_tokens", "prompt tokens reused from the cross-request prefix cache"),
        ):
            yield CounterMetricFamily(f"rollwise_engine_{key}", doc, value=s.get(key, 0))
        yield GaugeMetricFamily("rollwise_engine_prefix_cache_tokens", "tokens held by the prefix cache",
                                value=s.get("prefix_cache_tokens", 0))
        yield from _speculation(s.get("speculation"))
        finished = CounterMetricFamily("rollwise_engine_finished_samples", "samples returned, by finish reason",
                                       labels=["finish_reason"])
        for reason in ("stop", "length", "abort"):
            finished.add_metric([reason], self.frontend.finished_samples[reason])
        yield finished


def _speculation(counters: dict[str, int] | None):  # noqa: ANN202 - yields metric families
    """Speculative decoding's running totals (engine.speculation: history); nothing for an engine that
    keeps none. The acceptance rate is accepted / drafted over the engine's life."""
    if counters is None:
        return
    for name, key, doc in (
        ("spec_drafted_tokens", "drafted", "draft tokens proposed from rollout history and verified"),
        ("spec_accepted_tokens", "accepted", "draft tokens accepted by exact verification"),
        ("spec_rejected_tokens", "rejected", "draft tokens rejected (the target resampled that position)"),
        ("spec_verifications", "verifications", "sequence drafts verified (one forward each)"),
    ):
        yield CounterMetricFamily(f"rollwise_engine_{name}", doc, value=counters.get(key, 0))
    drafted = counters.get("drafted", 0)
    yield GaugeMetricFamily("rollwise_engine_spec_acceptance_rate", "accepted / drafted draft tokens so far",
                            value=counters.get("accepted", 0) / drafted if drafted else 0.0)
    positions = sorted((int(k.removeprefix(POSITION_PREFIX)), v) for k, v in counters.items()
                       if k.startswith(POSITION_PREFIX))
    if positions:  # vLLM: verifications that accepted draft position i (1-based)
        by_position = CounterMetricFamily("rollwise_engine_spec_accepted_at_position", "verifications that "
                                          "accepted the draft token at this position", labels=["position"])
        for position, count in positions:
            by_position.add_metric([str(position)], count)
        yield by_position
