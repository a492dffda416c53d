"""torch.distributed for the sharded trainer: a rank's process group, FSDP2 sharding, weight gathering.

Each rank joins one process group over a TCP store on loopback (gloo on CPU, NCCL on CUDA) and
shards the model the torchtitan way: `fully_shard` on every decoder layer, then on the root (which
keeps the embeddings, the final norm and the LM head). Gradients are reduce-scattered as a SUM,
not FSDP's default mean: the loss weights are already divided by the global token (or sequence)
count (rollwise.train.grpo.token_weights), so N ranks compute one process's gradient.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

MIB = 2**20


@dataclass(frozen=True)
class RankSpec:
    """What one rank process needs to join the group."""

    rank: int
    world_size: int
    port: int  # the TCP store on `host` (rank 0's node)
    device: Literal["cpu", "cuda"]
    threads: int  # torch CPU threads of this rank (the machine's cores split between ranks)
    mixed_precision: Literal["none", "bf16"] = "none"
    cpu_offload: bool = False
    host: str = "127.0.0.1"  # rank 0's node: loopback for local ranks, its address for Ray actors
    local_rank: int | None = None  # the device index on this node (None: `rank`, one node)
    from_env: bool = False  # a launcher (torchrun) started this rank: join with its env:// rendezvous
    # A collective waiting longer than this fails the rank: the backstop for a peer that hangs (a
    # peer that dies is seen at once by the controller, which watches every rank's process). Long
    # enough for rank 0 to write a full checkpoint while the others wait at the barrier.
    timeout_s: float = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device == "cuda" else "cpu"


def init_rank(spec: RankSpec) -> torch.device:
    """Join the process group; returns this rank's device. (Untested on CUDA/NCCL: no GPU here.)"""
    torch.set_num_threads(max(spec.threads, 1))
    if spec.device == "cuda":
        index = spec.rank if spec.local_rank is None else spec.local_rank
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
    # env://: torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (rank 0 must not bind it).
    init_method = "env://" if spec.from_env else f"tcp://{spec.host}:{spec.port}"
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo",
                            init_method=init_method, rank=spec.rank,
                            world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s))
    return device


def shard_model(root: nn.Module, layers: Iterable[nn.Module], spec: RankSpec) -> None:
    """FSDP2 over one data-parallel mesh: each layer its own unit, the root the rest."""
    mesh = dist.device_mesh.init_device_mesh(spec.device, (spec.world_size,))
    kwargs: dict = {"mesh": mesh}
    if spec.mixed_precision == "bf16":  # bf16 compute, fp32 gradient reduction (untested: CPU only here)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.cpu_offload:  # parameters, gradients and optimizer state stay in CPU memory (untested)
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    # The root's parameters (embeddings, LM head) are used again right away in backward: keep them.
    fully_shard(root, reshard_after_forward=False, **kwargs)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # SUM: the loss weights already hold the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def gathered_buckets(state: Mapping[str, Tensor], bucket_mb: float) -> Iterator[list[tuple[str, Tensor | str]]]:
    """The full tensors of a sharded `state` (keep_vars=True, so tied parameters are one object),
    a bucket of at most `bucket_mb` MiB at a time: only one bucket is ever gathered on a rank.
    Every rank must iterate (each full_tensor() is an all-gather); a tied name comes as the name of
    the tensor it shares. Tensors are on the CPU."""
    limit = bucket_mb * MIB
    seen: dict[int, str] = {}
    bucket: list[tuple[str, Tensor | str]] = []
    size = 0
    for name, tensor in state.items():
        if id(tensor) in seen:
            bucket.append((name, seen[id(tensor)]))
            continue
        seen[id(tensor)] = name
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        bucket.append((name, full.detach().to("cpu", copy=True)))
        size += nbytes
    if bucket:
        yield bucket
