"""Proof of token-in/token-out for a trajectory: what the engine sampled == what the trainer gets.

RecordingGenerator sits between a session and its real generator and keeps every (prompt, completion)
the engine actually produced. verify_trajectory then checks, turn by turn:

- the engine's prompt was exactly the trajectory's ids before the turn (so the engine continued
  from its own sampled tokens, and every prompt is a prefix of the next within a segment);
- the trajectory's span holds exactly the sampled ids, logprobs and policy versions;
- the loss mask is 1 on exactly those spans, and nowhere else;
- optionally, the trainer's own recompute of the logprobs on the trajectory's ids (the model the
  trainer holds) agrees with the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollwise.agent.generator import Generator, GeneratorInfo
from rollwise.agent.trajectory import Trajectory
from rollwise.types.generation import Completion, SamplingParams


class RecordingGenerator:
    """Passes every call to the real generator and keeps what came back."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], SamplingParams, Completion]] = []

    def info(self) -> GeneratorInfo:
        return self.inner.info()

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> Completion:
        completion = self.inner.generate(prompt_ids, params, session_id)
        self.calls.append((list(prompt_ids), params, completion))
        return completion


@dataclass
class TurnCheck:
    turn: int
    segment: int
    prompt_tokens: int
    sampled_tokens: int
    finish_reason: str
    prompt_is_prefix: bool
    ids_equal: bool
    logprobs_equal: bool
    versions_equal: bool
    retokenization_drift: bool
    trainer_max_abs_logprob_diff: float | None = None


@dataclass
class TitoReport:
    turns: list[TurnCheck] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    masked_tokens: int = 0  # mask-1 tokens in the trajectory
    sampled_tokens: int = 0  # tokens the engine returned

    @property
    def ok(self) -> bool:
        return not self.violations


def verify_trajectory(trajectory: Trajectory, calls: list[tuple[list[int], SamplingParams, Completion]],
                      model: Any = None, logprob_tol: float = 1e-3) -> TitoReport:
    report = TitoReport(splits=trajectory.splits)
    spans = {span.request_id: (i, seg, span) for i, seg in enumerate(trajectory.segments) for span in seg.spans}
    for s_index, segment in enumerate(trajectory.segments):
        try:
            segment.check()
        except AssertionError as exc:
            report.violations.append(f"segment {s_index}: {exc}")
    for turn, (prompt, params, c) in enumerate(calls):
        report.sampled_tokens += len(c.token_ids)
        if c.request_id not in spans:
            report.violations.append(f"turn {turn}: the engine's sample {c.request_id} is not in the trajectory")
            continue
        s_index, seg, span = spans[c.request_id]
        check = TurnCheck(
            turn=turn, segment=s_index, prompt_tokens=len(prompt), sampled_tokens=len(c.token_ids),
            finish_reason=c.finish_reason,
            prompt_is_prefix=seg.token_ids[: span.start] == prompt,
            ids_equal=seg.token_ids[span.start: span.end] == list(c.token_ids),
            logprobs_equal=seg.logprobs[span.start: span.end] == list(c.logprobs),
            versions_equal=seg.versions[span.start: span.end] == list(c.versions),
            retokenization_drift=span.retokenization_drift,
        )
        for name in ("prompt_is_prefix", "ids_equal", "logprobs_equal", "versions_equal"):
            if not getattr(check, name):
                report.violations.append(f"turn {turn}: {name.replace('_', ' ')} is false")
        if model is not None and c.token_ids:
            temperature = params.temperature or 1.0
            check.trainer_max_abs_logprob_diff = _trainer_diff(model, seg.token_ids, span.start, span.end,
                                                               c.logprobs, temperature)
            if check.trainer_max_abs_logprob_diff > logprob_tol:
                report.violations.append(f"turn {turn}: trainer logprobs differ from the engine's by "
                                         f"{check.trainer_max_abs_logprob_diff:.2e} (> {logprob_tol:g})")
        report.turns.append(check)
    report.masked_tokens = sum(sum(seg.loss_mask) for seg in trajectory.segments)
    if report.masked_tokens != report.sampled_tokens:
        report.violations.append(f"the loss mask covers {report.masked_tokens} tokens, the engine sampled "
                                 f"{report.sampled_tokens}")
    return report


@torch.no_grad()
def _trainer_diff(model: Any, ids: list[int], start: int, end: int, engine_logprobs: list[float],
                  temperature: float) -> float:
    """Max |logp_trainer - logp_engine| over one sampled span, with the trainer's own logprob code."""
    from rollwise.train.logprobs import LogprobOptions, sequence_logprobs

    input_ids = torch.tensor([ids[:end]])
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    mask[0, start:end] = True
    logp, _ = sequence_logprobs(model, input_ids, torch.ones_like(input_ids), mask, LogprobOptions(temperature))
    return float((logp - torch.tensor(engine_logprobs, dtype=logp.dtype)).abs().max())
