"""LoRA adapters in the reference engine: unmerged, per row, many in one batch.

The base weights are never touched. Each target projection's output gets `(x A^T) B^T * scaling`
added for the rows (tokens) whose sequence uses an adapter, computed in the same op order as PEFT's
LoRA Linear (`base(x) + lora_B(lora_A(x)) * scaling`), so the engine's logprobs equal the trainer's.
Unmerged (rather than merged on the fly) because one decode batch mixes sequences of different
jobs, each with its own adapter (multi-LoRA), and because loading an adapter then costs only its
own few megabytes: nothing of the base is reloaded or restored.

The model's projections call a hook (`lora_hook`, set by `AdapterSet.install`) with their input and
output; before each forward the engine says which rows belong to which adapter (`AdapterSet.rows`).

Two ways to add the deltas, chosen per forward:
- one adapter on every row: PEFT's ops exactly (two matmuls, the scaling, the add), nothing gathered;
- a mix (several adapters, or adapter and base rows): the batch's adapters stacked per module
  (`_Stack`: A's rows and B's columns side by side, cached until an adapter changes), so a module costs
  five ops however many adapters the batch holds: x A_cat^T, masked to each row's own block, times
  B_cat^T, times the row's scaling. Gathering each adapter's rows and scattering them back (the
  obvious way) costs five ops *per adapter* and two copies of its rows, which made one batch of two
  jobs cost as much as the two jobs one after the other on small models, where a decode step is its
  op count. The price is FLOPs: each row multiplies the other adapters' (zeroed) blocks too, a few
  percent of the base projection per extra rank-16 adapter at SmolLM2's width.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollwise.types.weights import AdapterSpec

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
UNEMBED = "lm_head"  # the one non-decoder-layer target: the LM head's output projection


@dataclass
class AdapterBuffer:
    """One adapter's tensors in one flat buffer, and the per-module views into it."""

    layout: tuple  # (dtype, ((module, A's shape, B's shape), ...)): what the buffer can hold
    flat: Tensor
    weights: dict[str, tuple[Tensor, Tensor]]  # module name -> (A [r, in], B [out, r]), views of `flat`

    @classmethod
    def empty(cls, layout: tuple) -> AdapterBuffer:
        dtype, modules = layout
        sizes = [math.prod(shape) for _, a, b in modules for shape in (a, b)]
        flat = torch.empty(sum(sizes), dtype=dtype)
        pieces = iter(flat.split(sizes))
        weights = {module: (next(pieces).view(a), next(pieces).view(b)) for module, a, b in modules}
        return cls(layout, flat, weights)


@dataclass
class LoadedAdapter:
    spec: AdapterSpec
    version: int
    buffer: AdapterBuffer  # where its tensors live; written again two loads of the same name later

    @property
    def weights(self) -> dict[str, tuple[Tensor, Tensor]]:
        """module name -> (A [r, in], B [out, r])"""
        return self.buffer.weights


def split_adapter_state(state: Mapping[str, Tensor]) -> tuple[dict[str, tuple[Tensor, Tensor]], list[str]]:
    """`<module>.lora_A.weight` / `<module>.lora_B.weight` pairs -> {module: (A, B)}, and problems."""
    problems: list[str] = []
    modules: dict[str, dict[str, Tensor]] = {}
    for name, tensor in state.items():
        for suffix, key in ((LORA_A, "A"), (LORA_B, "B")):
            if name.endswith(suffix):
                modules.setdefault(name.removesuffix(suffix), {})[key] = tensor
                break
        else:
            problems.append(f"{name!r} is not a LoRA tensor (<module>{LORA_A} or <module>{LORA_B})")
    pairs: dict[str, tuple[Tensor, Tensor]] = {}
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            problems.append(f"{module}: lora_A and lora_B must both be sent")
            continue
        pairs[module] = (ab["A"], ab["B"])
    return pairs, problems


class AdapterSet:
    """The adapters an engine has loaded, and the row -> adapter assignment of the current forward."""

    @classmethod
    def for_model(cls, model: nn.Module) -> AdapterSet:
        """An empty set hooked into `model`'s projections (the engine's adapter component)."""
        adapters = cls({**projection_targets(model), **unembed_target(model)})
        adapters.install(model)
        return adapters

    def __init__(self, targets: Mapping[str, tuple[int, int]]) -> None:
        self.targets = dict(targets)  # module name -> (out, in) of the base projection
        self.adapters: dict[str, LoadedAdapter] = {}
        self.default: str | None = None  # the adapter serving requests that name none
        # The current forward: one adapter on every row (`_single`), or a mix (`_mixed`: the stack of the
        # batch's adapters, each row's 0/1 mask over the stacked ranks and its scaling).
        self._single: LoadedAdapter | None = None
        self._mixed: tuple[_Stack, Tensor, Tensor] | None = None
        self._stacks: dict[tuple[int, ...], _Stack] = {}  # by the ids of the adapters stacked, in order
        self._spare: dict[str, AdapterBuffer] = {}  # per name: the buffer the next load of it writes

    # ---------------------------------------------------------------- loading

    def check(self, spec: AdapterSpec, state: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        """The adapter's (A, B) per module, or ValueError naming every problem of names and shapes (nothing is
        loaded). Values are checked by load(), on its copy."""
        pairs, problems = split_adapter_state(state)
        rank = spec.rank
        for module, (a, b) in pairs.items():
            if module not in self.targets:
                problems.append(f"{module}: not a projection of the base model "
                                "(targets: q/k/v/o, gate/up/down, lm_head)")
                continue
            out_dim, in_dim = self.targets[module]
            if tuple(a.shape) != (rank, in_dim):
                problems.append(f"{module}{LORA_A}: shape {tuple(a.shape)} != ({rank}, {in_dim})")
            if tuple(b.shape) != (out_dim, rank):
                problems.append(f"{module}{LORA_B}: shape {tuple(b.shape)} != ({out_dim}, {rank})")
        if not pairs:
            problems.append("the adapter has no tensors")
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
            raise ValueError(f"cannot load adapter {spec.name!r}: {shown}")
        return pairs

    def load(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int, dtype: torch.dtype) -> None:
        """Check, then copy in (the caller's tensors may be views of a trainer's live parameters) and check the
        values. Each name keeps two buffers and loads into the one not being served: a rejected adapter leaves
        the served one untouched, and a trainer pushing every step allocates and slices nothing after its
        second push (fresh buffers and ~800 small ops per push cost ~15 ms of SmolLM2-135M's rank-16 push)."""
        pairs = self.check(spec, state)
        layout = (dtype, tuple((m, tuple(a.shape), tuple(b.shape)) for m, (a, b) in pairs.items()))
        buffer = self._spare.pop(spec.name, None)
        if buffer is None or buffer.layout != layout:
            buffer = AdapterBuffer.empty(layout)
        with torch.no_grad():  # one fused copy (casting to the engine's dtype), as the base weights load
            torch._foreach_copy_([t for m in pairs for t in buffer.weights[m]],
                                 [t.detach() for a, b in pairs.values() for t in (a, b)])
        # A NaN or inf anywhere makes the sum non-finite (one multithreaded pass, no bool buffer); so can an
        # overflow of finite values, hence the exact per-tensor check, which only runs then.
        if not bool(torch.isfinite(buffer.flat.sum())):
            bad = [m for m, (a, b) in pairs.items() if not (torch.isfinite(a).all() and torch.isfinite(b).all())]
            if bad:
                self._spare[spec.name] = buffer
                more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
                raise ValueError(f"cannot load adapter {spec.name!r}: non-finite values in {', '.join(bad[:8])}{more}")
        replaced = self.adapters.get(spec.name)
        if replaced is not None:
            self._spare[spec.name] = replaced.buffer  # served until now; written again by the next load
        self.adapters[spec.name] = LoadedAdapter(spec, version, buffer)
        self._stacks.clear()  # a stack holding the replaced version must not serve again
        if spec.default:
            self.default = spec.name

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self._spare.pop(name, None)
        self._stacks.clear()
        if self.default == name:
            self.default = None

    def versions(self) -> dict[str, int]:
        """Served adapter name -> its version."""
        return {name: a.version for name, a in self.adapters.items()}

    def version_of(self, name: str | None, base_version: int) -> int:
        """The policy version sampling a request that names `name`: its named adapter's, else `base_version`."""
        return base_version if name is None else self.resolve(name).version

    def resolve(self, name: str | None) -> LoadedAdapter | None:
        """The adapter a request naming `name` runs with (None: the default adapter, if any)."""
        if name is None:
            return self.adapters.get(self.default) if self.default is not None else None
        if name not in self.adapters:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"adapter: {name!r} is not loaded on this engine (loaded: {loaded}); push it first "
                             "or send the request without an adapter")
        return self.adapters[name]

    # ---------------------------------------------------------------- the forward

    @contextmanager
    def rows(self, adapters: Sequence[LoadedAdapter | None], sizes: Sequence[int] | None = None) -> Iterator[None]:
        """During the block, row group i (sizes[i] consecutive rows, default 1) uses adapters[i]."""
        distinct: list[LoadedAdapter] = []
        for a in adapters:
            if a is not None and all(a is not d for d in distinct):
                distinct.append(a)
        if len(distinct) == 1 and all(a is not None for a in adapters):
            self._single = distinct[0]  # every row: PEFT's ops, nothing gathered
        elif distinct:
            stack = self._stack(distinct)
            # owner[row] = 1 + index of the row's adapter in `distinct` (0: no adapter), one per row group
            keys = torch.tensor([0 if a is None else 1 + next(i for i, d in enumerate(distinct) if d is a)
                                 for a in adapters])
            if sizes is not None:
                keys = torch.repeat_interleave(keys, torch.tensor(list(sizes)))
            self._mixed = (stack, stack.masks[keys], stack.scalings[keys])
        try:
            yield
        finally:
            self._single, self._mixed = None, None

    def _stack(self, distinct: Sequence[LoadedAdapter]) -> _Stack:
        key = tuple(id(a) for a in distinct)
        stack = self._stacks.get(key)
        if stack is None:
            if len(self._stacks) >= 16:  # batches mixing ever new subsets of many adapters: start over
                self._stacks.clear()
            stack = self._stacks[key] = _Stack.of(distinct, self.targets)
        return stack

    def add_delta(self, modules: Sequence[str], splits: Sequence[int], x: Tensor, y: Tensor) -> None:
        """y[:, part_i] += lora delta of modules[i] for each row's adapter (in place)."""
        if self._single is None and self._mixed is None:
            return
        offset = 0
        for module, width in zip(modules, splits):
            part = y[..., offset : offset + width]  # `...`: the prefill's LM head sees one row, [hidden]
            offset += width
            if self._single is not None:
                pair = self._single.weights.get(module)
                if pair is not None:
                    a, b = pair
                    # PEFT's op order: lora_B(lora_A(x)) * scaling, then added to the base output.
                    part += F.linear(F.linear(x, a), b) * self._single.spec.scaling
            elif self._mixed is not None:
                stack, mask, scaling = self._mixed
                pair = stack.weights.get(module)
                if pair is not None:
                    a, b = pair
                    # The same order per row: B(A x) (other adapters' blocks zeroed), times its scaling.
                    part += F.linear(F.linear(x, a) * mask, b) * scaling

    def install(self, model: nn.Module) -> None:
        """Set the hooks of the model's projections (see module docstring)."""
        for name, module in model.named_modules():
            fused = getattr(module, "lora_fused", None)  # (child names, output widths) of a fused matmul
            if fused is not None:
                names, widths = fused
                module.lora_hook = partial(self.add_delta, [f"{name}.{n}" for n in names], widths)
            elif name.endswith(("o_proj", "down_proj")) or (name == UNEMBED and name in self.targets):
                module.lora_hook = partial(self.add_delta, [name], [self.targets[name][0]])


@dataclass
class _Stack:
    """Several adapters side by side, per module: A's rows stacked ([sum of ranks, in]) and B's columns
    ([out, sum of ranks]), a zero block where an adapter does not target the module. `masks[k]` is the 0/1
    row over the stacked ranks that keeps adapter k-1's block (k = 0: no adapter, all zero), `scalings[k]`
    its scaling; a forward indexes both by each row's adapter."""

    weights: dict[str, tuple[Tensor, Tensor]]
    masks: Tensor  # [1 + adapters, sum of ranks]
    scalings: Tensor  # [1 + adapters, 1]

    @classmethod
    def of(cls, adapters: Sequence[LoadedAdapter], targets: Mapping[str, tuple[int, int]]) -> _Stack:
        ranks = [a.spec.rank for a in adapters]
        any_weight = next(iter(adapters[0].weights.values()))[0]
        dtype = any_weight.dtype
        masks = torch.zeros(1 + len(adapters), sum(ranks), dtype=dtype)
        start = 0
        for k, rank in enumerate(ranks):
            masks[1 + k, start : start + rank] = 1
            start += rank
        scalings = torch.tensor([[0.0]] + [[a.spec.scaling] for a in adapters], dtype=dtype)
        weights = {}
        for module in {m for a in adapters for m in a.weights}:
            out_dim, in_dim = targets[module]
            pairs = [a.weights.get(module) or (torch.zeros(r, in_dim, dtype=dtype), torch.zeros(out_dim, r, dtype=dtype))
                     for a, r in zip(adapters, ranks)]
            weights[module] = (torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs], dim=1))
        return cls(weights, masks, scalings)


def projection_targets(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target: module name -> (out, in) of its weight."""
    targets: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            out_dim, in_dim = module.weight.shape
            targets[name] = (int(out_dim), int(in_dim))
    return targets


def unembed_target(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The LM head as an adapter target (Tinker's train_unembed): its output projection only, also when it
    is tied to the embedding (the embedding lookup stays the base's). {} for a model without one."""
    head = getattr(model, UNEMBED, None)
    if head is None:
        return {}
    out_dim, in_dim = head.weight.shape
    return {UNEMBED: (int(out_dim), int(in_dim))}
