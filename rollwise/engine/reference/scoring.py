"""`Engine.score_tokens` on the reference engine: a call's sequences packed into forwards of at most
SCORE_BATCH_TOKENS tokens (rollwise.engine.scoring.prefix_batches: sequences sharing a prefix together), each one
forward with no KV cache (LlamaFamilyModel.packed_logprobs: the prefill's ops, fp32 log-softmax), under the base
weights or the default adapter, as a request without an adapter would sample.

A forward's sequences lie end to end in rows (rollwise.types.microbatch.pack_responses, the trainer's packer), each
token attending causally within its own sequence at its own positions (rollwise.types.packed_layout): the values of
one sequence scored alone, with one forward's matmuls for the lot. Sequences that share their unscored prefix (a GRPO
group's prompt) compute it once (shared_prefix_forward)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollwise.engine.reference.lora import AdapterSet
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.scoring import check_score_request, prefix_batches
from rollwise.types.microbatch import pack_responses
from rollwise.types.packed_layout import lay_out_rows, packed_attention_mask, prefixed_attention_mask
from rollwise.types.score import ScoreSequence


class ReferenceScoring:
    """Mixed into ReferenceEngine (which holds these attributes)."""

    model: LlamaFamilyModel
    adapters: AdapterSet
    max_model_len: int

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        """Per sequence, log p(token_ids[i] | token_ids[:i]) at `temperature` for i in start..len-1
        (rollwise.engine.scoring)."""
        check_score_request(sequences, temperature, max_model_len=self.max_model_len,
                            vocab_size=self.model.config.shape.vocab_size)
        out: list[list[float]] = [[] for _ in sequences]
        for batch in prefix_batches(sequences, max_sequences=len(sequences)):  # a group's prompt computed once
            with self.adapters.rows([self.adapters.resolve(None)]):
                scores = self._packed_forward([sequences[i] for i in batch], temperature)
            if not bool(scores.isfinite().all()):  # a token of probability 0 at a temperature near 0: JSON has no -inf
                raise ValueError(f"score: temperature={temperature} gives a token log-prob that is not finite (the "
                                 "token has probability 0 at this temperature): score at a higher temperature")
            for i, part in zip(batch, scores.split([len(sequences[i].token_ids) - sequences[i].start for i in batch])):
                out[i] = part.tolist()
        return out

    def _packed_forward(self, sequences: list[ScoreSequence], temperature: float) -> Tensor:
        """The scored tokens' log-probs of `sequences`, one after another, from one packed forward."""
        f = shared_prefix_forward(sequences)
        return self.model.packed_logprobs(f.token_ids, f.positions, f.place, f.mask, f.predictors, f.targets,
                                          temperature=temperature, keys=f.keys)


@dataclass
class PackedForward:
    """The arguments of LlamaFamilyModel.packed_logprobs for a batch of sequences (see shared_prefix_forward)."""

    token_ids: Tensor  # [T] each token computed once
    positions: Tensor  # [T]
    place: Tensor  # [T] flat index of each token's query slot in [rows, W]
    mask: Tensor  # [rows, 1, W, Wk]
    keys: Tensor | None  # [rows, Wk] token at each key slot (-1: none); None: the keys are the queries' layout
    predictors: Tensor  # [N] the token predicting each scored token
    targets: Tensor  # [N] the scored tokens, sequence after sequence


def shared_prefix_forward(sequences: list[ScoreSequence]) -> PackedForward:
    """Sequences whose unscored prefix (token_ids[:start]: a GRPO group's prompt) is the same compute it once: the
    prefix is a segment of its own, and each continuation (token_ids[start:]) sits in a row of its group whose keys
    are that prefix's, then the row's own (rollwise.types.packed_layout.prefixed_attention_mask), at positions
    prefix length + offset: the prompt's KV shared as the trainer's shared_prefix_hidden shares it, here without a
    KV cache. Other sequences are segments whole. Segments of a group are packed in rows (pack_responses) as wide as
    the longest segment. Each token attends to exactly its own sequence's earlier tokens at its own positions."""
    by_prefix: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(sequences):
        by_prefix.setdefault(tuple(s.token_ids[: s.start]), []).append(i)
    shared = [members for members in by_prefix.values() if len(members) > 1]
    # segments: (tokens, first position, group: -1 for none, else an index into `shared`)
    segments: list[tuple[list[int], int, int]] = []
    prefix_segment: list[int] = []
    whole_segment: dict[int, int] = {}  # a sequence computed whole -> its segment
    for members in by_prefix.values():
        if len(members) == 1:
            whole_segment[members[0]] = len(segments)
            segments.append((sequences[members[0]].token_ids, 0, -1))
    for members in shared:
        prefix_segment.append(len(segments))
        segments.append((sequences[members[0]].token_ids[: sequences[members[0]].start], 0, -1))
    continuation_segment: dict[int, int] = {}
    for g, members in enumerate(shared):
        for i in members:
            continuation_segment[i] = len(segments)
            segments.append((sequences[i].token_ids[sequences[i].start :], sequences[i].start, g))
    lengths = [len(tokens) for tokens, _, _ in segments]
    first = torch.tensor([0, *lengths]).cumsum(0).tolist()  # each segment's first token in the flat T
    width = max(lengths)
    rows: list[list[int]] = []
    row_group: list[int] = []
    for g in range(-1, len(shared)):
        members = [k for k, (_, _, group) in enumerate(segments) if group == g]
        layout, _ = pack_responses([lengths[k] for k in members], width) if members else ([], width)
        rows.extend([members[j] for j in row] for row in layout)
        row_group.extend([g] * len(layout))
    layout = lay_out_rows(rows, lengths, width)
    place = torch.cat(layout.place)
    positions = torch.cat([start + torch.arange(n) for (_, start, _), n in zip(segments, lengths)])
    token_ids = torch.tensor([t for tokens, _, _ in segments for t in tokens])
    targets = torch.tensor([t for s in sequences for t in s.token_ids[s.start:]])
    predictors: list[Tensor] = []
    for i, s in enumerate(sequences):
        if i in whole_segment:
            predictors.append(first[whole_segment[i]] + torch.arange(s.start - 1, len(s.token_ids) - 1))
        else:  # the continuation's first token after the prefix's last, the rest after their own column before
            k, p = continuation_segment[i], prefix_segment[segments[continuation_segment[i]][2]]
            predictors.append(torch.cat([torch.tensor([first[p] + lengths[p] - 1]),
                                         first[k] + torch.arange(lengths[k] - 1)]))
    if not shared:
        return PackedForward(token_ids, positions, place, packed_attention_mask(layout.segment_start), None,
                             torch.cat(predictors), targets)
    prefix_width = max(lengths[p] for p in prefix_segment)
    keys = torch.full((len(rows), prefix_width + width), -1, dtype=torch.long)
    for r, g in enumerate(row_group):
        if g >= 0:
            p = prefix_segment[g]
            keys[r, : lengths[p]] = first[p] + torch.arange(lengths[p])
    own = torch.full((len(rows) * width,), -1, dtype=torch.long)
    own[place] = torch.arange(len(token_ids))
    keys[:, prefix_width:] = own.view(len(rows), width)
    mask = prefixed_attention_mask(keys[:, :prefix_width] >= 0, layout.segment_start)
    return PackedForward(token_ids, positions, place, mask, keys, torch.cat(predictors), targets)
