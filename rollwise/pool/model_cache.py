"""The pool's tiered model cache (issue 42, after ServerlessLLM): a job's weights (a full model's pushed state
dict, or a LoRA job's adapter) are loaded from the fastest tier that holds them.

    memory   host-memory tensors, under a byte budget
    disk     flat checkpoints (rollwise.model.flat_format) under a cache directory, under a byte budget: read back
             by the parallel chunked reader, checksums verified
    remote   where the weights come from when no tier holds them: the caller's loader (in the pool, the job's
             weights as uploaded; elsewhere a model spec loaded by from_pretrained)

`get(key, remote)` returns the weights, the tier that served them and the seconds it took, and promotes them into
every faster tier (a remote load is written to disk and kept in memory). Eviction: lowest priority first, then
least recently used. A tier never holds more bytes than its budget (an entry larger than the budget is not
cached there): every change happens under one lock, and `check()` asserts it. Keys carry the version (and the
job's attach), so a cached entry never goes stale: a new push is a new key, the old one ages out.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from rollwise.model.flat_format import is_flat_dir, write_flat
from rollwise.model.flat_reader import read_flat
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.startup_cost import Tier

TIERS: tuple[Tier, ...] = ("memory", "disk", "remote")  # fastest first

Weights = dict[str, Tensor]


def weights_bytes(state: Mapping[str, Tensor]) -> int:
    """Bytes the tensors hold, storage shared by several names (tied embeddings) counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in state.values():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident not in seen:
            seen.add(ident)
            total += t.numel() * t.element_size()
    return total


@dataclass
class _Entry:
    nbytes: int
    priority: float
    weights: Weights | None = None  # memory tier: the tensors; disk tier: None (the directory holds them)
    ready: bool = True  # disk tier: False while its file is written (counted in the budget, not yet readable)


@dataclass(frozen=True)
class Fetched:
    weights: Weights
    tier: Tier
    seconds: float


class ModelCache:
    """Memory and disk tiers over a remote loader; thread-safe (one lock: a get, put or eviction is atomic)."""

    def __init__(self, settings: CacheSettings | None = None) -> None:
        self.settings = settings or CacheSettings()
        self.budgets: dict[Tier, int] = {"memory": self.settings.memory_bytes,
                                         "disk": self.settings.disk_bytes if self.settings.disk_dir else 0}
        self._tiers: dict[Tier, OrderedDict[str, _Entry]] = {"memory": OrderedDict(), "disk": OrderedDict()}
        self._lock = threading.RLock()
        self.hits: dict[Tier, int] = {t: 0 for t in TIERS}
        self.evictions: dict[Tier, int] = {"memory": 0, "disk": 0}
        self.errors = 0  # disk-tier writes that failed (the load itself went on)
        if self.settings.disk_dir is not None:
            try:
                self.settings.disk_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"--cache-dir {self.settings.disk_dir}: cannot create the model cache's disk tier "
                                 f"there ({exc}); give a writable directory") from exc
            # A previous run's entries: their keys (a job's attach) never come again, and they would hold disk
            # beyond the budget. Only this cache's own directories go (a hashed name holding a flat index).
            for old in self.settings.disk_dir.iterdir():
                if len(old.name) == 32 and old.is_dir() and is_flat_dir(old):
                    shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ reads

    def get(self, key: str, remote: Callable[[], Mapping[str, Tensor]], priority: float = 0.0) -> Fetched:
        """The weights under `key` from the fastest tier holding them (else `remote()`), promoted to every faster
        tier. The seconds: the load itself (a hit's lookup, the disk read, the remote call), not the promotion.
        Disk and remote loads run outside the lock (another slot's memory hit does not wait for them); an entry
        evicted from disk while it is read falls back to the remote tier."""
        t = time.perf_counter()
        with self._lock:
            entry = self._touch("memory", key, priority)
            if entry is not None and entry.weights is not None:
                self.hits["memory"] += 1
                return Fetched(entry.weights, "memory", time.perf_counter() - t)
            on_disk = self._touch("disk", key, priority) is not None
        weights: Weights | None = None
        tier: Tier = "remote"
        if on_disk:
            try:
                weights = dict(read_flat(self._dir(key)).state)  # checksums verified
                tier = "disk"
            except (OSError, ValueError):  # evicted meanwhile, or damaged on disk: the remote tier has it
                with self._lock:
                    if self._readable("disk", key):  # (not a fresh copy being written meanwhile)
                        self._remove("disk", key)
        if weights is None:
            weights = dict(remote())
        seconds = time.perf_counter() - t
        with self._lock:
            self.hits[tier] += 1
        self.put(key, weights, priority, tiers=("memory",) if tier == "disk" else ("memory", "disk"))
        return Fetched(weights, tier, seconds)

    def tier_of(self, key: str) -> Tier:
        """The fastest tier holding `key` ("remote": none); touches nothing (the scheduler's estimate)."""
        with self._lock:
            return next((t for t in ("memory", "disk") if self._readable(t, key)), "remote")

    # ------------------------------------------------------------ writes

    def put(self, key: str, weights: Mapping[str, Tensor], priority: float = 0.0,
            tiers: tuple[Tier, ...] = ("memory", "disk")) -> None:
        """Cache `weights` under `key` in `tiers` (those with a budget), evicting lower-priority / older entries
        to make room; an entry larger than a tier's whole budget is not cached there. The disk file is written
        outside the lock, its bytes reserved in the budget meanwhile (memory hits of other slots do not wait)."""
        nbytes = weights_bytes(weights)
        for tier in tiers:
            with self._lock:
                if tier == "remote" or nbytes > self.budgets[tier] or key in self._tiers[tier]:
                    continue
                if not self._make_room(tier, nbytes, priority):
                    continue
                entry = _Entry(nbytes, priority, dict(weights) if tier == "memory" else None, tier == "memory")
                self._tiers[tier][key] = entry
                self.check()
            if tier == "disk":
                self._write(key, weights, entry)

    def _write(self, key: str, weights: Mapping[str, Tensor], entry: _Entry) -> None:
        """Write a reserved disk entry's flat checkpoint (no lock held); a failure drops the entry."""
        try:
            write_flat(weights, self._dir(key), fsync=False)  # damage fails its checksums on read
            ok = True
        except OSError:  # disk full, or gone: the weights are served anyway, just not cached there
            ok = False
        with self._lock:
            if ok and self._tiers["disk"].get(key) is entry:
                entry.ready = True
                return
            if self._tiers["disk"].get(key) is entry:
                self._tiers["disk"].pop(key)
            if not ok:
                self.errors += 1
            if key not in self._tiers["disk"]:
                shutil.rmtree(self._dir(key), ignore_errors=True)

    def drop(self, prefix: str) -> None:
        """Forget every entry whose key starts with `prefix` (a detached job's weights), in every tier."""
        with self._lock:
            for tier, entries in self._tiers.items():
                for key in [k for k in entries if k.startswith(prefix)]:
                    self._remove(tier, key)

    # ------------------------------------------------------------ budget

    def used(self, tier: Tier) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._tiers[tier].values()) if tier != "remote" else 0

    def check(self) -> None:
        """The invariant: no tier holds more than its budget."""
        with self._lock:
            for tier in ("memory", "disk"):
                used = self.used(tier)
                assert used <= self.budgets[tier], f"{tier} tier holds {used} bytes > budget {self.budgets[tier]}"

    def report(self) -> dict[str, object]:
        """For the pool's /state: per tier its budget, bytes held, keys, hits and evictions."""
        with self._lock:
            out: dict[str, object] = {t: {"budget_bytes": self.budgets[t], "used_bytes": self.used(t),
                                          "entries": list(self._tiers[t]), "hits": self.hits[t],
                                          "evictions": self.evictions[t]} for t in ("memory", "disk")}
            out["remote"] = {"hits": self.hits["remote"]}
            out["disk_write_errors"] = self.errors
            return out

    def _make_room(self, tier: Tier, nbytes: int, priority: float) -> bool:
        """Evict (lowest priority, then least recently used) until `nbytes` fit; never an entry of higher
        priority than the newcomer's: then nothing is evicted and False is returned."""
        entries = self._tiers[tier]
        free = self.budgets[tier] - self.used(tier)
        if free >= nbytes:
            return True
        # lowest priority first, then least recently used (the OrderedDict's order: most recent last)
        order = sorted(enumerate(entries.items()), key=lambda item: (item[1][1].priority, item[0]))
        victims, freed = [], 0
        for _, (key, entry) in order:
            if free + freed >= nbytes:
                break
            if entry.priority > priority:
                return False
            if not entry.ready:  # being written: not removed under its writer
                continue
            victims.append(key)
            freed += entry.nbytes
        if free + freed < nbytes:
            return False
        for key in victims:
            self._remove(tier, key)
            self.evictions[tier] += 1
        return True

    def _readable(self, tier: Tier, key: str) -> bool:
        entry = self._tiers[tier].get(key)
        return entry is not None and entry.ready

    def _touch(self, tier: Tier, key: str, priority: float) -> _Entry | None:
        entry = self._tiers[tier].get(key) if self._readable(tier, key) else None
        if entry is not None:
            self._tiers[tier].move_to_end(key)  # most recently used last
            entry.priority = max(entry.priority, priority)
        return entry

    def _remove(self, tier: Tier, key: str) -> None:
        self._tiers[tier].pop(key, None)
        if tier == "disk":
            shutil.rmtree(self._dir(key), ignore_errors=True)

    def _dir(self, key: str) -> Path:
        assert self.settings.disk_dir is not None
        return self.settings.disk_dir / hashlib.sha256(key.encode()).hexdigest()[:32]
