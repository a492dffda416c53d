"""`rollwise bench r3`: an MoE policy trained with and without rollout routing replay (R3, issue 20).

The engine samples in reduced precision (the reference engine in bf16: the source of numerical difference a
real deployment has, where the engine serves bf16 and the trainer keeps fp32 master weights) and the trainer
computes in fp32. Two GRPO runs on the default task from the same start: one with train.routing_replay=none,
one with r3. Each step, on that step's rollouts and before its update, both forwards are measured (replayed
and live routing), whichever run is training:
- router disagreement: share of (token, layer) pairs whose experts differ from the engine's, and share of
  tokens with any layer differing (with R3 the trainer's forward uses the engine's: 0 by construction);
- logprob mismatch mean |log p_engine - log p_trainer| and k3 KL (DESIGN.md), and the share of tokens whose
  probability ratio p_trainer / p_engine is above 2 or below 1/2.
Also held-out accuracy after training, the capture size (bytes per token), the cost of replay in the
trainer (fwd+bwd tokens/s with and without the replay hooks: timed, run on an idle machine), and the
MoE-CAP sparsity-aware efficiency (activated parameters only) next to the dense model's.

Which model: `bundled:smollm2-moe` by default (1%-perturbed experts: it answers like the dense model, but a
routing flip barely changes a token, so R3 barely changes the mismatch); `--model
bundled:smollm2-moe-diverged` has experts 30% apart, where flips matter as in trained MoEs and R3 cuts the
mismatch 2.5x, at a cost in the untrained model's accuracy (docs/benchmarks.md, "Expert divergence").
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from rich.table import Table
from torch import nn

from rollwise.config import RewardConfig, TrainConfig, load_config
from rollwise.engine.reference import ReferenceEngine
from rollwise.engine.types import GenerationRequest, SamplingParams
from rollwise.reward.scoring import score
from rollwise.tasks import build_messages, encode_prompt, make_task
from rollwise.train.grpo import group_advantages
from rollwise.train.logprobs import sequence_logprobs
from rollwise.train.routing_replay import RoutingReplay, find_routers
from rollwise.train.trainer import GRPOTrainer, collate
from rollwise.types.sample import Sample

ENGINE_DTYPE = torch.bfloat16


def _prompts(tokenizer: Any, problems: list, cfg) -> list[list[int]]:
    return [encode_prompt(tokenizer, build_messages(p, cfg.prompt, cfg.reward)) for p in problems]


def _rollout(engine: ReferenceEngine, tokenizer: Any, task, problems, prompts, group: int, max_tokens: int,
             temperature: float, seed: int, reward_cfg: RewardConfig) -> list[Sample]:
    requests = [GenerationRequest(f"s{seed}-{i}", ids, SamplingParams(max_tokens=max_tokens, n=group,
                                                                      temperature=temperature, seed=seed + 97 * i))
                for i, ids in enumerate(prompts)]
    samples = []
    for c in engine.generate(requests):
        problem = problems[int(c.request_id.rsplit("-", 1)[1])]
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        result = score(problem, task, text, c.finish_reason, reward_cfg)
        s = Sample.from_completion(c, problem_id=problem.id, response_text=text)
        s.reward, s.strict_correct = result.reward, result.strict_correct
        samples.append(s)
    return samples


def _advantages(samples: list[Sample], group: int) -> None:
    rewards = torch.tensor([s.reward for s in samples]).view(-1, group)
    for s, a in zip(samples, group_advantages(rewards).flatten().tolist()):
        s.advantage = a


@torch.no_grad()
def mismatch(trainer: GRPOTrainer, samples: list[Sample], mode: str) -> dict[str, float]:
    """The trainer's (fp32) forward over the rollouts, routers replayed (r3) or live (none), vs the engine.
    Uses the trainer's own router hooks, switched to `mode` for this forward."""
    batch = collate(samples, torch.ones(sum(s.trained_tokens for s in samples)), pad_id=0)
    replay, trained_mode = trainer.routing, trainer.routing.mode
    replay.mode = mode
    try:
        replay.begin(batch.routing)
        logp, _ = sequence_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.target_mask)
        replay.end()
        routing = replay.take_metrics()
    finally:
        replay.mode = trained_mode
    delta = batch.behaviour_logp - logp  # log p_engine - log p_trainer
    return {"routing_disagreement": routing["routing_disagreement"],
            "routing_tokens_any_disagree": routing["routing_tokens_any_disagree"],
            "logprob_mismatch": float(delta.abs().mean()), "k3_kl": float((torch.exp(-delta) + delta - 1).mean()),
            "ratio_over_2": float((delta.abs() > math.log(2)).float().mean())}


def _accuracy(engine, tokenizer, task, problems, prompts, max_tokens, reward_cfg) -> float:
    samples = _rollout(engine, tokenizer, task, problems, prompts, 1, max_tokens, 0.0, 0, reward_cfg)
    return sum(s.strict_correct for s in samples) / max(len(samples), 1)


def _run(label: str, mode: str, model: nn.Module, tokenizer: Any, setup: dict) -> dict[str, Any]:
    cfg, task, steps, group = setup["cfg"], setup["task"], setup["steps"], setup["group"]
    policy = copy.deepcopy(model)
    engine = ReferenceEngine(policy, max_num_seqs=setup["max_num_seqs"], max_model_len=setup["max_model_len"],
                             dtype=ENGINE_DTYPE, seed=0)
    train_cfg = TrainConfig(lr=setup["lr"], micro_batch_size=4, routing_replay=mode, share_prompt_prefix=False,
                            off_policy_correction="none")
    trainer = GRPOTrainer(policy, train_cfg, pad_token_id=tokenizer.pad_token_id or 0)
    rows = []
    for step in range(steps):
        batch = setup["batches"][step]
        samples = _rollout(engine, tokenizer, task, batch["problems"], batch["prompts"], group, setup["max_tokens"],
                           1.0, 1000 * step, cfg.reward)
        _advantages(samples, group)
        row = {"step": step, "reward": sum(s.reward for s in samples) / len(samples)}
        for measured in ("none", "r3"):
            row.update({f"{k}_{measured}": v for k, v in mismatch(trainer, samples, measured).items()})
        metrics = trainer.train_step(samples)
        row["grad_norm"] = metrics["grad_norm"]
        engine.update_weights(trainer.weights(), trainer.version)
        rows.append(row)
    accuracy = _accuracy(engine, tokenizer, task, setup["eval_problems"], setup["eval_prompts"],
                         setup["max_tokens"], cfg.reward)
    return {"label": label, "routing_replay": mode, "steps": rows, "heldout_accuracy": accuracy,
            "routed_bytes_per_token": samples[0].routed_experts.bytes_per_token}


def _replay_cost(model: nn.Module, samples: list[Sample], repeats: int) -> dict[str, float]:
    """Timed: trainer fwd+bwd tokens/s with live routing (no hooks) and with R3's hooks, on one batch."""
    batch = collate(samples, torch.ones(sum(s.trained_tokens for s in samples)), pad_id=0)
    tokens = int(batch.attention_mask.sum())

    def once(replay: RoutingReplay | None) -> float:
        start = time.perf_counter()
        if replay is not None:
            replay.begin(batch.routing)
        logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
        logp.sum().backward()
        if replay is not None:
            replay.end()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    plain, replayed = [], []
    for _ in range(repeats):  # interleaved pairs: the machine's drift hits both alike
        plain.append(once(None))
        replay = RoutingReplay(model, "r3")
        try:
            replayed.append(once(replay))
        finally:
            replay.remove()
    plain_s, replay_s = sorted(plain)[len(plain) // 2], sorted(replayed)[len(replayed) // 2]
    return {"trainer_tokens_per_s_live": tokens / plain_s, "trainer_tokens_per_s_r3": tokens / replay_s,
            "replay_overhead": replay_s / plain_s - 1}


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


def run_r3_bench(model: nn.Module, tokenizer: Any, *, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    cfg = load_config()
    task = make_task(cfg.task)
    steps, prompts_per_step, group, max_tokens = (2, 2, 4, 16) if quick else (8, 8, 8, 96)
    train = task.problems("train")
    eval_problems = task.problems("eval")[: 8 if quick else 64]
    batches = []
    for step in range(steps):
        chosen = [train[(step * prompts_per_step + i) % len(train)] for i in range(prompts_per_step)]
        batches.append({"problems": chosen, "prompts": _prompts(tokenizer, chosen, cfg)})
    eval_prompts = _prompts(tokenizer, eval_problems, cfg)
    prompt_len = max(len(p) for p in eval_prompts + [p for b in batches for p in b["prompts"]])
    setup = {"cfg": cfg, "task": task, "steps": steps, "group": group, "max_tokens": max_tokens,
             "batches": batches, "eval_problems": eval_problems, "eval_prompts": eval_prompts,
             "max_num_seqs": max(prompts_per_step * group, len(eval_problems)),
             "max_model_len": prompt_len + max_tokens + 8, "lr": 1e-5 if not quick else 1e-4}
    torch.manual_seed(seed)
    runs = [_run("without R3", "none", model, tokenizer, setup), _run("with R3", "r3", model, tokenizer, setup)]
    engine = ReferenceEngine(model, max_num_seqs=setup["max_num_seqs"], max_model_len=setup["max_model_len"],
                             dtype=ENGINE_DTYPE, seed=0)
    cost_samples = _rollout(engine, tokenizer, task, batches[0]["problems"], batches[0]["prompts"], group,
                            max_tokens, 1.0, 7, cfg.reward)
    return {"quick": quick, "engine_dtype": str(ENGINE_DTYPE), "trainer_dtype": "torch.float32",
            "numerical_difference": "reference engine in bf16 vs trainer in fp32",
            "runs": runs, "cost": _replay_cost(copy.deepcopy(model).train(), cost_samples, 2 if quick else 5),
            "moe_cap": moe_cap(model), "steps": steps, "prompts_per_step": prompts_per_step, "group": group,
            "max_tokens": max_tokens}


def summary(run: dict[str, Any], measured: str) -> dict[str, float]:
    keys = ("routing_disagreement", "routing_tokens_any_disagree", "logprob_mismatch", "k3_kl", "ratio_over_2")
    return {k: sum(r[f"{k}_{measured}"] for r in run["steps"]) / len(run["steps"]) for k in keys}


def format_r3_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"R3: engine {result['engine_dtype']} vs trainer fp32, mean over "
                        f"{result['steps']} steps (trainer forward with live routing / with the engine's replayed)")
    for col in ("run", "forward", "router disagree", "tokens any-layer", "|dlogp|", "k3 KL", "ratio>2",
                "held-out acc"):
        table.add_column(col)
    for run in result["runs"]:
        for measured in ("none", "r3"):
            m = summary(run, measured)
            table.add_row(run["label"], "live" if measured == "none" else "replayed",
                          f"{m['routing_disagreement']:.4f}", f"{m['routing_tokens_any_disagree']:.4f}",
                          f"{m['logprob_mismatch']:.2e}", f"{m['k3_kl']:.2e}", f"{m['ratio_over_2']:.4f}",
                          f"{run['heldout_accuracy']:.3f}")
    cost, cap = result["cost"], result["moe_cap"]
    table.caption = (f"capture {result['runs'][0]['routed_bytes_per_token']} B/token; trainer fwd+bwd "
                     f"{cost['trainer_tokens_per_s_live']:.0f} tok/s live vs {cost['trainer_tokens_per_s_r3']:.0f} "
                     f"with R3 (overhead {cost['replay_overhead']:+.1%}); MoE-CAP: {cap['params_active'] / 1e6:.1f}M "
                     f"of {cap['params_total'] / 1e6:.1f}M params active (dense {cap['params_dense'] / 1e6:.1f}M), "
                     f"{cap['forward_flops_per_token'] / 1e6:.0f} MFLOP/token forward")
    return table
