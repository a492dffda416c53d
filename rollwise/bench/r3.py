"""`rollwise bench r3`: an MoE policy trained with and without rollout routing replay (R3, issue 20).

The engine samples in reduced precision and the trainer computes in fp32: the source of numerical difference a
real deployment has, where the engine serves bf16 and the trainer keeps fp32 master weights. The engine runs in
bf16 where the CPU computes it natively; elsewhere its GEMMs are bf16 emulated in fp32 (rollwise.bench.bf16_gemms:
bf16-rounded weights, inputs and outputs, fp32 accumulation, as a bf16 GEMM does), because real bf16 matmuls
without bf16 instructions run ~67x slower than fp32. Two GRPO runs on the default task from the same start: one
with train.routing_replay=none, one with r3. Each step, on that step's rollouts and before its update, both
forwards are measured (replayed and live routing), whichever run is training:
- router disagreement: share of (token, layer) pairs whose experts differ from the engine's, and share of
  tokens with any layer differing (with R3 the trainer's forward uses the engine's: 0 by construction);
- logprob mismatch mean |log p_engine - log p_trainer| and k3 KL (DESIGN.md), and the share of tokens whose
  probability ratio p_trainer / p_engine is above 2 or below 1/2.
Also held-out accuracy after training, the capture size (bytes per token), what capture and replay cost (timed,
so run on an idle machine; measured first, before the long untimed runs): the engine's rollout with and without
recording the experts, the trainer's fwd+bwd with and without the replay hooks, interleaved, and their share of
a step; and the MoE-CAP sparsity-aware efficiency (activated parameters only) next to the dense model's.

Which model: `bundled:smollm2-moe` by default (1%-perturbed experts: it answers like the dense model, but a
routing flip barely changes a token, so R3 barely changes the mismatch); `--model
bundled:smollm2-moe-diverged` has experts 30% apart, where flips matter as in trained MoEs and R3 cuts the
mismatch 2.5x, at a cost in the untrained model's accuracy (docs/benchmarks/r3.md, "Expert divergence").
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch import nn

from rollwise.bench.bf16_gemms import emulated_bf16, round_weights_
from rollwise.bench.moe_cap import moe_cap, moe_cap_efficiency
from rollwise.reward.scoring import RewardConfig
from rollwise.config import load_config
from rollwise.types.train_config import TrainConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.precision import resolve_dtype
from rollwise.observe.peak import machine_peak
from rollwise.reward.scoring import score
from rollwise.tasks import make_task
from rollwise.tasks.prompts import build_messages, encode_prompt
from rollwise.train.grpo import group_advantages
from rollwise.train.logprobs import sequence_logprobs
from rollwise.train.routing_replay import RoutingReplay
from rollwise.train.trainer import GRPOTrainer, collate
from rollwise.types.routing import RoutedExperts
from rollwise.types.sample import Sample

# What the engine computes in: bf16 where the CPU computes it natively ("auto"), else fp32 with bf16 GEMMs emulated.
ENGINE_DTYPE = resolve_dtype("auto")


class BenchEngine:
    """The reference engine at the benchmark's engine precision: native bf16 where the CPU computes it, else
    bf16 GEMMs emulated in fp32 (weights re-rounded after every push, linears rounded while it generates)."""

    def __init__(self, model: nn.Module, *, max_num_seqs: int, max_model_len: int):
        self.emulated = ENGINE_DTYPE != torch.bfloat16
        self.engine = ReferenceEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                      dtype=ENGINE_DTYPE, seed=0)
        if self.emulated:
            round_weights_(self.engine.model)

    @property
    def precision(self) -> str:
        return "bf16 GEMMs emulated in fp32 (no bf16 instructions on this CPU)" if self.emulated else "bf16"

    def generate(self, requests: list[GenerationRequest]) -> list:
        with emulated_bf16() if self.emulated else nullcontext():
            return self.engine.generate(requests)

    def push(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.engine.apply_weights(weights, version)
        if self.emulated:
            round_weights_(self.engine.model)


def _prompts(tokenizer: Any, problems: list, cfg) -> list[list[int]]:
    return [encode_prompt(tokenizer, build_messages(p, cfg.prompt, cfg.reward)) for p in problems]


def _rollout(engine: BenchEngine, tokenizer: Any, task, problems, prompts, group: int, max_tokens: int,
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


def _collated(samples: list[Sample]):
    """Right-padded prompt + response rows with every response token trained (the routing records included)."""
    return collate(samples, torch.ones(sum(s.trained_tokens for s in samples)), pad_id=0)


def _advantages(samples: list[Sample], group: int) -> None:
    rewards = torch.tensor([s.reward for s in samples]).view(-1, group)
    for s, a in zip(samples, group_advantages(rewards).flatten().tolist()):
        s.advantage = a


@torch.no_grad()
def mismatch(trainer: GRPOTrainer, samples: list[Sample], mode: str) -> dict[str, float]:
    """The trainer's (fp32) forward over the rollouts, routers replayed (r3) or live (none), vs the engine.
    Uses the trainer's own router hooks, switched to `mode` for this forward."""
    batch = _collated(samples)
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


def _accuracy(engine: BenchEngine, tokenizer, task, problems, prompts, max_tokens, reward_cfg) -> float:
    samples = _rollout(engine, tokenizer, task, problems, prompts, 1, max_tokens, 0.0, 0, reward_cfg)
    return sum(s.strict_correct for s in samples) / max(len(samples), 1)


@dataclass(frozen=True)
class Workload:
    """What each of the two GRPO runs does. The full size fits this 2-core CPU in ~20 min per run on the
    373M-parameter upcycled MoE (a step is ~3 min: rollout, two measuring forwards, the update)."""

    steps: int
    prompts_per_step: int
    group: int
    max_tokens: int
    eval_problems: int
    lr: float
    cost_prompts: int  # the timed cost rollouts and trainer passes: this many prompts x group
    cost_repeats: int  # pairs (with / without) per cost, each order in half of them

    @classmethod
    def preset(cls, quick: bool, cfg, steps: int | None = None) -> Workload:
        if quick:
            return cls(steps or 2, 2, 4, 16, 8, 1e-4, 1, 2)
        return cls(steps or 6, 4, cfg.rollout.group_size, cfg.rollout.max_tokens, 64, cfg.train.lr, 1, 6)


def _run(label: str, mode: str, model: nn.Module, tokenizer: Any, setup: dict, log) -> dict[str, Any]:
    cfg, task, work = setup["cfg"], setup["task"], setup["work"]
    policy = copy.deepcopy(model)
    engine = BenchEngine(policy, max_num_seqs=setup["max_num_seqs"], max_model_len=setup["max_model_len"])
    train_cfg = TrainConfig(lr=work.lr, micro_batch_size=4, routing_replay=mode, share_prompt_prefix=False,
                            off_policy_correction="none")
    trainer = GRPOTrainer(policy, train_cfg, pad_token_id=tokenizer.pad_token_id or 0)
    rows = []
    for step in range(work.steps):
        batch = setup["batches"][step]
        started = time.perf_counter()
        samples = _rollout(engine, tokenizer, task, batch["problems"], batch["prompts"], work.group,
                           work.max_tokens, 1.0, 1000 * step, cfg.reward)
        rolled = time.perf_counter()
        _advantages(samples, work.group)
        row = {"step": step, "reward": sum(s.reward for s in samples) / len(samples),
               "response_tokens": sum(len(s.response_ids) for s in samples)}
        for measured in ("none", "r3"):
            row.update({f"{k}_{measured}": v for k, v in mismatch(trainer, samples, measured).items()})
        measured_at = time.perf_counter()
        metrics = trainer.train_step(samples)
        trained = time.perf_counter()
        engine.push(trainer.weights(), trainer.version)
        row.update(grad_norm=metrics["grad_norm"], rollout_s=rolled - started, measure_s=measured_at - rolled,
                   train_s=trained - measured_at, push_s=time.perf_counter() - trained)
        rows.append(row)
        log(f"{label}: step {step + 1}/{work.steps}, reward {row['reward']:.3f}, |dlogp| live "
            f"{row['logprob_mismatch_none']:.4f} / replayed {row['logprob_mismatch_r3']:.4f}, "
            f"router disagree live {row['routing_disagreement_none']:.4f}")
    accuracy = _accuracy(engine, tokenizer, task, setup["eval_problems"], setup["eval_prompts"],
                         work.max_tokens, cfg.reward)
    log(f"{label}: held-out strict accuracy {accuracy:.3f}")
    return {"label": label, "routing_replay": mode, "steps": rows, "heldout_accuracy": accuracy,
            "routed_bytes_per_token": samples[0].routed_experts.bytes_per_token,
            "engine_precision": engine.precision}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)  # an even count (6 balanced pairs) averages the middle two


def _cost_rollout(engine: BenchEngine, tokenizer: Any, setup: dict) -> list[Sample]:
    """The timed rollout: the first step's first `cost_prompts` prompts x group, always the same seed (so every
    repeat samples the same tokens)."""
    cfg, work, batch = setup["cfg"], setup["work"], setup["batches"][0]
    return _rollout(engine, tokenizer, setup["task"], batch["problems"][: work.cost_prompts],
                    batch["prompts"][: work.cost_prompts], work.group, work.max_tokens, 1.0, 7, cfg.reward)


def _fwd_bwd(model: nn.Module, batch, replay: RoutingReplay | None = None) -> float:
    """Seconds of one trainer forward + backward over a collated batch (R3's hooks fed when `replay` is given)."""
    started = time.perf_counter()
    if replay is not None:
        replay.begin(batch.routing)
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
    logp.sum().backward()
    if replay is not None:
        replay.end()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _costs(model: nn.Module, tokenizer: Any, setup: dict) -> dict[str, float]:
    """Timed, interleaved pairs after an untimed warm-up (the machine's drift hits both alike):
    - capture: the engine's rollout of `cost_prompts` x group samples recording every token's experts, and
      not recording them (rollwise.engine.reference: `capture_routing`);
    - replay: the trainer's fwd+bwd over those samples with live routing (no hooks) and with R3's hooks."""
    work = setup["work"]
    engine = BenchEngine(model, max_num_seqs=setup["max_num_seqs"], max_model_len=setup["max_model_len"])
    rollout_s: dict[bool, list[float]] = {True: [], False: []}
    samples = _cost_rollout(engine, tokenizer, setup)  # warm-up, untimed
    for repeat in range(work.cost_repeats):
        for capture in (True, False) if repeat % 2 == 0 else (False, True):
            engine.engine.capture_routing = capture  # one engine both ways: two copies of the weights could differ in speed
            started = time.perf_counter()
            out = _cost_rollout(engine, tokenizer, setup)  # the same seed: both ways sample the same tokens
            rollout_s[capture].append(time.perf_counter() - started)
            samples = out if capture else samples
    trainer_model = copy.deepcopy(model).train()
    collated = _collated(samples)
    _fwd_bwd(trainer_model, collated)  # warm-up, untimed
    plain, replayed, hook_s = [], [], []
    for repeat in range(work.cost_repeats):
        for with_replay in (False, True) if repeat % 2 == 0 else (True, False):
            if not with_replay:
                plain.append(_fwd_bwd(trainer_model, collated))
                continue
            replay = RoutingReplay(trainer_model, "r3")
            clock = _HookClock(replay.routers)
            try:
                replayed.append(_fwd_bwd(trainer_model, collated, replay))
                hook_s.append(clock.seconds)
            finally:
                clock.remove()
                replay.remove()
    tokens = int(collated.attention_mask.sum())
    capture_s, no_capture_s = _median(rollout_s[True]), _median(rollout_s[False])
    plain_s, replay_s = _median(plain), _median(replayed)
    # Overheads: the median over pairs of each pair's ratio (a pair ran back to back, so the machine's drift
    # between pairs cancels), not a ratio of medians.
    return {"samples": len(samples), "pairs": work.cost_repeats,
            "rollout_s_capture": capture_s, "rollout_s_no_capture": no_capture_s,
            "capture_ratios": [a / b for a, b in zip(rollout_s[True], rollout_s[False])],
            "capture_overhead": _median([a / b for a, b in zip(rollout_s[True], rollout_s[False])]) - 1,
            "trainer_tokens_per_s_live": tokens / plain_s, "trainer_tokens_per_s_r3": tokens / replay_s,
            "replay_ratios": [a / b for a, b in zip(replayed, plain)],
            "replay_overhead": _median([a / b for a, b in zip(replayed, plain)]) - 1,
            # Counted, not compared: the seconds the work itself takes, which the paired ratios above cannot
            # resolve below this machine's few-percent run-to-run spread.
            "capture_ops_s_per_rollout": _capture_ops_seconds(samples, work.max_tokens),
            "replay_hooks_s_per_fwd_bwd": _median(hook_s), "fwd_bwd_s": plain_s}


class _HookClock:
    """The seconds R3's hooks take in a forward: a forward hook prepended to each router (it runs before R3's)
    starts a clock, one appended after R3's stops it. The routers themselves run either way; what replay adds
    is its hook, plus the backward of its gate weights in place of the router's own (the same small ops)."""

    def __init__(self, routers: list[nn.Module]) -> None:
        self.seconds, self._started = 0.0, 0.0
        self._handles = [h for r in routers for h in (r.register_forward_hook(self._start, prepend=True),
                                                      r.register_forward_hook(self._stop))]

    def _start(self, module, inputs, output) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, inputs, output) -> None:
        self.seconds += time.perf_counter() - self._started

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _capture_ops_seconds(samples: list[Sample], steps: int) -> float:
    """The engine's capture work for one rollout of `samples`, counted: per decode step, stacking the layers'
    experts and keeping each sequence's row (rollwise.engine.reference), then each sample's record encoded
    (RoutedExperts.from_array), on tensors of the rollout's own shapes."""
    first = samples[0].routed_experts
    layers, k, batch = first.num_layers, first.top_k, len(samples)
    per_layer = [torch.zeros(batch, k, dtype=torch.long) for _ in range(layers)]
    started = time.perf_counter()
    rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for _ in range(steps):
        stacked = torch.stack(per_layer, dim=1)
        for kept, row in zip(rows, stacked):
            kept.append(row[None])
    for s, kept in zip(samples, rows):
        prompt = torch.zeros(len(s.prompt_ids), layers, k, dtype=torch.long)
        RoutedExperts.from_array(torch.cat([prompt, *kept]), 127)
    return time.perf_counter() - started


def step_share(result: dict[str, Any]) -> dict[str, float]:
    """Capture and replay as a share of the R3 run's mean step: the capture overhead applied to its rollout
    time, the replay overhead to its train time. Two readings: `share` from the paired wall-clock ratios of
    `_costs`, and `share_counted` from the seconds their own work was counted to take (the paired ratios
    carry this machine's few-percent run-to-run spread, the counted ones do not). The runs are not timed
    idle, but only the phases' proportions enter the share. The measuring forwards are the benchmark's, not a
    training step's, so they are left out of the step."""
    rows = next(r for r in result["runs"] if r["routing_replay"] == "r3")["steps"]
    rollout = sum(r["rollout_s"] for r in rows) / len(rows)
    train = sum(r["train_s"] for r in rows) / len(rows)
    push = sum(r["push_s"] for r in rows) / len(rows)
    cost = result["cost"]
    step = rollout + train + push

    def extra(capture: float, replay: float) -> float:  # overheads as fractions of the phase without them
        capture, replay = max(capture, 0.0), max(replay, 0.0)
        return capture * rollout / (1 + capture) + replay * train / (1 + replay)

    paired = extra(cost["capture_overhead"], cost["replay_overhead"])
    out = {"step_s": step, "rollout_s": rollout, "train_s": train, "extra_s": paired, "share": paired / step}
    if "capture_ops_s_per_rollout" in cost:
        counted = extra(cost["capture_ops_s_per_rollout"] / cost["rollout_s_no_capture"],
                        cost["replay_hooks_s_per_fwd_bwd"] / cost["fwd_bwd_s"])
        out.update(extra_s_counted=counted, share_counted=counted / step)
    return out


def make_setup(tokenizer: Any, work: Workload) -> dict[str, Any]:
    """The prompts of every step and of the held-out evaluation, and the engine's sizes."""
    cfg = load_config()
    task = make_task(cfg.task)
    train = task.problems("train")
    eval_problems = task.problems("eval")[: work.eval_problems]
    batches = []
    for step in range(work.steps):
        chosen = [train[(step * work.prompts_per_step + i) % len(train)] for i in range(work.prompts_per_step)]
        batches.append({"problems": chosen, "prompts": _prompts(tokenizer, chosen, cfg)})
    eval_prompts = _prompts(tokenizer, eval_problems, cfg)
    prompt_len = max(len(p) for p in eval_prompts + [p for b in batches for p in b["prompts"]])
    return {"cfg": cfg, "task": task, "work": work, "batches": batches, "eval_problems": eval_problems,
            "eval_prompts": eval_prompts, "max_num_seqs": max(work.prompts_per_step * work.group, len(eval_problems)),
            "max_model_len": prompt_len + work.max_tokens + 8}


def dense_efficiency(model: nn.Module, tokenizer: Any, setup: dict[str, Any]) -> dict[str, float]:
    """The dense model's side of MoE-CAP's comparison, timed as `_costs` times the MoE (the same cost rollout at
    the same engine precision, the same fwd+bwd), medians of `cost_repeats` after a warm-up: tokens/s and MFU
    (for a dense model every parameter is active)."""
    work = setup["work"]
    engine = BenchEngine(model, max_num_seqs=setup["max_num_seqs"], max_model_len=setup["max_model_len"])
    rollout_s, samples = [], []
    for repeat in range(work.cost_repeats + 1):  # the first warms up
        started = time.perf_counter()
        samples = _cost_rollout(engine, tokenizer, setup)
        rollout_s.append(time.perf_counter() - started)
    trainer_model = copy.deepcopy(model).train()
    collated = _collated(samples)
    fwd_bwd_s = [_fwd_bwd(trainer_model, collated) for _ in range(work.cost_repeats + 1)]  # the first warms up
    params = sum(p.numel() for p in model.parameters())
    engine_tps = sum(len(s.response_ids) for s in samples) / _median(rollout_s[1:])
    trainer_tps = int(collated.attention_mask.sum()) / _median(fwd_bwd_s[1:])
    return {"params": params, "engine_tokens_per_s": engine_tps, "trainer_tokens_per_s": trainer_tps,
            "engine_mfu": engine_tps * 2 * params / machine_peak(ENGINE_DTYPE).flops,
            "trainer_mfu": trainer_tps * 6 * params / machine_peak(torch.float32).flops}


def run_r3_bench(model: nn.Module, tokenizer: Any, *, quick: bool = False, seed: int = 0, steps: int | None = None,
                 dense: nn.Module | None = None, log=lambda line: None) -> dict[str, Any]:
    """`dense`: the model the MoE was upcycled from, timed beside it (MoE-CAP's comparison); None: not timed."""
    work = Workload.preset(quick, load_config(), steps)
    setup = make_setup(tokenizer, work)
    torch.manual_seed(seed)
    log("timing capture and replay (interleaved; keep the machine idle for this part)")
    cost = _costs(model, tokenizer, setup)
    dense_side = None if dense is None else dense_efficiency(dense, tokenizer, setup)
    log(f"capture {cost['capture_overhead']:+.1%} of a rollout, replay {cost['replay_overhead']:+.1%} of a fwd+bwd; "
        "the two runs follow (counts, not timed)")
    runs = [_run("without R3", "none", model, tokenizer, setup, log), _run("with R3", "r3", model, tokenizer, setup, log)]
    result = {"quick": quick, "engine_precision": runs[0]["engine_precision"], "trainer_dtype": "torch.float32",
              "numerical_difference": f"reference engine: {runs[0]['engine_precision']}; trainer fp32",
              "workload": asdict(work), "runs": runs, "cost": cost, "moe_cap": moe_cap(model), "steps": work.steps}
    result["cost_share_of_step"] = step_share(result)
    result["efficiency"] = moe_cap_efficiency(result, machine_peak(ENGINE_DTYPE).flops, machine_peak(torch.float32).flops)
    result["dense_efficiency"] = dense_side
    return result


def summary(run: dict[str, Any], measured: str) -> dict[str, float]:
    keys = ("routing_disagreement", "routing_tokens_any_disagree", "logprob_mismatch", "k3_kl", "ratio_over_2")
    return {k: sum(r[f"{k}_{measured}"] for r in run["steps"]) / len(run["steps"]) for k in keys}


def mismatch_cut(result: dict[str, Any]) -> float:
    """How many times lower the logprob mismatch is with the engine's routing replayed than live, over both
    runs' steps (the same rollouts measured both ways)."""
    live = [r["logprob_mismatch_none"] for run in result["runs"] for r in run["steps"]]
    replayed = [r["logprob_mismatch_r3"] for run in result["runs"] for r in run["steps"]]
    return sum(live) / max(sum(replayed), 1e-30)


def format_r3_bench(result: dict[str, Any]) -> Table:
    table = Table(title=f"R3: engine {result['engine_precision']} vs trainer fp32, mean over "
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
    cost, cap, share, eff = result["cost"], result["moe_cap"], result["cost_share_of_step"], result["efficiency"]
    table.caption = (f"R3 cuts |dlogp| {mismatch_cut(result):.2f}x. Capture "
                     f"{result['runs'][0]['routed_bytes_per_token']} B/token, {cost['capture_overhead']:+.1%} of a "
                     f"rollout paired (its ops counted: {cost['capture_ops_s_per_rollout'] * 1e3:.1f} ms of "
                     f"{cost['rollout_s_no_capture']:.1f} s); trainer fwd+bwd {cost['trainer_tokens_per_s_live']:.0f} "
                     f"tok/s live vs {cost['trainer_tokens_per_s_r3']:.0f} with R3 ({cost['replay_overhead']:+.1%} "
                     f"paired; its hooks counted: {cost['replay_hooks_s_per_fwd_bwd'] * 1e3:.1f} ms of "
                     f"{cost['fwd_bwd_s']:.1f} s); together {share['share']:.1%} of a {share['step_s']:.0f} s step paired, "
                     f"{share['share_counted']:.2%} counted. MoE-CAP: {cap['params_active'] / 1e6:.1f}M "
                     f"of {cap['params_total'] / 1e6:.1f}M params active (dense {cap['params_dense'] / 1e6:.1f}M), "
                     f"{cap['forward_flops_per_token'] / 1e6:.0f} MFLOP/token forward; S-MFU engine "
                     f"{eff['engine_s_mfu']:.1%} (all params: {eff['engine_mfu_all_params']:.1%}), trainer "
                     f"{eff['trainer_s_mfu']:.1%} ({eff['trainer_mfu_all_params']:.1%})"
                     + ("" if result.get("dense_efficiency") is None else
                        f"; the dense model: engine {result['dense_efficiency']['engine_mfu']:.1%}, trainer "
                        f"{result['dense_efficiency']['trainer_mfu']:.1%}"))
    return table


def main(argv: list[str] | None = None) -> int:
    """`python -m rollwise.bench.r3 --dense SPEC [--json PATH]`: only the dense model's side of the MoE-CAP
    comparison (what `rollwise bench r3` times beside an upcycled bundled MoE), at the full workload's sizes."""
    import argparse
    import json

    from rollwise.model.loading import load_model

    parser = argparse.ArgumentParser(prog="python -m rollwise.bench.r3")
    parser.add_argument("--dense", required=True, metavar="SPEC", help="the dense model, e.g. bundled:smollm2-135m-instruct")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.dense)
    result = dense_efficiency(model, tokenizer, make_setup(tokenizer, Workload.preset(False, load_config())))
    result["command"] = f"python -m rollwise.bench.r3 --dense {args.dense}"
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
