"""The pool's jobs' weights through the tiered model cache (rollwise.pool.model_cache), and where each tenancy's
weights are for start-up-aware placement (rollwise.pool.startup_cost, fed to rollwise.pool.scheduler.plan).

In the pool the remote tier is the job's store (`Job.weights`: the version it uploaded, as the upload left it);
the memory tier holds the versions an engine loaded most recently, the disk tier flat checkpoints of them.
"""

from __future__ import annotations

from torch import Tensor

from rollwise.pool.jobs import Job, LoraBase
from rollwise.pool.model_cache import TIERS, Fetched, ModelCache, weights_bytes
from rollwise.pool.startup_cost import StartupCost, Tier, slot_starts


def cache_key(job: Job) -> str:
    """A job's current weights: the attach is in it, so a job attached again under the same name (another model)
    never gets the previous one's weights, and the version, so a new push is a new entry (nothing goes stale)."""
    return f"{job.name}@v{job.version}/{job.attached_at:.6f}"


def describe(tiers: list[Tier]) -> str:
    """How a load went, for the transition's reason and /state: "memory tier", "memory+remote tiers" (a LoRA base
    whose adapters came from several), "no adapters"."""
    used = [t for t in TIERS if t in tiers]
    if not used:
        return "no adapters"
    return "+".join(used) + (" tier" if len(used) == 1 else " tiers")


class WeightTiers:
    """Loads jobs' weights (a full job's state dict, a LoRA job's adapter) from the fastest tier holding them."""

    def __init__(self, cache: ModelCache | None = None, cost: StartupCost | None = None) -> None:
        self.cache = cache or ModelCache()
        self.cost = cost or StartupCost()
        self._bytes: dict[str, tuple[str, int]] = {}  # job -> (cache key, bytes): once per pushed version

    def fetch(self, job: Job) -> Fetched:
        """The job's current weights (caller holds job.lock: they do not change meanwhile)."""
        weights = job.weights
        if weights is None:
            raise ValueError(f"job {job.name!r} has pushed no weights yet")
        return self.cache.get(cache_key(job), lambda: weights, priority=job.priority)

    def load(self, job: Job, tiers: list[Tier]) -> dict[str, Tensor]:
        """fetch(), recording the tier in `tiers` (sync_adapters' loader for a LoRA base's adapters)."""
        got = self.fetch(job)
        tiers.append(got.tier)
        return got.weights

    def where(self, tenancy: Job | LoraBase) -> tuple[Tier, int]:
        """Where the tenancy's weights are and their bytes (a LoRA base: its adapters', the slowest tier counts;
        its base model stays in memory with the job)."""
        jobs = list(tenancy.members.values()) if isinstance(tenancy, LoraBase) else [tenancy]
        tier: Tier = "memory"
        nbytes = 0
        for job in jobs:
            if job.weights is None:
                continue
            key = cache_key(job)
            if self._bytes.get(job.name, ("", 0))[0] != key:
                self._bytes[job.name] = (key, weights_bytes(job.weights))
            nbytes += self._bytes[job.name][1]
            held = self.cache.tier_of(key)
            tier = max(tier, held, key=TIERS.index)
        return tier, nbytes

    def starts(self, sleeping: set[str], tenancies: dict[str, Job | LoraBase]) -> dict[str, float]:
        """Estimated start of every tenancy on a slot where `sleeping` sleep."""
        return slot_starts(self.cost, sleeping, {name: self.where(t) for name, t in tenancies.items()})

    def forget(self, job: Job) -> None:
        """A detached job's cached weights go (every version)."""
        prefix = f"{job.name}@"
        self.cache.drop(prefix)
        self._bytes.pop(job.name, None)
