"""A radix tree over token ids, remembering which replica has (probably) cached which prefix.

The router cannot see the engines' KV caches, so it models them, as Preble and SGLang's router do:
every request routed to a replica inserts its prompt (and, when it finishes, prompt + output, which
is the next turn's prefix) under that replica. `match` tells, for each replica, how many leading
tokens of a new prompt it is likely to hold. Each replica's share of the tree is bounded by a token
budget (its cache is finite too); the least recently used leaves go first.

Pure data structure: no I/O, no clocks (callers pass `now`), so simulators can drive it directly.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "edge", "parent", "replicas")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge  # the tokens on the edge from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's edge -> child
        self.replicas: dict[str, float] = {}  # replica -> last time a request through this node went there


class RadixTree:
    def __init__(self, max_tokens_per_replica: int | None = None) -> None:
        self.root = _Node((), None)
        self.max_tokens_per_replica = max_tokens_per_replica
        self._tokens: dict[str, int] = {}  # replica -> tokens it holds in the tree
        self._clock = 0.0

    def tokens_held(self, replica: str) -> int:
        return self._tokens.get(replica, 0)

    def _tick(self, now: float | None) -> float:
        self._clock = max(self._clock + 1e-9, now if now is not None else self._clock + 1.0)
        return self._clock

    # ------------------------------------------------------------ queries

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """replica -> length of the longest prefix of `tokens` the tree says it holds."""
        found: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_prefix(child.edge, tokens, depth)
            depth += common
            for replica in child.replicas:
                found[replica] = depth  # deeper nodes overwrite: the path is walked root to leaf
            if common < len(child.edge):
                break
            node = child
        return found

    # ------------------------------------------------------------ updates

    def insert(self, tokens: Sequence[int], replica: str, now: float | None = None) -> None:
        """Record that `replica` now holds the prefix `tokens`."""
        t = self._tick(now)
        node, depth = self.root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = _Node(tuple(tokens[depth:]), node)
                node.children[tokens[depth]] = child
            else:
                common = _common_prefix(child.edge, tokens, depth)
                if common < len(child.edge):
                    child = self._split(child, common)
            if replica not in child.replicas:
                self._tokens[replica] = self._tokens.get(replica, 0) + len(child.edge)
            child.replicas[replica] = t
            depth += len(child.edge)
            node = child
        if self.max_tokens_per_replica is not None and self._tokens.get(replica, 0) > self.max_tokens_per_replica:
            self._evict(replica, self.max_tokens_per_replica)

    def remove_replica(self, replica: str) -> None:
        """Forget everything about a replica (it died or restarted: its cache is gone)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.replicas.pop(replica, None) is not None:
                self._prune(node)
        self._tokens.pop(replica, None)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens; the new upper node inherits node's replicas."""
        parent = node.parent
        upper = _Node(node.edge[:at], parent)
        upper.replicas = dict(node.replicas)
        parent.children[upper.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _evict(self, replica: str, budget: int) -> None:
        """Drop the replica from its least recently used leaves until it holds <= 90% of budget
        (the margin keeps eviction from running on every insert)."""
        target = int(budget * 0.9)
        while self._tokens.get(replica, 0) > target:
            leaves = []
            stack = list(self.root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if replica in node.replicas and not any(replica in c.replicas for c in node.children.values()):
                    leaves.append(node)
            if not leaves:
                return
            leaves.sort(key=lambda n: n.replicas[replica])
            for node in leaves:
                if self._tokens[replica] <= target:
                    break
                del node.replicas[replica]
                self._tokens[replica] -= len(node.edge)
                self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Remove nodes no replica holds and nothing hangs below."""
        while node is not self.root and not node.replicas and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent

    # ------------------------------------------------------------ persistence

    def export(self) -> list[dict]:
        """Every root-to-leaf path with its replicas: enough to rebuild the tree after a restart."""
        out = []
        stack = [(child, ()) for child in self.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.edge
            for replica, t in node.replicas.items():
                if not any(replica in c.replicas for c in node.children.values()):
                    out.append({"replica": replica, "tokens": list(path), "t": t})
            stack.extend((c, path) for c in node.children.values())
        return out

    def load(self, entries: list[dict]) -> None:
        for e in sorted(entries, key=lambda e: e["t"]):
            self.insert(e["tokens"], e["replica"], e["t"])


def _common_prefix(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:]. Runs on the router's event loop for every
    request (match, insert, insert of the output): whole-slice comparisons (in C) halve the span each
    time, so a 500-token edge costs ~10 comparisons of slices instead of 500 Python iterations."""
    n = min(len(edge), len(tokens) - start)
    if edge[:n] == tuple(tokens[start:start + n]):  # the common case: the whole edge matches
        return n
    lo, hi = 0, n  # edge[:lo] matches; edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == tuple(tokens[start + lo:start + mid]):
            lo = mid
        else:
            hi = mid
    return lo
