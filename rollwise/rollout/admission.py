"""Admission and update-batch policy: which groups may start generating, and how many complete groups
the next update trains. Pure functions of counts and versions, so the real RolloutController and the
cluster simulator (which runs that same controller) decide identically, and tests can check the rules
without an engine.

Two update-batch policies (rollout.update_batch):

- fixed (the original): every update trains exactly prompts_per_step groups; groups started and not yet
  trained (the batch in training included) are capped at oversubscription x prompts_per_step.
- flexible (SortedRL's flexible update batch, issue 26): an update trains every complete group there is,
  at least prompts_per_step and at most max_batch_factor x prompts_per_step. Admission keeps the engines
  full instead of keeping a count of batches: new groups start while the samples running (submitted, not
  finished) are fewer than oversubscription x prompts_per_step x group_size (size it to the engines'
  slots: a group near its end holds one or two slots, not group_size), and while the complete groups
  waiting or in training are fewer than (eta + 1) x the largest batch (more could not be trained within
  eta: the trainer is the bottleneck, and generating more would only be regenerated). Groups still
  generating do not count: a group in its long tail holds one slot, and counting it drained the engines.

Why flexible: under a fixed batch, groups that finished beyond the batch wait one more update, and at
eta = 1 that makes them too stale to train (regenerated), so admission had to count the batch in
training and the engines drained while the trainer trained (docs/benchmarks/sortedrl.md, "SortedRL at cluster
scale"). A batch that takes whatever finished lets engines run at capacity through the train step.

Staleness never exceeds eta under either policy: the controller regenerates what would (after_update),
and checks every trained sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["sync", "sorted", "async"]
UpdateBatch = Literal["fixed", "flexible"]


@dataclass(frozen=True)
class AdmissionPolicy:
    mode: Mode
    eta: int  # rollout.max_staleness
    batch_groups: int  # prompts_per_step: the update batch (fixed), its minimum (flexible)
    oversubscription: float
    group_size: int = 1
    update_batch: UpdateBatch = "fixed"
    max_batch_factor: float = 2.0

    @property
    def max_batch_groups(self) -> int:
        """The most groups one update trains."""
        if self.update_batch == "fixed" or self.mode == "sync":
            return self.batch_groups
        return max(self.batch_groups, math.ceil(self.max_batch_factor * self.batch_groups))

    @property
    def max_running_samples(self) -> int:
        """flexible: the most samples submitted to the engines and not finished, at once."""
        return math.ceil(self.oversubscription * self.batch_groups * self.group_size)

    @property
    def max_untrained(self) -> int:
        """fixed: the most groups started and not yet trained (ready and in training included);
        flexible: the most complete groups waiting or in training."""
        if self.update_batch == "fixed" or self.mode == "sync":
            return math.ceil(self.oversubscription * self.batch_groups)
        return (self.eta + 1) * self.max_batch_groups


@dataclass(frozen=True)
class RolloutCounts:
    """Where the controller's groups are, counted."""

    generating: int  # started, not all samples finished
    ready: int  # complete, waiting for an update batch
    training: int  # handed out by next_batch, not yet marked trained
    running_samples: int = 0  # samples submitted to the engines and not finished

    @property
    def untrained(self) -> int:
        return self.generating + self.ready + self.training

    @property
    def complete_untrained(self) -> int:
        return self.ready + self.training


def may_admit(p: AdmissionPolicy, counts: RolloutCounts, group_index: int, updates: int) -> bool:
    """May group `group_index` (the k-th problem of the stream) start now, after `updates` train
    steps? Steps, not the policy version: a step skipped for lack of signal leaves the version where
    it was, and counting versions would then stop admission for good (the trainer waits for a batch
    that may never start). Token staleness is still bounded by version (trainable_limit).
    sync admits its batch itself (next_batch), never here."""
    if p.mode == "sync":
        return False
    if p.update_batch == "flexible":
        if counts.running_samples >= p.max_running_samples or counts.complete_untrained >= p.max_untrained:
            return False
    elif counts.untrained >= p.max_untrained:
        return False
    # AReaL admission control: generation may run at most eta updates ahead of the trainer.
    return not (p.mode == "async" and group_index // p.batch_groups > updates + p.eta)


def batch_ready(p: AdmissionPolicy, ready: int) -> bool:
    """Enough complete groups for an update. (Waiting for incomplete urgent groups instead, to avoid
    regenerating them, was measured slower: the trainer then idles on the longest sample, as in sync.)"""
    return ready >= p.batch_groups


def batch_size(p: AdmissionPolicy, ready: int) -> int:
    """Groups the next update takes out of `ready` complete ones (urgent ones first, the controller
    orders them): fixed takes prompts_per_step; flexible takes every one, up to max_batch_groups."""
    return min(ready, p.max_batch_groups)


def is_urgent(p: AdmissionPolicy, oldest_version: int, version: int) -> bool:
    """A group sampled (in part) this long ago must be in the batch taken at `version`, or exceed eta."""
    return p.mode != "sync" and oldest_version <= version - p.eta


def oldest_trainable_after_batch(p: AdmissionPolicy, version: int) -> int:
    """flexible: once the batch at `version` is taken, the next batch is taken at version + 1 at the
    earliest, so a group whose oldest token is older than this can no longer be trained within eta:
    regenerate it now rather than let it hold engine slots until the update."""
    return version + 1 - p.eta


def trainable_limit(p: AdmissionPolicy, version: int) -> int:
    """After the update to `version`: the oldest policy version a trainable token may have."""
    return version - p.eta
