"""`rollwise bench r3`'s parts (issue 20): bf16 GEMMs emulated in fp32, the engine's capture switch, and the
benchmark's bookkeeping (the cost share of a step, the mismatch cut), on a tiny random Mixtral."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rollwise.bench.bf16_gemms import emulated_bf16, round_to_bf16, round_weights_
from rollwise.bench.r3 import BenchEngine, mismatch_cut, step_share
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from test_cli import _run
from test_moe_r3 import PROMPTS, moe_model


def test_emulated_bf16_linear_computes_what_a_bf16_gemm_computes():
    """bf16 operands, fp32 accumulation, a bf16 result: the emulation in fp32 gives a real bf16 GEMM's output
    bit for bit on nearly every element (the rest differ in the sums' order, within one bf16 step), where a
    plain fp32 linear does not."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 96), round_to_bf16(torch.randn(80, 96) * 0.1)
    real = F.linear(x.bfloat16(), w.bfloat16()).float()
    with emulated_bf16():
        emulated = F.linear(x, w)
    plain = F.linear(x, w)
    assert emulated.dtype == torch.float32
    assert (emulated == real).float().mean() > 0.99
    assert torch.allclose(emulated, real, rtol=2 ** -7, atol=0)
    assert (plain == real).float().mean() < 0.1  # fp32 is not bf16: the check above can fail
    assert torch.equal(F.linear(x, w), plain)  # leaving the mode leaves F.linear alone


def test_round_weights_rounds_fused_views_in_place():
    engine = ReferenceEngine(moe_model(), max_num_seqs=2, max_model_len=64, seed=0)
    storage = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    round_weights_(engine.model)
    for name, p in engine.model.named_parameters():
        assert p.data_ptr() == storage[name]
        assert torch.equal(p, round_to_bf16(p)), name


def generate(engine, seed: int = 1) -> list:
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=8, n=2, seed=seed, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    return engine.generate(requests)


def test_engine_capture_switch_changes_only_the_routing():
    """capture_routing=False (what `bench r3` times against) samples the same tokens and logprobs and returns
    no experts; on (the default) every token's experts come back."""
    model = moe_model()
    on = generate(ReferenceEngine(model, max_num_seqs=8, max_model_len=64, seed=0))
    off = generate(ReferenceEngine(model, max_num_seqs=8, max_model_len=64, seed=0, capture_routing=False))
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert [c.logprobs for c in on] == [c.logprobs for c in off]
    assert all(c.routed_experts is not None for c in on)
    assert all(c.routed_experts is None for c in off)


def test_bench_engine_samples_in_reduced_precision_and_stays_rounded_after_a_push():
    """The benchmark's engine differs from an fp32 engine by a bf16-sized amount (that difference is what R3
    is measured against), and a push of fp32 weights leaves its weights bf16 again."""
    model = moe_model()
    fp32 = generate(ReferenceEngine(model, max_num_seqs=8, max_model_len=64, seed=0))
    bench = BenchEngine(model, max_num_seqs=8, max_model_len=64)
    reduced = generate(bench)
    deltas = [abs(a - b) for x, y in zip(fp32, reduced) for a, b in zip(x.logprobs, y.logprobs)]
    assert len(reduced) == len(fp32) and all(c.routed_experts is not None for c in reduced)
    assert 1e-5 < sum(deltas) / len(deltas) < 0.5
    pushed = {name: p.detach() * 1.001 for name, p in model.state_dict().items()}
    bench.push(pushed, 1)
    for p in bench.engine.model.parameters():
        assert torch.equal(p.float(), round_to_bf16(p.float()))


def test_cost_share_and_mismatch_cut_from_a_result():
    rows = [{"rollout_s": 10.0, "train_s": 20.0, "push_s": 1.0, "logprob_mismatch_none": 0.2,
             "logprob_mismatch_r3": 0.1}] * 2
    result = {"runs": [{"routing_replay": "none", "steps": rows}, {"routing_replay": "r3", "steps": rows}],
              "cost": {"capture_overhead": 0.25, "replay_overhead": 0.0}}
    share = step_share(result)
    assert share["step_s"] == pytest.approx(31.0)
    assert share["extra_s"] == pytest.approx(2.0)  # a rollout of 10 s with capture was 8 s without
    assert mismatch_cut(result) == pytest.approx(2.0)


def test_bench_r3_quick_runs_from_the_cli(tmp_path):
    out = tmp_path / "r3.json"
    proc = _run(["bench", "r3", "--quick", "--steps", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["steps"] == 1 and len(result["runs"][1]["steps"]) == 1
    replayed = result["runs"][1]["steps"][0]
    assert replayed["routing_disagreement_r3"] == 0.0
    assert {"capture_overhead", "replay_overhead"} <= set(result["cost"])
    assert result["cost"]["capture_ops_s_per_rollout"] > 0 and result["cost"]["replay_hooks_s_per_fwd_bwd"] > 0
    assert 0.0 <= result["cost_share_of_step"]["share"]
    assert "R3 cuts" in proc.stdout
