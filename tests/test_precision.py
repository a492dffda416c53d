"""engine.dtype and train.compute_dtype (rollwise.model.precision): bfloat16 matmuls in the engine
and under autocast in the trainer, float32 master weights, and MFU held to the bf16 peak."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rollwise.config import ConfigError, load_config
from rollwise.types.train_config import TrainConfig
from rollwise.engine.factory import EngineSettings, create_engine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.precision import cpu_has_native_bf16, resolve_dtype
from rollwise.model.tiny import tiny_llama
from rollwise.observe.metrics import loop_meter
from rollwise.train.logprobs import FusedLogprobs, LogprobOptions, lm_head_logprobs
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample


def _samples(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(3):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randint(3, 9))]
        for i in range(4):
            response = [rng.randrange(3, 90) for _ in range(rng.randint(2, 12))]
            out.append(Sample(sample_id=f"{g}/{i}", group_id=str(g), problem_id=str(g), prompt_ids=prompt,
                              response_ids=response, behaviour_logprobs=[-4.0] * len(response),
                              versions=[0] * len(response), finish_reason="stop", advantage=rng.uniform(-1, 1)))
    return out


def test_auto_means_bfloat16_exactly_where_the_cpu_computes_it_natively():
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def test_an_unknown_dtype_is_refused_naming_the_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.dtype=fp16"])
    assert "engine.dtype" in str(err.value) and "bfloat16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.compute_dtype=half"])
    assert "train.compute_dtype" in str(err.value)


@pytest.mark.parametrize("keep_mib", [512.0, 0.0])  # softmax kept for the backward, or recomputed
def test_fused_lm_head_under_autocast_gives_autograd_s_gradient(keep_mib):
    """The hand-written backward in bfloat16 equals autograd through the same bfloat16 forward."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(32, 101, bias=False)
    hidden = torch.randn(29, 32, requires_grad=True)
    targets = torch.randint(0, 101, (29,))
    upstream = torch.randn(29)

    def run(fused: bool) -> list[torch.Tensor]:
        lm_head.zero_grad()
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                logp, _ = FusedLogprobs.apply(hidden, lm_head.weight, None, targets, 1.0, 8, keep_mib)
            else:
                logp, _ = lm_head_logprobs(hidden, lm_head, targets, LogprobOptions(chunk_tokens=8))
        (logp.float() * upstream).sum().backward()
        assert hidden.grad.dtype == lm_head.weight.grad.dtype == torch.float32  # float32 master weights
        return [logp.detach().float(), hidden.grad.clone(), lm_head.weight.grad.clone()]

    for got, want in zip(run(True), run(False)):
        assert float((got - want).norm() / want.norm()) < 1e-2


def test_bfloat16_train_step_is_close_to_float32_and_keeps_float32_weights():
    """Same batch, same start: the bf16-autocast step's gradient is within a few percent of the fp32
    step's, and weights and optimizer state stay float32."""
    base = tiny_llama(seed=5)
    grads = {}
    for dtype in ("float32", "bfloat16"):
        trainer = GRPOTrainer(copy.deepcopy(base), TrainConfig(lr=1e-3, micro_batch_size=4, compute_dtype=dtype,
                                                                off_policy_correction="none"), pad_token_id=0)
        trainer.before_step = lambda m, d=dtype: grads.__setitem__(
            d, torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        metrics = trainer.train_step(_samples(seed=1))
        assert metrics["trained_tokens"] > 0
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        state = trainer.optimizer.state_dict()["state"]
        assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    assert grads["bfloat16"].dtype == torch.float32
    assert 0 < float((grads["bfloat16"] - grads["float32"]).norm() / grads["float32"].norm()) < 0.05


def test_bfloat16_reference_engine_takes_float32_pushes_and_samples_near_the_float32_policy():
    model = tiny_llama(seed=2)
    pushed = {n: t + 0.01 * torch.randn_like(t) for n, t in tiny_llama(seed=3).state_dict().items()}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2], [9, 9, 41]]
    out = {}
    for dtype in ("float32", "bfloat16"):
        settings = EngineSettings(kind="reference", max_num_seqs=4, max_model_len=64, dtype=dtype)
        engine = create_engine(settings, model, None, seed=0)
        assert engine.model.dtype == resolve_dtype(dtype)
        engine.apply_weights(pushed, 1)  # the trainer's float32 tensors, cast as they are copied in
        done = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        out[dtype] = sorted(done, key=lambda c: c.request_id)
    for a, b in zip(out["float32"], out["bfloat16"]):
        assert b.versions == [1] * len(b.token_ids)
        # greedy paths agree on their first tokens; the logprobs of the same tokens are close, not equal
        assert a.token_ids[0] == b.token_ids[0]
        assert 0 < abs(a.logprobs[0] - b.logprobs[0]) < 0.1
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the caller's model is untouched


def test_mfu_is_held_to_the_fastest_dtype_the_run_computes_in():
    model = tiny_llama(seed=0)
    train = TrainConfig()
    fp32 = loop_meter(model, train, overlapped=False, compute_dtypes=[torch.float32])
    mixed = loop_meter(model, train, overlapped=False, compute_dtypes=[torch.float32, torch.bfloat16])
    assert fp32.peak.dtype == "float32"
    assert mixed.peak.flops == max(fp32.peak.flops, loop_meter(model, train, overlapped=False,
                                                               compute_dtypes=[torch.bfloat16]).peak.flops)


def test_two_ranks_train_in_bfloat16_like_one_process():
    """FSDP2 ranks autocast as one process does: the same batch gives nearly the same gradient norm."""
    from rollwise.types.train_config import TrainerConfig
    from rollwise.train.sharded import ShardedTrainer

    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, compute_dtype="bfloat16", off_policy_correction="none")
    one = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=0).train_step(_samples(seed=4))["grad_norm"]
    sharded = ShardedTrainer(tiny_llama(seed=3), cfg, TrainerConfig(world_size=2, device="cpu"), pad_token_id=0)
    try:
        two = sharded.train_step(_samples(seed=4))["grad_norm"]
    finally:
        sharded.close()
    assert abs(two - one) <= 0.03 * one, (one, two)


def test_bench_trainer_step_runs_the_chosen_arms_each_against_its_dtype_peak(tmp_path, capsys):
    import json

    from rollwise.cli import main

    out = tmp_path / "step.json"
    assert main(["bench", "trainer-step", "--quick", "--arms", "baseline,default_bfloat16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["arm"]: row for row in result["rows"]}
    assert list(rows) == ["baseline", "default_bfloat16"]
    assert rows["baseline"]["peak_dtype"] == "float32" and rows["default_bfloat16"]["peak_dtype"] == "bfloat16"
    assert set(result["matmul_peak_flops_by_dtype"]) == {"float32", "bfloat16"}
    assert main(["bench", "trainer-step", "--quick", "--arms", "default"]) == 2  # baseline is required
    assert "must include 'baseline'" in capsys.readouterr().out
