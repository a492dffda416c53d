"""Where every sample is: the bookkeeping that makes "nothing lost, nothing twice" checkable.

A sample slot is (group index, sample index): group k is the k-th problem of the data stream, and
its slots are the GRPO group's samples. Each slot is in exactly one state at any time; moves are
checked against the allowed transitions, and every move back to `queued` (an abort or a stale
sample being regenerated) carries its reason.

    queued -> running -> finished -> batched -> trained
       ^         |           |
       +---------+-----------+   (aborted at a weight update / too stale: regenerate)
    any state but trained -> dropped (with a reason: the run ended, ...)

A running sample may also move between engines (live migration, rollwise.engine.migration): it stays
`running` on the same attempt, and the move is recorded with its engines (`migrate`), so a migration is
never mistaken for a regeneration and a sample can be followed from engine to engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

SlotState = Literal["queued", "running", "finished", "batched", "trained", "dropped"]
Slot = tuple[int, int]  # (group index, sample index)

_ALLOWED: dict[str, set[str]] = {
    "queued": {"running", "dropped"},
    "running": {"finished", "queued", "dropped"},
    "finished": {"batched", "queued", "dropped"},
    "batched": {"trained", "dropped"},
    "trained": set(),
    "dropped": set(),
}


class LedgerError(RuntimeError):
    """A sample moved in a way that would lose it or train it twice: a bug, never silenced."""


@dataclass(slots=True)  # one per sample ever started: ~1M at 4096 simulated GPUs
class SlotRecord:
    state: SlotState = "queued"
    attempts: int = 0  # times it was submitted to an engine
    # Attempts that had sampled at least one token when they were thrown away (an abort or staleness),
    # and how many tokens those were: the real cost of regenerating. An attempt aborted while it still
    # waited in the engine's queue cost nothing but its place in the queue.
    wasted_attempts: int = 0
    discarded_tokens: int = 0
    reasons: list[str] = field(default_factory=list)  # why it went back to queued or was dropped
    migrations: tuple[tuple[str, str], ...] = ()  # (from engine, to engine) of each live migration, in order


class RolloutLedger:
    def __init__(self) -> None:
        self.slots: dict[Slot, SlotRecord] = {}

    def add_group(self, group: int, size: int) -> None:
        for i in range(size):
            if (group, i) in self.slots:
                raise LedgerError(f"group {group} sample {i} is already tracked")
            self.slots[(group, i)] = SlotRecord()

    def move(self, slot: Slot, to: SlotState, reason: str | None = None, discarded_tokens: int = 0) -> None:
        """`discarded_tokens`: on a move back to queued, the tokens the thrown-away attempt had sampled."""
        record = self.slots.get(slot)
        if record is None:
            raise LedgerError(f"sample {slot} was never queued")
        if to not in _ALLOWED[record.state]:
            raise LedgerError(f"sample {slot}: {record.state} -> {to} is not allowed")
        if to in ("queued", "dropped"):
            if not reason:
                raise LedgerError(f"sample {slot}: moving to {to} needs a reason")
            record.reasons.append(reason)
        if to == "queued" and discarded_tokens > 0:
            record.wasted_attempts += 1
            record.discarded_tokens += discarded_tokens
        if to == "running":
            record.attempts += 1
        record.state = to

    def migrate(self, slot: Slot, source: str, target: str) -> None:
        """A running sample moved from engine `source` to `target` with its tokens (same attempt)."""
        record = self.slots.get(slot)
        if record is None:
            raise LedgerError(f"sample {slot} was never queued")
        if record.state != "running":
            raise LedgerError(f"sample {slot}: only a running sample migrates, it is {record.state}")
        if source == target:
            raise LedgerError(f"sample {slot}: a migration from engine {source!r} to itself")
        if record.migrations and record.migrations[-1][1] != source:
            raise LedgerError(f"sample {slot}: migrated from {source!r}, but it runs on {record.migrations[-1][1]!r}")
        record.migrations += ((source, target),)

    def migrations(self) -> int:
        """Live migrations of running samples, over all samples."""
        return sum(len(record.migrations) for record in self.slots.values())

    def state(self, slot: Slot) -> SlotState:
        return self.slots[slot].state

    def counts(self) -> dict[str, int]:
        counts = Counter(record.state for record in self.slots.values())
        return {state: counts.get(state, 0) for state in _ALLOWED}

    def regenerated(self) -> int:
        """Submissions beyond the first: samples generated again after an abort or for staleness."""
        return self.waste()["samples_regenerated"]

    def waste(self) -> dict[str, int]:
        """What regeneration cost, in one pass over the slots: submissions beyond the first (as
        regenerated()), those whose thrown-away attempt had sampled tokens (the rest never left the
        engine's queue), and the tokens thrown away."""
        regenerated = after_sampling = tokens = 0
        for record in self.slots.values():
            regenerated += max(record.attempts - 1, 0)
            after_sampling += record.wasted_attempts
            tokens += record.discarded_tokens
        return {"samples_regenerated": regenerated, "samples_regenerated_after_sampling": after_sampling,
                "tokens_discarded": tokens}

    def drop_reasons(self) -> dict[str, int]:
        return dict(Counter(r.reasons[-1] for r in self.slots.values() if r.state == "dropped"))
