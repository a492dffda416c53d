"""Packed rows for supervised fine-tuning: conversations laid end to end in rows of `sft.pack_tokens`
tokens, each attending only to its own earlier tokens and sitting at its own positions (0, 1, ...), so a
packed forward gives every token exactly the log-prob it has alone, and a row costs its tokens, not a
padded batch's longest conversation.

Rows are filled first-fit, longest first (rollwise.types.microbatch.pack_responses, the same bin packing the
RL trainer packs responses with); log-probs come from the trainer's chunked LM head
(rollwise.train.logprobs.lm_head_logprobs), so no [tokens, vocab] tensor is ever whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rollwise.tasks.chat_jsonl import TokenizedChat
from rollwise.train.logprobs import DEFAULT_OPTIONS, LogprobOptions, backbone_of, lm_head_logprobs
from rollwise.types.microbatch import pack_responses
from rollwise.types.packed_layout import lay_out_rows, packed_attention_mask


@dataclass
class PackedRows:
    input_ids: Tensor  # [R, W] conversations end to end, padding after them
    position_ids: Tensor  # [R, W] each conversation's own positions
    attention_mask: Tensor  # [R, 1, W, W] bool: causal within a conversation only
    target_mask: Tensor  # [R, W] True where the token is trained (assistant, not a conversation's first token)

    @property
    def n_tokens(self) -> int:
        return int(self.target_mask.sum())


def cut(chats: list[TokenizedChat], pack_tokens: int) -> tuple[list[TokenizedChat], int]:
    """Conversations cut to `pack_tokens` (those left with no trained token dropped), and how many were cut."""
    kept, n_cut = [], 0
    for c in chats:
        if len(c.input_ids) > pack_tokens:
            n_cut += 1
            c = TokenizedChat(c.line, c.input_ids[:pack_tokens], c.loss_mask[:pack_tokens])
        if sum(c.loss_mask[1:]):
            kept.append(c)
    return kept, n_cut


def pack_rows(chats: list[TokenizedChat], pack_tokens: int) -> list[list[TokenizedChat]]:
    """The conversations (each at most pack_tokens long: see `cut`) grouped into rows of pack_tokens tokens."""
    if not chats:
        return []
    layout, _ = pack_responses([len(c.input_ids) for c in chats], pack_tokens)
    return [[chats[i] for i in row] for row in layout]


def collate_rows(rows: list[list[TokenizedChat]], pad_id: int) -> PackedRows:
    chats = [c for row in rows for c in row]
    lengths = [len(c.input_ids) for c in chats]
    numbered = iter(range(len(chats)))  # the chats' indices, row after row
    layout_rows = [[next(numbered) for _ in row] for row in rows]
    width = max(sum(len(c.input_ids) for c in row) for row in rows)
    layout = lay_out_rows(layout_rows, lengths, width)
    input_ids = torch.full((len(rows) * width,), pad_id, dtype=torch.long)
    position_ids = torch.zeros(len(rows) * width, dtype=torch.long)
    target_mask = torch.zeros(len(rows) * width, dtype=torch.bool)
    for chat, place in zip(chats, layout.place):
        input_ids[place] = torch.tensor(chat.input_ids)
        position_ids[place] = torch.arange(len(place))
        target_mask[place[1:]] = torch.tensor(chat.loss_mask[1:], dtype=torch.bool)
    shape = (len(rows), width)
    return PackedRows(input_ids.view(shape), position_ids.view(shape),
                      packed_attention_mask(layout.segment_start), target_mask.view(shape))


def packed_logprobs(model: nn.Module, batch: PackedRows,
                    options: LogprobOptions = DEFAULT_OPTIONS) -> tuple[Tensor, Tensor]:
    """(log-prob, entropy) of every trained token of the rows, flattened row-major. Token t of a
    conversation is predicted by the hidden state at t - 1 of the same conversation."""
    device = next(model.parameters()).device
    hidden = backbone_of(model)(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                                position_ids=batch.position_ids.to(device)).last_hidden_state
    predict = batch.target_mask[:, 1:].to(device)
    targets = batch.input_ids.to(device)[:, 1:][predict]
    return lm_head_logprobs(hidden[:, :-1][predict], model.get_output_embeddings(), targets, options)
