"""Many LoRA tenants training over ONE frozen base model: per-row adapter deltas in one forward.

Each tenant's adapter is its own parameters (`TenantAdapter`: A [r, in], B [out, r] per target module, PEFT's
initialisation and op order `base(x) + lora_B(lora_A(x)) * scaling`). The base model's projections carry a
forward hook (`MultiLora.install`) that, while `MultiLora.rows(...)` says which consecutive rows of the batch
belong to which adapter, adds each row's own adapter delta to the projection's output; outside that block the
hook adds nothing. So tenants sharing a base run one forward (and one backward: each tenant's loss only
reaches its own adapter, since rows never mix in a causal LM), and every tenant gets what it would get alone
up to float summation order.

The rollwise engines apply adapters the same way at sampling time (rollwise.engine.reference.lora: the
same per-row idea, the same names `<module>.lora_A.weight` / `.lora_B.weight`).

The unembedding adapter (`lm_head`, tinker's train_unembed) is applied where the target log-probs are
computed (`target_logprobs`), a chunk of rows at a time, never as a merged [vocab, hidden] weight.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rollwise.engine.reference.lora import LORA_A, LORA_B
from rollwise.train.logprobs import KEEP_PROBS_MIB, LogprobOptions, lm_head_logprobs

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"
# Tinker's LoraConfig carries no alpha; SkyRL's Tinker server uses 32, and so does this one (scaling 32 / rank).
LORA_ALPHA = 32.0
# LM-head rows at once in the target log-probs: bounds the float32 logits to CHUNK x vocab.
CHUNK_TOKENS = 1024


class TenantAdapter:
    """One tenant's LoRA adapter: trainable (A, B) per target module of the base, by the base's HF module
    names. `parameters()` lists them in a fixed order (the optimizer's and the checkpoint's)."""

    def __init__(self, modules: dict[str, tuple[int, int]], rank: int, alpha: float, seed: int | None) -> None:
        """`modules`: module name -> (out, in) of its weight."""
        if rank < 1:
            raise ValueError(f"rank {rank} must be at least 1")
        self.rank, self.alpha = rank, alpha
        # any int the client sends is a valid seed (torch takes [0, 2^64))
        generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed % 2**64)
        self.weights: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for name in sorted(modules):
            out_dim, in_dim = modules[name]
            a = torch.empty(rank, in_dim)
            # PEFT's LoRA init: A ~ kaiming_uniform(a=sqrt(5)), B = 0 (the adapter starts as the base model)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.weights[name] = (nn.Parameter(a), nn.Parameter(torch.zeros(out_dim, rank)))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The short names targeted (q_proj, ..., lm_head), as AdapterSpec.target_modules."""
        return tuple(sorted({name.rsplit(".", 1)[-1] for name in self.weights}))

    def parameters(self) -> list[nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]

    def state(self) -> dict[str, Tensor]:
        """`<module>.lora_A.weight` / `.lora_B.weight` -> tensor (live, detached views)."""
        state: dict[str, Tensor] = {}
        for name, (a, b) in self.weights.items():
            state[name + LORA_A], state[name + LORA_B] = a.detach(), b.detach()
        return state

    def load(self, state: dict[str, Tensor]) -> None:
        """Copy `state` (names and shapes as `state()`) in exactly; a mismatch -> ValueError naming tensors."""
        mine = self.state()
        if set(state) != set(mine):
            missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise ValueError(f"adapter tensors do not match this model's LoRA config: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]} (same rank and train_attn/train_mlp/train_unembed?)")
        bad = [n for n, t in state.items() if t.shape != mine[n].shape]
        if bad:
            raise ValueError(f"adapter tensors of another shape: {bad[:4]} (same rank as when saved?)")
        with torch.no_grad():
            for name, tensor in state.items():
                mine[name].copy_(tensor)

    def lm_head(self) -> tuple[Tensor, Tensor] | None:
        return self.weights.get(UNEMBED_TARGET)


def lora_modules(model: nn.Module, *, attn: bool, mlp: bool, unembed: bool) -> dict[str, tuple[int, int]]:
    """The model's projections a tenant's adapter targets: module name -> (out, in)."""
    wanted = (ATTN_TARGETS if attn else ()) + (MLP_TARGETS if mlp else ())
    modules = {name: tuple(m.weight.shape) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in wanted}
    if unembed:
        head = model.get_output_embeddings()
        modules[UNEMBED_TARGET] = tuple(head.weight.shape)
    return {name: (int(shape[0]), int(shape[1])) for name, shape in modules.items()}


@dataclass(frozen=True)
class RowGroup:
    """`rows` consecutive rows of the batch that use `adapter` (None: the base alone)."""

    adapter: TenantAdapter | None
    rows: int


class MultiLora:
    """The per-row adapter hooks of one base model (see the module docstring)."""

    @classmethod
    def install(cls, model: nn.Module) -> MultiLora:
        lora = cls()
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in ATTN_TARGETS + MLP_TARGETS:
                module.register_forward_hook(partial(lora._hook, name))
        return lora

    def __init__(self) -> None:
        self._groups: tuple[RowGroup, ...] | None = None

    @contextmanager
    def rows(self, groups: Sequence[RowGroup]) -> Iterator[None]:
        """During the block, the model's batch rows are `groups` in order (hold the base's lock around it)."""
        self._groups = tuple(groups)
        try:
            yield
        finally:
            self._groups = None

    def _hook(self, name: str, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        groups = self._groups
        if groups is None or all(g.adapter is None or name not in g.adapter.weights for g in groups):
            return None
        x = args[0]
        if len(groups) == 1:  # one adapter on every row: PEFT's ops exactly
            a, b = groups[0].adapter.weights[name]
            # .to: adapters train in float32; a base loaded in another dtype gets deltas in its own (no-op if equal)
            return output + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * groups[0].adapter.scaling
        # Each group's own rows through its own A and B (rows are consecutive: slices, no gather). Not the engine's
        # stacked adapters (every row through all adapters' ranks, masked): at tinker's default rank 32, 8 tenants
        # would stack 256 ranks, ~45% of SmolLM2's q_proj again in FLOPs, where slices cost each row its own rank.
        deltas, start = [], 0
        for group in groups:
            part = x[start : start + group.rows]
            start += group.rows
            pair = None if group.adapter is None else group.adapter.weights.get(name)
            if pair is None:
                deltas.append(output.new_zeros((group.rows, *output.shape[1:])))
            else:
                a, b = pair[0].to(x.dtype), pair[1].to(x.dtype)
                deltas.append(F.linear(F.linear(part, a), b) * group.adapter.scaling)
        return output + torch.cat(deltas)


def _lora_head_chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, a: Tensor, b: Tensor,
                     scaling: float) -> Tensor:
    a, b = a.to(hidden.dtype), b.to(hidden.dtype)
    logits = F.linear(hidden, weight, bias) + F.linear(F.linear(hidden, a), b) * scaling
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def target_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, adapter: TenantAdapter | None) -> Tensor:
    """float32 log p(targets[i] | hidden[i]) for hidden [N, H] under the LM head `head` (plus the adapter's
    lm_head LoRA, if it has one), a chunk of rows at a time. Without a head adapter: rollwise.train.logprobs'
    fused function (softmax kept for the backward up to KEEP_PROBS_MIB, else recomputed). With one: autograd
    keeps each chunk's log-softmax while all of them fit KEEP_PROBS_MIB, past that each chunk is recomputed in
    the backward (activation checkpointing), so at most one chunk's logits exist at a time."""
    pair = None if adapter is None else adapter.lm_head()
    if pair is None:
        options = LogprobOptions(chunk_tokens=CHUNK_TOKENS, fused=True)
        return lm_head_logprobs(hidden, head, targets, options)[0].float()
    recompute = torch.is_grad_enabled() and hidden.shape[0] * head.weight.shape[0] * 4 > KEEP_PROBS_MIB * 2**20
    pieces = []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        args = (hidden[start : start + CHUNK_TOKENS], head.weight, head.bias, targets[start : start + CHUNK_TOKENS],
                pair[0], pair[1], adapter.scaling)
        if recompute:
            pieces.append(checkpoint(_lora_head_chunk, *args, use_reentrant=False))
        else:
            pieces.append(_lora_head_chunk(*args))
    return torch.cat(pieces)
