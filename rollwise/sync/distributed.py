"""torch.distributed transport: the trainer broadcasts each update in buckets to every engine process.

Layout: one *private* process group (a `WeightGroup`: its own TCPStore and gloo/NCCL group, never
torch.distributed's default group, which an in-process vLLM engine or the trainer's own data
parallelism already owns); the trainer is rank `src` (0), every other rank holds one engine. Gloo on
CPU, NCCL when the buffers live on a GPU (the NCCL path is the same code with a CUDA device; it is
not exercised on CPU-only machines). One push is:

  1. a header object (through the group's store): the manifest, plus the bucket sizes as plain ints
     so a receiver that cannot parse the manifest (version skew) still joins every broadcast that follows;
  2. one tensor broadcast per bucket; the sender flattens bucket i+1 while bucket i is on the wire
     (two reusable buffers), each receiver stages into its own buffers (they become the weights it
     hands to the engine, so staging costs no extra copy);
  3. every receiver verifies and applies (WeightReceiver.commit), then the results are gathered on
     the trainer (through the store), which raises WeightUpdateError naming every engine that refused.

Engine processes run `DistributedReceiver.serve()`, which returns when the trainer calls `close()`; a
Ray fleet (rollwise.control.ray.fleet_collective) instead asks each engine actor to `receive()` once per
update, and calls `send` and `collect` itself so it can notice a dead actor before waiting for its verdict.
"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor

from rollwise.types.bucket_layout import build_manifest, flatten_bucket, parse_manifest
from rollwise.engine.weight_receiver import StagedUpdate, WeightReceiver
from rollwise.sync.buckets import raise_if_rejected
from rollwise.types.weights import WeightManifest, WeightUpdateError
from rollwise.types.weights import AdapterSpec


@dataclass
class ReceiveResult:
    """What one engine rank reports back after an update."""

    rank: int
    version: int
    ok: bool
    error: str | None
    seconds: float  # from the header's arrival to the end of the apply (or the rejection)


def free_init_method(host: str = "127.0.0.1") -> str:
    """A tcp:// init_method on a free port of `host`, an address of this machine that the other ranks
    reach (loopback for single-machine groups; the node's IP for a Ray cluster of several nodes).
    The port is free when chosen; another process could still take it before rank 0 binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def loopback_init_method() -> str:
    """A tcp:// init_method on a free loopback port (tests, benches)."""
    return free_init_method("127.0.0.1")


class WeightGroup:
    """A process group for weight transport only, built from its own TCPStore (rank 0 hosts it).

    Why not `dist.init_process_group`: the default group belongs to someone else in a real job (vLLM
    in the trainer process creates one; so does FSDP), and there can be only one. Small objects
    (headers, results) go through the store; tensors through the gloo/NCCL group's broadcast."""

    def __init__(self, rank: int, world_size: int, init_method: str, *, device: torch.device | str = "cpu",
                 timeout_s: float = 300.0) -> None:
        url = urlparse(init_method)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": this process's current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), rank, world_size, timeout)
        self._round = 0  # every object exchange gets fresh keys

    def broadcast(self, tensor: Tensor, src: int) -> Any:
        """Async tensor broadcast; returns the work to wait() on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self._round += 1
        key = f"obj/{self._round}"
        if self.rank == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))  # noqa: S301 - written by our own rank 0 on this group

    def gather_object(self, obj: Any, dst: int) -> list[Any] | None:
        self._round += 1
        if self.rank != dst:
            self.store.set(f"gather/{self._round}/{self.rank}", pickle.dumps(obj))
            return None
        return [obj if rank == dst else pickle.loads(self.store.get(f"gather/{self._round}/{rank}"))  # noqa: S301
                for rank in range(self.world_size)]

    def close(self, timeout_s: float = 60.0) -> None:
        """Leave the group. Rank 0 hosts the store, so it waits (up to timeout_s) until every rank has
        left: dropping the store earlier would fail a receiver still reading the last header."""
        if self.store is None:
            return
        left = self.store.add("left", 1)
        deadline = time.monotonic() + timeout_s
        while self.rank == 0 and left < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            left = self.store.add("left", 0)
        self.pg = None
        self.store = None

    def abandon(self) -> None:
        """Drop the group without the goodbye (a rank died, or a transfer broke): on rank 0 this stops the
        store, so a rank still blocked on it fails at once instead of at its timeout. The group is then
        re-formed from scratch (a new init_method) by whoever owns it."""
        self.pg = None
        self.store = None


def init_weight_group(rank: int, world_size: int, init_method: str, *, device: torch.device | str = "cpu",
                      timeout_s: float = 300.0) -> WeightGroup:
    """Join a weight-transport group: NCCL for CUDA buffers, gloo for CPU ones. Every rank calls it."""
    return WeightGroup(rank, world_size, init_method, device=device, timeout_s=timeout_s)


class DistributedSender:
    """Trainer side. `push` returns once every engine has applied the version, or raises
    WeightUpdateError naming the engines that refused it (they stay on their previous version)."""

    def __init__(self, group: WeightGroup, tokenizer_fingerprint: str, *, bucket_mb: float = 64, src: int = 0,
                 rank_names: Sequence[str] | None = None) -> None:
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.bucket_mb = bucket_mb
        self.group = group
        self.src = src
        self.device = group.device
        # How a refusal names each rank ("engine 3" where the ranks hold a fleet's engines).
        self.rank_names = list(rank_names) if rank_names is not None else None
        self._buffers: list[Tensor] = []

    def name_of(self, rank: int) -> str:
        return self.rank_names[rank] if self.rank_names is not None else f"rank {rank}"

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def push(self, state_dict: Mapping[str, Tensor], version: int, *,
             adapter: AdapterSpec | None = None) -> list[ReceiveResult]:
        """Send the update, then wait for every engine's verdict (`send` + `collect`)."""
        self.send(state_dict, version, adapter=adapter)
        return self.collect(version)

    def send(self, state_dict: Mapping[str, Tensor], version: int, *,
             adapter: AdapterSpec | None = None) -> WeightManifest:
        """The header, then every bucket; returns once the last broadcast left this rank. A caller that
        can see the receivers die some other way (a Ray fleet) checks them before it calls `collect`,
        which would otherwise wait for a dead rank's verdict until the group's timeout. `adapter`: the
        state is that LoRA adapter (rollwise.sync.adapters), loaded beside the engines' base weights."""
        state = {name: tensor.detach() for name, tensor in state_dict.items()}
        manifest = build_manifest(state, version, self.tokenizer_fingerprint, self.bucket_mb)
        if adapter is not None:
            manifest = manifest.model_copy(update={"adapter": adapter})
        header = {"kind": "update", "bucket_nbytes": [b.nbytes for b in manifest.buckets],
                  "manifest": manifest.model_dump_json()}
        self.group.broadcast_object(header, self.src)
        in_flight: list[Any] = [None, None]  # double buffering: flatten one bucket while the other is sent
        try:
            for bucket in manifest.buckets:
                slot = bucket.index % 2
                if in_flight[slot] is not None:
                    in_flight[slot].wait()
                buf = flatten_bucket(bucket, state, out=self._buffer(slot, bucket.nbytes))
                in_flight[slot] = self.group.broadcast(buf, self.src)
            for slot in (0, 1):
                if in_flight[slot] is not None:
                    in_flight[slot].wait()
        finally:
            # A pending broadcast keeps the group's connections open, and a failed send's traceback keeps this
            # frame (and so the list) alive in the caller: drop them, so that abandoning the group closes the
            # connections and the receivers still waiting fail at once, not at the group's timeout.
            in_flight.clear()
        return manifest

    def collect(self, version: int) -> list[ReceiveResult]:
        """Every receiver's verdict on `version`; WeightUpdateError naming each rank that refused it."""
        results = self._gather()
        raise_if_rejected(version, [(self.name_of(r.rank), r.error or "") for r in results if not r.ok],
                          len(results))
        return results

    def _gather(self) -> list[ReceiveResult]:
        gathered = self.group.gather_object(None, self.src) or []
        return [r for r in gathered if isinstance(r, ReceiveResult)]

    def close(self) -> None:
        """Tell every engine rank to leave serve()."""
        self.group.broadcast_object({"kind": "stop"}, self.src)


# Receive buffers up to this size are kept for the next update (a LoRA adapter's every step): fresh memory
# costs a page fault per 4 KiB on first touch, ~10 us each on a VM, which made a 45 MB adapter's broadcast
# 2x slower. A full model's buffers are freed after each update: kept, they would be a second copy of the
# model resident in every engine process (on a GPU, in its memory).
KEEP_BUFFERS_MB = 256


class DistributedReceiver:
    """Engine side: receive updates from the trainer and apply them through a WeightReceiver."""

    def __init__(self, group: WeightGroup, receiver: WeightReceiver, *, src: int = 0,
                 keep_buffers_mb: float = KEEP_BUFFERS_MB) -> None:
        self.receiver = receiver
        self.group = group
        self.src = src
        self.device = group.device
        self.keep_bytes = keep_buffers_mb * 2**20
        self._kept: list[Tensor] = []  # the last small update's buffers, reused while the sizes match

    def _buffers(self, sizes: Sequence[int]) -> list[Tensor]:
        """Receive buffers for an update of these bucket sizes: the kept ones if they fit (nothing else holds
        them: the engine copied the last update in when it committed), else new ones."""
        if [b.numel() for b in self._kept] == list(sizes):
            kept, self._kept = self._kept, []
            return kept
        return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def receive(self) -> ReceiveResult | None:
        """Wait for the next update and apply it; None when the trainer closed the channel. A rejected
        update is reported to the trainer (and returned here), not raised: the engine keeps serving."""
        header = self.group.broadcast_object(None, self.src)
        if header["kind"] == "stop":
            return None
        start = time.perf_counter()
        sizes: list[int] = header["bucket_nbytes"]
        # Post every receive at once: they complete in order, and each bucket is checked as it lands
        # while the later ones are still arriving.
        buffers = self._buffers(sizes)
        works = [self.group.broadcast(buf, self.src) for buf in buffers]
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
        if sum(sizes) <= self.keep_bytes:
            self._kept = buffers
        # Release the rest before reporting: unmapping a model's worth of buffers takes a while, and it belongs
        # to this update, not to whatever the trainer sends next.
        buffers = works = staged = buf = work = None  # (the loop's names hold the last bucket)
        version = manifest.version if manifest is not None else -1
        result = ReceiveResult(rank=self.group.rank, version=version, ok=error is None, error=error,
                               seconds=time.perf_counter() - start)
        self.group.gather_object(result, self.src)
        return result

    def serve(self) -> list[ReceiveResult]:
        """Apply updates until the trainer calls close(); returns what happened to each."""
        results = []
        while (result := self.receive()) is not None:
            results.append(result)
        return results
