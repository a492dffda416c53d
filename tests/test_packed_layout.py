"""The one packed attention mask (rollwise.types.packed_layout) against masks built by hand, and the packed
forwards that use it (SFT rows, the teacher's scoring) against each sequence alone."""

from __future__ import annotations

import torch

from rollwise.types.microbatch import pack_responses
from rollwise.types.packed_layout import lay_out_rows, packed_attention_mask, prefixed_attention_mask


def _hand_mask(rows: list[list[int]], width: int) -> torch.Tensor:
    """Row r holds segments of the given lengths end to end: causal within each; padding sees itself only."""
    mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool)
    for r, lengths in enumerate(rows):
        col = 0
        for n in lengths:
            for q in range(col, col + n):
                for k in range(col, q + 1):
                    mask[r, 0, q, k] = True
            col += n
        for q in range(col, width):
            mask[r, 0, q, q] = True
    return mask


def test_packed_mask_equals_hand_built() -> None:
    lengths = [3, 5, 2, 1, 4]
    rows, width = pack_responses(lengths)  # first-fit decreasing: [[1], [4, 2], [0, 3]]
    layout = lay_out_rows(rows, lengths, width)
    assert torch.equal(packed_attention_mask(layout.segment_start),
                       _hand_mask([[lengths[i] for i in row] for row in rows], width))
    flat = torch.cat(layout.place)
    assert sorted(flat.tolist()) == sorted(set(flat.tolist()))  # every token at its own place
    for i, place in enumerate(layout.place):  # a sequence's tokens are consecutive columns of one row
        assert place.tolist() == list(range(int(place[0]), int(place[0]) + lengths[i]))
        assert int(place[0]) // width == next(r for r, row in enumerate(rows) if i in row)


def test_prefixed_mask_sees_prefix_then_own_segment() -> None:
    layout = lay_out_rows([[0, 1]], [2, 1], 4)
    prefix = torch.tensor([[True, True, False]])  # a prompt of 2 in a width of 3
    mask = prefixed_attention_mask(prefix, layout.segment_start)
    assert mask.shape == (1, 1, 4, 7)
    assert torch.equal(mask[0, 0, :, :3], prefix.expand(4, 3))
    assert torch.equal(mask[..., 3:], _hand_mask([[2, 1]], 4))
