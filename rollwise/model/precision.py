"""Which floating-point type matmuls run in: `engine.dtype` and `train.compute_dtype`.

float32 is exact and slow; bfloat16 is what RL frameworks run on GPUs (vLLM's default dtype for a
bf16 checkpoint, FSDP mixed precision) and, on a CPU with native bf16 dot products (AVX512-BF16 or
AMX), about twice float32's matmul rate. `auto` picks bfloat16 where the hardware has it, else
float32. The trainer keeps float32 master weights and optimizer state either way (mixed precision:
torch.autocast), so small updates are not rounded away.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

import torch

DtypeName = Literal["auto", "float32", "bfloat16"]


@cache  # the CPU does not change while we run
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in this CPU's flags. Read from /proc/cpuinfo, not torch: torch's own
    probes (torch.cpu._is_avx512_bf16_supported) are private. Without these, bf16 matmuls are emulated
    and slower than fp32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: DtypeName, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype `name` means on `device` (auto: bfloat16 when the device computes it natively)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if kind == "cpu" and cpu_has_native_bf16() else torch.float32
