"""Routing policies: which replica serves a request. Pure decisions over plain data, no I/O.

The gateway (app.py) and the simulator (sim.py) both call them the same way:

    decision = policy.choose(request, replicas)   # replicas: the eligible ones, never empty
    policy.on_routed(request, decision, now)      # it was sent there
    policy.on_finished(request, replica, output_ids, now)   # it came back (output token ids, if known)
    policy.forget(replica)                        # the replica died or restarted

Policies:
- round_robin: the next replica in turn; ignores prefixes and keys (the baseline).
- least_load: the lowest load cost (pending prefill + decode work, see LoadCost).
- consistent_hash: rendezvous hashing of the session key (else the group key, else the first
  64 prompt tokens): the same key always lands on the same replica while it is eligible, and only the
  keys of a replica that leaves move.
- group_affinity: a session or GRPO group stays where its first request was placed (least load);
  the router passes that placement in as `request.pinned`.
- prefix (Preble): a radix tree of what each replica has cached. Exploit the replica holding the
  longest prefix when it covers enough of the prompt; else explore: the lowest load cost including
  this request's own uncached prefill there, so a short match (the system prompt every group shares)
  still counts: a new group goes where that prefix is cached unless the replica is busier by more than
  the prefill it saves. On a lightly loaded cluster this consolidates (bench router's full run: 21/21/21/5
  requests per replica per round), and that is where prefix's hit-rate edge over vllm-router's cache_aware
  comes from; exploring by load or smallest tree instead spreads groups like cache_aware and loses the
  edge, without touching the tail, which is the t=0 burst (issue 25, docs/benchmarks.md).
  Rebalance: when the exploited replica's load exceeds `imbalance` times the lightest one's (plus a
  slack), send the request to the lightest replica instead, which then caches the hot prefix too.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rollwise.router.radix import RadixTree


@dataclass(frozen=True)
class LoadCost:
    """Work units of pending tokens. Prefill tokens run many per forward pass, decode tokens one per
    sequence per step, so a decode token costs more wall time than a prefill token."""

    prefill_weight: float = 1.0
    decode_weight: float = 4.0

    def of(self, prefill_tokens: float, decode_tokens: float) -> float:
        return self.prefill_weight * prefill_tokens + self.decode_weight * decode_tokens


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows about a replica's pending work (its own accounting of requests in flight)."""

    name: str
    in_flight: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens of requests in flight
    decode_tokens: int = 0  # tokens still expected from requests in flight (n * max_tokens)


@dataclass(frozen=True)
class RouteRequest:
    tokens: Sequence[int] = ()  # prompt token ids (empty when the router could not tokenize)
    session_key: str | None = None
    group_key: str | None = None
    pinned: str | None = None  # where this session/group was last routed (from the router's table)
    samples: int = 1  # n
    max_tokens: int = 256  # expected decode tokens per sample

    @property
    def affinity_key(self) -> str | None:
        return self.session_key or self.group_key


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # round_robin, least_load, hash, affinity, place, exploit, explore, rebalance
    matched_tokens: int = 0  # prompt tokens the policy expects the replica to have cached


class Policy:
    name: ClassVar[str] = ""
    learns_outputs: ClassVar[bool] = False  # wants on_finished with output token ids

    def __init__(self, cost: LoadCost | None = None) -> None:
        self.cost = cost or LoadCost()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        raise NotImplementedError

    def on_routed(self, request: RouteRequest, decision: Decision, now: float | None = None) -> None:
        pass

    def on_finished(
        self, request: RouteRequest, replica: str, outputs: Sequence[Sequence[int]], now: float | None = None
    ) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass

    def load(self, r: ReplicaLoad) -> float:
        return self.cost.of(r.prefill_tokens, r.decode_tokens)

    def least_loaded(self, replicas: Sequence[ReplicaLoad], extra: dict[str, float] | None = None) -> ReplicaLoad:
        """Lowest cost (+ extra[name]); ties by fewer requests in flight, then name (deterministic)."""
        extra = extra or {}
        return min(replicas, key=lambda r: (self.load(r) + extra.get(r.name, 0.0), r.in_flight, r.name))


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, cost: LoadCost | None = None) -> None:
        super().__init__(cost)
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.name)
        return Decision(ordered[next(self._counter) % len(ordered)].name, "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        new_prefill = {r.name: self.cost.of(len(request.tokens), 0) for r in replicas}
        return Decision(self.least_loaded(replicas, new_prefill).name, "least_load")


def _hash64(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest(), "big")


class ConsistentHash(Policy):
    name = "consistent_hash"
    prefix_tokens = 64  # keyless requests hash their prompt's start (the shared part of a group's prompt)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        key = request.affinity_key
        if key is None:
            key = "tokens:" + ",".join(map(str, request.tokens[: self.prefix_tokens]))
        best = max(replicas, key=lambda r: _hash64(key, r.name))  # rendezvous (highest random weight)
        return Decision(best.name, "hash")


class GroupAffinity(Policy):
    name = "group_affinity"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        if request.pinned is not None and any(r.name == request.pinned for r in replicas):
            return Decision(request.pinned, "affinity")
        return Decision(self.least_loaded(replicas).name, "place")


@dataclass
class PrefixConfig:
    min_match_ratio: float = 0.5  # Preble: exploit when the cached prefix covers more than this share
    min_match_tokens: int = 16  # ... and at least this many tokens (one engine cache block)
    imbalance: float = 2.0  # rebalance when the exploited replica's load > imbalance * the lightest's ...
    slack: float = 2048.0  # ... + this many work units (an idle cluster is never "imbalanced")
    tree_tokens_per_replica: int | None = 1 << 20  # the tree's model of each replica's cache


class PrefixAware(Policy):
    name = "prefix"
    learns_outputs = True

    def __init__(self, cost: LoadCost | None = None, config: PrefixConfig | None = None) -> None:
        super().__init__(cost)
        self.config = config or PrefixConfig()
        self.tree = RadixTree(self.config.tree_tokens_per_replica)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> Decision:
        cfg, tokens = self.config, request.tokens
        names = {r.name for r in replicas}
        matches = {name: m for name, m in (self.tree.match(tokens) if tokens else {}).items() if name in names}
        best_len = max(matches.values(), default=0)
        uncached = {r.name: self.cost.of(len(tokens) - matches.get(r.name, 0), 0) for r in replicas}
        lightest = self.least_loaded(replicas, uncached)
        candidate: tuple[ReplicaLoad, str] | None = None
        if best_len >= cfg.min_match_tokens and best_len >= cfg.min_match_ratio * len(tokens):
            candidate = (self.least_loaded([r for r in replicas if matches.get(r.name) == best_len]), "exploit")
        elif request.pinned in names and matches.get(request.pinned, 0) == best_len:
            # A session whose replica holds as much of it as any other (the tree may know little of it,
            # e.g. after a router restart) goes back there: that engine's cache holds its history.
            candidate = (next(r for r in replicas if r.name == request.pinned), "affinity")
        if candidate is not None:
            chosen, reason = candidate
            cost = self.load(chosen) + uncached[chosen.name]
            if chosen.name != lightest.name and cost > cfg.imbalance * (self.load(lightest) + uncached[lightest.name]) + cfg.slack:
                return Decision(lightest.name, "rebalance", matches.get(lightest.name, 0))
            return Decision(chosen.name, reason, matches.get(chosen.name, 0))
        return Decision(lightest.name, "explore", matches.get(lightest.name, 0))

    def on_routed(self, request: RouteRequest, decision: Decision, now: float | None = None) -> None:
        if request.tokens:
            self.tree.insert(request.tokens, decision.replica, now)

    def on_finished(
        self, request: RouteRequest, replica: str, outputs: Sequence[Sequence[int]], now: float | None = None
    ) -> None:
        # prompt + output is what the engine caches on finish, and the next turn's prompt starts with it.
        for out in outputs:
            if request.tokens and out:
                self.tree.insert(list(request.tokens) + list(out), replica, now)

    def forget(self, replica: str) -> None:
        self.tree.remove_replica(replica)


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RoundRobin, LeastLoad, ConsistentHash, GroupAffinity, PrefixAware)
}


def make_policy(name: str, cost: LoadCost | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](cost)
