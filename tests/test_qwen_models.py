"""Qwen2 (Qwen2.5) and Qwen3 dense models on every path rollwise has, against transformers' own classes.

No package ships real Qwen weights offline, so these are small random configs (rollwise.model.tiny):
Qwen2 with random q/k/v biases, Qwen3 with random QK-norm weights, tied and untied embeddings, and RoPE
scaled as configured (linear, YaRN, Llama 3). Checked: the reference engine's logprobs and greedy tokens
equal a full transformers forward; the trainer's logprobs do too; a trained full-weight push (in process and
through files) and a LoRA adapter push leave engine and trainer agreeing; `rollwise serve engine --engine
reference --model DIR` serves a Qwen3 directory and takes a new one from disk; unknown architectures are
refused by name. vLLM on a pushed Qwen3 update: tests/test_vllm_qwen.py (opt-in, its own vLLM process).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from engine_processes import wait_healthy
from rollwise.types.train_config import LoraConfig, TrainConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.reference.model_config import ModelConfig
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.local_server import free_port
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.model.tiny import tiny_qwen2, tiny_qwen3, tiny_tokenizer
from rollwise.sync.adapters import AdapterSender
from rollwise.sync.buckets import InProcessTransport
from rollwise.sync.files import FileReceiver, FileTransport
from rollwise.train.logprobs import sequence_logprobs
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.generation import GenerationRequest, SamplingParams
from grpo_samples import engine_group

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Original context 256 scaled 4x: positions past 256 exercise the scaled frequencies.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500.0}
MODELS = {
    "qwen2_tied": lambda seed=0: tiny_qwen2(seed=seed),
    "qwen2_untied_linear": lambda seed=0: tiny_qwen2(seed=seed, tie_word_embeddings=False, rope_parameters=LINEAR),
    "qwen3_tied": lambda seed=0: tiny_qwen3(seed=seed),
    "qwen3_untied_yarn": lambda seed=0: tiny_qwen3(seed=seed, tie_word_embeddings=False, rope_parameters=YARN),
    # head_dim 32 with hidden 64 and 4 heads: q is wider than the residual stream, as in real Qwen3s.
    "qwen3_llama3_rope_mha_wide_heads": lambda seed=0: tiny_qwen3(seed=seed, num_kv_heads=4, head_dim=32,
                                                                   rope_parameters=LLAMA3),
}
FP = tokenizer_fingerprint(tiny_tokenizer())
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 2, 3]


def _hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _trainer_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompt):] = True
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), mask)[0]


def _engine(model) -> ReferenceEngine:
    return ReferenceEngine(model, max_num_seqs=4, max_model_len=320, seed=0, tokenizer_fingerprint=FP)


def _greedy(engine: ReferenceEngine, prompt: list[int] = PROMPT, max_tokens: int = 10):
    return engine.generate([GenerationRequest("g", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))])[0]


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_engine_and_trainer_equal_transformers(name):
    model = MODELS[name]()
    ours = LlamaFamilyModel.from_hf(model).named_parameters(remove_duplicate=False)
    assert {n for n, _ in ours} == set(model.state_dict())
    engine = _engine(model)
    # A long prompt: positions past YaRN's original 256 (and Llama 3's 64) use the scaled frequencies.
    long_prompt = [3 + (7 * i) % 95 for i in range(270)]
    requests = [GenerationRequest("s", PROMPT, SamplingParams(max_tokens=12, n=2, seed=1, ignore_eos=True)),
                GenerationRequest("l", long_prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=2,
                                                                   ignore_eos=True))]
    for c in engine.generate(requests):
        expected = _hf_logprobs(model, c.prompt_ids, c.token_ids, 0.8 if c.request_id == "l" else 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0), (name, c.sample_id)
        if c.request_id == "s":
            assert torch.allclose(_trainer_logprobs(model, c.prompt_ids, c.token_ids), expected, atol=1e-5, rtol=0)
    assert _greedy(engine, max_tokens=16).token_ids == _hf_greedy(model, PROMPT, 16)


def test_scaled_rope_and_qk_norm_are_what_the_engine_computes():
    """The configured RoPE really differs from default RoPE (so the exactness above covers it), and
    Qwen3's QK-norm weights reach the output."""
    scaled = ModelConfig.from_hf(tiny_qwen3(rope_parameters=YARN).config)
    plain = ModelConfig.from_hf(tiny_qwen3(rope_parameters={**YARN, "rope_type": "default"}).config)
    assert not torch.equal(scaled.inv_freq(), plain.inv_freq()) and scaled.rope_attention_scaling > 1.0
    assert scaled.qk_norm and not ModelConfig.from_hf(tiny_qwen2().config).qk_norm
    model = tiny_qwen3()
    before = _greedy(_engine(model)).logprobs
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight.mul_(3.0)
    assert _greedy(_engine(model)).logprobs != before


def test_unknown_architectures_and_dynamic_rope_are_refused_by_name(tmp_path):
    folder = tmp_path / "gpt2"
    tiny_qwen3().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*Qwen2ForCausalLM, Qwen3ForCaus"):
        load_model(str(folder))
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        ModelConfig.from_hf(tiny_qwen3(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 1000.0}).config)
    with pytest.raises(ValueError, match="family one of llama, qwen2, qwen3"):
        load_model("tiny:qwen4:0")
    model, _ = load_model("tiny:qwen3:2")
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(model.lm_head.weight, tiny_qwen3(seed=2).lm_head.weight)


# ----------------------------------------------------------------------------- trainer -> engine


def _mismatch(trainer: GRPOTrainer, engine: ReferenceEngine) -> float:
    """Largest |engine logprob - trainer logprob| over a fresh group sampled by the engine."""
    return max((torch.tensor(s.behaviour_logprobs) - _trainer_logprobs(trainer.model, s.prompt_ids, s.response_ids))
               .abs().max().item() for s in engine_group(engine, 7))


@pytest.mark.parametrize("name", ["qwen2_untied_linear", "qwen3_tied"])
def test_a_trained_full_weight_push_in_process_and_through_files(name, tmp_path):
    torch.manual_seed(0)
    trainer = GRPOTrainer(MODELS[name](), TrainConfig(lr=5e-3, micro_batch_size=4), pad_token_id=0)
    engines = [_engine(MODELS[name]()), _engine(MODELS[name]())]
    trainer.train_step(engine_group(engines[0], 1))
    assert _mismatch(trainer, engines[0]) > 1e-3  # the step changed the weights
    InProcessTransport([WeightReceiver(engines[0], FP)], FP).push(trainer.weights(), trainer.version)
    FileReceiver(WeightReceiver(engines[1], FP)).load(FileTransport(tmp_path, FP).push(trainer.weights(), 1))
    for engine in engines:
        assert engine.policy_version == 1 and _mismatch(trainer, engine) < 1e-5


def test_lora_adapter_round_trip_on_qwen3():
    base = tiny_qwen3()
    torch.manual_seed(0)
    trainer = GRPOTrainer(base, TrainConfig(lr=5e-3, micro_batch_size=4, lora=LoraConfig(rank=4, alpha=8.0)),
                          pad_token_id=0)
    assert {n.split(".")[-2] for n in trainer.weights()} == {"lora_A", "lora_B"}
    assert {n.split(".")[-3] for n in trainer.weights()} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"}
    engine = _engine(base)
    for step in range(2):
        trainer.train_step(engine_group(engine, step))
        WeightReceiver(engine, FP, adapters=engine).receive(AdapterSender(FP, trainer.lora).update(trainer))
    assert engine.loaded_adapters() == {"policy": 2}
    # The adapter sits before Qwen3's q_norm/k_norm in both: engine and trainer agree to fp32 round-off...
    assert _mismatch(trainer, engine) < 1e-5
    engine.unload_adapter("policy")
    assert _mismatch(trainer, engine) > 1e-3  # ...and the adapter is what made them agree


# ----------------------------------------------------------------------------- the engine server


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_serve_engine_reference_serves_a_qwen3_directory_and_loads_an_update_from_disk(tmp_path):
    model, update = tiny_qwen3(seed=0, tie_word_embeddings=False), tiny_qwen3(seed=1, tie_word_embeddings=False)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollwise.cli", "serve", "engine", "--engine", "reference",
         "--model", _save(model, tmp_path / "qwen3"), "--port", str(port), "--max-num-seqs", "2",
         "--max-model-len", "128", "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)

        def greedy() -> dict:
            body = {"prompt_ids": PROMPT, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
            return httpx.post(f"{url}/generate", json=body, timeout=60).json()["choices"][0]

        first = greedy()
        assert first["token_ids"] == _hf_greedy(model, PROMPT, 10)
        assert first["logprobs"] == pytest.approx(_hf_logprobs(model, PROMPT, first["token_ids"]).tolist(), abs=1e-5)
        r = httpx.post(f"{url}/update_weights_from_disk", json={"path": _save(update, tmp_path / "new"), "version": 1},
                       timeout=60)
        assert r.status_code == 200, r.text
        second = greedy()
        assert second["logprobs"] == pytest.approx(_hf_logprobs(update, PROMPT, second["token_ids"]).tolist(),
                                                   abs=1e-5)
        assert second["token_ids"] == _hf_greedy(update, PROMPT, 10)
    finally:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
