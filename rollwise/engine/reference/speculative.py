"""Speculative decoding for the reference engine: draft tokens from rollout history
(rollwise.engine.speculation), verified exactly against the current weights in one forward.

`Speculation` is a component ReferenceEngine (rollwise.engine.reference.engine) holds when it has a drafter:
built with the model, the drafter, max_model_len, the engine's counters and the two engine steps it reuses
(`processed_logits`, `record`). The KV cache is an argument of `decode`, not stored: the engine frees and
re-allocates it on sleep/wake.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from rollwise.engine.reference.sampling import sample_one, scaled_logprobs, top_logprobs, verify_draft_token
from rollwise.engine.speculation.drafter import Drafter
from rollwise.types.generation import Completion

if TYPE_CHECKING:
    from rollwise.engine.reference.scheduler import Sequence
    from rollwise.engine.reference.model import KVCache, LlamaFamilyModel


class Speculation:
    """Draft, verify and accept (see the module docstring); ReferenceEngine._decode calls `decode`."""

    def __init__(self, model: LlamaFamilyModel, drafter: Drafter, max_model_len: int, stats: dict[str, int],
                 processed_logits: Callable[[list[Sequence], Tensor], Tensor],
                 record: Callable[[Sequence, int, float, list[tuple[int, float]]], Completion | None]) -> None:
        self.model = model
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.stats = stats  # the engine's spec_stats, counted here
        self.processed_logits = processed_logits  # min_tokens and penalties, as a plain decode step applies them
        self.record = record  # append one sampled token (and retire the sequence it finishes)

    def decode(self, cache: KVCache, seqs: list[Sequence]) -> list[Completion] | None:
        """One speculative decode step over `seqs`; None (nothing done) when no sequence has a draft."""
        drafts = [self._draft(seq, len(seqs)) for seq in seqs]
        return self._verify(cache, seqs, drafts) if any(drafts) else None

    def _draft(self, seq: Sequence, running: int) -> list[int]:
        """The drafter's proposal for `seq`, within its length-aware budget and what it may still emit
        (one verification step emits up to len(draft) + 1 tokens)."""
        params, generated = seq.request.params, len(seq.token_ids)
        room = min(params.max_tokens - generated, self.max_model_len - len(seq.request.prompt_ids) - generated) - 1
        k = min(room, self.drafter.budget_for(seq.request.prompt_ids, generated, running))
        return self.drafter.propose(seq.request.prompt_ids, seq.token_ids, k) if k > 0 else []

    def _verify(self, cache: KVCache, seqs: list[Sequence], drafts: list[list[int]]) -> list[Completion]:
        """One forward over each sequence's last token and its draft; then, per sequence, accept draft
        tokens one by one with exact speculative sampling (sampling.verify_draft_token) until one is
        replaced or the sequence finishes, plus one token from the target after a fully accepted draft.
        Every emitted token's logprob is read off the same processed distribution a plain decode step
        would use at that position, under the current weights."""
        chunks = [[seq.token_ids[-1], *draft] for seq, draft in zip(seqs, drafts)]
        logits = self.model.extend(cache, chunks, [seq.slot for seq in seqs])
        finished, row = [], 0
        for seq, draft in zip(seqs, drafts):
            rows, row = logits[row : row + len(draft) + 1], row + len(draft) + 1
            done = self._accept(seq, draft, rows)
            # Roll the KV back to what was kept: every token but the last (which has no KV yet).
            cache.lengths[seq.slot] = len(seq.request.prompt_ids) + len(seq.token_ids) - 1
            if done is not None:
                finished.append(done)
        return finished

    def _accept(self, seq: Sequence, draft: list[int], rows: Tensor) -> Completion | None:
        params = seq.request.params
        self.stats["verifications"] += bool(draft)
        self.stats["drafted"] += len(draft)
        for j, row in enumerate(rows):
            logprobs = scaled_logprobs(self.processed_logits([seq], row[None]), [params])[0]
            if j < len(draft):
                token, accepted = verify_draft_token(logprobs, params, draft[j], seq.generator)
                self.stats["accepted" if accepted else "rejected"] += 1
            else:
                token, accepted = sample_one(logprobs, params, seq.generator), False
            top = top_logprobs(logprobs, params.top_logprobs) if params.top_logprobs else []
            done = self.record(seq, token, float(logprobs[token]), top)
            if done is not None or not accepted:
                # Drafts after a finish or a replaced token are discarded (counted as neither).
                return done
        return None


def speculation_metrics(stats: Mapping[str, int], drafter: Drafter | None) -> dict[str, float]:
    """Drafted, accepted and rejected tokens so far; acceptance rate = accepted / drafted; mean
    accepted length per verification (one sequence's draft checked in one forward); the drafter's memory."""
    out: dict[str, float] = {f"spec_{k}": float(v) for k, v in stats.items()}
    out["spec_acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0
    out["spec_mean_accepted_length"] = stats["accepted"] / stats["verifications"] if stats["verifications"] else 0.0
    if drafter is not None:
        out.update({f"spec_history_{k}": float(v) for k, v in drafter.memory().items()})
    return out
