"""torch.distributed transport: the trainer broadcasts each update in buckets to every engine process.

Layout: one process group; the trainer is rank `src` (0), every other rank holds one engine. Gloo
on CPU, NCCL when the buffers live on a GPU (the NCCL path is the same code with a CUDA device; it
is not exercised on CPU-only machines). One push is:

  1. a header object (broadcast_object_list): the manifest, plus the bucket sizes as plain ints so a
     receiver that cannot parse the manifest (version skew) still joins every broadcast that follows;
  2. one tensor broadcast per bucket; the sender flattens bucket i+1 while bucket i is on the wire
     (two reusable buffers), each receiver stages into its own buffers (they become the weights it
     hands to the engine, so staging costs no extra copy);
  3. every receiver verifies and applies (WeightReceiver.commit), then the results are gathered on
     the trainer, which raises WeightUpdateError naming every engine that refused.

Engine processes run `DistributedReceiver.serve()`, which returns when the trainer calls `close()`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rollwise.sync.buckets import (
    StagedUpdate,
    WeightManifest,
    WeightReceiver,
    WeightUpdateError,
    build_manifest,
    flatten_bucket,
    parse_manifest,
    raise_if_rejected,
)


@dataclass
class ReceiveResult:
    """What one engine rank reports back after an update."""

    rank: int
    version: int
    ok: bool
    error: str | None
    seconds: float  # from the header's arrival to the end of the apply (or the rejection)


def loopback_init_method() -> str:
    """A tcp:// init_method on a free loopback port (for single-machine groups: tests, benches).
    The port is free when chosen; another process could still take it before rank 0 binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_weight_group(rank: int, world_size: int, init_method: str, *, device: torch.device | str = "cpu",
                      timeout_s: float = 300.0) -> None:
    """Join the default process group: NCCL for CUDA buffers, gloo for CPU ones."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _default_device(group: Any) -> torch.device:
    # NCCL only moves CUDA tensors; everything else here is gloo on CPU.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_header(header: dict | None, src: int, group: Any, device: torch.device) -> dict:
    box = [header]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


class DistributedSender:
    """Trainer side. `push` returns once every engine has applied the version, or raises
    WeightUpdateError naming the engines that refused it (they stay on their previous version)."""

    def __init__(self, tokenizer_fingerprint: str, *, bucket_mb: float = 64, group: Any = None, src: int = 0,
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedSender needs a process group: call init_weight_group first")
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.bucket_mb = bucket_mb
        self.group = group
        self.src = src
        self.device = torch.device(device) if device is not None else _default_device(group)
        self._buffers: list[Tensor] = []

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def push(self, state_dict: Mapping[str, Tensor], version: int) -> list[ReceiveResult]:
        state = {name: tensor.detach() for name, tensor in state_dict.items()}
        manifest = build_manifest(state, version, self.tokenizer_fingerprint, self.bucket_mb)
        header = {"kind": "update", "bucket_nbytes": [b.nbytes for b in manifest.buckets],
                  "manifest": manifest.model_dump_json()}
        _broadcast_header(header, self.src, self.group, self.device)
        in_flight: list[Any] = [None, None]  # double buffering: flatten one bucket while the other is sent
        for bucket in manifest.buckets:
            slot = bucket.index % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()
            buf = flatten_bucket(bucket, state, out=self._buffer(slot, bucket.nbytes))
            in_flight[slot] = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
        for work in in_flight:
            if work is not None:
                work.wait()
        results = self._gather()
        raise_if_rejected(version, [(f"rank {r.rank}", r.error or "") for r in results if not r.ok], len(results))
        return results

    def _gather(self) -> list[ReceiveResult]:
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.gather_object(None, gathered, dst=self.src, group=self.group)
        return [r for r in gathered if isinstance(r, ReceiveResult)]

    def close(self) -> None:
        """Tell every engine rank to leave serve()."""
        _broadcast_header({"kind": "stop"}, self.src, self.group, self.device)


class DistributedReceiver:
    """Engine side: receive updates from the trainer and apply them through a WeightReceiver."""

    def __init__(self, receiver: WeightReceiver, *, group: Any = None, src: int = 0,
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedReceiver needs a process group: call init_weight_group first")
        self.receiver = receiver
        self.group = group
        self.src = src
        self.device = torch.device(device) if device is not None else _default_device(group)

    def receive(self) -> ReceiveResult | None:
        """Wait for the next update and apply it; None when the trainer closed the channel. A rejected
        update is reported to the trainer (and returned here), not raised: the engine keeps serving."""
        header = _broadcast_header(None, self.src, self.group, self.device)
        if header["kind"] == "stop":
            return None
        start = time.perf_counter()
        sizes: list[int] = header["bucket_nbytes"]
        # Post every receive at once: they complete in order, and each bucket is checked as it lands
        # while the later ones are still arriving.
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        works = [dist.broadcast(buf, src=self.src, group=self.group, async_op=True) for buf in buffers]
        manifest: WeightManifest | None = None
        error: str | None = None
        try:
            manifest = parse_manifest(header["manifest"], "the trainer's manifest")
            if [b.nbytes for b in manifest.buckets] != sizes:
                raise WeightUpdateError("the header's bucket sizes disagree with the manifest; nothing was applied")
            self.receiver.check(manifest)  # fail early, but keep joining the broadcasts below
        except WeightUpdateError as exc:
            error = str(exc)
        staged = StagedUpdate(manifest) if manifest is not None and error is None else None
        for index, (buf, work) in enumerate(zip(buffers, works)):
            work.wait()
            if staged is not None:
                staged.add_flat(index, buf)
        if staged is not None:
            try:
                self.receiver.commit(staged)
            except WeightUpdateError as exc:
                error = str(exc)
        version = manifest.version if manifest is not None else -1
        result = ReceiveResult(rank=dist.get_rank(), version=version, ok=error is None, error=error,
                               seconds=time.perf_counter() - start)
        dist.gather_object(result, None, dst=self.src, group=self.group)
        return result

    def serve(self) -> list[ReceiveResult]:
        """Apply updates until the trainer calls close(); returns what happened to each."""
        results = []
        while (result := self.receive()) is not None:
            results.append(result)
        return results
