"""The forwards behind the per-token advantages (train.advantage=gae, train.kl_penalty=reward), run on the policy's
own micro-batches (issue 41, the trainer's step cost).

The reference's log-probs (the KL folded into the reward) and the critic's values are read at the trained tokens of
the same micro-batches the policy's update runs (rollwise.train.trainer.GRPOTrainer.collate_chunks: a group's
prompt once, responses packed), not on right-padded rows that repeat the prompt on every row. Each micro-batch's
trained tokens are flattened sample after sample in its chunk's order (rollwise.train.trainer.token_owners), so its
results split back per sample by the samples' trained-token counts.

- The reference: no graph (inference mode), the log-probs alone (no entropy: LogprobOptions.entropy=False), and,
  when the trainer autocasts, its linear layers' weights kept in the compute dtype (`keep_linears_in`): autocast
  would otherwise cast every weight again at every micro-batch (it caches casts only of weights that require grad).
  The values are the same: autocast rounds a float32 weight to the compute dtype exactly as the one-time cast does.
- The critic: at train.updates_per_step=1 one forward per micro-batch, with grad (Critic.values_and_update: GAE is
  per sample, so each micro-batch's values give its own returns and its value loss is backpropagated at once);
  with more updates a step, `values` now and `update` after the policy's (its several epochs re-run forwards).

The sharded trainer's ranks (rollwise.train.rank) run this same class on their own micro-batches. Those are the
step's one collation: the policy's update runs the same batches, the advantages filled in (rollwise.train.step_batches).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor, nn

from rollwise.train.critic import Critic, PredictorBatch
from rollwise.train.logprobs import LogprobOptions
from rollwise.train.token_advantages import gae_returns, kl_estimate
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig

__all__ = ["StepTimes", "TokenForwards", "TokenInputs", "in_order", "keep_linears_in", "per_batch", "per_sample"]


@dataclass
class StepTimes:
    """Where a train step's seconds beyond the policy's went (step metrics): the reference's forwards (the KL in the
    reward or in the loss) and the critic's (values and update)."""

    time_ref_s: float = 0.0
    time_critic_s: float = 0.0

    def take(self) -> dict[str, float]:
        """The step's times, and zero again for the next step."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, 0.0)
        return out

    @contextmanager
    def timing(self, name: str, device: torch.device) -> Iterator[None]:
        """Adds the block's seconds to `name`; on CUDA after its kernels finished (the queue is asynchronous)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)


@dataclass
class TokenInputs:
    """One step's forwards, per sample (by id(sample)): the KL estimates to fold into the reward and the critic's
    values, before this step's update (None: not used); the critic's update metrics when it already stepped."""

    kl: dict[int, Tensor] | None
    values: dict[int, Tensor] | None
    critic_metrics: dict[str, float] = field(default_factory=dict)
    critic_updated: bool = False


def per_sample(chunks: list[list[Sample]], per_batch_tokens: list[Tensor]) -> dict[int, Tensor]:
    """Per-micro-batch tensors over trained tokens (chunk i's samples in order) by id(sample); a sharded rank's
    filler batches after its chunks are ignored."""
    out: dict[int, Tensor] = {}
    for chunk, tokens in zip(chunks, per_batch_tokens):
        for s, part in zip(chunk, torch.split(tokens, [s.trained_tokens for s in chunk])):
            out[id(s)] = part
    return out


def in_order(samples: list[Sample], by_id: dict[int, Tensor] | None) -> list[Tensor] | None:
    """One tensor per sample of `samples`; a sample no micro-batch holds (no trained tokens) gets an empty one."""
    return None if by_id is None else [by_id.get(id(s), torch.zeros(0)) for s in samples]


def per_batch(chunks: list[list[Sample]], by_id: dict[int, Tensor], padding: int = 0) -> list[Tensor]:
    """The inverse of per_sample: each chunk's samples' tensors concatenated, plus `padding` repeats of the first."""
    out = [torch.cat([by_id[id(s)] for s in chunk]) for chunk in chunks]
    return out + out[:1] * padding


def keep_linears_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen model's linear layers (LM head included) in `dtype`, the rest (embeddings, norms) as they are: under
    autocast to `dtype` it computes exactly what the float32 model computes, without casting its weights each time.
    A tied LM head gets its own copy (the input embeddings stay float32, as autocast leaves them)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embeddings is not None and head.weight is embeddings.weight:
        head.weight = nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.to(dtype)
    return model


class TokenForwards:
    def __init__(self, cfg: TrainConfig, ref_model: nn.Module | None, critic: Critic | None,
                 compute: Callable[[], AbstractContextManager], options: LogprobOptions, device: torch.device) -> None:
        self.cfg, self.ref_model, self.critic, self.compute = cfg, ref_model, critic, compute
        self.options = replace(options, entropy=False)  # the reference's entropy is never read
        self.device = device
        self.times = StepTimes()

    @property
    def needed(self) -> bool:
        """Whether `run` runs any forward (train.teacher's per-token rewards alone need none)."""
        return self.critic is not None or (self.ref_model is not None and self.cfg.kl_penalty == "reward")

    def run(self, chunks: list[list[Sample]], batches: list[PredictorBatch], n_tokens: int) -> TokenInputs:
        """The reference's KL (train.kl_penalty=reward) and the critic's values (gae) on `batches`, the micro-batches
        of `chunks` (plus a sharded rank's filler after them); at train.updates_per_step=1 the critic's update too,
        its value loss over `n_tokens` (the whole batch's trained tokens, on every rank)."""
        kl = None
        if self.ref_model is not None and self.cfg.kl_penalty == "reward":
            with self.times.timing("time_ref_s", self.device):
                kl = per_sample(chunks, self.reference_kl(batches))
        if self.critic is None:
            return TokenInputs(kl, None)
        with self.times.timing("time_critic_s", self.device):
            if self.cfg.updates_per_step > 1:  # its epochs re-run forwards after the policy's: Critic.update then
                return TokenInputs(kl, per_sample(chunks, [v.cpu() for v in self.critic.values(batches, self.compute)]))

            def returns_of(i: int, values: Tensor) -> Tensor:
                chunk = chunks[i] if i < len(chunks) else chunks[0]  # a filler repeats the first
                return gae_returns(chunk, self.cfg, None if kl is None else [kl[id(s)] for s in chunk], values)

            values, metrics = self.critic.values_and_update(batches, returns_of, self.compute, n_tokens)
        return TokenInputs(kl, per_sample(chunks, values), metrics, critic_updated=True)

    def reference_kl(self, batches: list[PredictorBatch]) -> list[Tensor]:
        """Per micro-batch, on the CPU: the KL estimate of the sampling policy (the behaviour log-probs) against the
        reference at each trained token. A filler batch (weight 0) is not run: zeros."""
        out = []
        with torch.inference_mode():
            for mb in batches:
                if mb.padding:
                    out.append(torch.zeros(mb.behaviour_logp.shape))
                    continue
                with self.compute():
                    logp, _ = mb.logprobs(self.ref_model, self.options)
                out.append(kl_estimate(mb.behaviour_logp, logp.float(), self.cfg.kl_estimator).cpu())
        return out

    def reference_logprobs(self, mb: PredictorBatch) -> Tensor:
        """The reference's log-probs of a micro-batch's trained tokens for the KL in the loss (no graph; not
        inference mode: the loss reads them in its graph)."""
        with self.times.timing("time_ref_s", self.device), torch.no_grad(), self.compute():
            logp, _ = mb.logprobs(self.ref_model, self.options)
        return logp.float()
