"""An engine as a Ray actor (`placement: ray`): its own engine on an EngineWorker thread, in its own process.

The actor builds its engine itself (rollwise.engine.factory), as local placement does in the trainer's
process, after checking that its tokenizer is the trainer's (invariant 1). Completions leave it only
when the fleet (rollwise.control.ray.fleet) acknowledges them, and every call names the incarnation it
means: a restarted actor refuses calls meant for the one that died until the fleet has re-synced it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from rollwise.engine.outbox import Outbox
from rollwise.types.generation import Completion, GenerationRequest

if TYPE_CHECKING:
    from ray.actor import ActorClass

    from rollwise.engine.contract import Engine
    from rollwise.engine.core import EngineWorker
    from rollwise.sync.distributed import DistributedReceiver, ReceiveResult
    from rollwise.types.generation import ModelInfo
    from rollwise.types.weights import WeightManifest


class IncarnationChanged(RuntimeError):
    """A call meant for an engine actor's previous incarnation (it died and Ray restarted it)."""


# What a call to an engine actor raises when the actor it meant is gone: recover (restart + re-sync).
GONE = (RayActorError, IncarnationChanged)


class EngineActor:
    """One engine in its own process (wrapped with ray.remote by `engine_actor_class`)."""

    def __init__(self, cfg_data: dict, index: int, fingerprint: str, eos_ids: list[int] | None,
                 policy_version: int) -> None:
        self.token = uuid.uuid4().hex  # this incarnation: a restarted actor gets a new one
        self.index = index
        # Completions wait here until the fleet acknowledges them (a reply lost in transit is sent again).
        self._outbox: Outbox[Completion] = Outbox()
        self._drain_lock = threading.Lock()  # one drain or abort at a time (the actor runs 8 calls at once)
        self.worker: EngineWorker | None = None
        self.weight_rx: DistributedReceiver | None = None  # sync.sender=collective: this engine's rank in the fleet's weight group
        self.error: str | None = None
        try:
            self._start(cfg_data, fingerprint, eos_ids, policy_version)
        except Exception as exc:  # reported on the first call, not retried by restarts
            self.error = f"engine actor {index} failed to start: {exc!r}"

    def _start(self, cfg_data: dict, fingerprint: str, eos_ids: list[int] | None, policy_version: int) -> None:
        import torch

        from rollwise.config import RunConfig
        from rollwise.engine.core import EngineWorker
        from rollwise.engine.factory import create_engine
        from rollwise.model.loading import load_model, tokenizer_fingerprint

        cfg = RunConfig.model_validate(cfg_data)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model, tokenizer = load_model(cfg.model)
        mine = tokenizer_fingerprint(tokenizer)
        if mine != fingerprint:  # invariant 1: engine and trainer tokenize identically
            raise ValueError(
                f"tokenizer fingerprint mismatch: the engine actor's tokenizer for {cfg.model!r} hashes to "
                f"{mine[:16]}…, the trainer's to {fingerprint[:16]}…; every node must load the same model files"
            )
        engine = create_engine(cfg.engine, model, tokenizer, model_name=cfg.model, eos_token_ids=eos_ids,
                               policy_version=policy_version, seed=cfg.seed + self.index, tokenizer_fingerprint=mine)
        self.engine = engine
        self.worker = EngineWorker(engine, name=f"engine-{self.index}")

    def _check(self, token: str | None = None) -> EngineWorker:
        if self.error is not None:
            raise RuntimeError(self.error)
        if token is not None and token != self.token:
            # The fleet addressed the incarnation that died: nothing runs here until it has re-synced
            # this one (current weights and version first, then its requests).
            raise IncarnationChanged(f"engine actor {self.index} was restarted (incarnation {self.token[:8]})")
        assert self.worker is not None  # _start built it, or self.error says why not
        return self.worker

    # ------------------------------------------------------------ commands

    def info(self) -> dict[str, Any]:
        m = self._check().model_info()
        return {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                "node_ip": ray.util.get_node_ip_address(), "name": m.engine, "max_num_seqs": m.max_num_seqs,
                "policy_version": m.policy_version, "wall_minus_monotonic": time.time() - time.monotonic(),
                "weight_device": _weight_device(self.engine)}

    def submit(self, requests: list[GenerationRequest], token: str | None = None) -> None:
        self._check(token).submit(requests)  # all or none

    def abort(self, request_ids: list[str], ack: int, token: str | None = None
              ) -> tuple[list[Completion], list[tuple[int, Completion]]]:
        """(abort completions, unacknowledged completions). As with a local EngineWorker, a sample that
        finished before the abort must be receivable right after it: the worker queued it before running
        the abort, so it is in the second list (with everything else not yet acknowledged)."""
        worker = self._check(token)
        aborted = worker.abort(request_ids)
        with self._drain_lock:
            self._outbox.acknowledge(ack)
            self._outbox.put_many(_ready(worker))
            return aborted, self._outbox.poll(ack)

    def pause(self, token: str | None = None) -> None:
        self._check(token).pause()

    def resume(self, token: str | None = None) -> None:
        self._check(token).resume()

    def load_weights(self, manifest: WeightManifest, state_dict: dict, token: str | None = None) -> int:
        """One WeightUpdate: its manifest, and its payload (Ray resolves the fleet's ObjectRef argument
        to the tensors, read from the object store). Checked whole against this engine, then applied."""
        from rollwise.types.weight_update import WeightUpdate

        self._check(token).load_weights(WeightUpdate(manifest, state_dict))
        return manifest.version

    def join_weight_group(self, init_method: str, rank: int, world_size: int, device: str, timeout_s: float,
                          token: str | None = None) -> None:
        """Join the fleet's weight group as `rank` (sync.sender=collective; rollwise.sync.distributed),
        leaving the one joined before (the fleet re-forms the group when its engines change). Returns
        once every rank has joined; `device` is cuda (NCCL) or cpu (gloo), the fleet's choice for all."""
        from rollwise.sync.distributed import DistributedReceiver, init_weight_group

        worker = self._check(token)
        if self.weight_rx is not None:
            self.weight_rx.group.abandon()
            self.weight_rx = None
        group = init_weight_group(rank, world_size, init_method, device=device, timeout_s=timeout_s)
        self.weight_rx = DistributedReceiver(group, worker.weight_receiver())

    def receive_weights_collective(self, token: str | None = None) -> ReceiveResult:
        """Receive the next broadcast update and commit it through the same checked WeightReceiver as
        load_weights. Returns the ReceiveResult (a refusal included: the engine keeps its version);
        raises only when the transfer itself broke."""
        self._check(token)
        if self.weight_rx is None:
            raise RuntimeError(f"engine actor {self.index} is in no weight group: the fleet calls join_weight_group first")
        result = self.weight_rx.receive()
        if result is None:
            raise RuntimeError(f"engine actor {self.index}: the weight group was closed")
        return result

    def model_info(self) -> ModelInfo:
        return self._check().model_info()

    def drain(self, ack: int, timeout: float, token: str | None = None) -> list[tuple[int, Completion]]:
        """Completions after sequence number `ack` (those <= ack were received: forgotten). Waits up
        to `timeout` for the first one; one drain at a time (the fleet keeps one in flight)."""
        worker = self._check(token)
        with self._drain_lock:
            self._outbox.acknowledge(ack)
            self._outbox.put_many(_ready(worker))  # everything finished so far goes in this reply
            return self._outbox.poll(ack, timeout, refill=lambda wait: _ready(worker, wait))

    def timeline_since(self, cursor: int, token: str | None = None) -> tuple[list[tuple[float, int]], float]:
        """Timeline points from index `cursor` on, and this process's wall - monotonic clock offset."""
        tl = self._check(token).engine.timeline
        return list(tl[cursor:]), time.time() - time.monotonic()


def _weight_device(engine: Engine) -> str:
    """cuda when the engine's weights live on a GPU (its rank then joins over NCCL), else cpu (gloo)."""
    return "cuda" if engine.device.startswith("cuda") else "cpu"


def _ready(worker: EngineWorker, wait: float = 0.0) -> list[Completion]:
    """The completions the worker has finished, waiting up to `wait` seconds for the first one."""
    first = worker.next_completion(timeout=wait) if wait > 0 else None
    out = [] if first is None else [first]
    while not worker.completions.empty():
        c = worker.next_completion(timeout=0)
        if c is None:
            break
        out.append(c)
    return out


def engine_actor_class() -> ActorClass:
    return ray.remote(EngineActor)


