"""Live migration with the vLLM backend (issue 42 item 3; rollwise.engine.vllm_migration): a running greedy request
moved mid-generation out of a vLLM engine, into one, and between engine servers over HTTP (`POST /migrate`) ends
with the tokens, logprobs and versions one engine produces alone; the tokens sampled after the handover carry the
target's version. A request a vLLM continuation would sample differently (frequency/presence penalties) is refused,
named, and keeps running where it is.

One vLLM engine per process (vLLM keeps its in-process engine in globals), so vLLM -> vLLM is a handover through a
reference engine and back (vLLM exports, stages and continues), and the HTTP test moves vLLM <-> reference servers.
A seeded non-greedy sample keeps its tokens and continues from a fresh RNG stream (vLLM's cannot move)."""

from __future__ import annotations

import threading
import time

import httpx
import torch
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")

from rollwise.engine.migration import Migratable, MigrationRefused, MigrationState, migrate  # noqa: E402
from rollwise.engine.reference.engine import ReferenceEngine  # noqa: E402
from rollwise.engine.retention import RetentionLimits, RetentionRequest  # noqa: E402
from rollwise.engine.vllm_backend import VLLMEngine  # noqa: E402
from rollwise.engine.vllm_requests import config_eos  # noqa: E402
from rollwise.local_server import serve_in_thread  # noqa: E402
from rollwise.model.tiny import tiny_llama, tiny_tokenizer  # noqa: E402
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MAX_LEN = 448
TOKENS = 24
LONG = 400  # over HTTP: long enough to be still running when the test pauses the server, whatever the load
NAME, FINGERPRINT = "tiny-vllm", "test-tokenizer"
PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 2, 3], [1, 60, 7, 33, 12, 9, 70, 71],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
            32, 33, 34, 35, 36]]  # past one 32-token KV block: the staged prefix is served from vLLM's prefix cache


RETENTION = RetentionLimits(pin_budget_tokens=4 * MAX_LEN, ttl_max_s=60.0)


def _requests(tag: str, tokens: int = TOKENS) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1, seed=0)  # head_dim 64: vLLM's CPU attention


@pytest.fixture(scope="module")
def vllm_engine(model):
    engine = VLLMEngine(model, tiny_tokenizer(), max_num_seqs=8, max_model_len=MAX_LEN, seed=0, kv_cache_gib=1,
                        model_name=NAME, tokenizer_fingerprint=FINGERPRINT, retention=RETENTION,
                        retention_policy="always_preserve")  # (sessions: the InferCept test)
    yield engine
    engine.close()


def _reference(model, version: int, retention: RetentionLimits | None = None) -> ReferenceEngine:
    return ReferenceEngine(model, max_num_seqs=8, max_model_len=MAX_LEN, policy_version=version, seed=0,
                           model_name=NAME, tokenizer_fingerprint=FINGERPRINT, retention=retention,
                           retention_policy="always_preserve",
                           eos_token_ids=config_eos(model))  # the vLLM engine's


@pytest.fixture(scope="module")
def alone(vllm_engine) -> dict[str, Completion]:
    """What the vLLM engine produces for each prompt without any migration (keyed by prompt index; greedy: the
    first TOKENS of them are what a shorter request produces)."""
    return {c.request_id[-1]: c for c in vllm_engine.generate(_requests("alone", LONG))}


def _run(engine, steps: int | None = None) -> list[Completion]:
    out: list[Completion] = []
    while engine.has_unfinished() and (steps is None or steps > 0):
        out += engine.step()
        steps = None if steps is None else steps - 1
    return out


def _assert_as_alone(got: list[Completion], alone: dict[str, Completion], versions: dict[str, list[int]]) -> None:
    assert sorted(c.request_id for c in got) == sorted(versions)  # each once: nothing lost, nothing twice
    for c in got:
        ref = alone[c.request_id[-1]]
        assert c.prompt_ids == ref.prompt_ids and c.token_ids == ref.token_ids[:TOKENS] and c.finish_reason == "length"
        assert c.logprobs == pytest.approx(ref.logprobs[:TOKENS], abs=2e-3)
        assert c.versions == versions[c.request_id], c.request_id


def test_vllm_is_migratable_and_model_info_matches_the_reference(vllm_engine, model):
    assert isinstance(vllm_engine, Migratable)
    info, ref = vllm_engine.model_info(), _reference(model, 0).model_info()
    assert (info.model, info.vocab_size, info.tokenizer_fingerprint) == (ref.model, ref.vocab_size,
                                                                          ref.tokenizer_fingerprint)


class _SleepsAtCommit:
    """A real reference engine as the target, put to sleep just before the handover's commit: it refuses it."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):  # noqa: ANN204 - every other Migratable method: the engine's
        return getattr(self.engine, name)

    def commit_migration(self, state: MigrationState) -> None:
        self.engine.sleep()
        self.engine.commit_migration(state)


def test_a_refused_handover_resumes_on_vllm_as_one_engine(vllm_engine, model, alone):
    """The target refuses the commit: vLLM kept each request's place (suspended, its tokens kept) and resumes it
    from where it stopped (greedy: the tokens one engine produces), nothing lost or emitted twice."""
    for r in _requests("k"):
        vllm_engine.add_request(r)
    assert _run(vllm_engine, 3) == []
    with pytest.raises(MigrationRefused) as refused:
        migrate(vllm_engine, _SleepsAtCommit(_reference(model, 3)), source_steps=2)
    assert sorted(refused.value.stayed) == ["k0", "k1", "k2"]
    assert all("sleeping" in why for why in refused.value.stayed.values())
    _assert_as_alone(_run(vllm_engine), alone, {f"k{i}": [0] * TOKENS for i in range(3)})
    assert vllm_engine.migratable_requests() == [] and not vllm_engine.has_unfinished()


def test_greedy_requests_move_vllm_to_reference_and_back_as_one_engine(vllm_engine, model, alone):
    """vLLM (v0) -> reference (v3) after a few steps, with catch-up rounds while vLLM decodes; then reference ->
    vLLM, whose staging request runs (and emits nothing) before the handover. Tokens keep the versions that
    sampled them: vLLM's 0, then the reference's 3, then vLLM's 0 again."""
    reference = _reference(model, 3)
    for r in _requests("v"):
        vllm_engine.add_request(r)
    assert _run(vllm_engine, 3) == []
    there = migrate(vllm_engine, reference, source_steps=2)
    assert sorted(there.migrated) == ["v0", "v1", "v2"] and there.finished_on_source == []
    assert not vllm_engine.has_unfinished() and vllm_engine.migratable_requests() == []
    assert _run(reference, 4) == []
    # back to vLLM by hand, to let its staging request run between the rounds
    first = {rid: reference.export_running(rid) for rid in reference.migratable_requests()}
    staged = sum(vllm_engine.stage_migration(s) for s in first.values())
    assert staged == sum(len(s.request.prompt_ids) + len(s.samples[0].token_ids) - 1 for s in first.values())
    assert vllm_engine.step() == [] and not vllm_engine.has_unfinished()  # the staging ran; no sample came of it
    assert _run(reference, 2) == []
    back = {}
    for rid in first:
        final = reference.export_running(rid)
        reference.release_migrated(rid)
        vllm_engine.commit_migration(final)
        back[rid] = len(final.samples[0].token_ids)
    got = _run(vllm_engine)
    versions = {rid: [0] * there.migrated[rid] + [3] * (back[rid] - there.migrated[rid]) + [0] * (TOKENS - back[rid])
                for rid in back}
    assert all(0 < there.migrated[r] < back[r] < TOKENS for r in back), (there.migrated, back)
    _assert_as_alone(got, alone, versions)


def test_greedy_requests_move_reference_to_vllm_as_one_engine(vllm_engine, model, alone):
    reference = _reference(model, 5)
    for r in _requests("r"):
        reference.add_request(r)
    _run(reference, 5)
    moved = migrate(reference, vllm_engine, source_steps=2)
    assert sorted(moved.migrated) == ["r0", "r1", "r2"] and not reference.has_unfinished()
    got = _run(vllm_engine)
    _assert_as_alone(got, alone, {rid: [5] * n + [0] * (TOKENS - n) for rid, n in moved.migrated.items()})


def test_seeded_samples_continue_with_a_fresh_stream(vllm_engine, model):
    """vLLM's RNG state cannot move (its generators live in its worker): a seeded non-greedy sample keeps every token
    it had and continues, to its full length, from a fresh stream derived from (seed, index, tokens so far)."""
    request = GenerationRequest("seeded", PROMPTS[1], SamplingParams(max_tokens=TOKENS, temperature=1.0, n=2, seed=11,
                                                                     ignore_eos=True))
    [unmoved0, unmoved1] = vllm_engine.generate([request])
    reference = _reference(model, 2)
    vllm_engine.add_request(request)
    _run(vllm_engine, 4)
    state = vllm_engine.export_running("seeded")
    assert [s.rng_state for s in state.samples] == [b"", b""]  # none exported: nothing to restore elsewhere
    moved = migrate(vllm_engine, reference)
    got = sorted(_run(reference), key=lambda c: c.index)
    n = moved.migrated["seeded"] // 2
    for c, unmoved in zip(got, (unmoved0, unmoved1)):
        assert len(c.token_ids) == TOKENS and c.token_ids[:n] == unmoved.token_ids[:n]
        assert c.versions == [0] * n + [2] * (TOKENS - n)


def test_a_request_a_continuation_would_change_is_refused_and_keeps_running(vllm_engine, model):
    """Frequency/presence penalties count output tokens, which a vLLM continuation sees as prompt: refused, named,
    nothing changed (it stays on the source; on a vLLM target, nothing is staged)."""
    penalised = GenerationRequest("pen", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   frequency_penalty=0.5))
    vllm_engine.add_request(penalised)
    _run(vllm_engine, 2)
    assert vllm_engine.migratable_requests() == ["pen"]  # in flight, named: a migration accounts for it
    with pytest.raises(ValueError, match="'pen'.*frequency/presence penalties"):
        vllm_engine.export_running("pen")
    reference = _reference(model, 0)
    with pytest.raises(ValueError, match="'pen'.*frequency/presence penalties") as refused:
        migrate(vllm_engine, reference)  # it stays, with the reason; nothing moved
    assert list(refused.value.stayed) == ["pen"] and not reference.has_unfinished()
    [done] = _run(vllm_engine)
    assert done.request_id == "pen" and len(done.token_ids) == 8  # it finished where it ran
    reference.add_request(penalised)
    _run(reference, 2)
    with pytest.raises(ValueError, match="frequency/presence penalties"):
        migrate(reference, vllm_engine)
    assert reference.migratable_requests() == ["pen"] and not vllm_engine.has_unfinished()
    assert not vllm_engine.has_staging()


def test_a_request_the_vllm_target_would_cut_off_stays_on_the_source(vllm_engine, model):
    """A source with a longer max_model_len than the vLLM target: a request whose budget fits only the source stays
    there (migration.check_context_limit), nothing staged on vLLM; vLLM's export carries its own limit."""
    source = ReferenceEngine(model, max_num_seqs=8, max_model_len=2 * MAX_LEN, policy_version=0, seed=0,
                             model_name=NAME, tokenizer_fingerprint=FINGERPRINT, eos_token_ids=config_eos(model))
    long = GenerationRequest("long", PROMPTS[1], SamplingParams(max_tokens=MAX_LEN, temperature=0.0, ignore_eos=True))
    source.add_request(long)
    _run(source, 2)
    with pytest.raises(MigrationRefused, match=rf"'long'.*max_model_len={MAX_LEN}.*max_model_len >= "
                                              rf"{len(PROMPTS[1]) + MAX_LEN}") as refused:
        migrate(source, vllm_engine)
    assert list(refused.value.stayed) == ["long"] and not vllm_engine.has_unfinished()
    assert not vllm_engine.has_staging()
    [done] = _run(source)
    assert len(done.token_ids) == MAX_LEN  # not cut off: it ran on where it was
    vllm_engine.add_request(_requests("lim", 4)[0])
    _run(vllm_engine, 1)
    assert vllm_engine.export_running("lim0").max_model_len == MAX_LEN
    _run(vllm_engine)


def test_a_session_with_retained_kv_moves_to_vllm_and_is_retained_there(vllm_engine, model):
    """InferCept: a turn resumed from its session's retained KV on a reference engine moves to the vLLM engine, which
    binds no session at commit (vLLM binds one at retain(), from the finished turn): the turn ends as one engine's,
    the agent's retain() there preserves it, and the session's next turn reuses its KV from vLLM's prefix cache."""
    source = _reference(model, 0, RETENTION)
    [turn1] = source.generate([GenerationRequest("it1", PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0,
                                                                                    ignore_eos=True))])
    assert source.retain(RetentionRequest("sess", "it1", "python", 0.5)).action == "preserve"
    context = turn1.prompt_ids + turn1.token_ids + [70, 71, 72]
    turn2 = GenerationRequest("it2", context, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    [expected] = _reference(model, 0).generate([turn2])
    source.add_request(turn2)
    _run(source, 2)
    moved = migrate(source, vllm_engine)
    assert list(moved.migrated) == ["it2"] and not source.has_unfinished()
    [got] = _run(vllm_engine)
    assert got.token_ids == expected.token_ids and got.logprobs == pytest.approx(expected.logprobs, abs=2e-3)
    kept = vllm_engine.retain(RetentionRequest("sess", "it2", "python", 0.5))
    try:
        assert kept.action == "preserve" and kept.tokens > 0
        whole = got.prompt_ids + got.token_ids
        [turn3] = vllm_engine.generate([GenerationRequest("it3", whole + [80, 81], SamplingParams(
            max_tokens=2, temperature=0.0, ignore_eos=True))])
        assert turn3.cached_prompt_tokens >= len(whole) // 32 * 32  # every whole block of the session's context
    finally:
        vllm_engine.release_session("sess")


def test_replace_weights_serves_the_new_owners_weights_and_refuses_a_partial_or_busy_swap(vllm_engine, model):
    """Engine.replace_weights on vLLM (a pool recycling the engine for another job): the other owner's whole weights
    at its version, which may be lower; the old weights' prefix cache is dropped (a repeat of a cached prompt is
    recomputed); swapping the first weights back answers as before, token for token. A partial state or an engine
    with requests in flight is refused and changes nothing. (It restores the engine's weights: the tests after it use them.)"""
    def prompt(rid: str) -> GenerationRequest:  # the same greedy request, under a new id each time
        return GenerationRequest(rid, PROMPTS[2], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))

    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    version = vllm_engine.policy_version
    before = vllm_engine.generate([prompt("w0")])[0]
    try:
        with pytest.raises(ValueError, match="missing weight"):
            vllm_engine.replace_weights({k: v for k, v in other.items() if k != "model.norm.weight"}, version + 5)
        vllm_engine.add_request(prompt("busy"))
        with pytest.raises(ValueError, match="idle engine"):
            vllm_engine.replace_weights(other, version + 5)
        vllm_engine.abort("busy")
        _run(vllm_engine)
        again = vllm_engine.generate([prompt("w1")])[0]
        assert vllm_engine.policy_version == version and again.token_ids == before.token_ids  # unchanged
        assert again.cached_prompt_tokens > 0  # the prompt's first KV block is in the prefix cache

        vllm_engine.replace_weights(other, version + 5)
        vllm_engine.replace_weights(original, version)  # a lower version: the first owner's, back
        back = vllm_engine.generate([prompt("w2")])[0]
        assert vllm_engine.policy_version == version and back.versions == [version] * TOKENS
        assert back.cached_prompt_tokens == 0  # the cache of the weights before the swap was dropped
        assert back.token_ids == before.token_ids and back.logprobs == pytest.approx(before.logprobs, abs=1e-4)

        vllm_engine.replace_weights(other, version + 5)
        swapped = vllm_engine.generate([prompt("w3")])[0]
        assert swapped.versions == [version + 5] * TOKENS and swapped.cached_prompt_tokens == 0
        assert swapped.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the other owner's weights answered
    finally:
        if vllm_engine.has_unfinished():
            vllm_engine.abort("busy")
            _run(vllm_engine)
        vllm_engine.replace_weights(original, version)


def _move_over_http(source: str, target: str, tag: str) -> tuple[httpx.Response, dict[str, dict]]:
    """Three long greedy requests on `source`'s /generate, moved to `target` by POST /migrate while they run;
    returns /migrate's answer and each client's answer."""
    answers: dict[str, dict] = {}

    def generate(r: GenerationRequest) -> None:
        body = {"prompt_ids": r.prompt_ids, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True,
                "request_id": r.request_id}
        answers[r.request_id] = httpx.post(source + "/generate", json=body, timeout=120).json()

    threads = [threading.Thread(target=generate, args=(r,)) for r in _requests(tag, LONG)]
    httpx.post(source + "/pause")  # all three queued first, so they start together (a tiny model decodes fast)
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (health := httpx.get(source + "/health").json())["waiting"] < len(threads):
        assert time.monotonic() < deadline, health
    httpx.post(source + "/resume")
    while (health := httpx.get(source + "/health").json())["running"] < len(threads):
        assert time.monotonic() < deadline and not answers, (health, answers)  # (none may finish unseen)
    httpx.post(source + "/pause")  # (so none finishes before the move, whatever the load)
    try:
        moved = httpx.post(source + "/migrate", json={"target": target}, timeout=60)
    finally:
        httpx.post(source + "/resume")
    for t in threads:
        t.join(timeout=120)
    return moved, answers


def test_migrate_route_moves_requests_out_of_and_into_a_vllm_server(vllm_engine, model, alone):
    """POST /migrate on a vLLM engine server (no longer 409): its requests continue on a reference engine server,
    and the other way round (the vLLM server's engine thread runs the staging requests); the clients get the
    samples one engine would have produced, each saying where it moved."""
    from rollwise.engine.server import create_app as engine_app

    tok = tiny_tokenizer()
    with serve_in_thread(engine_app(vllm_engine, tok, NAME)) as (v, _), \
            serve_in_thread(engine_app(_reference(model, 0), tok, NAME)) as (r, _):
        moves = {"out": (v, r, *_move_over_http(v, r, "out")), "in": (r, v, *_move_over_http(r, v, "in"))}
    for tag, (source, target, moved, answers) in moves.items():
        assert moved.status_code == 200, moved.text
        assert moved.json()["still_here"] == 0 and moved.json()["finished_on_source"] == []
        assert len(moved.json()["migrated"]) == 3 and all(0 < n < LONG for n in moved.json()["migrated"].values())
        for i in range(3):
            [choice] = answers[f"{tag}{i}"]["choices"]
            ref = alone[str(i)]
            assert choice["token_ids"] == ref.token_ids and choice["versions"] == [0] * LONG
            assert choice["logprobs"] == pytest.approx(ref.logprobs, abs=2e-3)
            assert choice["migrations"] == [[source, target]]

