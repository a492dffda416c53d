"""Model-FLOPs accounting (rollwise.observe.flops) against an independent count, and the peak cache.

torch.utils.flop_counter.FlopCounterMode counts the FLOPs of every matmul a real forward / backward
of a tiny Llama runs (eager attention, so attention's matmuls are counted too). Our count must match
it exactly where the two count the same thing: the weight matmuls of a prefill, a whole decode step
with a KV cache (its attention is causal by construction), and the 2x backward rule.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rollwise.model.tiny import tiny_llama
from rollwise.observe.flops import DenseModel, generation_flops, training_flops, utilisation
from rollwise.observe.metrics import LoopMeter, StepTimes
from rollwise.observe import peak as peak_module
from rollwise.observe.peak import Peak, datasheet_peak, machine_peak
from rollwise.types.microbatch import chunk_samples
from rollwise.types.sample import Sample


def _counted(fn) -> dict[str, int]:
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.fixture(scope="module")
def model() -> nn.Module:
    m = tiny_llama(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2)
    m.set_attn_implementation("eager")  # attention as plain matmuls, which FlopCounterMode counts
    return m.eval()


def test_parameter_count_from_config_matches_the_models_matrices(model):
    spec = DenseModel.from_hf_config(model.config)
    layer_matrices = sum(mod.weight.numel() for name, mod in model.named_modules()
                         if isinstance(mod, nn.Linear) and name.startswith("model.layers."))
    assert spec.body_params == layer_matrices
    assert spec.head_params == model.get_output_embeddings().weight.numel()


def test_prefill_weight_matmuls_match_flop_counter(model):
    spec = DenseModel.from_hf_config(model.config)
    length, keep = 23, 5
    ids = torch.randint(0, 50, (1, length))
    counts = _counted(lambda: model(ids, logits_to_keep=keep))
    # mm: every weight matrix (layers at every position, LM head at `keep`); bmm: eager attention,
    # which computes the full length x length scores before masking (not model FLOPs: half is masked).
    assert counts["mm"] == spec.forward_flops(0, length, keep) - _attention(spec, 0, length)
    assert counts["bmm"] == 4 * spec.shape.num_layers * spec.shape.num_heads * spec.shape.head_dim * length * length


def _attention(spec: DenseModel, start: int, end: int) -> float:
    return spec.forward_flops(start, end, 0) - 2 * spec.body_params * (end - start)


def test_decode_step_matches_flop_counter_attention_included(model):
    spec = DenseModel.from_hf_config(model.config)
    with torch.no_grad():
        cache = model(torch.randint(0, 50, (1, 17)), use_cache=True).past_key_values
        counts = _counted(lambda: model(torch.tensor([[7]]), past_key_values=cache, use_cache=True))
    # position 17 attends 18 keys: exactly what a decode step computes
    assert counts["mm"] + counts["bmm"] == spec.forward_flops(17, 18, logits=1)


def test_backward_costs_twice_the_forward_in_weight_matmuls(model):
    ids = torch.randint(0, 50, (2, 11))
    forward = _counted(lambda: model(ids))["mm"]
    model.train()
    both = _counted(lambda: model(ids).logits.sum().backward())["mm"]
    model.zero_grad(set_to_none=True)
    model.eval()
    assert both == 3 * forward  # the 6N rule: forward 2N, backward 4N
    # Frozen weights (LoRA's base): only input gradients flow back, 1x the forward's matmuls.
    model.requires_grad_(False)
    try:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        frozen = _counted(lambda: model(inputs_embeds=embeds).logits.sum().backward())["mm"]
    finally:
        model.requires_grad_(True)
    assert frozen == 2 * forward


def _sample(prompt: list[int], response: int, advantage: float = 1.0, cached: int = 0, group: str = "g") -> Sample:
    return Sample(sample_id=f"{group}/{response}", group_id=group, problem_id="p", prompt_ids=prompt,
                  response_ids=list(range(response)), behaviour_logprobs=[0.0] * response, versions=[0] * response,
                  finish_reason="stop", advantage=advantage, extra={"cached_prompt_tokens": cached})


def test_generation_excludes_prefix_cache_hits(model):
    spec = DenseModel.from_hf_config(model.config)
    cold, warm = _sample([1] * 20, 6), _sample([1] * 20, 6, cached=16)
    # prompt 20 + response 6: positions 0..24 are fed forward, 6 of them give the sampled tokens' logits
    assert generation_flops(spec, [cold]) == spec.forward_flops(0, 25, 6)
    assert generation_flops(spec, [cold]) - generation_flops(spec, [warm]) == spec.forward_flops(0, 16, 0)


class _Settings:
    def __init__(self, share: bool, micro_batch_size: int = 8) -> None:
        self.share_prompt_prefix, self.micro_batch_size = share, micro_batch_size


def test_training_counts_a_shared_prompt_once_and_skips_zero_advantage_samples(model):
    spec = DenseModel.from_hf_config(model.config)
    prompt = [3] * 12
    group = [_sample(prompt, n) for n in (4, 7, 9)]
    padded = training_flops(spec, group, _Settings(share=False))
    shared = training_flops(spec, group, _Settings(share=True))
    assert padded == 3 * sum(spec.forward_flops(0, 12 + n - 1, n) for n in (4, 7, 9))
    assert padded - shared == pytest.approx(3 * 2 * spec.forward_flops(0, 12, 0))  # 2 prompts not recomputed
    # A zero-advantage sample carries no gradient: the trainer skips it (unless a KL term needs it).
    with_zero = group + [_sample(prompt, 30, advantage=0.0)]
    assert training_flops(spec, with_zero, _Settings(share=False)) == padded
    assert training_flops(spec, with_zero, _Settings(share=False), kl_reference=True) > 4 / 3 * padded
    # Two updates per batch: twice the work. No sample with signal: one measuring forward only.
    assert training_flops(spec, group, _Settings(share=False), updates=2) == 2 * padded
    # LoRA: frozen base weights take no weight gradient: their backward is the input gradient alone.
    weights, attention = (sum(x) for x in zip(*(spec.forward_parts(0, 12 + n - 1, n) for n in (4, 7, 9))))
    assert training_flops(spec, group, _Settings(share=False), frozen_weights=True) == 2 * weights + 3 * attention
    flat = [_sample(prompt, 5, advantage=0.0)]
    assert training_flops(spec, flat, _Settings(share=False)) == spec.forward_flops(0, 16, 5)
    assert chunk_samples(group, _Settings(share=True))[0]  # the settings object is what the trainer reads


def test_mixture_of_experts_config_is_refused_by_name():
    with pytest.raises(ValueError, match="num_local_experts"):
        DenseModel.from_hf_config({"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 64,
                                   "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 10})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        DenseModel.from_hf_config({"model_type": "mystery", "hidden_size": 64, "num_attention_heads": 4,
                                   "vocab_size": 10})


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    monkeypatch.setattr(peak_module, "CPU_MATMUL_SIZE", 512)  # the caching is under test, not the peak
    first = machine_peak(torch.float32, device="cpu")
    assert first.source == "measured" and first.flops > 1e8
    cache = tmp_path / "matmul_peak.json"
    entries = json.loads(cache.read_text())
    (key,) = entries
    # Measured on a calm machine: a second call reads it back instead of measuring.
    entries[key] = {"peak": {**entries[key]["peak"], "flops": 123.0}, "load_1m": 0.0}
    cache.write_text(json.dumps(entries))
    assert machine_peak(torch.float32, device="cpu").flops == 123.0
    # Measured on a machine busier than this one is now: measured again, and the higher one kept.
    entries[key]["load_1m"] = 1e6
    cache.write_text(json.dumps(entries))
    assert machine_peak(torch.float32, device="cpu").flops > 1e8
    assert json.loads(cache.read_text())[key]["peak"]["flops"] > 1e8
    cache.write_text("{not json")  # damaged: measured again, not a crash
    assert machine_peak(torch.float32, device="cpu").flops > 1e8
    assert machine_peak(torch.float32, device="cpu", remeasure=True).flops > 1e8


def test_gpu_peak_comes_from_the_datasheet_by_device_name():
    assert datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert datasheet_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
    assert datasheet_peak("Some Future GPU", torch.bfloat16) is None


def test_loop_meter_reports_step_eval_and_run_utilisation(model):
    spec = DenseModel.from_hf_config(model.config)
    peak = Peak(flops=1e9, source="measured", device="test", dtype="float32", units=2)
    meter = LoopMeter(spec, peak, _Settings(share=True))
    samples = [_sample([3] * 12, n) for n in (4, 7)]
    meter.step_begin()
    meter.phase_end("generate")
    meter.phase_end("train")
    step = meter.step_metrics(samples, StepTimes(generate=0.5, train=0.25, step=1.0))
    assert 0.0 <= step["idle_core_fraction_generate"] and 0.0 <= step["idle_core_fraction_train"]
    assert step["mfu_generate"] == pytest.approx(generation_flops(spec, samples) / 0.5e9)
    assert step["mfu_train"] == pytest.approx(step["flops_train"] / 0.25e9)
    assert step["mfu_step"] == pytest.approx((step["flops_generate"] + step["flops_train"]) / 1e9)
    assert step["idle_core_s"] >= 0
    ev = meter.eval_metrics(samples, seconds=2.0)
    run = meter.run_metrics(wall_s=10.0)
    assert run["flops"]["total"] == step["flops_generate"] + step["flops_train"] + ev["flops_eval"]
    assert run["mfu"]["run"] == pytest.approx(run["flops"]["total"] / 1e10)
    assert run["mfu"]["eval"] == pytest.approx(ev["flops_eval"] / 2e9)
    assert utilisation(1.0, 0.0, 1e9) is None


def test_time_split_accounts_for_the_whole_wall_time():
    from rollwise.observe.summary import total_time_split, time_split

    def step(n: int, end: float) -> dict[str, float]:
        return {"step": n, "elapsed_s": end, "time_step_s": 4.0, "time_generate_s": 1.5, "time_reward_s": 0.5,
                "time_train_s": 1.5, "time_weight_sync_s": 0.5}

    # start 10 s (3 s of it the first evaluation); steps end at 14, 22 (a 2 s mid-run eval and a 2 s
    # checkpoint before step 2 began at 18) and 26; then the final evaluation (3 s) and 1 s of the rest.
    records = [step(1, 14.0), step(2, 22.0), step(3, 26.0)]
    evals = [{"step": 0, "eval_seconds": 3.0}, {"step": 1, "eval_seconds": 2.0}, {"step": 3, "eval_seconds": 3.0}]
    start, steps = time_split(records, evals, wall_time_s=30.0)
    assert start == {"eval": 3.0, "startup": 7.0}
    assert steps[0]["eval"] == 2.0 and steps[0]["other"] == 2.0
    assert steps[2]["eval"] == 3.0 and steps[2]["other"] == 1.0
    assert sum(total_time_split(records, evals, 30.0).values()) == pytest.approx(30.0)


def test_bench_loop_runs_the_default_config_and_checks_the_goals():
    from rollwise.bench.loop import loop_overrides, summarise
    from rollwise.config import load_config

    default, quick = load_config(), load_config(None, loop_overrides(True, None, "runs/x"))
    full = load_config(None, loop_overrides(False, None, "runs/x"))
    assert full.model_copy(update={"output_dir": default.output_dir}) == default  # the default run, unchanged
    assert quick.train.steps == 2 and quick.model == default.model
    evals = [{"label": "before", "step": 0, "strict_accuracy": 0.06}, {"label": "mid", "step": 3, "strict_accuracy": 0.5},
             {"label": "after", "step": 15, "strict_accuracy": 0.6}]
    summary = {"run_dir": "runs/x", "engine": "vllm", "steps": 15, "eval_after": evals[-1],
               "samples": {"trained": 1920}, "mfu": {"run": 0.3}}
    r = summarise(default.model, False, wall=400.0, cpu=700.0, idle=100.0, summary=summary, evals=evals)
    assert r["samples_per_s"] == pytest.approx(4.8) and r["gain_first_mid"] == pytest.approx(0.44)
    assert r["goals"] == {"run MFU >= 45% of the measured peak": False, "wall <= 7 min (default run)": True,
                          "held-out strict +50 points at the end": True,
                          "held-out strict +40 points at the first mid-run eval": True}
