"""One rank of the sharded trainer: GRPOTrainer on an FSDP2-sharded model, driven over a pipe.

`rank_main` is the rank process's entry point (rollwise.train.sharded starts it). It answers
commands from the controller in order: start, train, measure, weights, save, load, memory, stop. Each
reply is ("ok", value) or ("error", traceback); a rank that raises leaves the group, and the
controller stops the others (they would wait in a collective forever).
"""

from __future__ import annotations

import copy
import resource
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from rollwise.config import TrainConfig
from rollwise.train.checkpoint import DCP_DIR, SCHEDULER_FILE, optimizer_state_by_name
from rollwise.train.distributed import RankSpec, gathered_buckets, init_rank, shard_model
from rollwise.train.trainer import GRPOTrainer, GroupMicroBatch, MicroBatch, to_device
from rollwise.types.sample import Sample


@dataclass
class RankWork:
    """A rank's share of one train step: its micro-batches and their tokens' global loss weights."""

    share: bool  # shared-prompt micro-batches (one group each)
    chunks: list[list[Sample]]
    weights: Tensor  # flattened over the chunks' trained tokens, in order
    padding: int  # zero-weight repeats to run after them (see MicroBatch.padding)
    idle: bool = False  # the chunks are not this rank's either: every micro-batch is padding


class PolicyLogprobs(nn.Module):
    """The FSDP root: its forward is a micro-batch's log-probs, so the root's parameters (embeddings,
    LM head) are gathered by FSDP's own hooks even though the LM head is applied outside the
    Hugging Face forward (rollwise.train.logprobs)."""

    def __init__(self, model: nn.Module, temperature: float, chunk_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.temperature, self.chunk_tokens = temperature, chunk_tokens

    def forward(self, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        return mb.logprobs(self.model, self.temperature, self.chunk_tokens)


class RankTrainer(GRPOTrainer):
    def __init__(self, model: nn.Module, cfg: TrainConfig, spec: RankSpec, device: torch.device, *,
                 pad_token_id: int, temperature: float) -> None:
        self.spec, self.device = spec, device
        super().__init__(model.to(device), cfg, pad_token_id=pad_token_id, temperature=temperature)
        self.grad_bytes = 0
        self.before_step = self._record_grad_bytes

    def _prepare_model(self) -> None:
        self.policy = PolicyLogprobs(self.model, self.temperature, self.cfg.logprob_chunk_tokens)
        shard_model(self.policy, self.model.get_decoder().layers, self.spec)

    def _logprobs(self, mb: MicroBatch | GroupMicroBatch) -> tuple[Tensor, Tensor]:
        return self.policy(mb)

    def collate_chunks(self, share: bool, chunks: list[list[Sample]], weights: Tensor,
                       padding: int = 0) -> list[MicroBatch | GroupMicroBatch]:
        batches = super().collate_chunks(share, chunks, weights, padding)
        return [to_device(mb, self.device) for mb in batches]

    # ------------------------------------------------------------ commands

    def train(self, work: RankWork) -> dict[str, Any]:
        batches = self.collate_chunks(work.share, work.chunks, work.weights, work.padding)
        if work.idle:
            batches = [replace(mb, padding=True) for mb in batches]
        proximal: list[Tensor] = []
        metrics: dict[str, float] = {}
        for update in range(self.cfg.updates_per_step):
            metrics = self._update(batches, record_mismatch=update == 0, proximal=proximal)
        return {"metrics": metrics, "version": self.version}

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

    def send_weights(self, bucket_mb: float, conn: Connection) -> None:
        for bucket in gathered_buckets(self.model.state_dict(keep_vars=True), bucket_mb):
            if self.spec.rank == 0:
                conn.send(("ok", bucket))
            del bucket  # one bucket of full tensors at a time
        if self.spec.rank == 0:
            conn.send(("ok", None))

    def save(self, tmp: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / DCP_DIR)
        # A model/ that loads on its own (Hugging Face), as every rollwise checkpoint has.
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.spec.rank == 0:
            self.model.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)
            torch.save({"scheduler": self.scheduler.state_dict()}, tmp / SCHEDULER_FILE)
        dist.barrier()

    def load(self, arg: tuple[Path, int]) -> None:
        ckpt, self.version = arg
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


def rank_main(spec: RankSpec, model: nn.Module, cfg: TrainConfig, pad_token_id: int, temperature: float,
              conn: Connection) -> None:
    """A rank process: join the group, shard a private copy of `model`, then serve commands."""
    trainer = None
    try:
        device = init_rank(spec)
        trainer = RankTrainer(copy.deepcopy(model), cfg, spec, device, pad_token_id=pad_token_id,
                              temperature=temperature)
        del model  # the controller's copy (shared memory): this rank keeps only its shard
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
                if cmd == "weights":
                    trainer.send_weights(arg, conn)
                    if spec.rank != 0:
                        conn.send(("ok", None))
                    continue
                result = {"train": trainer.train, "measure": trainer.measure, "save": trainer.save,
                          "load": trainer.load, "memory": trainer.memory}[cmd](arg)
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
                break
    except EOFError:  # the controller went away
        pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
