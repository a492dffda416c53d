"""`placement: ray` with `ray.trainer_ranks=N`: the sharded trainer as N Ray actors, one process group.

Each `TrainerRankActor` sits in its own bundle of the run's placement group (ray.trainer_cpus /
ray.trainer_gpus each), loads the model itself, and becomes one FSDP2 rank (rollwise.train.rank):
rank 0's actor names its node and a free port, then every actor joins the group there (gloo on CPU,
NCCL on CUDA). `RayRankGroup` is the RankGroup the driver's ShardedTrainer drives them through
(rollwise.train.rank_group): a command goes to every actor at once, and a failed or dead actor fails
the step with TrainerRankError after the others are killed (they would wait in a collective), so
the run resumes from its last checkpoint with `checkpoint.resume=auto`.

Weights: the actors may sit on other nodes, so they all-gather bucket by bucket (no rank ever holds
more than one bucket of full tensors) and rank 0 returns each bucket to the driver, which hands the
whole state to the engines through Ray's object store (rollwise.sync.senders.ObjectStoreSender).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ray
import torch
from torch import Tensor

from rollwise.config import RunConfig
from rollwise.train.distributed import RankSpec, free_port, init_rank, resolve_device
from rollwise.train.rank import RankTrainer
from rollwise.train.rank_group import RESUME_HINT, TrainerRankError, assemble

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle


class TrainerRankActor:
    """One rank of the sharded trainer in a Ray actor (its model loaded here, from the run's spec)."""

    def __init__(self, cfg_data: dict, fingerprint: str, rank: int, world_size: int) -> None:
        from rollwise.model.loading import load_model, tokenizer_fingerprint

        self.cfg = RunConfig.model_validate(cfg_data)
        self.rank, self.world_size = rank, world_size
        torch.manual_seed(self.cfg.seed)  # the same initial model everywhere (it is loaded, not drawn)
        self.model, tokenizer = load_model(self.cfg.model)
        mine = tokenizer_fingerprint(tokenizer)
        if mine != fingerprint:
            raise RuntimeError(
                f"tokenizer fingerprint mismatch: trainer rank {rank}'s tokenizer for {self.cfg.model!r} hashes to "
                f"{mine[:16]}…, the driver's to {fingerprint[:16]}…; every node must load the same model files")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.trainer: RankTrainer | None = None
        self.buckets: Iterator[list[tuple[str, Tensor | str]]] | None = None

    def address(self) -> tuple[str, int]:
        """Where the group meets (asked of rank 0): this node's address and a free port on it."""
        return ray.util.get_node_ip_address(), free_port()

    def join(self, host: str, port: int) -> dict[str, Any]:
        threads = max(int(self.cfg.ray.trainer_cpus), 1)
        spec = RankSpec(self.rank, self.world_size, port, resolve_device(self.cfg.trainer.device), threads=threads,
                        mixed_precision=self.cfg.trainer.mixed_precision, cpu_offload=self.cfg.trainer.cpu_offload,
                        host=host)
        device = init_rank(spec)
        self.trainer = RankTrainer(self.model, self.cfg.train, spec, device, pad_token_id=self.pad_id,
                                   temperature=self.cfg.rollout.temperature or 1.0)
        del self.model  # the trainer holds its shard now
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "rank": self.rank}

    def handle(self, cmd: str, arg: Any) -> Any:
        assert self.trainer is not None, "join() first"
        return self.trainer.handle(cmd, arg)

    def start_gather(self, bucket_mb: float) -> None:
        assert self.trainer is not None, "join() first"
        self.buckets = self.trainer.gathered(bucket_mb)

    def next_bucket(self) -> list[tuple[str, Tensor | str]] | None:
        """The next gathered bucket (every rank must be asked together: each is an all-gather);
        rank 0 returns it, the others None. None from rank 0: the gather is done."""
        assert self.buckets is not None, "start_gather() first"
        bucket = next(self.buckets, None)
        if bucket is None:
            self.buckets = None
        return bucket if self.rank == 0 else None


class RayRankGroup:
    """The RankGroup over TrainerRankActors (rollwise.train.rank_group)."""

    def __init__(self, actors: list[ActorHandle], timeout_s: float) -> None:
        self.actors = actors
        self.world_size = len(actors)
        self.timeout_s = timeout_s
        self.closed = False

    def join(self) -> list[dict[str, Any]]:
        """Form the process group; every actor's {pid, node_ip, rank}."""
        host, port = self._get([self.actors[0].address.remote()], "trainer rank 0 to start")[0]
        return self._get([a.join.remote(host, port) for a in self.actors], "the trainer ranks to join")

    def call(self, cmd: str, args: list[Any]) -> list[Any]:
        return self._get([a.handle.remote(cmd, arg) for a, arg in zip(self.actors, args)], cmd)

    def weights(self, bucket_mb: float) -> dict[str, Tensor]:
        self._get([a.start_gather.remote(bucket_mb) for a in self.actors], "the weight gather")
        state: dict[str, Tensor] = {}
        while (bucket := self._get([a.next_bucket.remote() for a in self.actors], "the weight gather")[0]) is not None:
            assemble(bucket, state)
        return state

    def _get(self, refs: list[ObjectRef], what: str) -> list[Any]:
        """Every reply; the first failure (an actor that died or raised) kills the group: the others
        may be blocked in a collective with the failed rank and would never answer."""
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not ready:
                self.close()
                raise TrainerRankError(f"the trainer ranks did not answer within {self.timeout_s:.0f}s during {what}; "
                                       f"they were stopped. {RESUME_HINT}")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                rank = refs.index(ready[0])
                self.close()
                raise TrainerRankError(f"trainer rank {rank} (a Ray actor) died during {what}: {exc.__class__.__name__}; "
                                       f"the other ranks were stopped. {RESUME_HINT}") from None
            except ray.exceptions.RayTaskError as exc:
                rank = refs.index(ready[0])
                self.close()
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise TrainerRankError(f"trainer rank {rank} failed during {what}: {cause}\n{RESUME_HINT}") from None
        return ray.get(refs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        kill_actors(self.actors)


def kill_actors(actors: list[ActorHandle]) -> None:
    """Kill each actor for good (no restart); one already gone is not an error."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass


__all__ = ["RayRankGroup", "TrainerRankActor", "kill_actors"]
