"""MoE-CAP's sparsity-aware accounting for `rollwise bench r3` (rollwise.bench.r3): what an MoE's activated
parameters cost per token, and the engine's and trainer's utilisation counted that way beside the
sparsity-unaware figure a dense-model MFU formula gives."""

from __future__ import annotations

from typing import Any

from torch import nn

from rollwise.train.routing_replay import find_routers


def moe_cap(model: nn.Module) -> dict[str, float]:
    """MoE-CAP's sparsity-aware counts: only the experts a token is routed to count toward its FLOPs and the
    bytes a decode step reads. Returns total and activated parameters, FLOPs per token (2N forward, 6N
    trained), and the dense model's (one expert's MLP per layer, as the model was upcycled from)."""
    routers = find_routers(model)
    total = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    num_experts, top_k = routers[0].weight.shape[0], routers[0].top_k
    router_params = sum(r.weight.numel() for r in routers)
    active = total - expert_params + expert_params * top_k // num_experts
    dense = total - expert_params - router_params + expert_params // num_experts
    return {"params_total": total, "params_active": active, "params_dense": dense, "experts": num_experts,
            "top_k": top_k, "forward_flops_per_token": 2 * active, "train_flops_per_token": 6 * active,
            "dense_forward_flops_per_token": 2 * dense, "decode_bytes_per_token_fp32": 4 * active,
            "decode_bytes_per_token_bf16": 2 * active}


def moe_cap_efficiency(result: dict[str, Any], engine_peak: float, trainer_peak: float) -> dict[str, float]:
    """MoE-CAP's sparsity-aware utilisation (S-MFU: only activated parameters count) of the engine (the R3 run's
    rollouts: 2 x active FLOPs per sampled token; prefill's few prompt tokens left out) and the trainer (the
    timed fwd+bwd: 6 x active per position), beside the sparsity-unaware figure that counts every parameter
    (what a dense-model MFU formula reports for an MoE, overstating its work by total / active)."""
    cap, cost = result["moe_cap"], result["cost"]
    rows = next(r for r in result["runs"] if r["routing_replay"] == "r3")["steps"]
    engine_tps = sum(r["response_tokens"] for r in rows) / sum(r["rollout_s"] for r in rows)
    trainer_tps = cost["trainer_tokens_per_s_live"]
    return {"engine_peak_flops": engine_peak, "trainer_peak_flops": trainer_peak,
            "engine_tokens_per_s": engine_tps, "trainer_tokens_per_s": trainer_tps,
            "engine_s_mfu": engine_tps * cap["forward_flops_per_token"] / engine_peak,
            "engine_mfu_all_params": engine_tps * 2 * cap["params_total"] / engine_peak,
            "trainer_s_mfu": trainer_tps * cap["train_flops_per_token"] / trainer_peak,
            "trainer_mfu_all_params": trainer_tps * 6 * cap["params_total"] / trainer_peak}
