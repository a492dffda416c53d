"""The Tinker service's samplers (rollwise.service.sampler) on a tiny random Llama, through Samplers.publish /
sample_many and the SDK's own decoder of the reply: sampled logprobs equal an independent recompute (a merged-
weight HF copy) and the trainer's forward, stop strings / stop tokens end a sample with the stopping tokens
included, `[]` stops at nothing (not even EOS), seeds reproduce, two tenants batched together equal each alone,
prompt logprobs equal a direct forward (NaN at position 0), and unsupported options are refused naming the field
while the rest of the batch runs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from rollwise.pool.cache_settings import CacheSettings
from rollwise.service.base_models import BaseModels
from rollwise.service.datums import Datum, ForwardBackwardBatch
from rollwise.service.errors import ServiceUserError
from rollwise.service.sampler import SampleJob, Samplers
from rollwise.service.tenant_model import TenantModel

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BASE = "tiny:0"
EOS = 2
PROMPT = [1, 20, 31, 42, 15, 9, 60]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return BaseModels(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def base(bases):
    return bases.get(BASE)


def tenant(base, seed: int, lora: types.LoraConfig | None = None) -> TenantModel:
    """A LoRA tenant (all targets, lm_head included) whose adapter is random, so it differs from the base."""
    t = TenantModel(base, lora or types.LoraConfig(rank=4, seed=seed))
    g = torch.Generator().manual_seed(seed)
    t.adapter.load({k: 0.05 * torch.randn(v.shape, generator=g) for k, v in t.adapter.state().items()})
    return t


@pytest.fixture(scope="module")
def samplers(bases, base):
    s = Samplers(bases, max_num_seqs=8, max_model_len=64)
    s.publish("base", None, BASE)
    s.tenants = {name: tenant(base, seed) for name, seed in (("a", 1), ("b", 2))}
    for name, t in s.tenants.items():
        s.publish(name, t.sampler_weights(), BASE)
    return s


def job(sampler_id: str, prompt=PROMPT, n: int = 1, **kw) -> SampleJob:
    extra = {k: kw.pop(k) for k in list(kw) if k in SampleJob.__dataclass_fields__}
    params = types.SamplingParams(**{"max_tokens": 12, "seed": 7, "stop": [], **kw})
    return SampleJob(sampler_id, list(prompt), n, params, **extra)


def run(samplers: Samplers, *jobs: SampleJob):
    out = samplers.sample_many(list(jobs))
    return [r if isinstance(r, ServiceUserError) else deserialize_sample_response(r) for r in out]


def merged(base, t: TenantModel | None):
    """Independent of the engine: an HF copy of the base with W + scaling * B @ A merged into every target."""
    model = copy.deepcopy(base.model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # the LoRA is on the output only
    if t is not None:
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, (a, b) in t.adapter.weights.items():
                modules[name].weight += t.adapter.scaling * b @ a
    return model


def token_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, by a plain HF forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize("sampler_id", ["base", "a"])
def test_sampled_logprobs_equal_a_recompute_and_the_trainer(samplers, base, sampler_id):
    t = samplers.tenants.get(sampler_id)
    (resp,) = run(samplers, job(sampler_id, n=2, max_tokens=10))
    model = merged(base, t)
    for seq in resp.sequences:
        assert len(seq.tokens) == 10 and seq.stop_reason == "length"
        want = token_logprobs(model, PROMPT + seq.tokens)[len(PROMPT) - 1:]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-5, rtol=1e-5)
        if t is not None:  # the trainer's forward (forward_only) of the same tokens gives the same logprobs
            full = PROMPT + seq.tokens
            datum = Datum(tokens=torch.tensor(full[:-1]), inputs={"target_tokens": torch.tensor(full[1:]),
                                                                  "weights": torch.ones(len(full) - 1)})
            (lps,), _ = t.forward_backward(ForwardBackwardBatch("m", 1, "cross_entropy", {}, True, [datum]))
            torch.testing.assert_close(torch.tensor(seq.logprobs), lps[len(PROMPT) - 1:], atol=1e-5, rtol=1e-5)


def test_stop_strings_and_stop_tokens_end_with_the_stopping_tokens(samplers, base):
    decode = base.tokenizer.decode
    (free,) = run(samplers, job("a", max_tokens=30))
    text = decode(free.sequences[0].tokens)
    stop = text[6:8]  # a two-token string the free sample contains (char-level tokenizer: one token per char)
    cut = text.find(stop) + len(stop)
    stop_token = free.sequences[0].tokens[5]
    first = next(i for i, tok in enumerate(free.sequences[0].tokens) if tok in (stop_token, EOS)) + 1
    engine = samplers.served("a").engine
    generated = engine.stats["generated_tokens"]
    by_string, by_token, by_both = run(samplers, job("a", max_tokens=30, stop=[stop]),
                                       job("a", max_tokens=30, stop=[stop_token]),
                                       job("a", max_tokens=30, stop=["never-there", stop]))
    for resp in (by_string, by_both):
        seq = resp.sequences[0]
        assert seq.tokens == free.sequences[0].tokens[:cut] and decode(seq.tokens).endswith(stop)
        assert seq.logprobs == pytest.approx(free.sequences[0].logprobs[:cut], abs=1e-5)  # batched otherwise
        assert seq.stop_reason == "stop"
    seq = by_token.sequences[0]
    assert seq.tokens == free.sequences[0].tokens[:first] and seq.stop_reason == "stop"
    # a stop string ends the engine's request as it matches: nothing past it was generated
    assert engine.stats["generated_tokens"] - generated == 2 * cut + first


def test_none_stops_at_eos_and_empty_list_stops_at_nothing(samplers):
    """Samples of a flat distribution, long enough that some contain EOS: with stop=None the same seed ends at the
    first EOS (included), with stop=[] it runs past it to max_tokens."""
    free, eos = run(samplers, job("base", n=8, max_tokens=50, temperature=2.0),
                    job("base", n=8, max_tokens=50, temperature=2.0, stop=None))
    with_eos = [i for i, seq in enumerate(free.sequences) if EOS in seq.tokens[:-1]]
    assert with_eos, "no sample contains EOS: pick another seed"
    for i in with_eos:
        first = free.sequences[i].tokens.index(EOS) + 1
        assert len(free.sequences[i].tokens) == 50 and free.sequences[i].stop_reason == "length"
        assert eos.sequences[i].tokens == free.sequences[i].tokens[:first] and eos.sequences[i].stop_reason == "stop"


def test_topk_sample_logprobs_are_the_most_likely_tokens_of_each_step(samplers, base):
    (resp,) = run(samplers, job("a", max_tokens=6, topk_sample_logprobs=3, stop=["never-there"]))
    seq = resp.sequences[0]
    tokens = PROMPT + seq.tokens
    with torch.no_grad():
        logits = merged(base, samplers.tenants["a"])(input_ids=torch.tensor([tokens])).logits[0].float()
    want = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1).topk(3)
    assert seq.topk_logprobs_np is not None and seq.topk_logprobs_np.token_ids.shape == (6, 3)
    assert seq.topk_logprobs_np.token_ids.tolist() == want.indices.tolist()
    torch.testing.assert_close(torch.from_numpy(seq.topk_logprobs_np.logprobs), want.values, atol=1e-4, rtol=1e-4)


def test_seeds_reproduce_and_sample_i_uses_seed_plus_i(samplers):
    three, again, *singles = run(samplers, job("b", n=3, seed=11, temperature=1.3, top_k=20, top_p=0.9),
                                 job("b", n=3, seed=11, temperature=1.3, top_k=20, top_p=0.9),
                                 *[job("b", seed=11 + i, temperature=1.3, top_k=20, top_p=0.9) for i in range(3)])
    assert [s.tokens for s in three.sequences] == [s.tokens for s in again.sequences]
    assert [s.tokens for s in three.sequences] == [one.sequences[0].tokens for one in singles]
    assert len({tuple(s.tokens) for s in three.sequences}) > 1


def test_tenants_batched_together_equal_each_alone(samplers, base):
    jobs = [job("a", n=2, seed=3), job("b", n=2, seed=3), job("base", n=2, seed=3)]
    together = run(samplers, *jobs)
    alone = [run(samplers, j)[0] for j in jobs]
    for t_resp, a_resp in zip(together, alone):
        for x, y in zip(t_resp.sequences, a_resp.sequences):
            assert x.tokens == y.tokens
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=1e-5)
    assert together[0].sequences[0].tokens != together[1].sequences[0].tokens  # the adapters really differ
    # a published sampler is a snapshot: training the tenant on does not change what it serves
    t = samplers.tenants["a"]
    t.adapter.load({k: v + 1.0 for k, v in t.adapter.state().items()})
    assert run(samplers, jobs[0])[0].sequences[0].tokens == alone[0].sequences[0].tokens
    t.adapter.load({k: v - 1.0 for k, v in t.adapter.state().items()})


@pytest.mark.parametrize("sampler_id", ["base", "b"])
def test_prompt_logprobs_equal_a_direct_forward(samplers, base, sampler_id):
    (resp, last) = run(samplers, job(sampler_id, max_tokens=1, prompt_logprobs=True),
                       job(sampler_id, max_tokens=1, prompt_logprobs=True, prompt_logprobs_last_n=3))
    got = resp.prompt_logprobs_np
    assert len(got) == len(PROMPT) and math.isnan(got[0])
    want = token_logprobs(merged(base, samplers.tenants.get(sampler_id)), PROMPT)
    torch.testing.assert_close(torch.tensor(got[1:]), want, atol=1e-5, rtol=1e-5)
    assert all(math.isnan(v) for v in last.prompt_logprobs_np[:-3])
    torch.testing.assert_close(torch.tensor(last.prompt_logprobs_np[-3:]), want[-3:], atol=1e-5, rtol=1e-5)


def test_target_prompt_logprobs_score_the_asked_tokens_from_a_sparse_request(samplers, base):
    """As the cookbook's decisions recipe asks: row i scores prompt position i + 1, -1 asks nothing (0.0 back)."""
    targets = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    targets[4] = torch.tensor([5, 6, 7])
    targets[1, 0] = 30
    sparse = types.TensorData.from_torch_sparse(targets, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    wire = {f: getattr(sparse, f) for f in ("data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices")}
    body = types.SampleRequest.model_validate(  # as the API receives it
        {"sampling_session_id": "a", "num_samples": 1, "prompt": types.ModelInput.from_ints(PROMPT).model_dump(),
         "sampling_params": {"max_tokens": 1}, "target_prompt_logprobs": wire})
    (resp,) = run(samplers, SampleJob.from_request(body))
    got = resp.target_prompt_logprobs.to_torch()
    with torch.no_grad():
        logits = merged(base, samplers.tenants["a"])(input_ids=torch.tensor([PROMPT])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1)
    want = torch.where(targets >= 0, logprobs.gather(-1, targets.clamp(min=0)), 0.0)
    assert got.shape == targets.shape and bool((got[targets < 0] == 0).all())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_topk_prompt_logprobs_are_the_most_likely_tokens_at_each_position(samplers, base):
    (resp,) = run(samplers, job("b", max_tokens=1, topk_prompt_logprobs=4, prompt_logprobs_last_n=4))
    with torch.no_grad():
        logits = merged(base, samplers.tenants["b"])(input_ids=torch.tensor([PROMPT])).logits[0].float()
    want = torch.log_softmax(logits[:-1], -1).topk(4)
    got = resp.topk_prompt_logprobs  # the SDK's lists: None where not scored (position 0, before the last 4)
    assert resp.prompt_logprobs_np is None and len(got) == len(PROMPT)
    assert got[: len(PROMPT) - 4] == [None] * (len(PROMPT) - 4)
    for position in range(len(PROMPT) - 4, len(PROMPT)):
        assert [t for t, _ in got[position]] == want.indices[position - 1].tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[position]]), want.values[position - 1],
                                   atol=1e-5, rtol=1e-5)


def full_tenant(base, seed: int) -> TenantModel:
    full = TenantModel(base, None)
    with torch.no_grad():
        for p in full.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 7919 + p.numel())))
    return full


def test_full_parameter_sampler_serves_its_own_weights(bases, base):
    s = Samplers(bases, max_num_seqs=4, max_model_len=64, max_full_samplers=1)
    try:
        full = full_tenant(base, 1)
        s.publish("full", full.sampler_weights(), BASE)
        (resp,) = run(s, job("full", max_tokens=8, prompt_logprobs=True))
        seq = resp.sequences[0]
        want = token_logprobs(full.model, PROMPT + seq.tokens)
        torch.testing.assert_close(torch.tensor(seq.logprobs), want[len(PROMPT) - 1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(resp.prompt_logprobs_np[1:]), want[: len(PROMPT) - 1], atol=1e-5,
                                   rtol=1e-5)
        s.publish("full2", TenantModel(base, None).sampler_weights(), BASE)  # past max_full_samplers: full goes
        dropped, fresh = run(s, job("full", max_tokens=2), job("full2", max_tokens=2))
        assert isinstance(dropped, ServiceUserError) and "sampling_session_id" in str(dropped)
        assert len(fresh.sequences[0].tokens) == 2
        assert list(s.full.state()["jobs"]) == [s.served("full2").job.name]  # its pool job was detached
    finally:
        s.close()


def test_full_parameter_tenants_alternating_on_one_pool_slot_equal_each_alone(bases, base):
    """Two full-parameter tenants sampled alternately through the pool's one slot (no engine kept asleep: each switch
    recycles the engine, its weights from the tiered cache) get exactly what each gets alone; the pool reports it."""
    tenants = {"f1": full_tenant(base, 1), "f2": full_tenant(base, 2)}
    greedy = dict(max_tokens=6, temperature=0.0, topk_sample_logprobs=2)

    def alone(name: str):
        s = Samplers(bases, max_num_seqs=4, max_model_len=64)
        try:
            s.publish(name, tenants[name].sampler_weights(), BASE)
            return run(s, job(name, **greedy))[0]
        finally:
            s.close()

    want = {name: alone(name) for name in tenants}
    s = Samplers(bases, max_num_seqs=4, max_model_len=64, full_slots=1, full_sleeping=0,
                 full_cache=CacheSettings(memory_bytes=1 << 30))
    try:
        for name, t in tenants.items():
            s.publish(name, t.sampler_weights(), BASE)
        got = [(name, run(s, job(name, **greedy))[0]) for name in ("f1", "f2", "f1", "f2")]
        got.append(("f1", run(s, job("f1", prompt_logprobs=True, **greedy))[0]))
        for name, resp in got:
            assert resp.sequences[0].tokens == want[name].sequences[0].tokens
            assert resp.sequences[0].logprobs == want[name].sequences[0].logprobs
            top, top_want = resp.sequences[0].topk_logprobs_np, want[name].sequences[0].topk_logprobs_np
            assert top.token_ids.tolist() == top_want.token_ids.tolist() and top.logprobs.tolist() == top_want.logprobs.tolist()
        assert want["f1"].sequences[0].tokens != want["f2"].sequences[0].tokens or (
            want["f1"].sequences[0].logprobs != want["f2"].sequences[0].logprobs)
        state = s.full.state()
        loads = [t["reason"] for t in state["transitions"] if t["target"] == "active"]
        # the first switch builds the slot's engine; the next ones recycle it (the tenants share one model)
        assert len(loads) >= 4 and loads[0].startswith("load (") and all(r.startswith("recycle (") for r in loads[1:]), loads
        assert any("memory tier" in r for r in loads), loads  # switched back in from the cache's memory tier
        assert state["model_cache"]["memory"]["hits"] >= 2
    finally:
        s.close()


@pytest.mark.parametrize("field, kw", [
    ("topk_prompt_logprobs", {"topk_prompt_logprobs": 1000}),  # more than the vocabulary
    ("prompt_alt_tokens_k", {"prompt_alt_tokens_k": 1}),
    ("target_prompt_logprobs", {"target_prompt_logprobs": torch.zeros(3, 2, dtype=torch.long)}),  # wrong rows
    ("topk_sample_logprobs", {"topk_sample_logprobs": 1000}),  # more than the vocabulary
    ("prompt_logprobs_last_n", {"prompt_logprobs_last_n": 2}),  # without prompt_logprobs
    ("sampling_params.stop", {"stop": [10_000]}),
    ("sampling_params.top_p", {"top_p": 1.5}),
    ("prompt", {"prompt": [1, 999]}),
])
def test_unsupported_or_wrong_options_fail_alone_naming_the_field(samplers, field, kw):
    prompt = kw.pop("prompt", PROMPT)
    good_before, bad, good_after = run(samplers, job("a"), job("a", prompt=prompt, **kw), job("b"))
    assert isinstance(bad, ServiceUserError) and str(bad).startswith(field)
    assert len(good_before.sequences[0].tokens) == 12 and len(good_after.sequences[0].tokens) == 12
    assert run(samplers, job("nope"))[0].args[0].startswith("sampling_session_id")


def test_lora_samplers_past_max_adapters_drop_the_least_recently_used(bases, base):
    s = Samplers(bases, max_num_seqs=4, max_model_len=64, max_adapters=2)
    tenants = [tenant(base, seed) for seed in (1, 2, 3)]
    s.publish("x", tenants[0].sampler_weights(), BASE)
    s.publish("y", tenants[1].sampler_weights(), BASE)
    run(s, job("x", max_tokens=1))  # x is now used more recently than y
    s.publish("z", tenants[2].sampler_weights(), BASE)
    x, y, z = run(s, job("x", max_tokens=2), job("y", max_tokens=2), job("z", max_tokens=2))
    assert isinstance(y, ServiceUserError) and str(y).startswith("sampling_session_id")
    assert len(x.sequences[0].tokens) == 2 and len(z.sequences[0].tokens) == 2
    assert len(s.served("x").engine.loaded_adapters()) == 2
