"""One rank of the sharded trainer: GRPOTrainer on an FSDP2-sharded model, driven by commands.

`RankTrainer.handle(cmd, arg)` is the one dispatcher every way of driving a rank uses: the local
rank processes (`rank_main`, over a pipe; rollwise.train.rank_group), Ray actors
(rollwise.control.ray.trainer_ranks) and torchrun-launched ranks (rollwise.train.torchrun). The
commands: train, measure, write_shards, save, load, memory, and token_inputs (train.advantage=gae and
train.kl_penalty=reward: the critic's values and the reference's KL before the step, from which the controller
computes the per-token advantages: rollwise.train.sharded_token_advantages). Over the pipe each reply is
("ok", value) or ("error", traceback); a rank that raises leaves the group, and the controller stops the
others (they would wait in a collective forever).

Weights leave a rank one of two ways. Ranks on the controller's host write their own shard of every
tensor into a full-size shared-memory landing the controller allocated (`write_shards`): no
collective, each rank copies 1/N of the model in parallel, and no rank ever holds a full tensor.
Ranks elsewhere (Ray actors on other nodes) all-gather bucket by bucket instead
(rollwise.train.distributed.gathered_buckets).
"""

from __future__ import annotations

import copy
import resource
import signal
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from rollwise.types.train_config import TrainConfig
from rollwise.train.checkpoint import DCP_DIR, SCHEDULER_FILE, optimizer_state_by_name
from rollwise.train.critic_shards import load_critic_shards, save_critic_shards
from rollwise.train.distributed import RankSpec, gathered_buckets, init_rank, shard_model
from rollwise.train.trainer import GRPOTrainer, MicroBatch, to_device
from rollwise.train.logprobs import LogprobOptions
from rollwise.train.packing import GroupMicroBatch
from rollwise.train.step_batches import KeptBatches, chunks_key, with_token_advantages, with_weights
from rollwise.train.token_forwards import in_order
from rollwise.types.sample import Sample


@dataclass
class RankWork:
    """A rank's share of one train step: its micro-batches and their tokens' global loss weights."""

    share: bool  # shared-prompt micro-batches (one group each)
    chunks: list[list[Sample]]
    weights: Tensor  # flattened over the chunks' trained tokens, in order
    padding: int  # zero-weight repeats to run after them (see MicroBatch.padding)
    idle: bool = False  # the chunks are not this rank's either: every micro-batch is padding
    critic: CriticTargets | None = None  # train.advantage=gae, updates_per_step > 1: the critic's update after the policy's
    batch_tokens: int = 0  # the whole batch's trained tokens (over all ranks): the critic's value loss denominator

    def key(self) -> tuple:
        """The same for the step's two commands (token_inputs, train): their micro-batches are the same."""
        return chunks_key(self.chunks, self.padding, self.idle)


@dataclass
class TokenReply:
    """A rank's answer to token_inputs: per sample of its chunks, the KL estimates and the critic's values (None:
    not used, or an idle rank), and the critic's update metrics when it stepped there (its share of the batch's)."""

    kl: list[Tensor] | None
    values: list[Tensor] | None
    critic_metrics: dict[str, float]
    critic_updated: bool


@dataclass
class CriticTargets:
    """The critic's targets on a rank's share of a gae step (rollwise.train.sharded_token_advantages): the values
    the advantages were computed with and the GAE returns, flattened over the rank's chunks' trained tokens in
    order, and the whole batch's trained tokens (the value loss's denominator on every rank)."""

    old: Tensor
    returns: Tensor
    n_tokens: int


class PolicyLogprobs(nn.Module):
    """The FSDP root: its forward is a micro-batch's log-probs, so the root's parameters (embeddings,
    LM head) are gathered by FSDP's own hooks even though the LM head is applied outside the
    Hugging Face forward (rollwise.train.logprobs)."""

    def __init__(self, model: nn.Module, options: LogprobOptions) -> None:
        super().__init__()
        self.model, self.options = model, options

    def forward(self, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        return mb.logprobs(self.model, self.options)


class RankTrainer(GRPOTrainer):
    def __init__(self, model: nn.Module, cfg: TrainConfig, spec: RankSpec, device: torch.device, *,
                 pad_token_id: int, temperature: float) -> None:
        self.spec, self.device = spec, device
        super().__init__(model.to(device), cfg, pad_token_id=pad_token_id, temperature=temperature)
        self.grad_bytes = 0
        self.before_step = self._record_grad_bytes
        self.kept: KeptBatches | None = None  # token_inputs' micro-batches, for the step's train (one collation)

    def _prepare_model(self) -> None:
        self.policy = PolicyLogprobs(self.model, LogprobOptions.of(self.cfg, self.temperature))
        shard_model(self.policy, self.model.get_decoder().layers, self.spec)

    def _prepare_critic(self, value_model: nn.Module) -> None:
        # The critic sharded like the policy: each decoder layer its own unit, the root (embeddings, norm, value
        # head) the rest, on the same data-parallel mesh, gradients summed over the ranks.
        shard_model(value_model, value_model.backbone.layers, self.spec)

    def _logprobs(self, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        with self._compute():  # train.compute_dtype, as in one process
            logp, entropy = self.policy(mb)
        return logp.float(), entropy.float()

    def collate_chunks(self, share: bool, chunks: list[list[Sample]], weights: Tensor,
                       padding: int = 0) -> list[MicroBatch | GroupMicroBatch]:
        batches = super().collate_chunks(share, chunks, weights, padding)
        return [to_device(mb, self.device) for mb in batches]

    # ------------------------------------------------------------ commands

    def train(self, work: RankWork) -> dict[str, Any]:
        batches = self._step_batches(work)
        proximal: list[Tensor] = []
        metrics: dict[str, float] = {}
        for update in range(self.cfg.updates_per_step):
            metrics = self._update(batches, record_mismatch=update == 0, proximal=proximal)
        if work.critic is not None and self.critic is not None:
            metrics.update(self._update_critic(work, work.critic, batches))
        metrics.update(self.forwards.times.take())  # this step's, token_inputs' included
        return {"metrics": metrics, "version": self.version}

    def token_inputs_of(self, work: RankWork) -> TokenReply:
        """Command token_inputs (per-token advantages, before the step's update): per sample of this rank's
        chunks, the KL estimates and the critic's values, from the one-process trainer's TokenForwards on the
        rank's own micro-batches (those its update runs), filler included (every rank runs as many critic forwards
        as the others); at train.updates_per_step=1 the critic's update runs here too (its metrics: this rank's
        share). An idle rank's chunks are another rank's: no KL and no values."""
        batches = self._work_batches(work)
        self.kept = KeptBatches(work.key(), batches)
        inputs = self.forwards.run(work.chunks, batches, work.batch_tokens)
        if work.idle:
            return TokenReply(None, None, inputs.critic_metrics, inputs.critic_updated)
        mine = [s for chunk in work.chunks for s in chunk]
        return TokenReply(in_order(mine, inputs.kl), in_order(mine, inputs.values), inputs.critic_metrics,
                          inputs.critic_updated)

    def _work_batches(self, work: RankWork, weights: Tensor | None = None) -> list[MicroBatch | GroupMicroBatch]:
        batches = self.forward_batches(work.share, work.chunks, work.padding, weights)
        return [replace(mb, padding=True) for mb in batches] if work.idle else batches

    def _step_batches(self, work: RankWork) -> list[MicroBatch | GroupMicroBatch]:
        """The step's micro-batches: token_inputs' (the same work) with the loss weights and the per-token advantages
        the controller sent with `work` filled in (rollwise.train.step_batches), else collated here, once."""
        kept, self.kept = self.kept, None
        if kept is None or kept.key != work.key():
            return self._work_batches(work, work.weights)
        return with_token_advantages(with_weights(kept.batches, work.chunks, work.weights), work.chunks)

    def _update_critic(self, work: RankWork, targets: CriticTargets,
                       batches: list[MicroBatch | GroupMicroBatch]) -> dict[str, float]:
        """Critic.update (updates_per_step > 1) on the same micro-batches its values came from (token_inputs_of);
        the filler repeats the first at weight 0."""
        sizes = [mb.n_tokens for mb in batches[: len(work.chunks)]]
        old, returns = list(torch.split(targets.old, sizes)), list(torch.split(targets.returns, sizes))
        old += old[:1] * work.padding
        returns += returns[:1] * work.padding
        with self.forwards.times.timing("time_critic_s", self.device):
            return self.critic.update(batches, old, returns, self._compute, targets.n_tokens)

    def memory(self, _: Any = None) -> dict[str, float]:
        """This rank's bytes of parameters, gradients (at the last optimizer step) and optimizer
        state (its shards), and its process's peak resident memory (rollwise bench trainer)."""
        return {"param_bytes": float(sum(_local_bytes(p) for p in self.model.parameters())),
                "grad_bytes": float(self.grad_bytes),
                "optim_bytes": float(sum(_local_bytes(t) for state in self.optimizer.state.values()
                                         for t in state.values() if isinstance(t, Tensor))),
                "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}

    def _record_grad_bytes(self, model: nn.Module) -> None:
        # Gradients are freed after each step (zero_grad(set_to_none=True)): count them before it.
        self.grad_bytes = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)

    def measure(self, work: RankWork) -> dict[str, float]:
        return self._measure(self.collate_chunks(work.share, work.chunks, work.weights))

    def write_shards(self, landing: Mapping[str, Tensor]) -> None:
        """This rank's rows of every tensor into `landing` (full-size, shared with the controller).
        FSDP2 shards dim 0 like torch.chunk: rank r holds rows [r*c, r*c + len) with c = ceil(n/N).
        A tensor that is not sharded (a buffer, or a parameter FSDP keeps unsharded) is rank 0's to write."""
        written: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            dest = landing[name]
            if id(dest) in written:  # tied: one landing tensor for both names
                continue
            written.add(id(dest))
            if isinstance(tensor, DTensor):
                local = tensor.to_local().detach()
                rows = -(-tensor.shape[0] // self.spec.world_size)
                offset = min(self.spec.rank * rows, tensor.shape[0])
                if tensor.placements != (Shard(0),) or local.shape[0] != min(rows, tensor.shape[0] - offset):
                    raise RuntimeError(f"{name}: expected FSDP2's dim-0 shard of rows [{offset}, {offset + rows}), "
                                       f"got placements {tensor.placements} and a local shape {tuple(local.shape)}")
                dest.narrow(0, offset, local.shape[0]).copy_(local)
            elif self.spec.rank == 0:
                dest.copy_(tensor.detach())

    def gathered(self, bucket_mb: float) -> Iterator[list[tuple[str, Tensor | str]]]:
        """The full weights a bucket at a time (an all-gather per tensor: every rank must iterate)."""
        return gathered_buckets(self.model.state_dict(keep_vars=True), bucket_mb)

    def handle(self, cmd: str, arg: Any) -> Any:
        """Run one controller command on this rank (every rank of the group runs the same one)."""
        commands = {"train": self.train, "measure": self.measure, "write_shards": self.write_shards,
                    "save": self.save, "load": self.load, "memory": self.memory, "token_inputs": self.token_inputs_of}
        if cmd not in commands:
            raise ValueError(f"unknown trainer-rank command {cmd!r}; known: {', '.join(commands)}")
        return commands[cmd](arg)

    def save(self, tmp: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / DCP_DIR)
        # A model/ that loads on its own (Hugging Face), as every rollwise checkpoint has.
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.spec.rank == 0:
            self.model.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)
            torch.save({"scheduler": self.scheduler.state_dict()}, tmp / SCHEDULER_FILE)
        if self.critic is not None:  # train.advantage=gae: critic/ in the same form (rollwise.train.critic_shards)
            save_critic_shards(self.critic, tmp, self.spec.rank)
        dist.barrier()

    def load(self, arg: tuple[Path, int]) -> None:
        ckpt, self.version = arg
        if self.critic is not None:
            load_critic_shards(self.critic, ckpt)
        if (ckpt / DCP_DIR).exists():  # any world size's sharded checkpoint: DCP reshards on load
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt / DCP_DIR)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            self.scheduler.load_state_dict(torch.load(ckpt / SCHEDULER_FILE, weights_only=False)["scheduler"])
            return
        # A single-process checkpoint: full weights and optimizer.pt, each rank keeps its shard.
        full: dict[str, Tensor] = {}
        for shard in sorted((ckpt / "model").glob("*.safetensors")):
            full.update(load_file(shard))
        options = StateDictOptions(full_state_dict=True, strict=False)  # tied weights are stored once
        set_model_state_dict(self.model, full, options=options)
        opt = torch.load(ckpt / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state_by_name(self.model, opt["optimizer"]),
                                 options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(opt["scheduler"])


def _local_bytes(tensor: Tensor) -> int:
    """Bytes this rank holds of `tensor` (its shard of a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


# Commands after which a local rank's weights changed: it writes them into the landing right away.
CHANGES_WEIGHTS = ("train", "load")


def rank_main(spec: RankSpec, model: nn.Module, cfg: TrainConfig, pad_token_id: int, temperature: float,
              landing: Mapping[str, Tensor], conn: Connection) -> None:
    """A rank process: join the group, shard a private copy of `model`, then serve commands over
    `conn`. Whenever its weights change (start, train, load) it writes its shards into `landing`
    (the controller's shared-memory weights) before replying, so a push finds them there already:
    the copy (~1/N of the model, all ranks at once) is part of the step, not of the push."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the controller, which stops the ranks in order
    trainer = None
    try:
        device = init_rank(spec)
        trainer = RankTrainer(copy.deepcopy(model), cfg, spec, device, pad_token_id=pad_token_id,
                              temperature=temperature)
        del model  # the controller's copy (shared memory): this rank keeps only its shard
        trainer.write_shards(landing)  # also faults the landing's pages in once, here, not in a push
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            try:
                result = trainer.handle(cmd, landing if cmd == "write_shards" else arg)
                if cmd in CHANGES_WEIGHTS:
                    start = time.perf_counter()
                    trainer.write_shards(landing)
                    if cmd == "train":
                        result["metrics"]["weights_landing_s"] = time.perf_counter() - start
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
                break
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the controller went away: nobody to tell
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
