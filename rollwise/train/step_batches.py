"""A train step's micro-batches, collated once (issue 41: the step's work done once).

With per-token advantages (train.advantage=gae, train.kl_penalty=reward) a sample's advantages come from the
reference's and the critic's forwards on the step's own micro-batches, so they are not known when the micro-batches
are collated. The step collates them once (rollwise.train.trainer.GRPOTrainer.forward_batches: the loss weights, the
sequence advantages, on the model's device), runs those forwards on them, plans the advantages over the whole batch
(set on the samples: rollwise.train.token_advantages.plan_token_advantages) and then fills them in here: one new
advantages tensor per micro-batch (dataclasses.replace; every other tensor is the same object, nothing re-collated).

The sharded trainer's ranks get the step in two commands (token_inputs, then train: rollwise.train.rank); a rank
keeps the first command's micro-batches for the second (`KeptBatches`) and fills in the loss weights and the
advantages the controller sent with it (`with_weights`, `with_token_advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from rollwise.types.sample import Sample

__all__ = ["KeptBatches", "chunks_key", "token_advantages_of", "with_token_advantages", "with_weights"]


class _Batch(Protocol):
    advantages: Tensor
    weights: Tensor


B = TypeVar("B", bound=_Batch)  # MicroBatch, GroupMicroBatch, PackedGroupsMicroBatch (dataclasses)


def token_advantages_of(chunk: list[Sample]) -> Tensor | None:
    """A chunk's per-token advantages, flattened sample after sample as every collate flattens trained tokens (a
    sample without them: its sequence advantage on each token); None when no sample has them."""
    if all(s.token_advantages is None for s in chunk):
        return None
    return torch.tensor([a for s in chunk for a in (
        s.token_advantages if s.token_advantages is not None else [s.advantage] * s.trained_tokens)],
        dtype=torch.float32)


def with_token_advantages(batches: list[B], chunks: list[list[Sample]]) -> list[B]:
    """`batches` (the micro-batches of `chunks`, then a sharded rank's filler repeats of the first, as
    GRPOTrainer.collate_chunks builds them) with the chunks' per-token advantages, each on its batch's device."""
    out = []
    for i, mb in enumerate(batches):
        advantages = token_advantages_of(chunks[i] if i < len(chunks) else chunks[0])
        out.append(mb if advantages is None else replace(mb, advantages=advantages.to(mb.advantages.device)))
    return out


def with_weights(batches: list[B], chunks: list[list[Sample]], weights: Tensor) -> list[B]:
    """`batches` (as with_token_advantages') with the loss weights `weights` (flattened over the chunks' trained
    tokens, in order) as collate_chunks gives them: a filler repeat carries zeros."""
    out: list[B] = []
    offset = 0
    for i, mb in enumerate(batches):
        if i >= len(chunks):
            out.append(replace(mb, weights=torch.zeros_like(out[0].weights)))
            continue
        n_tokens = sum(s.trained_tokens for s in chunks[i])
        out.append(replace(mb, weights=weights[offset : offset + n_tokens].to(mb.weights.device)))
        offset += n_tokens
    return out


def chunks_key(chunks: list[list[Sample]], padding: int, idle: bool) -> tuple:
    """What makes two commands' micro-batches the same: the samples of each chunk, in order, and the filler."""
    return tuple(tuple(s.sample_id for s in chunk) for chunk in chunks), padding, idle


@dataclass
class KeptBatches:
    """A sharded rank's micro-batches of the step's first command, for its second (`key`: chunks_key)."""

    key: tuple
    batches: list
