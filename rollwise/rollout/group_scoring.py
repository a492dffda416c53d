"""The groups a rollout controller has handed to its Scorer and not yet got back, and when each moved.

A ConcurrentScorer (the reward pool, Ray reward actors) scores a complete group in the background: the controller
submits it and goes on taking completions and starting groups, and picks the group up once it is scored. Any
other Scorer scores inline, as before (its time is returned, for the step's reward time).

The times recorded here (a group's samples all in, its scoring done, each completion's arrival) are the
controller's own clock, so overlap is measured, not guessed: `overlapped_completions` counts completions of other
groups that arrived while a group was being scored. With an inline scorer it is 0 by construction (the controller
is busy scoring); with the pool it is how much generation went on during scoring.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from rollwise.types.contracts import ConcurrentScorer, Scorer
from rollwise.types.sample import Sample


@dataclass(frozen=True)
class ScoreTimes:
    group: int
    generated_at: float  # the group's last sample arrived (monotonic)
    scored_at: float  # the controller saw its scoring done


class GroupScoring:
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        # One check, at construction: whether this scorer works in the background.
        self.concurrent = isinstance(scorer, ConcurrentScorer)
        self._pending: dict[int, tuple[Future[None], float]] = {}  # group -> (scoring, generated_at), in order
        self._inline_done: dict[int, float] = {}  # group -> when an inline scorer returned
        self.times: list[ScoreTimes] = []  # scored groups since the last step_metrics
        self.arrivals: list[float] = []  # when each completion arrived, since then (in time order)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, group: int) -> bool:
        return group in self._pending

    def arrived(self) -> None:
        self.arrivals.append(time.monotonic())

    def submit(self, group: int, samples: list[Sample], generated_at: float) -> float:
        """Hand a complete group to the scorer; returns the seconds spent scoring inline (0 in the background)."""
        if self.concurrent:
            assert isinstance(self.scorer, ConcurrentScorer)
            self._pending[group] = (self.scorer.submit(samples), generated_at)
            return 0.0
        self.scorer.score(samples)
        done: Future[None] = Future()
        done.set_result(None)
        self._pending[group] = (done, generated_at)
        self._inline_done[group] = scored_at = time.monotonic()  # scored when score() returned
        return scored_at - generated_at

    def collect(self) -> list[int]:
        """The groups whose scoring is done, in the order they were submitted (removed from here)."""
        now = time.monotonic()
        finished = [g for g, (f, _) in self._pending.items() if f.done()]
        for g in finished:
            _, generated_at = self._pending.pop(g)
            self.times.append(ScoreTimes(g, generated_at, self._inline_done.pop(g, now)))
        return finished

    def wait(self, timeout: float) -> None:
        """Block until some group's scoring is done, or `timeout` seconds."""
        if self._pending:
            wait([f for f, _ in self._pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def discard(self, group: int) -> None:
        """A group that lost a sample (regenerated): its scoring result is not used; it is scored again once
        complete (scoring is a function of the response, so a late write of the old result is the same value)."""
        self._pending.pop(group, None)
        self._inline_done.pop(group, None)

    def clear(self) -> None:
        self._pending.clear()
        self._inline_done.clear()

    def step_metrics(self) -> dict[str, float]:
        """The overlap of scoring with generation since the last call, from the recorded times:
        `reward_overlapped_completions` (as overlapped_completions()), `reward_scoring_s` (the groups' scoring
        times, each from its last sample's arrival to its scoring done, summed) and `reward_after_generation_s`
        (from the last completion that arrived to the last group's scoring done: the wall time scoring added
        after generation ended). Scoring overlapped with generation when the sum exceeds that tail."""
        scoring_s, tail_s = sum(t.scored_at - t.generated_at for t in self.times), 0.0
        if self.times:
            last_scored = max(t.scored_at for t in self.times)
            arrived = bisect_right(self.arrivals, last_scored)  # completions that arrived before it
            tail_s = last_scored - self.arrivals[arrived - 1] if arrived else 0.0
        return {"reward_overlapped_completions": float(self.overlapped_completions()),
                "reward_scoring_s": scoring_s, "reward_after_generation_s": tail_s}

    def overlapped_completions(self) -> int:
        """Completions of other groups that arrived while a group was being scored (since the last call)."""
        # Arrivals are appended in time order; a group's own arrivals are at or before its generated_at.
        n = sum(bisect_left(self.arrivals, t.scored_at) - bisect_right(self.arrivals, t.generated_at)
                for t in self.times)
        # Keep the arrivals a group still being scored may yet count; the scored ones are done with.
        start = min((generated_at for _, generated_at in self._pending.values()), default=time.monotonic())
        self.arrivals = self.arrivals[bisect_right(self.arrivals, start):]
        self.times = []
        return n
