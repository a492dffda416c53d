"""Where the engines run: the one switch between `placement: local`, `placement: ray` and a shared pool.

The training loop never cares: it gets a `Placement` whose `worker` speaks the EngineWorker interface
(submit / next_completion / abort / pause / resume / update_weights / close) that the rollout controller
drives, and whose `engine` answers the read-only questions the loop's metrics ask (name, max_num_seqs,
timeline of running sequences).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollwise.config import RunConfig
from rollwise.engine.factory import create_engine, describe_engine
from rollwise.rollout.worker import EngineWorker


class EngineView(Protocol):
    """What the loop reads from 'the engine' for metrics and plots, wherever it runs."""

    name: str
    max_num_seqs: int
    timeline: list[tuple[float, int]]  # (monotonic time, running sequences); appended as the engine steps


@dataclass
class Placement:
    worker: Any  # EngineWorker interface (rollwise.rollout.worker.EngineWorker)
    engine: EngineView
    description: str  # one line for the console
    # Extra teardown after worker.close() (engine-owned files, actors, pool detach).
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        self.worker.close()
        for fn in self.on_close:
            fn()


def place_engines(cfg: RunConfig, model: Any, tokenizer: Any, *, fingerprint: str, policy_version: int,
                  eos_ids: list[int] | None) -> Placement:
    """Start (or attach to) the engines this run generates with, holding the trainer's current weights."""
    if cfg.pool.url:
        from rollwise.pool.client import attach_to_pool

        return attach_to_pool(cfg, model, tokenizer, fingerprint=fingerprint, policy_version=policy_version)
    if cfg.placement == "ray":
        from rollwise.control.ray_placement import place_on_ray

        return place_on_ray(cfg, model, tokenizer, fingerprint=fingerprint, policy_version=policy_version,
                            eos_ids=eos_ids)
    engine = create_engine(
        cfg.engine.kind, model, tokenizer, max_num_seqs=cfg.engine.max_num_seqs,
        max_model_len=cfg.engine.max_model_len, eos_token_ids=eos_ids, policy_version=policy_version,
        seed=cfg.seed, model_name=cfg.model, tokenizer_fingerprint=fingerprint,
        kv_cache_gib=cfg.engine.kv_cache_gib, enforce_eager=cfg.engine.enforce_eager,
    )
    # Invariant 1 (engine and trainer tokenize identically) holds by construction here: with local
    # placement both use this one tokenizer. Remote engines compare fingerprints.
    return Placement(EngineWorker(engine), engine, describe_engine(engine),
                     on_close=[getattr(engine, "close", lambda: None)])  # vLLM: its weight directory
