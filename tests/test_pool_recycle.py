"""A pool slot switching between full-parameter jobs of one model recycles the outgoing engine (issue 42, item 2):
the engine eviction would drop is handed to the incoming job, its weights replaced whole (Engine.replace_weights).

- two jobs of one tiny model, alternating on one slot with nothing kept asleep: every switch after the first is a
  recycle, and /state's transitions say so (the outgoing job evicted "engine recycled for ...", the incoming one
  loaded by "recycle (memory tier)", once the tier holds its weights);
- each job's greedy tokens and logprobs equal an engine built fresh with that job's weights, for the same prompt in
  both jobs (a prefix-cache hit left by the other job's weights would change them: none is reused), and its tokens
  carry its own version, also when it is lower than the engine's previous owner's;
- a job of another model gets an engine built for it, not recycled;
- replace_weights refuses a state that is not the whole model or an engine with requests in flight, naming the
  problem, and changes nothing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rollwise.engine.contract import run_to_completion
from rollwise.engine.factory import create_engine
from rollwise.model.loading import load_model
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.jobs import Job
from rollwise.pool.scheduler import Policy
from rollwise.pool.states import check_log
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_LEN = 64
PROMPT = list(range(1, 41))  # longer than a prefix-cache block: a second run of it reuses cached KV
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
VERSIONS = {"a": 7, "b": 2}  # b's version is lower than a's: the recycled engine's version goes down


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) * 0.2 for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def pool():
    model, tok = load_model("tiny:0")
    pool = EnginePool(1, max_num_seqs=2, max_model_len=MAX_LEN, policy=Policy(min_slice_s=0.0), max_sleeping=0,
                      prefix_cache_tokens=256, cache=CacheSettings(memory_bytes=1 << 30))  # a memory tier for all
    pool.start()
    weights = {name: _perturbed(model, seed) for seed, name in enumerate(VERSIONS, 1)}
    jobs = {}
    for name, version in VERSIONS.items():
        jobs[name] = pool.attach(name, "tiny:0", 1.0, None, loaded=(model, tok))
        pool.push_weights(jobs[name], weights[name], version)
    other_model, other_tok = load_model("tiny:qwen2:0")
    jobs["c"] = pool.attach("c", "tiny:qwen2:0", 1.0, None, loaded=(other_model, other_tok))
    pool.push_weights(jobs["c"], other_model.state_dict(), 1)
    fresh = {}
    for name, version in VERSIONS.items():  # an engine built with the job's weights, its prefix cache empty
        engine = create_engine("reference", model, tok, max_num_seqs=2, max_model_len=MAX_LEN, eos_token_ids=[tok.eos_token_id],
                               policy_version=version, seed=0)
        engine.apply_weights(weights[name], version)
        fresh[name] = run_to_completion(engine, [GenerationRequest("fresh", PROMPT, GREEDY)])[0]
    yield pool, jobs, fresh
    pool.close()


def _run(pool: EnginePool, job: Job, rid: str) -> Completion:
    done = threading.Event()
    [req] = pool.submit(job, [(rid, PROMPT, GREEDY)], waiter=done)
    assert done.wait(60), pool.state()["slots"][0]["errors"]
    assert req.error is None
    return req.done[0]


def _last(pool: EnginePool, job: str, target: str) -> dict:
    return [t for t in pool.state()["transitions"] if t["job"] == job and t["target"] == target][-1]


def test_alternating_jobs_of_one_model_recycle_one_engine_and_serve_their_own_weights(pool):
    pool, jobs, fresh = pool
    first = _run(pool, jobs["a"], "a0")
    again = _run(pool, jobs["a"], "a0-again")  # the same prompt on the same engine: served from its prefix cache
    assert again.cached_prompt_tokens > 0 and again.token_ids == first.token_ids
    assert _last(pool, "a", "active")["reason"].startswith("load (")  # the slot's first engine is built
    engine = pool.slots[0].instances["a"]
    for rnd, name in enumerate(["b", "a", "b", "a"]):
        got = _run(pool, jobs[name], f"{name}{rnd}")
        other = "a" if name == "b" else "b"
        assert pool.slots[0].instances == {name: engine}  # the one engine, now this job's
        tier = "remote" if rnd == 0 else "memory"  # b's first fetch fills the memory tier (a's did at its load)
        assert _last(pool, name, "active")["reason"] == f"recycle ({tier} tier) for {name} (after {other})"
        assert _last(pool, other, "sleeping")["reason"] == f"slot switches to {name} (memory kept)"  # handed over awake
        assert _last(pool, other, "evicted")["reason"].endswith(f"engine recycled for {name}")
        assert got.cached_prompt_tokens == 0  # the other job's cached KV of this very prompt was dropped
        assert got.versions == [VERSIONS[name]] * len(got.token_ids)  # b's 2 after a's 7: the version went down
        want = fresh[name]
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert fresh["a"].token_ids != fresh["b"].token_ids or fresh["a"].logprobs != fresh["b"].logprobs
    assert pool.shared.violations == [] and check_log(pool.state()["transitions"], 1) == []  # a legal history


def test_a_job_of_another_model_gets_an_engine_built(pool):
    pool, jobs, _ = pool
    _run(pool, jobs["a"], "a-before-c")
    recycled = pool.slots[0].instances["a"]
    _run(pool, jobs["c"], "c0")
    assert _last(pool, "c", "active")["reason"].startswith("load (")
    assert "recycled" not in _last(pool, "a", "evicted")["reason"]
    assert _last(pool, "a", "sleeping")["reason"] == "slot switches to c"  # it slept: its memory was not kept
    assert pool.slots[0].instances["c"] is not recycled


def test_replace_weights_drops_the_old_weights_prefix_cache(pool):
    """On an awake engine too (the pool's recycled one slept, which dropped it already): the engine answers the
    prompt it cached under the old weights as an engine built with the new ones does."""
    _, jobs, fresh = pool
    engine = create_engine("reference", jobs["a"].template, jobs["a"].tokenizer, max_num_seqs=2, max_model_len=MAX_LEN,
                           eos_token_ids=jobs["a"].eos_ids, policy_version=9, seed=0, prefix_cache_tokens=256)
    engine.apply_weights(jobs["a"].weights, 9)
    run_to_completion(engine, [GenerationRequest("old", PROMPT, GREEDY)])
    assert engine.prefix_cache_tokens > 0
    engine.replace_weights(jobs["b"].weights, VERSIONS["b"])
    assert engine.prefix_cache_tokens == 0 and engine.policy_version == VERSIONS["b"]
    got = run_to_completion(engine, [GenerationRequest("new", PROMPT, GREEDY)])[0]
    assert got.cached_prompt_tokens == 0 and got.token_ids == fresh["b"].token_ids
    assert got.logprobs == pytest.approx(fresh["b"].logprobs, abs=1e-5)


def test_replace_weights_refuses_a_partial_state_or_a_busy_engine_and_changes_nothing():
    model, tok = load_model("tiny:0")
    engine = create_engine("reference", model, tok, max_num_seqs=2, max_model_len=MAX_LEN, policy_version=5, seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state = _perturbed(model, 3)
    missing = next(iter(state))
    with pytest.raises(ValueError, match=f"missing weight '{missing}'"):
        engine.replace_weights({k: v for k, v in state.items() if k != missing}, 1)
    engine.add_request(GenerationRequest("busy", PROMPT, GREEDY))
    with pytest.raises(ValueError, match="idle engine"):
        engine.replace_weights(state, 1)
    assert engine.policy_version == 5
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    engine.abort("busy")
    engine.replace_weights(state, 1)
    assert engine.policy_version == 1
