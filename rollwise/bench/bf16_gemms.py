"""bf16 GEMMs computed in fp32: an engine's bf16 numerics on a CPU that has no bf16 instructions.

`rollwise bench r3` needs the engine to compute in reduced precision while the trainer stays in fp32 (that
difference is what flips MoE routers). A bf16 GEMM reads bf16 operands, accumulates in fp32 and writes a bf16
result. So an fp32 forward whose weights were rounded to bf16 (once, and again after every weight push) and
whose linear layers round their input and their output to bf16 computes what a bf16 engine's GEMMs compute, up
to the order of the fp32 sums. That is the whole point of this module: on a CPU without AVX512-BF16 or AMX,
torch's real bf16 matmul is emulated in software and ran 67x slower than fp32 here (1.1 vs 77 GFLOP/s at
[64 x 576] x [576 x 1536]), which would make the benchmark take hours.

What it does not round: attention, norms, the SiLU product and residual adds stay fp32 (a bf16 engine would
round those too), so the difference it produces is at most a bf16 engine's; the benchmark says so.
`emulated_bf16()` is a TorchFunctionMode, so it covers every `F.linear` in the forward (modules, fused
projections, the experts' and the router's), in the thread that enters it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


def round_to_bf16(t: Tensor) -> Tensor:
    """The nearest bf16 value of every element, kept in t's (wider) dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


@torch.no_grad()
def round_weights_(model: nn.Module) -> None:
    """Round every floating-point parameter of `model` to bf16 in place (fused views included)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.copy_(round_to_bf16(p))


class _Bf16Linear(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # operands rounded, fp32 accumulation, result rounded: a bf16 GEMM
            x, *rest = args
            return round_to_bf16(func(round_to_bf16(x), *rest, **kwargs))
        return func(*args, **kwargs)


@contextmanager
def emulated_bf16() -> Iterator[None]:
    """Every F.linear in this thread computes as a bf16 GEMM would (weights must be bf16-rounded already:
    `round_weights_`; rounding them per call would copy every weight on every step)."""
    with _Bf16Linear():
        yield
