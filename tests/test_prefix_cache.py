"""The reference engine's cross-request prefix cache.

- exactness: a multi-turn conversation and a GRPO group give the same tokens (seeded sampling) and
  logprobs (to 1e-5; only fp32 summation order differs) with the cache as without it, while the
  cache reports reused prompt tokens;
- the cache stays within its token budget, evicting least-recently-used leaf blocks;
- a weight update empties it (KV of old weights is never reused);
- `rollwise serve engine` exposes hits in /metrics and empties the cache on /flush_cache.
"""

from __future__ import annotations

import pytest
import torch

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.reference.prefix_cache import PrefixCache
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _engine(model, cache_tokens: int) -> ReferenceEngine:
    return ReferenceEngine(model, max_num_seqs=8, max_model_len=256, eos_token_ids=[2], prefix_cache_tokens=cache_tokens)


def _conversation(engine: ReferenceEngine, turns: int = 4) -> list:
    """Each turn's prompt = the previous prompt + its answer + a new 'user' message, like an agent."""
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(5, 90, (45,), generator=gen).tolist()
    out = []
    for t in range(turns):
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=t, ignore_eos=True)
        completion = engine.generate([GenerationRequest(f"turn{t}", history, params)])[0]
        out.append(completion)
        history = history + completion.token_ids + torch.randint(5, 90, (7,), generator=gen).tolist()
    return out


def test_multi_turn_outputs_equal_with_and_without_cache(model):
    plain, cached = _engine(model, 0), _engine(model, 4096)
    without, with_cache = _conversation(plain), _conversation(cached)
    for a, b in zip(without, with_cache):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [c.cached_prompt_tokens for c in without] == [0, 0, 0, 0]
    # Turn t reuses whole 16-token blocks of turn t-1's prompt + answer (the history cached on finish).
    reused = [c.cached_prompt_tokens for c in with_cache]
    assert reused[0] == 0 and all(r >= len(p.prompt_ids) - 16 - 7 - 10 for r, p in zip(reused[1:], with_cache[1:]))
    assert all(r % 16 == 0 and r < len(c.prompt_ids) for r, c in zip(reused, with_cache))
    assert cached.stats["prefix_cache_hit_tokens"] == sum(reused) == cached.stats["cached_prompt_tokens"]
    assert plain.stats["prefix_cache_hit_tokens"] == 0


def test_grpo_group_submitted_one_by_one_reuses_the_prompt(model):
    prompt = list(range(5, 85))  # 80 tokens: 4 cacheable blocks (one token is always recomputed)
    results = {}
    for cache_tokens in (0, 4096):
        engine = _engine(model, cache_tokens)
        results[cache_tokens] = [
            engine.generate([GenerationRequest(f"s{i}", prompt, SamplingParams(max_tokens=6, seed=i))])[0]
            for i in range(4)
        ]
    for a, b in zip(results[0], results[4096]):
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [c.cached_prompt_tokens for c in results[4096]] == [0, 64, 64, 64]


def test_n_samples_share_the_prefill_and_count_the_cached_prefix(model):
    engine = _engine(model, 4096)
    prompt = list(range(5, 45))  # 40 tokens: 2 blocks
    engine.generate([GenerationRequest("warm", prompt, SamplingParams(max_tokens=2, seed=0))])
    group = engine.generate([GenerationRequest("g", prompt, SamplingParams(max_tokens=2, n=3, seed=0))])
    assert sorted(c.cached_prompt_tokens for c in group) == [32, 40, 40]


def test_budget_evicts_least_recently_used_leaves(model):
    engine = _engine(model, 0)
    cache = PrefixCache(max_tokens=64, block_size=16)
    k = engine.cache.k[:, 0]
    v = engine.cache.v[:, 0]
    a, b = list(range(10, 58)), list(range(100, 148))  # 3 blocks each
    assert cache.insert(a, k, v) == 3 and cache.num_tokens == 48
    assert cache.insert(b, k, v) == 3 and cache.num_tokens == 64  # 2 leaf blocks of `a` evicted
    assert cache.match(a + [1]).num_tokens == 16  # a's first block is all that is left of it
    assert cache.match(b + [1]).num_tokens == 48
    cache.insert(a[:32], k, v)  # a's second block back: now b's leaf is the oldest
    assert cache.match(a + [1]).num_tokens == 32 and cache.match(b + [1]).num_tokens == 32
    assert cache.match(b[:16]) is None  # at least one prompt token is always recomputed


def test_weight_update_empties_the_cache(model):
    engine = _engine(model, 4096)
    prompt = list(range(5, 60))
    engine.generate([GenerationRequest("a", prompt, SamplingParams(max_tokens=4, seed=0))])
    assert engine.prefix_cache.num_tokens > 0
    other = tiny_llama(seed=1)
    engine.apply_weights(other.state_dict(), version=1)
    assert engine.prefix_cache.num_tokens == 0
    after = engine.generate([GenerationRequest("b", prompt, SamplingParams(max_tokens=4, seed=0))])[0]
    fresh = _engine(other, 0).generate([GenerationRequest("c", prompt, SamplingParams(max_tokens=4, seed=0))])[0]
    assert after.cached_prompt_tokens == 0 and after.token_ids == fresh.token_ids
    assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)


def test_server_reports_hits_and_flushes():
    import httpx

    from rollwise.engine.server import build_engine, create_app
    from rollwise.local_server import serve_in_thread

    engine, tokenizer = build_engine("tiny:0", max_num_seqs=4, max_model_len=128, seed=0, prefix_cache_tokens=2048)
    with serve_in_thread(create_app(engine, tokenizer, "tiny:0")) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            body = {"prompt": "x" * 40, "max_tokens": 2, "seed": 0}
            first = http.post("/v1/completions", json=body).json()["choices"][0]
            second = http.post("/v1/completions", json=body).json()["choices"][0]
            assert (first["cached_prompt_tokens"], second["cached_prompt_tokens"]) == (0, 32)
            metrics = http.get("/metrics").text
            assert "rollwise_engine_prefix_cache_hit_tokens_total 32.0" in metrics
            assert http.post("/flush_cache").json()["flushed_tokens"] > 0
            assert http.post("/v1/completions", json=body).json()["choices"][0]["cached_prompt_tokens"] == 0
            health = http.get("/health").json()
            assert health["running"] == 0 and health["max_num_seqs"] == 4
