"""The reference engine against full HF forward passes: exact logprobs, greedy equivalence under
continuous batching, seeded n-sample sharing, sampling distributions, weight updates, stop rules."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen2ForCausalLM

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.reference.model_config import ModelConfig
from rollwise.engine.reference.sampling import sample
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_llama

VOCAB = 103  # tiny_tokenizer's size; the models below share it


def _qwen2_with_bias() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


MODELS = {
    "llama_tied_gqa": lambda: tiny_llama(vocab_size=VOCAB),
    "llama_untied_mha": lambda: tiny_llama(vocab_size=VOCAB, num_kv_heads=4, tie_word_embeddings=False, seed=3),
    "qwen2_bias": _qwen2_with_bias,
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(vocab_size=VOCAB)


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [3 + (offset + 7 * i) % (VOCAB - 3) for i in range(length)]


def _req(rid: str, prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**params))


def _hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("name", list(MODELS))
def test_logprobs_match_hf_forward(name):
    model = MODELS[name]()
    engine = ReferenceEngine(model, max_num_seqs=8, max_model_len=128, seed=0)
    requests = [
        _req("a", _prompt(3), max_tokens=12, n=2, ignore_eos=True),
        _req("b", _prompt(17, 5), max_tokens=9, ignore_eos=True),
        _req("c", _prompt(40, 9), max_tokens=15, n=3, ignore_eos=True),
        # logprobs are of logits / T before truncation, whatever top-k/top-p keep
        _req("d", _prompt(8, 2), max_tokens=10, temperature=0.7, top_p=0.9, top_k=20, ignore_eos=True),
    ]
    completions = engine.generate(requests)
    assert [(c.request_id, c.index) for c in completions] == [
        ("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2), ("d", 0)
    ]
    temperature = {r.request_id: r.params.temperature for r in requests}
    for c in completions:
        expected = _hf_logprobs(model, c.prompt_ids, c.token_ids, temperature[c.request_id])
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0), c.sample_id


def test_parameter_names_match_hf_state_dict():
    for build in MODELS.values():
        model = build()
        ours = dict(LlamaFamilyModel.from_hf(model).named_parameters(remove_duplicate=False))
        assert set(ours) == set(model.state_dict())


def test_greedy_continuous_batching_matches_sequential_and_hf(hf_model):
    lengths, budgets = [5, 23, 11, 2, 31], [9, 4, 14, 7, 3]
    requests = [
        _req(f"r{i}", _prompt(n, i), max_tokens=m, temperature=0.0, ignore_eos=True)
        for i, (n, m) in enumerate(zip(lengths, budgets))
    ]
    batched = ReferenceEngine(hf_model, max_num_seqs=2, max_model_len=64)
    together = batched.generate(requests)
    single = ReferenceEngine(hf_model, max_num_seqs=1, max_model_len=64)
    alone = [single.generate([r])[0] for r in requests]
    for req, a, b in zip(requests, together, alone):
        assert a.token_ids == b.token_ids == _hf_greedy(hf_model, req.prompt_ids, req.params.max_tokens)
        assert a.finish_reason == "length"
    counts = [n for _, n in batched.timeline]
    assert max(counts) == 2 and counts[-1] == 0  # sequences joined and left a full batch


def test_engine_owns_its_weights():
    model = tiny_llama(vocab_size=VOCAB)
    engine = ReferenceEngine(model, max_model_len=64)
    before = engine.generate([_req("x", _prompt(6), max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    after = engine.generate([_req("x", _prompt(6), max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
    assert after.token_ids == before.token_ids


# ----------------------------------------------------------------------------- sampling


def test_n_samples_share_one_prefill_and_match_separate_seeds(hf_model):
    prompt = _prompt(20)
    shared = ReferenceEngine(hf_model, max_num_seqs=8, max_model_len=64)
    grouped = shared.generate([_req("g", prompt, max_tokens=10, n=4, seed=123, ignore_eos=True)])
    assert shared.stats["prompt_tokens"] == 4 * 20
    assert shared.stats["cached_prompt_tokens"] == 3 * 20
    assert [c.cached_prompt_tokens for c in grouped] == [0, 20, 20, 20]

    # One at a time: each request computes its own prefill.
    alone = ReferenceEngine(hf_model, max_num_seqs=8, max_model_len=64)
    singles = [
        alone.generate([_req(f"s{i}", prompt, max_tokens=10, seed=123 + i, ignore_eos=True)])[0] for i in range(4)
    ]
    assert alone.stats["cached_prompt_tokens"] == 0
    assert [c.token_ids for c in grouped] == [c.token_ids for c in singles]
    assert len({tuple(c.token_ids) for c in grouped}) > 1  # the samples do differ

    # Admitted together, separate requests with the same prompt share one prefill too, and
    # different batch-mates (an extra unseeded request) do not change seeded results.
    together = ReferenceEngine(hf_model, max_num_seqs=8, max_model_len=64)
    batch = together.generate(
        [_req(f"s{i}", prompt, max_tokens=10, seed=123 + i, ignore_eos=True) for i in range(4)]
        + [_req("noise", _prompt(9, 4), max_tokens=6, ignore_eos=True)]
    )
    assert together.stats["cached_prompt_tokens"] == 3 * 20
    assert [c.token_ids for c in batch[:4]] == [c.token_ids for c in grouped]


def test_sampler_frequencies_match_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draws = 4000

    def frequencies(**kw) -> torch.Tensor:
        params = [SamplingParams(**kw)]
        counts = torch.zeros(logits.shape[1])
        for seed in range(draws):
            tokens, _ = sample(logits, params, [torch.Generator().manual_seed(seed)])
            counts[tokens[0]] += 1
        return counts / draws

    probs = torch.softmax(logits[0], dim=-1)
    assert (frequencies() - probs).abs().max() < 0.03
    assert (frequencies(temperature=2.0) - torch.softmax(logits[0] / 2, dim=-1)).abs().max() < 0.03
    top2 = torch.zeros_like(probs)
    top2[:2] = probs[:2] / probs[:2].sum()
    assert (frequencies(top_k=2) - top2).abs().max() < 0.03
    # top_p=0.8 keeps the smallest prefix reaching 80% of the mass: here tokens 0-2
    nucleus = torch.zeros_like(probs)
    nucleus[:3] = probs[:3] / probs[:3].sum()
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    assert (frequencies(top_p=0.8) - nucleus).abs().max() < 0.03


def test_engine_first_token_frequencies_match_model(hf_model):
    prompt = _prompt(7)
    engine = ReferenceEngine(hf_model, max_num_seqs=32, max_model_len=32)
    requests = [_req(f"q{k}", prompt, max_tokens=1, n=32, seed=32 * k) for k in range(64)]
    counts = torch.zeros(VOCAB)
    for c in engine.generate(requests):
        counts[c.token_ids[0]] += 1
    with torch.no_grad():
        probs = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert (counts / counts.sum() - probs).abs().max() < 0.03


def test_top_k_one_and_tiny_top_p_are_greedy(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=8, max_model_len=64)
    prompts = [_prompt(n, n) for n in (4, 13, 27)]

    def run(**kw) -> list[list[int]]:
        reqs = [_req(f"p{i}", p, max_tokens=8, ignore_eos=True, **kw) for i, p in enumerate(prompts)]
        return [c.token_ids for c in engine.generate(reqs)]

    greedy = run(temperature=0.0)
    assert run(top_k=1, seed=1) == greedy
    assert run(top_p=1e-6, seed=2) == greedy


def test_unseeded_requests_follow_the_engine_seed(hf_model):
    def run(seed: int) -> list[int]:
        engine = ReferenceEngine(hf_model, max_model_len=32, seed=seed)
        return engine.generate([_req("u", _prompt(5), max_tokens=12, ignore_eos=True)])[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


# ----------------------------------------------------------------------------- weights


def _perturbed(model, scale: float = 0.5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_update_weights_stamps_versions_per_token(hf_model):
    engine = ReferenceEngine(hf_model, max_model_len=64, policy_version=3)
    engine.add_request(_req("v", _prompt(10), max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill token + one decode token under version 3
    engine.apply_weights(_perturbed(hf_model), version=4)
    assert engine.policy_version == 4
    done = []
    while engine.has_unfinished():
        done += engine.step()
    (completion,) = done
    assert completion.versions == [3, 3] + [4] * 10
    # The continuation was sampled by the new weights over the old KV cache (partial rollout):
    # it departs from what the old policy alone would have produced.
    old = ReferenceEngine(hf_model, max_model_len=64)
    old_tokens = old.generate([_req("v", _prompt(10), max_tokens=12, temperature=0.0, ignore_eos=True)])[0].token_ids
    assert completion.token_ids[:2] == old_tokens[:2] and completion.token_ids != old_tokens


def test_update_weights_accepts_the_trainers_full_state_dict():
    trainer = tiny_llama(vocab_size=VOCAB, seed=5)
    engine = ReferenceEngine(tiny_llama(vocab_size=VOCAB), max_model_len=64)
    engine.apply_weights(trainer.state_dict(), version=1)
    fresh = ReferenceEngine(trainer, max_model_len=64)
    req = _req("w", _prompt(9), max_tokens=10, temperature=0.0, ignore_eos=True)
    updated = engine.generate([req])[0]
    assert updated.token_ids == fresh.generate([req])[0].token_ids
    assert updated.versions == [1] * 10


def test_bad_update_raises_and_keeps_old_weights(hf_model):
    engine = ReferenceEngine(hf_model, max_model_len=64)
    req = _req("k", _prompt(9), max_tokens=10, temperature=0.0, ignore_eos=True)
    before = engine.generate([req])[0].token_ids
    bad_shape = _perturbed(hf_model)  # every other entry is valid and would change the outputs
    bad_shape["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="down_proj.*shape"):
        engine.apply_weights(bad_shape, version=9)
    unknown = _perturbed(hf_model)
    unknown["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="unexpected weight"):
        engine.apply_weights(unknown, version=9)
    assert engine.policy_version == 0
    assert engine.generate([req])[0].token_ids == before


# ----------------------------------------------------------------------------- stopping


def test_stop_token_eos_and_ignore_eos(hf_model):
    prompt = _prompt(12)
    engine = ReferenceEngine(hf_model, max_model_len=64)
    free = engine.generate([_req("f", prompt, max_tokens=10, temperature=0.0, ignore_eos=True)])[0].token_ids
    stop = free[3]
    cut = free.index(stop) + 1  # the first occurrence ends the sample, stop token included

    c = engine.generate([_req("s", prompt, max_tokens=10, temperature=0.0, stop_token_ids=[stop])])[0]
    assert (c.token_ids, c.finish_reason, len(c.logprobs), len(c.versions)) == (free[:cut], "stop", cut, cut)

    eos_engine = ReferenceEngine(hf_model, max_model_len=64, eos_token_ids=[stop])
    c = eos_engine.generate([_req("e", prompt, max_tokens=10, temperature=0.0)])[0]
    assert (c.token_ids, c.finish_reason) == (free[:cut], "stop")
    c = eos_engine.generate([_req("i", prompt, max_tokens=10, temperature=0.0, ignore_eos=True)])[0]
    assert (c.token_ids, c.finish_reason) == (free, "length")
    # stop_token_ids apply even with ignore_eos
    req = _req("j", prompt, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    c = eos_engine.generate([req])[0]
    assert c.finish_reason == "stop"


def test_default_eos_comes_from_the_model_config(hf_model):
    assert ReferenceEngine(hf_model, max_model_len=16).eos_token_ids == {2}


def test_max_tokens_and_max_model_len(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=4, max_model_len=16)
    short, capped, single = engine.generate(
        [
            _req("m", _prompt(4), max_tokens=5, ignore_eos=True),
            _req("l", _prompt(10), max_tokens=50, ignore_eos=True),
            _req("o", _prompt(15), max_tokens=50, ignore_eos=True),
        ]
    )
    assert (len(short.token_ids), short.finish_reason) == (5, "length")
    assert (len(capped.token_ids), capped.finish_reason) == (6, "length")  # 10 + 6 = max_model_len
    assert (len(single.token_ids), single.finish_reason) == (1, "length")


def test_abort_running_and_waiting(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=2, max_model_len=64)
    prompt = _prompt(8)
    full = engine.generate([_req("ref", prompt, max_tokens=20, temperature=0.0, ignore_eos=True)])[0].token_ids
    engine.add_request(_req("a", prompt, max_tokens=20, temperature=0.0, ignore_eos=True, n=2))
    engine.add_request(_req("b", prompt, max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    aborted = engine.abort("a")
    assert [c.index for c in aborted] == [0, 1]
    for c in aborted:
        assert c.finish_reason == "abort" and c.token_ids == full[:3] and len(c.logprobs) == 3
    assert engine.num_running == 0 and engine.timeline[-1][1] == 0
    (waiting,) = engine.abort("b")  # still queued: "a" held both slots
    assert (waiting.token_ids, waiting.finish_reason) == ([], "abort")
    assert not engine.has_unfinished()
    assert engine.abort("unknown") == []


def test_streaming_api_returns_completions_as_they_finish(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=4, max_model_len=64)
    engine.add_request(_req("short", _prompt(5), max_tokens=2, ignore_eos=True))
    engine.add_request(_req("long", _prompt(5), max_tokens=6, ignore_eos=True))
    finished_at = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for c in engine.step():
            finished_at[c.request_id] = step
    # the first step samples two tokens (prefill + decode), then one per step
    assert finished_at == {"short": 1, "long": 5}
    assert engine.stats["steps"] == 5 and engine.stats["generated_tokens"] == 8


# ----------------------------------------------------------------------------- validation


def test_invalid_requests_raise(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=4, max_model_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(_req("e", []))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(_req("l", _prompt(16)))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(_req("n", _prompt(3), n=5))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(_req("v", [1, VOCAB]))
    engine.add_request(_req("d", _prompt(3)))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(_req("d", _prompt(3)))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([_req("g", _prompt(3))])
    engine.abort("d")
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([_req("ok", _prompt(3)), _req("bad", [])])
    assert not engine.has_unfinished()  # the valid request was withdrawn too
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def _llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, **kw)


def test_unsupported_architectures_raise():
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf(GPT2Config())
    # Frequencies that change with the sequence length (scaled RoPE is tests/test_qwen_models.py's)
    with pytest.raises(ValueError, match="RoPE type 'dynamic'"):
        ModelConfig.from_hf(_llama_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))
    assert ModelConfig.from_hf(_llama_config(rope_theta=5000.0)).rope_theta == 5000.0


def test_mistral_full_attention_only_within_its_window():
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=32)
    from transformers import MistralForCausalLM

    model = LlamaFamilyModel.from_hf(MistralForCausalLM(config))
    model.new_cache(2, 32)
    with pytest.raises(ValueError, match="sliding window"):
        model.new_cache(2, 64)


def test_bf16_engine_runs_close_to_fp32(hf_model):
    engine = ReferenceEngine(hf_model, max_model_len=64, dtype=torch.bfloat16)
    c = engine.generate([_req("b", _prompt(10), max_tokens=6, ignore_eos=True, seed=0)])[0]
    expected = _hf_logprobs(hf_model, c.prompt_ids, c.token_ids)
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=0.1)


def test_timeline_records_running_counts(hf_model):
    engine = ReferenceEngine(hf_model, max_num_seqs=3, max_model_len=64)
    engine.generate([_req(f"t{i}", _prompt(4, i), max_tokens=2 + 3 * i, ignore_eos=True) for i in range(4)])
    counts = [n for _, n in engine.timeline]
    times = [t for t, _ in engine.timeline]
    assert times == sorted(times)
    assert max(counts) == 3 and counts[-1] == 0 and len(counts) >= 2 * engine.stats["steps"]
    engine.reset_timeline()
    assert engine.timeline == []


def test_sequences_count_as_running_from_the_start_of_their_prefill(hf_model):
    """The bubble ratio counts a slot busy while its sequence is prefilled, as the simulated engine does;
    a sequence that ends at its first token was still busy for the whole prefill."""
    from rollwise.observe.bubble import busy_integral

    engine = ReferenceEngine(hf_model, max_num_seqs=4, max_model_len=64)
    engine.add_request(_req("p", _prompt(30), max_tokens=1, ignore_eos=True, n=2))
    assert len(engine.step()) == 2  # both finished at prefill
    (start, running), *rest = engine.timeline
    assert running == 2 and rest[-1][1] == 0
    assert busy_integral(engine.timeline, start, rest[-1][0]) > 0



def _sim_engine(_hf_model):
    from rollwise.sim.cost import CostModel
    from rollwise.sim.engine import SimEngine

    return SimEngine(CostModel(step_overhead_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3,
                               decode_s_per_ctx_token=1e-6, max_num_seqs=4, max_model_len=64), vocab_size=VOCAB)


@pytest.mark.parametrize("make", [lambda m: ReferenceEngine(m, max_num_seqs=4, max_model_len=64), _sim_engine],
                         ids=["reference", "sim"])
def test_pause_sleep_and_timeline_rules_are_the_same_for_every_engine(hf_model, make):
    """The rules of rollwise.engine.state.EngineState, on the real engine and the simulated one."""
    engine = make(hf_model)
    engine.add_request(_req("a", _prompt(6), max_tokens=20, ignore_eos=True, n=2, seed=1))
    engine.step()
    assert engine.num_running == 2 and engine.timeline[-1][1] == 2
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.sleep()  # requests in flight
    engine.pause()
    marks = len(engine.timeline)
    engine.pause()  # idempotent: no second mark
    assert engine.paused and len(engine.timeline) == marks and engine.timeline[-1][1] == 0
    assert engine.step() == [] and engine.num_running == 2  # frozen, not dropped
    engine.resume()
    engine.resume()
    assert not engine.paused and len(engine.timeline) == marks + 1 and engine.timeline[-1][1] == 2
    old = engine.timeline
    engine.reset_timeline()
    assert engine.timeline == [] and len(old) == marks + 1  # readers keep what they had
    tokens = [len(c.token_ids) for c in engine.abort("a")]
    assert tokens and all(t >= 1 for t in tokens) and not engine.has_unfinished()
    assert engine.timeline == [(engine.timeline[0][0], 0)]
    assert engine.sleep() is True and engine.sleeping and engine.load().sleeping
    with pytest.raises(ValueError, match="sleeping"):
        engine.add_request(_req("b", _prompt(6), max_tokens=2))
    engine.wake()
    engine.wake()
    assert not engine.sleeping
    (c,) = engine.generate([_req("c", _prompt(6), max_tokens=3, ignore_eos=True)])
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


# ----------------------------------------------------------------------------- benchmark


def test_engine_bench_runs_and_formats():
    from rich.console import Console

    from rollwise.bench.engine import format_engine_bench, run_engine_bench
    from rollwise.model.tiny import tiny_tokenizer

    result = run_engine_bench(tiny_llama(num_layers=1), tiny_tokenizer(), quick=True, seed=1, with_vllm=False)
    ref, hf = result["reference"], result["hf_generate"]
    budgets = result["config"]["budgets"]
    assert ref["tokens"] == hf["tokens"] == sum(map(sum, budgets))
    assert hf["tokens_incl_padding"] == sum(8 * max(b) for b in budgets) > hf["tokens"]
    assert result["speedup"] == pytest.approx(ref["tok_per_s"] / hf["tok_per_s"])
    console = Console(width=160, record=True)
    console.print(format_engine_bench(result))
    assert "HF generate" in console.export_text()
