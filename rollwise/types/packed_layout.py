"""Where packed sequences sit in a forward's rows, and what each token attends to there: one definition for every
packed forward (the reference engine's scoring, rollwise.engine.reference.scoring; supervised fine-tuning's rows,
rollwise.train.sft_packing).

Rows come from `rollwise.types.microbatch.pack_responses` (which sequences share a row). A sequence ("segment")
occupies consecutive columns of its row; `segment_start` marks, per column, where its segment starts (-1 on
padding). A token attends causally within its own segment only, so a packed forward gives every token the value it
has alone. Here rather than in rollwise.types.microbatch, which stays torch-free for the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RowLayout:
    segment_start: Tensor  # [rows, W] column where each token's segment starts, -1 on padding
    place: list[Tensor]  # per sequence (input order): the flat indices into [rows, W] of its tokens


def lay_out_rows(rows: list[list[int]], lengths: list[int], width: int) -> RowLayout:
    """Sequences of `lengths` laid end to end in `rows` (each a list of sequence indices, as pack_responses gives)
    of `width` columns."""
    segment_start = torch.full((len(rows), width), -1, dtype=torch.long)
    place: list[Tensor] = [torch.empty(0, dtype=torch.long)] * len(lengths)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = lengths[i]
            if col + n > width:
                raise ValueError(f"lay_out_rows: row {r} holds {col + n} tokens, more than its width {width}")
            segment_start[r, col : col + n] = col
            place[i] = r * width + col + torch.arange(n)
            col += n
    return RowLayout(segment_start, place)


def packed_attention_mask(segment_start: Tensor) -> Tensor:
    """[rows, 1, W, W] bool attention mask of packed rows: a token sees its own segment's tokens up to itself; a
    padding query sees itself only (a query row of all False would make softmax NaN)."""
    width = segment_start.shape[-1]
    cols = torch.arange(width, device=segment_start.device)
    real = segment_start >= 0
    same = (segment_start[:, :, None] == segment_start[:, None, :]) & real[:, :, None] & real[:, None, :]
    eye = torch.eye(width, dtype=torch.bool, device=segment_start.device)
    return ((same & (cols[:, None] >= cols[None, :])) | eye)[:, None]


def prefixed_attention_mask(prefix_keys: Tensor, segment_start: Tensor) -> Tensor:
    """[rows, 1, W, P + W] bool attention mask of packed rows that continue a shared prefix (a group's prompt, its
    keys laid before the row's own): a token sees its row's real prefix keys (prefix_keys [rows, P] bool) and its
    own segment up to itself (packed_attention_mask)."""
    rows, width = segment_start.shape
    prefix = prefix_keys[:, None, None, :].expand(rows, 1, width, prefix_keys.shape[1])
    return torch.cat([prefix, packed_attention_mask(segment_start)], dim=-1)
