"""How a train step cuts its samples into micro-batches, and how many token positions it computes.

Pure (no torch): the trainer (rollwise.train.trainer) runs these micro-batches, and the simulator's
trainer model (rollwise.sim.cost) prices a step by `computed_tokens` without importing the trainer.
"""

from __future__ import annotations

from typing import Protocol

from rollwise.types.sample import Sample


class MicroBatchSettings(Protocol):
    """The fields of the train section (rollwise.config.TrainConfig) that micro-batching reads."""

    micro_batch_size: int
    share_prompt_prefix: bool


def chunk_samples(samples: list[Sample], cfg: MicroBatchSettings) -> tuple[bool, list[list[Sample]]]:
    """The micro-batches a train step runs: (whether they share their prompt, the samples of each)."""
    samples = [s for s in samples if s.trained_tokens]
    # The shared-prompt forward uses the response mask as attention mask; multi-turn samples
    # (loss mask 0 on tool/template tokens the model must still attend to) take the padded forward.
    share = cfg.share_prompt_prefix and all(s.loss_mask is None for s in samples)
    if share:
        # Samples with the same prompt (a GRPO group) go together: the prompt is computed once.
        by_prompt: dict[tuple[int, ...], list[Sample]] = {}
        for s in samples:
            by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
        samples = [s for group in by_prompt.values() for s in group]
    chunks: list[list[Sample]] = []
    for s in samples:
        same_prompt = chunks and chunks[-1][0].prompt_ids == s.prompt_ids
        if chunks and len(chunks[-1]) < cfg.micro_batch_size and (same_prompt or not share):
            chunks[-1].append(s)
        else:
            chunks.append([s])
    return share, chunks


def computed_tokens(samples: list[Sample], cfg: MicroBatchSettings) -> int:
    """Token positions the forward/backward computes, padding included: a shared-prompt micro-batch
    is its prompt once + rows x its longest response; a padded one is rows x its longest sequence.
    The train step's time follows this, not the sum of sample lengths (the simulator's trainer model
    uses it: sorted mode's early-finished groups pad to shorter lengths and train faster)."""
    share, chunks = chunk_samples(samples, cfg)
    if share:
        return sum(len(c[0].prompt_ids) + len(c) * max(len(s.response_ids) for s in c) for c in chunks)
    return sum(len(c) * max(len(s.prompt_ids) + len(s.response_ids) for s in c) for c in chunks)
