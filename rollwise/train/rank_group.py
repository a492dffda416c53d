"""The trainer ranks as one group the controller drives: started here as processes, or elsewhere.

`RankGroup` is what rollwise.train.sharded.ShardedTrainer needs from its ranks: run one command on
every rank (one argument each) and get every rank's reply, the full weights, and a stop. Three
groups implement it:

    ProcessRankGroup     this module      rank processes started from here (torch.multiprocessing,
                                          spawn) over pipes; weights land in shared memory
    RayRankGroup         rollwise.control.ray.trainer_ranks   one Ray actor per rank (placement: ray)
    TorchrunRankGroup    rollwise.train.torchrun               ranks a launcher (torchrun) started;
                                                               this process is rank 0

Every group turns a failed or dead rank into TrainerRankError (and stops the others, which would
wait in a collective forever), so the step fails clearly and the run resumes from a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from rollwise.types.train_config import TrainConfig, TrainerConfig
from rollwise.train.distributed import RankSpec, free_port, resolve_device
from rollwise.train.rank import rank_main

DEATH_GRACE_S = 2.0  # how long a rank's collective error waits to see whether a peer died
RESUME_HINT = ("The step did not complete and the trainer is stopped: rerun with checkpoint.resume=auto "
               "(or checkpoint.resume=RUN_DIR/checkpoints/step_NNNNNN) to continue from the last checkpoint.")


class TrainerRankError(RuntimeError):
    """A trainer rank failed or died; the step did not complete (resume from the last checkpoint)."""


class RankGroup(Protocol):
    world_size: int

    def call(self, cmd: str, args: list[Any]) -> list[Any]:
        """Run `cmd` on every rank (rank i gets args[i]); every rank's reply, in rank order."""

    def weights(self, bucket_mb: float) -> dict[str, Tensor]:
        """The full weights by name (tied names share one tensor), valid until the next command."""

    def close(self) -> None: ...


def shared_landing(model: nn.Module) -> dict[str, Tensor]:
    """A full-size shared-memory tensor per weight of `model` (tied names share one), for rank
    processes on this host to write their shards into (RankTrainer.write_shards)."""
    landing: dict[str, Tensor] = {}
    by_id: dict[int, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in by_id:
            by_id[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
        landing[name] = by_id[id(tensor)]
    return landing


@dataclass
class _Rank:
    process: BaseProcess
    conn: Connection


class ProcessRankGroup:
    """`trainer_cfg.world_size` rank processes on this host, each with a private copy of `model`
    that it shards (FSDP2); the machine's cores are split between them."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, trainer_cfg: TrainerConfig, *, pad_token_id: int,
                 temperature: float, threads: int) -> None:
        self.world_size = trainer_cfg.world_size
        self.landing = shared_landing(model)
        port = free_port()
        ctx = mp.get_context("spawn")
        self.ranks: list[_Rank] = []
        for rank in range(self.world_size):
            spec = RankSpec(rank, self.world_size, port, resolve_device(trainer_cfg.device),
                            threads=max(threads // self.world_size, 1), mixed_precision=trainer_cfg.mixed_precision,
                            cpu_offload=trainer_cfg.cpu_offload)
            here, there = ctx.Pipe()
            process = ctx.Process(target=rank_main, name=f"rollwise-trainer-rank{rank}", daemon=True,
                                  args=(spec, model, cfg, pad_token_id, temperature, self.landing, there))
            process.start()
            there.close()
            self.ranks.append(_Rank(process, here))
        self._collect("start")

    def call(self, cmd: str, args: list[Any]) -> list[Any]:
        for r, arg in zip(self.ranks, args):
            r.conn.send((cmd, arg))
        return self._collect(cmd)

    def weights(self, bucket_mb: float) -> dict[str, Tensor]:
        # The ranks wrote their rows into the shared landing when their weights last changed (every
        # rank at once, inside the step: rank_main): no collective, no pickling, nothing to wait for,
        # and no process ever holds more than its shard plus the landing it shares with us.
        return dict(self.landing)

    def _collect(self, what: str) -> list[Any]:
        return [self._recv(rank, what) for rank in range(self.world_size)]

    def _recv(self, rank: int, what: str) -> Any:
        """One reply from `rank`. Every rank's process is watched while waiting, not only `rank`'s:
        a rank that died leaves the others blocked in a collective, so waiting on them alone would
        hang. A dead or failed rank fails the call and stops the whole group."""
        r = self.ranks[rank]
        wait([r.conn] + [x.process.sentinel for x in self.ranks])
        if r.conn.poll():
            status, value = r.conn.recv()
            if status == "ok":
                return value
            # A collective error on one rank is usually the symptom of another rank's death: blame
            # the dead one when there is one (its exit is seen within a moment).
            wait([x.process.sentinel for x in self.ranks if x is not r], timeout=DEATH_GRACE_S)
            if not self._dead():
                self._stop_after_failure()
                raise TrainerRankError(f"trainer rank {rank} failed during {what}:\n{value}\n{RESUME_HINT}")
        dead = self._dead()
        self._stop_after_failure()
        ranks = ", ".join(f"rank {i} (exit code {code})" for i, code in dead)
        raise TrainerRankError(f"trainer {ranks} died during {what}; the other ranks were stopped. {RESUME_HINT}")

    def _dead(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the ranks whose process ended. The sentinel is ready a moment before
        the exit code can be read (is_alive() would still say True): join briefly for the code."""
        ended = set(wait([x.process.sentinel for x in self.ranks], timeout=0))
        dead = [(i, x.process) for i, x in enumerate(self.ranks) if x.process.sentinel in ended]
        for _, process in dead:
            process.join(timeout=1)
        return [(i, process.exitcode) for i, process in dead]

    def _stop_after_failure(self) -> None:
        """The surviving ranks may be blocked in a collective with a dead peer: they cannot read a
        "stop", so they are terminated (then killed) instead of waited for."""
        for r in self.ranks:
            if r.process.is_alive():
                r.process.terminate()
        for r in self.ranks:
            r.process.join(timeout=5)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()

    def close(self) -> None:
        for r in self.ranks:
            if r.process.is_alive():
                try:
                    r.conn.send(("stop", None))
                except OSError:
                    pass
        for r in self.ranks:
            r.process.join(timeout=10)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()


def assemble(bucket: list[tuple[str, Tensor | str]], into: dict[str, Tensor]) -> None:
    """Add one gathered bucket's tensors to `into` (a tied name arrives as the name it shares)."""
    for name, item in bucket:
        into[name] = into[item] if isinstance(item, str) else item


__all__ = ["DEATH_GRACE_S", "RESUME_HINT", "ProcessRankGroup", "RankGroup", "TrainerRankError", "assemble",
           "shared_landing"]
