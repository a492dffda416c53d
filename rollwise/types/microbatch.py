"""How a train step cuts its samples into micro-batches, and how many token positions it computes.

Pure (no torch): the trainer (rollwise.train.trainer) runs these micro-batches, and the simulator's
trainer model (rollwise.sim.cost) prices a step by `computed_tokens` without importing the trainer.
Sample fields are read with len() and iteration only (they may be lists or arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rollwise.types.sample import Sample


class MicroBatchSettings(Protocol):
    """The fields of the train section (rollwise.types.train_config.TrainConfig) that micro-batching reads.
    `pack_responses`, `pack_groups` and `micro_batch_tokens` are read with defaults (off, off, 2048)
    where a settings object lacks them. micro_batch_tokens bounds every micro-batch's computed positions
    (a group is cut into parts when it would exceed it), so memory does not grow with response length."""

    micro_batch_size: int
    share_prompt_prefix: bool


def _packs_responses(cfg: MicroBatchSettings) -> bool:
    return bool(getattr(cfg, "pack_responses", False))


def _packs_groups(cfg: MicroBatchSettings) -> bool:
    # Several groups in one forward is an extension of the packed forward (rows over each prompt's KV).
    return _packs_responses(cfg) and bool(getattr(cfg, "pack_groups", False))


def _token_budget(cfg: MicroBatchSettings) -> int:
    return int(getattr(cfg, "micro_batch_tokens", 2048))


def pack_responses(lengths: list[int], width: int | None = None) -> tuple[list[list[int]], int]:
    """Responses of these lengths packed into rows as wide as the longest, or `width` (first-fit
    decreasing): (the response indices of each row, in order, the row width). A group's responses
    then cost about their total length in the forward, not group size x the longest."""
    width = max(lengths) if width is None else width
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows, width


def prompt_groups(chunk: list[Sample]) -> list[list[Sample]]:
    """A shared-prompt micro-batch's samples by prompt, in order of first appearance."""
    by_prompt: dict[tuple[int, ...], list[Sample]] = {}
    for s in chunk:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    return list(by_prompt.values())


def _shared_cost(chunk: list[Sample], packed: bool) -> int:
    """Positions a shared-prompt micro-batch computes: its prompts as one right-padded batch
    (groups x the longest prompt), then its response rows (rows x the longest response): one row
    per sample, or, packed, each group's responses several to a row (pack_responses)."""
    groups = prompt_groups(chunk)
    width = max(len(s.response_ids) for s in chunk)
    prompts = len(groups) * max(len(g[0].prompt_ids) for g in groups)
    if not packed:
        return prompts + len(chunk) * width
    rows = sum(len(pack_responses([len(s.response_ids) for s in g], width)[0]) for g in groups)
    return prompts + rows * width


def _padded_cost(chunk: list[Sample]) -> int:
    """Positions a padded micro-batch computes: rows x its longest prompt + response."""
    return len(chunk) * max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)


def _within_budget(chunk: list[Sample], cost: Callable[[list[Sample]], int], budget: int) -> list[list[Sample]]:
    """`chunk` itself when it computes at most `budget` positions, else cut into parts that do (longest
    response first, next fit); a sample longer than the budget is a part of its own. Long responses
    then train in more, smaller micro-batches instead of one whose activations outgrow memory."""
    if cost(chunk) <= budget:
        return [chunk]
    parts: list[list[Sample]] = []
    for s in sorted(chunk, key=lambda s: -len(s.response_ids)):
        if parts and cost(parts[-1] + [s]) <= budget:
            parts[-1].append(s)
        else:
            parts.append([s])
    return parts


def _pack_group_pieces(pieces: list[list[Sample]], cfg: MicroBatchSettings) -> list[list[Sample]]:
    """Whole groups (pieces of at most micro_batch_size samples) together in a micro-batch while it
    computes at most micro_batch_tokens positions (next fit). Longest response first: a micro-batch's
    rows are as wide as its longest response, so groups of similar widths go together."""
    budget = _token_budget(cfg)
    chunks: list[list[Sample]] = []
    for piece in sorted(pieces, key=lambda p: -max(len(s.response_ids) for s in p)):
        if chunks and _shared_cost(chunks[-1] + piece, packed=True) <= budget:
            chunks[-1].extend(piece)
        else:
            chunks.append(list(piece))
    return chunks


def chunk_samples(samples: list[Sample], cfg: MicroBatchSettings) -> tuple[bool, list[list[Sample]]]:
    """The micro-batches a train step runs: (whether they share their prompt, the samples of each).
    A shared-prompt micro-batch holds one group's samples (at most micro_batch_size), or with
    train.pack_groups several whole groups (each prompt computed once, see _pack_group_pieces). No
    micro-batch computes more than micro_batch_tokens positions unless one sample alone does."""
    samples = [s for s in samples if s.trained_tokens]
    # The shared-prompt forward uses the response mask as attention mask; multi-turn samples
    # (loss mask 0 on tool/template tokens the model must still attend to) take the padded forward.
    share = cfg.share_prompt_prefix and all(s.loss_mask is None for s in samples)
    size, budget = cfg.micro_batch_size, _token_budget(cfg)
    if not share:
        return share, [part for i in range(0, len(samples), size)
                       for part in _within_budget(samples[i : i + size], _padded_cost, budget)]
    # Samples with the same prompt (a GRPO group) go together: the prompt is computed once.
    packed = _packs_responses(cfg)
    pieces = [part for g in prompt_groups(samples) for i in range(0, len(g), size)
              for part in _within_budget(g[i : i + size], lambda c: _shared_cost(c, packed), budget)]
    if _packs_groups(cfg):
        return share, _pack_group_pieces(pieces, cfg)
    return share, pieces


def computed_tokens(samples: list[Sample], cfg: MicroBatchSettings) -> int:
    """Token positions the forward/backward computes, padding included: a shared-prompt micro-batch
    is its prompts once (groups x the longest) + rows x its longest response, a row holding one
    response or, with train.pack_responses, several; a padded one is rows x its longest sequence.
    The train step's time follows this, not the sum of sample lengths (the simulator's trainer model
    uses it: sorted mode's early-finished groups pad to shorter lengths and train faster)."""
    share, chunks = chunk_samples(samples, cfg)
    if share:
        return sum(_shared_cost(c, _packs_responses(cfg)) for c in chunks)
    return sum(_padded_cost(c) for c in chunks)
