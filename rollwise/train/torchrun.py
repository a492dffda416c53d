"""Trainer ranks started by a launcher: `torchrun --nproc-per-node=N -m rollwise.cli train trainer.world_size=N`.

Every process the launcher starts runs the same command. Rank 0 runs the whole training run (rollout,
engines, rewards, the loop) and is also trainer rank 0; every other rank only follows (`follow`): it
loads the model, joins the group and runs the commands rank 0 sends, until rank 0 is done.

Commands travel over a gloo group of their own (object collectives on CPU tensors, whatever the
training backend is): rank 0 broadcasts (command, one argument per rank), every rank runs it
(RankTrainer.handle, the dispatcher every kind of rank uses), and the replies are gathered on rank 0.
Weights are all-gathered bucket by bucket (the ranks may sit on several nodes). A rank that fails
replies with its traceback and leaves; a rank that dies is the launcher's to notice (torchrun stops the
others), and the run resumes from its last checkpoint with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from rollwise.config import RunConfig
from rollwise.train.distributed import RankSpec, init_rank, resolve_device
from rollwise.train.rank import RankTrainer
from rollwise.train.rank_group import RESUME_HINT, TrainerRankError, assemble

STOP = "stop"
GATHER = "gather"


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a launcher-started group (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int


def launched_rank(env: Mapping[str, str], cfg: RunConfig) -> LaunchedRank | None:
    """This process's rank if a launcher started it (RANK and WORLD_SIZE set, WORLD_SIZE > 1), else
    None. The launcher's world size must be the config's: refused before any work otherwise."""
    if "RANK" not in env or int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    world = int(env["WORLD_SIZE"])
    if cfg.trainer.world_size != world:
        raise ValueError(f"the launcher started {world} processes (WORLD_SIZE={world}) but trainer.world_size="
                         f"{cfg.trainer.world_size}: set trainer.world_size={world}, or run without torchrun "
                         f"(`rollwise train trainer.world_size=N` starts the ranks itself)")
    if cfg.placement != "local":
        raise ValueError(f"torchrun-launched trainer ranks run with placement=local, got placement={cfg.placement!r}")
    return LaunchedRank(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])))


def _spec(me: LaunchedRank, cfg: RunConfig) -> RankSpec:
    threads = cfg.threads or max(len(os.sched_getaffinity(0)) // me.world_size, 1)
    return RankSpec(me.rank, me.world_size, port=0, device=resolve_device(cfg.trainer.device), threads=threads,
                    mixed_precision=cfg.trainer.mixed_precision, cpu_offload=cfg.trainer.cpu_offload,
                    local_rank=me.local_rank, from_env=True)


def _rank_trainer(me: LaunchedRank, model: nn.Module, cfg: RunConfig, pad_token_id: int) -> RankTrainer:
    spec = _spec(me, cfg)
    device = init_rank(spec)
    return RankTrainer(model, cfg.train, spec, device, pad_token_id=pad_token_id,
                       temperature=cfg.rollout.temperature or 1.0)


class TorchrunRankGroup:
    """The RankGroup on launcher-started ranks, driven from rank 0 (this process)."""

    def __init__(self, me: LaunchedRank, model: nn.Module, cfg: RunConfig, pad_token_id: int) -> None:
        assert me.rank == 0, "rank 0 drives the group; the other ranks follow()"
        self.world_size = me.world_size
        # A copy: the rank shards its model in place, and `model` stays the engines' starting point.
        self.trainer = _rank_trainer(me, copy.deepcopy(model), cfg, pad_token_id)
        self.control = dist.new_group(backend="gloo")  # commands and replies as Python objects, on CPU
        self.closed = False

    def call(self, cmd: str, args: list[Any]) -> list[Any]:
        dist.broadcast_object_list([cmd, args], src=0, group=self.control)
        mine: tuple[str, Any]
        try:
            mine = ("ok", self.trainer.handle(cmd, args[0]))
        except Exception:
            mine = ("error", traceback.format_exc())
        replies: list[Any] = [None] * self.world_size
        dist.gather_object(mine, replies, dst=0, group=self.control)
        failed = [(rank, value) for rank, (status, value) in enumerate(replies) if status != "ok"]
        if failed:
            rank, value = failed[0]
            raise TrainerRankError(f"trainer rank {rank} failed during {cmd}:\n{value}\n{RESUME_HINT}")
        return [value for _, value in replies]

    def weights(self, bucket_mb: float) -> dict[str, Tensor]:
        dist.broadcast_object_list([GATHER, [bucket_mb] * self.world_size], src=0, group=self.control)
        state: dict[str, Tensor] = {}
        for bucket in self.trainer.gathered(bucket_mb):
            assemble(bucket, state)
        return state

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        dist.broadcast_object_list([STOP, [None] * self.world_size], src=0, group=self.control)
        dist.destroy_process_group()


def follow(me: LaunchedRank, model: nn.Module, cfg: RunConfig, pad_token_id: int) -> None:
    """A rank other than 0: run rank 0's commands until it stops the group (or a command fails)."""
    trainer = _rank_trainer(me, model, cfg, pad_token_id)
    control = dist.new_group(backend="gloo")
    try:
        while True:
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, src=0, group=control)
            cmd, args = message
            if cmd == STOP:
                break
            if cmd == GATHER:
                for _ in trainer.gathered(args[me.rank]):  # every rank takes part in each all-gather
                    pass
                continue
            try:
                reply: tuple[str, Any] = ("ok", trainer.handle(cmd, args[me.rank]))
            except Exception:
                reply = ("error", traceback.format_exc())
            dist.gather_object(reply, None, dst=0, group=control)
            if reply[0] != "ok":
                raise TrainerRankError(f"trainer rank {me.rank} failed during {cmd}; see rank 0's error")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["LaunchedRank", "TorchrunRankGroup", "follow", "launched_rank"]
