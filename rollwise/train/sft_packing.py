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
    width = max(sum(len(c.input_ids) for c in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    target_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for k, chat in enumerate(row):
            n = len(chat.input_ids)
            input_ids[r, col:col + n] = torch.tensor(chat.input_ids)
            position_ids[r, col:col + n] = torch.arange(n)
            target_mask[r, col + 1:col + n] = torch.tensor(chat.loss_mask[1:], dtype=torch.bool)
            segment[r, col:col + n] = k
            col += n
    cols = torch.arange(width)
    causal = cols[:, None] >= cols[None, :]
    same = segment[:, :, None] == segment[:, None, :]
    real = (segment >= 0)[:, :, None] & (segment >= 0)[:, None, :]
    # A padding position attends to itself only (a query row of all False would make softmax NaN).
    mask = (same & causal & real) | torch.eye(width, dtype=torch.bool)[None]
    return PackedRows(input_ids, position_ids, mask[:, None], target_mask)


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
