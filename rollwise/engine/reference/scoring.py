"""`Engine.score_tokens` on the reference engine: a call's sequences packed into forwards of at most
SCORE_BATCH_TOKENS tokens (rollwise.engine.scoring.score_batches), each one forward with no KV cache
(LlamaFamilyModel.packed_logprobs: the prefill's ops, fp32 log-softmax), under the base weights or the default
adapter, as a request without an adapter would sample.

A forward's sequences lie end to end in rows as wide as its longest (rollwise.types.microbatch.pack_responses, the
trainer's packer), each token attending causally within its own sequence at its own positions: the values of one
sequence scored alone, with one forward's matmuls for the lot."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rollwise.engine.reference.lora import AdapterSet
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.scoring import check_score_request, score_batches
from rollwise.types.microbatch import pack_responses
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
        for batch in score_batches([len(s.token_ids) for s in sequences], max_sequences=len(sequences)):
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
        rows, width = pack_responses([len(s.token_ids) for s in sequences])
        segment = torch.full((len(rows), width), -1, dtype=torch.long)  # column where each token's sequence starts
        base: list[int] = [0] * len(sequences)  # flat index of each sequence's first token in the [rows, W] layout
        for r, members in enumerate(rows):
            col = 0
            for i in members:
                n = len(sequences[i].token_ids)
                segment[r, col : col + n] = col
                base[i] = r * width + col
                col += n
        cols = torch.arange(width)
        # causal within a sequence; a padding query sees itself (no all-masked row: softmax would give NaN)
        mask = ((segment[:, :, None] == segment[:, None, :]) & (cols[:, None] >= cols[None, :])
                | torch.eye(width, dtype=torch.bool))[:, None]
        lengths = [len(s.token_ids) for s in sequences]
        place = torch.cat([b + torch.arange(n) for b, n in zip(base, lengths)])
        positions = torch.cat([torch.arange(n) for n in lengths])
        offsets = torch.tensor([0, *lengths]).cumsum(0)[:-1].tolist()  # each sequence's first token in the flat T
        predictors = torch.cat([o + torch.arange(s.start - 1, n - 1) for o, s, n in zip(offsets, sequences, lengths)])
        targets = torch.tensor([t for s in sequences for t in s.token_ids[s.start:]])
        return self.model.packed_logprobs(torch.tensor([t for s in sequences for t in s.token_ids]), positions,
                                          place, mask, predictors, targets, temperature=temperature)
