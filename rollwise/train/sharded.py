"""The sharded GRPO trainer: `trainer.world_size` FSDP2 data-parallel ranks behind one `Trainer`.

`ShardedTrainer` (this process, the controller side) implements rollwise.types.contracts.Trainer and
speaks for the group. It starts the ranks itself (torch.multiprocessing, spawn), one process per
rank, each holding 1/N of the parameters, gradients and optimizer state (rollwise.train.rank).
The same trainer drives ranks started elsewhere through `ShardedTrainer.over(group)`: Ray actors
(rollwise.control.ray.trainer_ranks) or torchrun-launched processes (rollwise.train.torchrun).

train.advantage=gae (the critic, sharded like the policy on each rank) and train.kl_penalty=reward add a round
before the update: rollwise.train.sharded_token_advantages.

A train step is exact: the controller weighs every trained token against the global batch (the
token or sequence count over all ranks), then deals the micro-batches to the ranks balanced by
token count; each rank runs GRPOTrainer's update on its share, and FSDP2 sums the gradients.
Ranks with fewer micro-batches run zero-weight repeats, since every rank must run as many forwards
as the others (FSDP's collectives). The full weights come back through the group (local ranks write
their shards into shared memory; remote ranks all-gather a bucket at a time, so no rank holds more
than one bucket of full tensors) and leave through the one checked weight path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rollwise.types.train_config import TrainConfig, TrainerConfig
from rollwise.train.checkpoint import load_rng_and_state, write_checkpoint
from rollwise.train.critic import SUMMED_OVER_RANKS
from rollwise.train.critic_layers import check_trainable_layers
from rollwise.train.grpo import token_weights
from rollwise.train.policy_loss import resolve_policy_loss
from rollwise.train.rank import RankWork
from rollwise.train.rank_group import ProcessRankGroup, RankGroup, TrainerRankError
from rollwise.train.sharded_token_advantages import plan_on_ranks
from rollwise.types.critic_config import token_advantage_reason
from rollwise.types.microbatch import chunk_samples, computed_tokens
from rollwise.types.sample import Sample

DEFAULT_BUCKET_MB = 64.0


def balance(costs: list[int], ranks: int) -> list[list[int]]:
    """Indices of `costs` dealt to `ranks` bins, largest first onto the lightest bin (LPT), so the
    ranks' token counts are close; each bin keeps its indices in the original order."""
    bins: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        r = loads.index(min(loads))
        bins[r].append(i)
        loads[r] += costs[i]
    return [sorted(b) for b in bins]


def split_work(samples: list[Sample], cfg: TrainConfig, ranks: int) -> list[RankWork]:
    """Each rank's micro-batches with the loss weights of the global batch (exact normalisation)."""
    share, chunks = chunk_samples(samples, cfg)
    ordered = [s for chunk in chunks for s in chunk]
    weights = token_weights([s.trained_tokens for s in ordered], cfg.loss_agg)
    per_sample: list[Tensor] = list(torch.split(weights, [s.trained_tokens for s in ordered]))
    weight_of = {id(s): w for s, w in zip(ordered, per_sample)}
    if share:
        # A shared-prompt micro-batch holds whole groups: deal the groups (pieces of at most
        # micro_batch_size samples), then cut each rank's share into micro-batches (with
        # train.pack_groups several groups to one, which must not leave a rank without work).
        pieces = chunk_samples(samples, cfg.model_copy(update={"pack_groups": False}))[1]
        bins = balance([computed_tokens(p, cfg) for p in pieces], ranks)
        dealt = [chunk_samples([s for i in b for s in pieces[i]], cfg)[1] for b in bins]
    else:
        # Padded micro-batches: deal samples by tokens, then cut each rank's share into micro-batches.
        costs = [len(s.prompt_ids) + len(s.response_ids) for s in ordered]
        dealt = [chunk_samples([ordered[i] for i in b], cfg)[1] if b else [] for b in balance(costs, ranks)]
    most = max(max(len(d) for d in dealt), 1)
    work = []
    for rank_chunks in dealt:
        if not rank_chunks:  # fewer micro-batches than ranks: this rank only repeats one at weight 0
            w = torch.cat([torch.zeros_like(weight_of[id(s)]) for s in chunks[0]])
            work.append(RankWork(share, [chunks[0]], w, padding=most - 1, idle=True))
            continue
        w = torch.cat([weight_of[id(s)] for chunk in rank_chunks for s in chunk])
        work.append(RankWork(share, rank_chunks, w, padding=most - len(rank_chunks)))
    return work


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks': sums add, per-token means are weighed by tokens, and the
    rest (grad norm, lr, flags) are the same on every rank."""
    tokens = [m.get("trained_tokens", 0.0) for m in per_rank]
    total = sum(tokens)
    out = dict(per_rank[0])
    out["loss"] = sum(m["loss"] for m in per_rank)
    out["trained_tokens"] = total
    if "weights_landing_s" in out:  # the slowest rank's copy into the shared landing
        out["weights_landing_s"] = max(m["weights_landing_s"] for m in per_rank)
    for key in SUMMED_OVER_RANKS:  # the critic's value loss and clip fraction: each rank's share of the batch's
        if key in out:
            out[key] = sum(m[key] for m in per_rank)
    for key in ("clip_fraction", "entropy", "kl", "is_weight_mean", "is_masked_fraction", "mismatch_abs_logp",
                "mismatch_k3"):
        if key in out:
            out[key] = sum(m[key] * n for m, n in zip(per_rank, tokens)) / max(total, 1.0)
    return out


class ShardedTrainer:
    """N FSDP2 ranks as one Trainer. Built on rank processes started here (`ShardedTrainer(model,
    ...)`: `model` is copied to the ranks and left as it is here), or on any RankGroup (`over`)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, trainer_cfg: TrainerConfig, *, pad_token_id: int,
                 temperature: float = 1.0, tokenizer: Any = None, threads: int = 0,
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        refuse_torchrun(os.environ)
        resolve_policy_loss(cfg)  # a custom train.policy_loss is checked here, once, before any rank starts
        if cfg.advantage == "gae":  # the critic's layers against the model's, as a rank would refuse them
            check_trainable_layers(cfg.gae.critic_trainable_layers, model.config.num_hidden_layers)
        group = ProcessRankGroup(model, cfg, trainer_cfg, pad_token_id=pad_token_id, temperature=temperature,
                                 threads=threads or len(os.sched_getaffinity(0)))
        self._attach(group, cfg, tokenizer, bucket_mb)

    @classmethod
    def over(cls, group: RankGroup, cfg: TrainConfig, *, tokenizer: Any = None, version: int = 0,
             bucket_mb: float = DEFAULT_BUCKET_MB) -> ShardedTrainer:
        """The trainer driving ranks started elsewhere (Ray actors, torchrun)."""
        trainer = cls.__new__(cls)
        trainer._attach(group, cfg, tokenizer, bucket_mb)
        trainer._version = version
        return trainer

    def _attach(self, group: RankGroup, cfg: TrainConfig, tokenizer: Any, bucket_mb: float) -> None:
        self.group, self.cfg, self.tokenizer, self.bucket_mb = group, cfg, tokenizer, bucket_mb
        # gae, or the KL in the reward: per-token advantages from the ranks' forwards (rollwise.train.sharded_token_advantages)
        self.token_advantages = token_advantage_reason(cfg.advantage, cfg.kl_penalty, cfg.kl_coef,
                                                       cfg.teacher is not None) is not None
        self.world_size = group.world_size
        self._version = 0

    def _all(self, cmd: str, arg: Any = None) -> list[Any]:
        return self.group.call(cmd, [arg] * self.world_size)

    def close(self) -> None:
        self.group.close()

    # ------------------------------------------------------------ rollwise.types.contracts.Trainer

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        planned = [s for s in samples if s.advantage != 0.0] if self.cfg.skips_zero_advantage() else samples
        informative = [s for s in planned if s.trained_tokens]
        if not informative:
            # Nothing to learn from: entropy and mismatch of the first micro-batch, measured on all
            # ranks alike (every forward is collective); rank 0's answer.
            share, chunks = chunk_samples(samples, self.cfg)
            first = RankWork(share, chunks[:1], torch.zeros(sum(s.trained_tokens for s in chunks[0])), padding=0)
            measured = self._all("measure", first)[0]
            return {"loss": 0.0, "grad_norm": 0.0, "update_skipped_no_signal": 1.0,
                    "update_skipped_nonfinite_grad": 0.0, "trained_tokens": 0.0, "trained_samples": 0.0,
                    "clip_fraction": 0.0, "kl": 0.0, **measured}
        work = split_work(informative, self.cfg, self.world_size)
        # The per-token advantages over the batch the one-process trainer would plan over (`planned`)
        token_metrics = plan_on_ranks(self.group, work, planned, self.cfg) if self.token_advantages else {}
        replies = self.group.call("train", work)
        self._version = replies[0]["version"]
        metrics = combine_metrics([r["metrics"] for r in replies])
        metrics["trained_samples"] = float(len(informative))
        metrics["update_skipped_no_signal"] = 0.0
        metrics["trainer_rank_token_imbalance"] = _imbalance([r["metrics"]["trained_tokens"] for r in replies])
        metrics.update(token_metrics)
        return metrics

    def weights(self) -> dict[str, Tensor]:
        """The full weights, from the ranks' shards (see RankGroup.weights for how each group
        gathers them; none holds more than one bucket of full tensors on a rank)."""
        return self.group.weights(self.bucket_mb)

    def memory(self) -> list[dict[str, float]]:
        """Each rank's bytes of parameters, gradients and optimizer state, and its peak RSS."""
        return self._all("memory")

    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any], keep_last: int) -> Path:
        if self.tokenizer is None:
            raise ValueError("ShardedTrainer(tokenizer=...) is needed to write a checkpoint (it is saved with the model)")

        def write(tmp: Path) -> None:
            self._all("save", tmp)  # model/ (full, rank 0), dcp/ (every rank's shard), scheduler.pt
            self.tokenizer.save_pretrained(tmp / "model")

        return write_checkpoint(run_dir, step, self.version, extra, keep_last, write)

    def load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        state = load_rng_and_state(ckpt)
        self._version = int(state["policy_version"])
        self._all("load", (ckpt, self._version))
        return state


def refuse_torchrun(env: Mapping[str, str]) -> None:
    """`ShardedTrainer(model, ...)` starts N rank processes: in a launcher-started process (torchrun:
    RANK/WORLD_SIZE set) every process would start N more. Refused, naming the two ways that work."""
    launched = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in env]
    if launched and int(env.get("WORLD_SIZE", "1")) > 1:
        raise TrainerRankError(
            f"this process was started by torchrun (or another launcher: {', '.join(launched)} set), and "
            "ShardedTrainer(model, ...) would start its own ranks in every one of them: run `torchrun "
            "--nproc-per-node=N -m rollwise.cli train trainer.world_size=N` (rank 0 drives, the others follow: "
            "rollwise.train.torchrun), or `rollwise train trainer.world_size=N` without torchrun")


def _imbalance(tokens: list[float]) -> float:
    """max / mean of the ranks' trained tokens (1.0: perfectly balanced)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 1.0


__all__ = ["ShardedTrainer", "balance", "combine_metrics", "refuse_torchrun", "split_work"]
