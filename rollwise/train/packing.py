"""Shared-prompt micro-batches: one GRPO group (GroupMicroBatch: its prompt once, responses one to
a row or packed several to a row, train.pack_responses), or several groups in one forward
(PackedGroupsMicroBatch, train.pack_groups, issue 23 item 2).

A micro-batch of several groups runs their prompts once, as one right-padded batch, and then rows
of responses packed end to end (rollwise.types.microbatch.pack_responses), each row over its own
group's prompt KV with a block-diagonal causal mask. Fewer, larger micro-batches than one group
each: fewer gradient accumulations into every parameter and fewer [vocab, hidden] LM-head weight
gradients per step, and larger matmuls. Exact: a token attends to exactly what it attends to in
the one-group packed forward (its prompt and its own response's earlier tokens), at the same positions.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rollwise.train.logprobs import (DEFAULT_OPTIONS, RECOMPUTE_SHARE, LogprobOptions, backbone_of,
                                     lm_head_logprobs, shared_prompt_hidden)
from rollwise.train.routing_replay import ReplayBatch, group_batch
from rollwise.types.microbatch import pack_responses, prompt_groups
from rollwise.types.packed_layout import RowLayout, lay_out_rows, prefixed_attention_mask
from rollwise.types.sample import Sample

__all__ = ["GroupMicroBatch", "PackedGroupsMicroBatch", "collate_group", "collate_packed_groups",
           "packed_groups_hidden", "packed_groups_logprobs", "shared_prefix_hidden", "unmasked_rows"]


@dataclass
class GroupMicroBatch:
    """Samples of one GRPO group: one shared prompt, right-padded responses (prompt computed once),
    or, packed (train.pack_responses), several responses per row (see packed_groups_logprobs)."""

    prompt_ids: Tensor  # [P]
    responses: Tensor  # [G, R], or packed [rows, W]
    response_mask: Tensor  # [G, R] the loss mask (packed: True on response tokens)
    behaviour_logp: Tensor  # [N]
    advantages: Tensor  # [N]
    weights: Tensor  # [N]
    padding: bool = False
    routing: ReplayBatch | None = None
    segment_start: Tensor | None = None  # packed: [rows, W] column where each token's response starts, -1 padding
    order: Tensor | None = None  # packed: [N] flat index into [rows, W] of each response token, in sample order
    # Each trained token's sample (0..num_seqs-1) and sampling policy version (rollwise.train.policy_loss)
    seq_index: Tensor | None = None
    versions: Tensor | None = None
    num_seqs: int = 0

    def logprobs(self, model: nn.Module, options: LogprobOptions) -> tuple[Tensor, Tensor]:
        hidden, targets = self.hidden(backbone_of(model))
        return lm_head_logprobs(hidden, model.get_output_embeddings(), targets, options)

    def hidden(self, backbone: nn.Module) -> tuple[Tensor, Tensor]:
        """(hidden states [N, H] that predict the trained tokens, those tokens [N]), in the loss's order: what
        the LM head (logprobs) or the critic's value head (rollwise.train.critic) reads."""
        if self.order is not None:  # packed: the several-groups forward with this one group
            prompt_len = torch.tensor([self.prompt_ids.shape[0]], device=self.prompt_ids.device)
            row_group = torch.zeros(self.responses.shape[0], dtype=torch.long, device=self.responses.device)
            return packed_groups_hidden(backbone, self.prompt_ids[None], prompt_len, self.responses, row_group,
                                        self.segment_start, self.order)
        return shared_prompt_hidden(backbone, self.prompt_ids, self.responses, self.response_mask)

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())


def collate_group(samples: list[Sample], weights: Tensor, pad_id: int, pack: bool = False) -> GroupMicroBatch:
    if pack:
        return collate_packed_group(samples, weights, pad_id)
    length = max(len(s.response_ids) for s in samples)
    responses = torch.full((len(samples), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.bool)
    for row, s in enumerate(samples):
        responses[row, : len(s.response_ids)] = torch.tensor(s.response_ids)
        mask[row, : len(s.response_ids)] = True
    return GroupMicroBatch(
        prompt_ids=torch.tensor(samples[0].prompt_ids),
        responses=responses,
        response_mask=mask,
        behaviour_logp=torch.tensor([lp for s in samples for lp in s.behaviour_logprobs], dtype=torch.float32),
        advantages=torch.tensor([s.advantage for s in samples for _ in s.response_ids], dtype=torch.float32),
        weights=weights,
        routing=group_batch(samples, length),
    )


def collate_packed_group(samples: list[Sample], weights: Tensor, pad_id: int) -> GroupMicroBatch:
    """One group's responses laid end to end in rows as wide as the longest (pack_responses)."""
    rows, width = pack_responses([len(s.response_ids) for s in samples])
    layout = lay_out_rows(rows, [len(s.response_ids) for s in samples], width)
    tokens = _laid_out(samples, layout, width, pad_id)
    segment_start = layout.segment_start
    return GroupMicroBatch(
        prompt_ids=torch.tensor(samples[0].prompt_ids),
        responses=tokens,
        response_mask=segment_start >= 0,
        behaviour_logp=torch.tensor([lp for s in samples for lp in s.behaviour_logprobs], dtype=torch.float32),
        advantages=torch.tensor([s.advantage for s in samples for _ in s.response_ids], dtype=torch.float32),
        weights=weights,
        segment_start=segment_start,
        order=torch.cat(layout.place),
    )


@dataclass
class PackedGroupsMicroBatch:
    """Samples of one or more groups: prompts once, responses several to a row (see module doc)."""

    prompts: Tensor  # [groups, P] right-padded prompts
    prompt_lens: Tensor  # [groups]
    tokens: Tensor  # [rows, W] responses laid end to end, padding after them
    row_group: Tensor  # [rows] the group (prompt) of each row
    segment_start: Tensor  # [rows, W] column where each token's response starts, -1 on padding
    order: Tensor  # [N] flat index into [rows, W] of each response token, in sample order
    behaviour_logp: Tensor  # [N]
    advantages: Tensor  # [N]
    weights: Tensor  # [N]
    padding: bool = False  # a sharded rank's zero-weight repeat (see rollwise.train.trainer.MicroBatch)
    routing: ReplayBatch | None = None  # never set: MoE routing replay takes the padded layout
    seq_index: Tensor | None = None  # as GroupMicroBatch's
    versions: Tensor | None = None
    num_seqs: int = 0

    def logprobs(self, model: nn.Module, options: LogprobOptions) -> tuple[Tensor, Tensor]:
        hidden, targets = self.hidden(backbone_of(model))
        return lm_head_logprobs(hidden, model.get_output_embeddings(), targets, options)

    def hidden(self, backbone: nn.Module) -> tuple[Tensor, Tensor]:
        """As GroupMicroBatch.hidden."""
        return packed_groups_hidden(backbone, self.prompts, self.prompt_lens, self.tokens, self.row_group,
                                    self.segment_start, self.order)

    @property
    def n_tokens(self) -> int:
        return int(self.order.numel())


def _long(ids) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.long)


def collate_packed_groups(samples: list[Sample], weights: Tensor, pad_id: int) -> PackedGroupsMicroBatch:
    """A micro-batch of whole groups (rollwise.types.microbatch.chunk_samples with pack_groups):
    each group's responses packed into rows as wide as the micro-batch's longest response."""
    groups = prompt_groups(samples)
    width = max(len(s.response_ids) for s in samples)
    prompt_width = max(len(g[0].prompt_ids) for g in groups)
    prompts = torch.full((len(groups), prompt_width), pad_id, dtype=torch.long)
    for g, members in enumerate(groups):
        prompts[g, : len(members[0].prompt_ids)] = _long(members[0].prompt_ids)
    rows: list[tuple[int, list[Sample]]] = []  # (group, the samples laid in the row)
    for g, members in enumerate(groups):
        layout, _ = pack_responses([len(s.response_ids) for s in members], width)
        rows.extend((g, [members[i] for i in row]) for row in layout)
    position = {id(s): k for k, s in enumerate(samples)}
    layout = lay_out_rows([[position[id(s)] for s in members] for _, members in rows],
                          [len(s.response_ids) for s in samples], width)
    tokens = _laid_out(samples, layout, width, pad_id)
    return PackedGroupsMicroBatch(
        prompts=prompts,
        prompt_lens=_long([len(g[0].prompt_ids) for g in groups]),
        tokens=tokens,
        row_group=_long([g for g, _ in rows]),
        segment_start=layout.segment_start,
        # the loss weights come flattened in the chunk's sample order: so do the tokens
        order=torch.cat(layout.place),
        behaviour_logp=torch.tensor([float(lp) for s in samples for lp in s.behaviour_logprobs], dtype=torch.float32),
        advantages=torch.tensor([s.advantage for s in samples for _ in range(len(s.response_ids))],
                                dtype=torch.float32),
        weights=weights,
    )


def _laid_out(samples: list[Sample], layout: RowLayout, width: int, pad_id: int) -> Tensor:
    """[rows, W] the samples' response tokens where `layout` places them, padding elsewhere."""
    tokens = torch.full((layout.segment_start.shape[0], width), pad_id, dtype=torch.long)
    flat = tokens.view(-1)
    for s, place in zip(samples, layout.place):
        flat[place] = _long(s.response_ids)
    return tokens


def unmasked_rows(prompts: Tensor, prompt_lens: Tensor, row_group: Tensor, segment_start: Tensor) -> bool:
    """Whether every prompt fills the padded prompt width, every row is one continuation filling the row
    (no packing, no padding) and every group has a row: then prompt + row is a plain causal sequence. A group
    with several rows computes its prompt once a row there: taken while that adds at most 1/RECOMPUTE_SHARE
    of the rows' tokens (long continuations, where the masked forward's memory grows with length squared)."""
    groups, prompt_width = prompts.shape
    rows, width = segment_start.shape
    return bool((prompt_lens == prompt_width).all() and (segment_start == 0).all()
                and torch.bincount(row_group, minlength=groups).all()
                and (rows - groups) * prompt_width * RECOMPUTE_SHARE <= rows * width)


def _causal_rows_hidden(backbone: nn.Module, prompts: Tensor, tokens: Tensor,
                        row_group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """shared_prefix_hidden when unmasked_rows: each row after its prompt as one causal sequence, with no
    attention mask, so SDPA takes its is_causal kernel. The continuation over the prompt's KV cache needs a
    [rows, 1, W, P + W] mask (queries offset from keys), which SDPA turns into a float copy per layer: memory
    that grows with the response length squared (issue 41 item 7). Same positions, same keys per token: the
    same values; the prompt's gradient sums over its rows, as through the shared KV."""
    prompt_width = prompts.shape[1]
    hidden = backbone(input_ids=torch.cat([prompts[row_group], tokens], dim=1), use_cache=False).last_hidden_state
    first_row = torch.stack([torch.nonzero(row_group == g)[0, 0] for g in range(prompts.shape[0])])
    offsets = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return hidden[first_row, :prompt_width], hidden[:, prompt_width:], offsets


def shared_prefix_hidden(
    backbone: nn.Module,
    prompts: Tensor,
    prompt_lens: Tensor,
    tokens: Tensor,
    row_group: Tensor,
    segment_start: Tensor,
    prompt_scope: AbstractContextManager | None = None,
    rows_scope: AbstractContextManager | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The shared-prefix forward: the prompts (prefixes) once, batched and right-padded, then the rows of
    continuations, each over its group's prompt KV (selected with grad, so gradients into a prompt sum over its
    rows, as in the padded forward). Continuation tokens sit at their own sequence's positions: prompt length +
    offset in their segment (segment_start: the column where each token's segment starts, -1 on padding).

    `prompt_scope` / `rows_scope` are entered around the prompt and the rows forward (the Tinker service's
    per-row LoRA adapters: the two forwards have different rows). Returns (prompt hidden [groups, P, H], row
    hidden [rows, W, H], each token's offset in its segment [rows, W]). Used by `packed_groups_logprobs` and by
    rollwise.service's forward_backward (datums that start with the same tokens)."""
    if prompt_scope is None and rows_scope is None and unmasked_rows(prompts, prompt_lens, row_group, segment_start):
        return _causal_rows_hidden(backbone, prompts, tokens, row_group)
    prompt_keys = torch.arange(prompts.shape[1], device=prompts.device)[None, :] < prompt_lens[:, None]
    with prompt_scope if prompt_scope is not None else nullcontext():
        prompt_out = backbone(input_ids=prompts, attention_mask=prompt_keys.long(), use_cache=True)
    cache = prompt_out.past_key_values
    cache.batch_select_indices(row_group)
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    offsets = torch.where(segment_start >= 0, cols[None, :] - segment_start, 0)
    with rows_scope if rows_scope is not None else nullcontext():
        response_hidden = backbone(
            input_ids=tokens, attention_mask=prefixed_attention_mask(prompt_keys[row_group], segment_start),
            position_ids=prompt_lens[row_group][:, None] + offsets, past_key_values=cache, use_cache=True,
        ).last_hidden_state
    return prompt_out.last_hidden_state, response_hidden, offsets


def packed_groups_logprobs(
    model: nn.Module,
    prompts: Tensor,
    prompt_lens: Tensor,
    tokens: Tensor,
    row_group: Tensor,
    segment_start: Tensor,
    order: Tensor,
    options: LogprobOptions = DEFAULT_OPTIONS,
) -> tuple[Tensor, Tensor]:
    """Log-probs (and entropy) of the response tokens of several groups, flattened by `order`: the prompts
    once, each response over its group's prompt KV (shared_prefix_hidden)."""
    hidden, targets = packed_groups_hidden(backbone_of(model), prompts, prompt_lens, tokens, row_group,
                                           segment_start, order)
    return lm_head_logprobs(hidden, model.get_output_embeddings(), targets, options)


def packed_groups_hidden(backbone: nn.Module, prompts: Tensor, prompt_lens: Tensor, tokens: Tensor,
                         row_group: Tensor, segment_start: Tensor, order: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden states [N, H] that predict the response tokens, those tokens [N]), flattened by `order`, from the
    shared-prefix forward of any decoder stack (a causal LM's, or the critic's: rollwise.train.critic)."""
    prompt_hidden, response_hidden, offsets = shared_prefix_hidden(
        backbone, prompts, prompt_lens, tokens, row_group, segment_start)
    # A response's first token is predicted by its prompt's last position, the others by the column before.
    hidden_size = response_hidden.shape[-1]
    last_prompt = prompt_hidden[torch.arange(prompts.shape[0], device=prompts.device), prompt_lens - 1]
    shifted = torch.cat([response_hidden[:, :1], response_hidden[:, :-1]], dim=1)
    first = (offsets == 0)[..., None]
    predictors = torch.where(first, last_prompt[row_group][:, None, :], shifted).reshape(-1, hidden_size)
    return predictors[order], tokens.reshape(-1)[order]
