"""Start-up-aware placement (issue 42, after ServerlessLLM's scheduler): how long a tenancy takes to start on a
slot, per where its weights are, and how long a running request takes to migrate, per token.

A pure cost model (`StartupCost`, `estimate_start`, `estimate_migration`) that the pool's slot loops
(rollwise.pool.slots: `SlotView.starts`) and the simulator (rollwise.sim.mux) both feed to
rollwise.pool.scheduler.plan, so both place alike; and `calibrate()`, which measures this machine's constants
(memcpy GB/s, flat-checkpoint read GB/s from the page cache, prefill seconds per token when given a model).
"""

from __future__ import annotations

import tempfile
import time
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

Tier = Literal["memory", "disk", "remote"]  # where a model's weights are, fastest first (rollwise.pool.model_cache)
Where = Literal["active", "sleeping", "memory", "disk", "remote"]


class StartupCost(BaseModel):
    """Seconds = fixed + bytes / bandwidth, per tier; a sleeping engine wakes in `wake_s`. Defaults: a host
    with an NVMe disk and a 1 GB/s network store (calibrate() replaces them with this machine's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wake_s: float = Field(0.01, ge=0)  # a sleeping engine back to active (KV re-allocated)
    build_s: float = Field(0.05, ge=0)  # building an engine around loaded weights
    memory_gbps: float = Field(10.0, gt=0)  # host-memory tier: a copy
    disk_gbps: float = Field(3.0, gt=0)  # local-disk tier: a parallel chunked read
    remote_gbps: float = Field(1.0, gt=0)  # remote store
    migrate_s_per_token: float = Field(1e-4, ge=0)  # the destination recomputes the KV cache of every token


def estimate_start(cost: StartupCost, where: Where, nbytes: int) -> float:
    """Seconds until a tenancy whose weights (`nbytes`) are `where` serves on a slot."""
    if where == "active":
        return 0.0
    if where == "sleeping":
        return cost.wake_s
    gbps = {"memory": cost.memory_gbps, "disk": cost.disk_gbps, "remote": cost.remote_gbps}[where]
    return cost.build_s + nbytes / (gbps * 1e9)


def estimate_migration(cost: StartupCost, tokens: int) -> float:
    """Seconds to move a running request of `tokens` tokens (prompt + generated) to another engine."""
    return cost.migrate_s_per_token * tokens


def calibrate(nbytes: int = 64 * 2**20, model: torch.nn.Module | None = None, tokens: int = 64) -> StartupCost:
    """This machine's constants: memcpy and flat read (page cache) bandwidths measured on `nbytes`, and, given a
    model, its prefill seconds per token (what a migration's destination spends per token). The remote tier's
    bandwidth is not measurable from here: it stays the default unless the caller sets it."""
    import torch

    from rollwise.model.flat_format import write_flat
    from rollwise.model.flat_reader import read_flat

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages: not what is measured
    t = time.perf_counter()
    dst.copy_(src)
    memory_gbps = nbytes / max(time.perf_counter() - t, 1e-9) / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        write_flat({"x": src}, tmp, fsync=False)
        read_flat(tmp)  # into the page cache
        disk_gbps = nbytes / max(read_flat(tmp).seconds, 1e-9) / 1e9
    # faster tiers are never estimated slower than slower ones (a noisy measurement must not invert placement)
    fields: dict[str, float] = {"memory_gbps": max(memory_gbps, disk_gbps), "disk_gbps": disk_gbps,
                                "remote_gbps": min(StartupCost().remote_gbps, disk_gbps)}
    if model is not None:
        ids = torch.zeros((1, tokens), dtype=torch.long)
        with torch.no_grad():
            model(input_ids=ids)
            t = time.perf_counter()
            model(input_ids=ids)
        fields["migrate_s_per_token"] = (time.perf_counter() - t) / tokens
    return StartupCost(**fields)


def slot_starts(cost: StartupCost, sleeping: set[str], tiers: dict[str, tuple[Where, int]]) -> dict[str, float]:
    """Estimated start per tenancy on one slot: those sleeping there wake; the others load from their tier
    (`tiers`: tenancy -> (where its weights are, bytes))."""
    return {name: estimate_start(cost, "sleeping" if name in sleeping else where, nbytes)
            for name, (where, nbytes) in tiers.items()}
