"""Multi-LoRA (issue 22): jobs that share a base model and differ by adapter run in one engine batch.

- two LoRA jobs decoding in the same batches (plus a base-model request) get exactly the greedy tokens
  each gets alone, each sample stamped with its own adapter's version;
- the OpenAI endpoints take the adapter as the model name, /v1/models lists the loaded adapters, an
  adapter that is not loaded is refused naming it.
Real parts: a tiny random Llama, PEFT adapters, the reference engine, a uvicorn server on loopback.
"""

from __future__ import annotations

import importlib.util

import httpx
import openai
import pytest
import torch
from adapters import random_adapter

from rollwise.types.train_config import LoraConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.engine.server import create_app
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.sync.adapters import adapter_update
from rollwise.train.lora import adapter_spec

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _push(engine, base, name: str, cfg: LoraConfig, seed: int, version: int, fp: str | None = None) -> None:
    spec = adapter_spec(cfg, name, default=False)
    WeightReceiver(engine, fp, adapters=engine).receive(adapter_update(random_adapter(base, cfg, seed), spec, version, fp or ""))


JOB_A = LoraConfig(rank=4, alpha=8.0)
JOB_B = LoraConfig(rank=2, alpha=2.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _requests(tag: str, adapter: str | None) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                              adapter=adapter) for i, p in enumerate(PROMPTS)]


def _engine(base) -> ReferenceEngine:
    engine = ReferenceEngine(base, max_num_seqs=16, max_model_len=64, seed=0)
    _push(engine, base, "job-a", JOB_A, seed=1, version=3)
    _push(engine, base, "job-b", JOB_B, seed=2, version=5)
    return engine


def test_two_lora_jobs_in_one_batch_get_exactly_the_tokens_each_gets_alone():
    base = tiny_llama()
    alone = {}
    steps_alone = 0
    for adapter in ("job-a", "job-b", None):
        engine = _engine(base)
        alone[adapter] = engine.generate(_requests("x", adapter))
        steps_alone += engine.stats["steps"]
    engine = _engine(base)
    together = engine.generate(_requests("a", "job-a") + _requests("b", "job-b") + _requests("n", None))
    # One batch: the three jobs' sequences decoded in the same steps, not one after another.
    assert engine.stats["steps"] < steps_alone / 2
    n = len(PROMPTS)
    for got, adapter in ((together[:n], "job-a"), (together[n:2 * n], "job-b"), (together[2 * n:], None)):
        assert [c.token_ids for c in got] == [c.token_ids for c in alone[adapter]], adapter
        torch.testing.assert_close([c.logprobs for c in got], [c.logprobs for c in alone[adapter]], atol=1e-5, rtol=0)
    # The adapters really differ (else the test would prove nothing), and each sample carries its adapter's version.
    per_job = [tuple(lp for c in together[j * n:(j + 1) * n] for lp in c.logprobs) for j in range(3)]
    assert all(max(abs(x - y) for x, y in zip(per_job[i], per_job[j])) > 1e-2 for i, j in ((0, 1), (0, 2), (1, 2)))
    assert {v for c in together[:n] for v in c.versions} == {3}
    assert {v for c in together[n:2 * n] for v in c.versions} == {5}
    assert {v for c in together[2 * n:] for v in c.versions} == {0}


def test_a_request_for_an_adapter_that_is_not_loaded_is_refused():
    engine = _engine(tiny_llama())
    with pytest.raises(ValueError, match=r"adapter: 'job-c' is not loaded .*loaded: job-a, job-b"):
        engine.add_request(_requests("c", "job-c")[0])
    engine.add_request(_requests("a", "job-a")[0])
    with pytest.raises(ValueError, match="adapter 'job-a' still serves requests"):
        engine.unload_adapter("job-a")
    engine.abort("a-0")
    engine.unload_adapter("job-a")
    with pytest.raises(ValueError, match="'job-a' is not loaded"):
        engine.add_request(_requests("a", "job-a")[0])


def test_openai_endpoints_take_the_adapter_as_the_model_name():
    base, tokenizer = tiny_llama(), tiny_tokenizer()
    fp = tokenizer_fingerprint(tokenizer)
    expected = _engine(base).generate(_requests("e", "job-b")[:1])[0]
    engine = ReferenceEngine(base, max_num_seqs=16, max_model_len=64, seed=0, tokenizer_fingerprint=fp)
    # pushed through the checked path before the server starts stepping the engine
    _push(engine, base, "job-a", JOB_A, seed=1, version=3, fp=fp)
    _push(engine, base, "job-b", JOB_B, seed=2, version=5, fp=fp)
    with serve_in_thread(create_app(engine, tokenizer, "tiny")) as (url, _server):
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("job-a", "tiny"), ("job-b", "tiny")]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        out = client.completions.create(model="job-b", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                        logprobs=0, extra_body={"ignore_eos": True})
        assert out.choices[0].token_ids == expected.token_ids
        assert out.choices[0].policy_versions == [5] * 8
        torch.testing.assert_close(out.choices[0].logprobs.token_logprobs, expected.logprobs, atol=1e-5, rtol=0)
        base_out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                             logprobs=0, extra_body={"ignore_eos": True})
        assert base_out.choices[0].policy_versions == [0] * 8
        assert abs(base_out.choices[0].logprobs.token_logprobs[0] - expected.logprobs[0]) > 1e-2
        with pytest.raises(openai.NotFoundError, match="job-c"):
            client.completions.create(model="job-c", prompt=PROMPTS[0], max_tokens=2)


def test_simulated_lora_jobs_share_engines_without_switching():
    """rollwise.sim.lora: 2 LoRA jobs on 1 engine (one batch) hold far fewer engine-hours than 2 dedicated
    engines; the same 2 jobs on 2 shared engines are slowed only by the unmerged-adapter overhead."""
    from rollwise.sim.cost import CONFIG_DIR, load_cost_file
    from rollwise.sim.lora import AdapterCost, compare_lora, projection_jobs

    cost, trainer = load_cost_file(CONFIG_DIR / "h100-7b.yaml")
    jobs = projection_jobs(2, trainer, steps=3)
    one = compare_lora(jobs, 1, cost, AdapterCost(decode_overhead=0.1))
    assert one["engine_hours_saved"] > 0.3
    two = compare_lora(jobs, 2, cost, AdapterCost(decode_overhead=0.1))
    assert two["max_slowdown"] < one["max_slowdown"]
    free = compare_lora(jobs, 2, cost, AdapterCost(decode_overhead=0.0, adapter_push_s=0.0))
    assert two["median_slowdown"] > free["median_slowdown"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serves_several_adapters_in_one_batch_like_the_reference_engine():
    """vLLM (enable_lora, one LoRARequest per adapter version) and the reference engine (unmerged per-row
    adapters) serve the same pushed adapters: same greedy tokens, logprobs within 1e-4, versions stamped."""
    from rollwise.engine.vllm_backend import VLLMEngine

    base = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1)  # vLLM's CPU attention needs head_dim 64
    a, b = LoraConfig(rank=8, alpha=16.0), LoraConfig(rank=8, alpha=8.0, target_modules=["q_proj", "v_proj"])
    reference = ReferenceEngine(base, max_num_seqs=16, max_model_len=64, seed=0)
    engine = VLLMEngine(base, tiny_tokenizer(), max_num_seqs=16, max_model_len=64, seed=0, kv_cache_gib=1, max_loras=2)
    try:
        for target in (reference, engine):
            _push(target, base, "job-a", a, seed=1, version=3)
            _push(target, base, "job-b", b, seed=2, version=5)
        assert engine.loaded_adapters() == {"job-a": 3, "job-b": 5}
        requests = _requests("a", "job-a") + _requests("b", "job-b") + _requests("n", None)
        want, got = reference.generate(requests), engine.generate(requests)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and g.versions == w.versions, g.request_id
            torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-4, rtol=0)
        _push(engine, base, "job-a", a, seed=4, version=4)  # a new version: a new LoRARequest
        assert engine.generate(_requests("a2", "job-a")[:1])[0].versions == [4] * 8
        with pytest.raises(ValueError, match="'job-c' is not loaded"):
            engine.add_request(_requests("c", "job-c")[0])
    finally:
        engine.close()
