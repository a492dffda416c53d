"""What one job may take of the pool's host memory: an attach is refused before the pool commits memory it has
not got (issue 43: 60 attaches in half a second each loaded a model, without limit).

A job's *footprint* is what the pool may come to hold for it, counted when it attaches, from its loaded model:
the model the job attached with (kept as the template its engines are built from), the pool's copy of its
latest pushed weights, and one engine per slot (active or sleeping, each with its own weights and KV cache).
The LoRA jobs of one base share that base's engines: the first one counts them, the others only their own
template (adapters are small). `MemoryBudget` refuses a job whose footprint does not fit in what is left of
the budget (`--memory-budget`, by default 90% of the memory the machine had available when the pool started),
nor in what the machine has available now, with a 503 saying both numbers and what to do.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from rollwise.observe.memory import GIB, MemoryReading, read_memory
from rollwise.pool.jobs import PoolError

AUTO_FRACTION = 0.9  # of the memory available at start-up, when no budget is given


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers (tied tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def kv_bytes(config: object, max_num_seqs: int, max_model_len: int, dtype_bytes: int = 4) -> int:
    """One engine's KV cache for this model: keys and values of every layer for every sequence position."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", 0) or 0) // heads)
    return 2 * layers * kv_heads * head_dim * max_num_seqs * max_model_len * dtype_bytes


def footprint(model_bytes: int, kv: int, engines: int, *, lora: bool, base_held: bool) -> int:
    """Host bytes the pool may come to hold for one job (see the module docstring)."""
    if lora and base_held:
        return model_bytes
    engine_copies = engines * (model_bytes + kv)
    return model_bytes + engine_copies + (0 if lora else model_bytes)


class MemoryBudget:
    """The host memory the pool lets its jobs hold. `budget_bytes` None: AUTO_FRACTION of what is available now."""

    def __init__(self, budget_bytes: int | None = None, read: Callable[[], MemoryReading] = read_memory) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"--memory-budget must be > 0, got {budget_bytes / GIB:g} GiB")
        self.read = read
        self.budget = budget_bytes if budget_bytes is not None else int(read().available * AUTO_FRACTION)

    def check(self, job: str, need: int, committed: int) -> None:
        """Refuse (503, Retry-After) a job needing `need` bytes when the jobs attached hold `committed`."""
        left = self.budget - committed
        available = self.read().available
        if need <= left and need <= available:
            return
        why = (f"it needs about {need / GIB:.2f} GiB of host memory (its model, the pool's copy of its weights and "
               f"an engine per slot) and the pool's budget has {max(left, 0) / GIB:.2f} GiB of "
               f"{self.budget / GIB:.2f} GiB left" if need > left else
               f"it needs about {need / GIB:.2f} GiB of host memory and the machine has only "
               f"{available / GIB:.2f} GiB available")
        raise PoolError(503, f"job {job!r} does not fit in the pool's memory: {why}; wait for a job to detach, "
                             "attach a smaller model, or start the pool with more --memory-budget (or fewer "
                             "--engines)", "model", retry_after=30)
