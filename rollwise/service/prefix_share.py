"""Datums that start with the same tokens compute those tokens once (the trainer's shared-prompt forward).

A GRPO step sends a group's samples as datums that all begin with the group's prompt. The padded forward computes
that prompt once per datum; here, as `rollwise train` with train.share_prompt_prefix does, each group's common
prefix runs once and every datum's continuation runs over the prefix's keys/values
(rollwise.train.packing.shared_prefix_hidden). Exact: every token attends to exactly what it attends to in the
datum's own forward, at the same position, so hidden states (and gradients, summed over the group through the
shared prefix) equal the padded forward's up to float summation order.

Only datums of the SAME model share a prefix: another tenant's adapter changes the prefix's activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rollwise.train.packing import shared_prefix_hidden

# A prefix group never spans more datums than this (bounds the O(n * window) grouping search).
WINDOW = 256


@dataclass(frozen=True)
class PrefixLayout:
    """Which datums (rows of the pass, in order) share which prefix: groups[g] lists rows, prefix_lens[g] is the
    number of leading tokens they all compute once (at most each member's length - 1: every row keeps a
    continuation of at least one token)."""

    groups: list[list[int]]
    prefix_lens: list[int]

    def group_of_rows(self, n_rows: int) -> list[int]:
        owner = [0] * n_rows
        for g, members in enumerate(self.groups):
            for r in members:
                owner[r] = g
        return owner

    def prefix_of_rows(self, n_rows: int) -> list[tuple[int, int]]:
        """Each row's (group, prefix length)."""
        return [(g, self.prefix_lens[g]) for g in self.group_of_rows(n_rows)]


def _common_prefix(a: Tensor, b: Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def plan_prefixes(rows: Sequence[Tensor], models: Sequence[int]) -> PrefixLayout | None:
    """Group `rows` (token ids [n_i]) of the same model (`models[i]`: an id per model) by shared prefix, so the
    positions saved are as many as possible; None when sharing would compute no fewer positions (padding
    included) than the padded forward. Rows sorted by (model, tokens) put rows with long common prefixes next to
    each other; the best cut of that order into groups (each saving (members - 1) x its prefix) is a small DP."""
    n = len(rows)
    if n < 2:
        return None
    order = sorted(range(n), key=lambda i: (models[i], rows[i].tolist()))
    # adjacent[k]: prefix shared by order[k] and order[k+1] (0 across models)
    adjacent = [(_common_prefix(rows[order[k]], rows[order[k + 1]]) if models[order[k]] == models[order[k + 1]]
                 else 0) for k in range(n - 1)]
    best = [0] * (n + 1)  # best[j]: positions saved by the best grouping of order[:j]
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last group, its prefix length)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, rows[order[j - 1]].numel() - 1)
        prefix = rows[order[j - 1]].numel() - 1
        for i in range(j - 2, max(-1, j - 1 - WINDOW), -1):  # group order[i:j]
            prefix = min(prefix, adjacent[i], rows[order[i]].numel() - 1)
            if prefix <= 0:
                break  # no longer group shares anything (best[] never decreases)
            if best[i] + (j - i - 1) * prefix > best[j]:
                best[j], cut[j] = best[i] + (j - i - 1) * prefix, (i, prefix)
    groups, prefix_lens = [], []
    j = n
    while j > 0:
        i, prefix = cut[j]
        groups.append([order[k] for k in range(i, j)])
        prefix_lens.append(prefix)
        j = i
    groups.reverse()
    prefix_lens.reverse()
    # A row alone saves nothing whatever its prefix: keep it no longer than the groups' (less prompt padding).
    shared = [p for g, p in zip(groups, prefix_lens) if len(g) > 1]
    if not shared:
        return None
    prefix_lens = [p if len(g) > 1 else max(1, min(p, max(shared))) for g, p in zip(groups, prefix_lens)]
    lengths = [int(t.numel()) for t in rows]
    width = max(lengths[r] - prefix_lens[g] for g, members in enumerate(groups) for r in members)
    if len(groups) * max(prefix_lens) + n * width >= n * max(lengths):
        return None
    return PrefixLayout(groups, prefix_lens)


def prefix_shared_hidden(backbone: nn.Module, rows: Sequence[Tensor], layout: PrefixLayout,
                         prompt_scope: AbstractContextManager | None = None,
                         rows_scope: AbstractContextManager | None = None) -> list[Tensor]:
    """Each row's last hidden states [n_i, H], the prefixes computed once per group (see the module doc).
    `prompt_scope` is entered around the forward whose batch rows are the layout's groups in order, `rows_scope`
    around the one whose rows are `rows` in order (per-row LoRA adapters)."""
    lens = layout.prefix_lens
    prompts = torch.zeros(len(layout.groups), max(lens), dtype=torch.long)
    for g, members in enumerate(layout.groups):
        prompts[g, : lens[g]] = rows[members[0]][: lens[g]]
    row_group = layout.group_of_rows(len(rows))
    rest = [int(t.numel()) - lens[row_group[r]] for r, t in enumerate(rows)]
    tokens = torch.zeros(len(rows), max(rest), dtype=torch.long)
    segment_start = torch.full((len(rows), max(rest)), -1, dtype=torch.long)
    for r, t in enumerate(rows):
        tokens[r, : rest[r]] = t[lens[row_group[r]]:]
        segment_start[r, : rest[r]] = 0
    prompt_hidden, row_hidden, _ = shared_prefix_hidden(
        backbone, prompts, torch.tensor(lens), tokens, torch.tensor(row_group), segment_start,
        prompt_scope, rows_scope)
    return [torch.cat([prompt_hidden[row_group[r], : lens[row_group[r]]], row_hidden[r, : rest[r]]])
            for r in range(len(rows))]


def head_inputs(hidden: Sequence[Tensor], targets: Sequence[Tensor],
                prefixes: Sequence[tuple[int, int]] | None = None) -> tuple[Tensor, Tensor, list[Tensor]]:
    """What the LM head computes for datums with last hidden states `hidden` [n_i, H] and `targets` [n_i] or
    [n_i, K]: (hidden rows [M, H], their target ids [M], per datum the row of each target element, in target
    order). With `prefixes` (datum i's (group, prefix length): its first positions are its group's shared
    prefix), a prefix position whose 1-D target every member of the group has is one row for the whole group:
    its log-prob is the same for each member, and gathering it for each sums their gradients, as separate rows
    would."""
    rows_h: list[Tensor] = []
    rows_t: list[Tensor] = []
    count = 0

    def add(h: Tensor, t: Tensor) -> Tensor:
        nonlocal count
        rows_h.append(h)
        rows_t.append(t)
        count += t.numel()
        return torch.arange(count - t.numel(), count)

    shared: dict[int, tuple[Tensor, Tensor]] = {}  # datum -> (its positions computed once for the group, their rows)
    members: dict[int, list[int]] = {}
    for i, (group, length) in enumerate(prefixes or ()):
        if targets[i].dim() == 1 and length > 0:
            members.setdefault(group, []).append(i)
    for ids in members.values():
        if len(ids) < 2:
            continue
        length = prefixes[ids[0]][1]  # type: ignore[index]
        stacked = torch.stack([targets[i][:length] for i in ids])
        positions = (stacked == stacked[0]).all(0).nonzero()[:, 0]
        if positions.numel():
            rows = add(hidden[ids[0]][positions], stacked[0][positions])
            shared.update({i: (positions, rows) for i in ids})
    index = []
    for i, (h, t) in enumerate(zip(hidden, targets)):
        n = t.shape[0]
        if i in shared:
            positions, rows = shared[i]
            own = torch.ones(n, dtype=torch.bool)
            own[positions] = False
            own_positions = own.nonzero()[:, 0]
            where = torch.empty(n, dtype=torch.long)
            where[positions] = rows
            where[own_positions] = add(h[own_positions], t[own_positions])
            index.append(where)
        else:
            k = t.shape[1] if t.dim() == 2 else 1
            index.append(add(h[:n].repeat_interleave(k, dim=0) if k > 1 else h[:n], t.reshape(-1)))
    return torch.cat(rows_h), torch.cat(rows_t), index
