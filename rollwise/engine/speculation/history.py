"""A model-free drafter over the policy's own recent rollouts (DAS, arXiv 2511.13841).

RL samples the same problems again and again, and GRPO siblings of one prompt are near copies of
each other (more so as training lowers the entropy). So the continuation a request is about to
produce has very likely been produced before, by a sibling or by an earlier step's rollout of the
same problem. The drafter indexes finished rollouts per problem (and globally) and proposes the
most frequent continuation of the request's current suffix.

The index is a suffix-count table: for every context of 1..max_n tokens seen in a rollout, how often
each next token followed it. That is the suffix tree of the window cut at depth max_n, stored flat:
adding or removing a rollout of L tokens costs O(L * max_n) dict updates, lookups O(max_n) per
drafted token, and removing a rollout restores the exact counts (so the window slides cheaply).

Drafts are only proposals: the engine verifies every drafted token against the current policy, so
a draft from an older policy version, another problem (hash collision) or a stale window can cost
speed, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from rollwise.engine.speculation.budget import BudgetPolicy, draft_budget

START = -1  # a rollout's first context position: "nothing generated yet" (never a real token id)


class SuffixCounts:
    """Next-token counts after each context of 1..max_n tokens, over a multiset of sequences."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def _contexts(self, tokens: tuple[int, ...]):
        for i in range(1, len(tokens)):
            nxt = tokens[i]
            for n in range(1, min(self.max_n, i) + 1):
                yield tokens[i - n : i], nxt

    def add(self, tokens: tuple[int, ...]) -> None:
        for ctx, nxt in self._contexts(tokens):
            followers = self.counts.setdefault(ctx, {})
            followers[nxt] = followers.get(nxt, 0) + 1

    def remove(self, tokens: tuple[int, ...]) -> None:
        for ctx, nxt in self._contexts(tokens):
            followers = self.counts[ctx]
            if followers[nxt] == 1:
                del followers[nxt]
                if not followers:
                    del self.counts[ctx]
            else:
                followers[nxt] -= 1

    def predict(self, context: list[int], min_match: int) -> int | None:
        """The most frequent follower of the longest suffix of `context` (>= min_match tokens) seen."""
        for n in range(min(self.max_n, len(context)), min_match - 1, -1):
            followers = self.counts.get(tuple(context[-n:]))
            if followers:
                return max(followers, key=followers.__getitem__)
        return None

    @property
    def entries(self) -> int:
        return sum(len(f) for f in self.counts.values())


@dataclass
class _Rollout:
    problem: int
    tokens: tuple[int, ...]  # START + the response's token ids
    version: int
    key: str | None


@dataclass(frozen=True)
class HistorySettings:
    window_rollouts: int = 64  # per problem: the most recent rollouts kept
    max_versions: int = 4  # rollouts sampled more than this many policy versions ago age out
    max_tokens: int = 1_000_000  # all problems together: oldest rollouts go first beyond this
    max_n: int = 8  # longest context matched (the suffix tree's depth)
    min_match: int = 2  # shortest context trusted for a draft
    use_global: bool = True  # fall back to all problems' rollouts when the problem's own has no match


class HistoryDrafter:
    """Per-problem and global suffix counts over a sliding window of recent rollouts.

    A problem is its prompt (token ids): GRPO siblings share it, so a sibling drafts from the others
    as soon as one of them finishes. `observe` is fed every finished sample (by the engine itself
    and/or the rollout controller; a sample key makes feeding twice harmless)."""

    def __init__(self, settings: HistorySettings = HistorySettings(), budget: BudgetPolicy = BudgetPolicy()) -> None:
        self.settings = settings
        self.budget = budget
        self.newest_version = 0
        self._rollouts: OrderedDict[int, _Rollout] = OrderedDict()  # id -> rollout, oldest first
        self._by_problem: dict[int, deque[int]] = {}
        self._problem_index: dict[int, SuffixCounts] = {}
        self._global = SuffixCounts(settings.max_n)
        self._keys: set[str] = set()
        self._tokens = 0  # response tokens held (the memory bound)
        self._next_id = 0

    # ------------------------------------------------------------ feeding

    def clear(self) -> None:
        """Forget every rollout (a benchmark starting a new workload on the same engine)."""
        self.__init__(self.settings, self.budget)  # type: ignore[misc]


    def observe(self, prompt_ids: list[int], token_ids: list[int], version: int, key: str | None = None) -> None:
        """Add one finished rollout (its response tokens, sampled by policy `version`)."""
        if not token_ids or (key is not None and key in self._keys):
            return
        self.on_policy_version(version)
        if version <= self.newest_version - self.settings.max_versions:
            return  # already too old to keep
        problem = problem_key(prompt_ids)
        rollout = _Rollout(problem, (START, *token_ids), version, key)
        rid, self._next_id = self._next_id, self._next_id + 1
        self._rollouts[rid] = rollout
        self._by_problem.setdefault(problem, deque()).append(rid)
        self._problem_index.setdefault(problem, SuffixCounts(self.settings.max_n)).add(rollout.tokens)
        if self.settings.use_global:
            self._global.add(rollout.tokens)
        if key is not None:
            self._keys.add(key)
        self._tokens += len(token_ids)
        while len(self._by_problem[problem]) > self.settings.window_rollouts:
            self._evict(self._by_problem[problem][0])
        while self._tokens > self.settings.max_tokens:
            self._evict(next(iter(self._rollouts)))

    def on_policy_version(self, version: int) -> None:
        """Age out rollouts of versions that fell out of the window (called at weight updates too)."""
        if version <= self.newest_version:
            return
        self.newest_version = version
        oldest_kept = version - self.settings.max_versions + 1
        for rid in [r for r, ro in self._rollouts.items() if ro.version < oldest_kept]:
            self._evict(rid)

    def _evict(self, rid: int) -> None:
        rollout = self._rollouts.pop(rid)
        ids = self._by_problem[rollout.problem]
        ids.remove(rid)
        index = self._problem_index[rollout.problem]
        index.remove(rollout.tokens)
        if not ids:
            del self._by_problem[rollout.problem], self._problem_index[rollout.problem]
        if self.settings.use_global:
            self._global.remove(rollout.tokens)
        if rollout.key is not None:
            self._keys.discard(rollout.key)
        self._tokens -= len(rollout.tokens) - 1

    # ------------------------------------------------------------ drafting

    def propose(self, prompt_ids: list[int], generated: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `generated` (the response so far) for this prompt."""
        if k <= 0:
            return []
        index = self._problem_index.get(problem_key(prompt_ids))
        context = [START, *generated[-self.settings.max_n :]]
        draft: list[int] = []
        while len(draft) < k:
            token = index.predict(context, self.settings.min_match) if index is not None else None
            if token is None and self.settings.use_global:
                token = self._global.predict(context, self.settings.min_match)
            if token is None:
                break
            draft.append(token)
            context.append(token)
        return draft

    def expected_remaining(self, prompt_ids: list[int], generated: int) -> float:
        """Mean remaining length of this problem's recorded rollouts that ran longer than `generated`
        (with no history of its own: the mean rollout length of all problems, less `generated`). A request that already outlived its whole history is the
        tail the batch waits for: it is assumed to go on for half again what it has generated."""
        ids = self._by_problem.get(problem_key(prompt_ids))
        if ids:
            longer = [n for n in (len(self._rollouts[r].tokens) - 1 - generated for r in ids) if n > 0]
            if longer:
                return sum(longer) / len(longer)
        elif self._rollouts and self._tokens / len(self._rollouts) > generated:  # O(1): no per-rollout scan
            return self._tokens / len(self._rollouts) - generated
        return max(1.0, generated / 2)

    def budget_for(self, prompt_ids: list[int], generated: int, running: int) -> int:
        return draft_budget(self.expected_remaining(prompt_ids, generated), running, self.budget)

    # ------------------------------------------------------------ reporting

    def memory(self) -> dict[str, int]:
        """What the window holds: rollouts, tokens, problems and suffix-count entries (the memory bound)."""
        return {
            "rollouts": len(self._rollouts),
            "tokens": self._tokens,
            "problems": len(self._by_problem),
            "entries": sum(i.entries for i in self._problem_index.values()) + self._global.entries,
        }


def problem_key(prompt_ids: list[int]) -> int:
    return hash(tuple(prompt_ids))
