"""`rollwise serve engine` over real HTTP: a uvicorn server on a free loopback port with a tiny
random model, spoken to with the official `openai` client and plain httpx.

- chat and text completions: token ids round-trip (decode(token_ids) == text), one logprob and one
  policy version per token, prompt ids as sent, usage counts;
- streaming: chunks concatenate to the non-streamed text and token ids (seeded sampling), `[DONE]`;
- stop strings cut the text before the stop string, streamed or not;
- /generate returns what a local ReferenceEngine returns for the same seeded request;
- /model_info's fingerprint is tokenizer_fingerprint of the tokenizer; /metrics counts tokens;
- malformed requests get 4xx JSON errors naming the field; pause / abort / request-id conflicts;
- weight updates: a corrupt file is refused (4xx) and the old version keeps serving, a valid one
  changes the policy version in every response;
- the console script starts a server (`rollwise serve engine --model tiny:0 --port P`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from rollwise.cli import main
from rollwise.engine.client import EngineClient, EngineServerError
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.server import build_engine, create_app
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.tasks.prompts import encode_prompt

MODEL = "tiny:0"
MAX_MODEL_LEN = 128
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@contextlib.contextmanager
def _running_server(model: str = MODEL):
    engine, tokenizer = build_engine(model, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, model)) as (url, _server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            yield SimpleNamespace(url=url, engine=engine, tokenizer=tokenizer, openai=client)
        finally:
            client.close()


@pytest.fixture(scope="module")
def srv():
    with _running_server() as s:
        yield s


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def _post(url: str, path: str, body: dict | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(url + path, json=body, **kw)


# ------------------------------------------------------------------ OpenAI endpoints


def test_chat_completion_carries_exact_tokens(srv):
    r = srv.openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = r.choices[0]
    prompt = encode_prompt(srv.tokenizer, MESSAGES)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.prompt_token_ids == prompt
    assert 1 <= len(choice.token_ids) <= 12
    assert _decode(srv.tokenizer, choice.token_ids) == choice.message.content
    assert choice.message.role == "assistant"
    assert len(choice.logprobs.content) == len(choice.token_ids) == len(choice.policy_versions)
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert choice.policy_versions == [0] * len(choice.token_ids)
    assert choice.finish_reason in ("stop", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(choice.token_ids))
    # Greedy is deterministic: the same request gives the same tokens.
    again = srv.openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert again.choices[0].token_ids == choice.token_ids


def test_text_completion_text_and_token_id_prompts(srv):
    ids = srv.tokenizer.encode("2+2=")
    kw = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    by_text = srv.openai.completions.create(prompt="2+2=", **kw).choices[0]
    by_ids = srv.openai.completions.create(prompt=ids, **kw).choices[0]
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 10
    assert by_text.finish_reason == "length"
    assert by_text.text == _decode(srv.tokenizer, by_text.token_ids)
    assert len(by_text.logprobs.token_logprobs) == len(by_text.logprobs.tokens) == 10

    # Several prompts x n samples: choice index = prompt * n + sample.
    r = srv.openai.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=5, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in r.choices] == [srv.tokenizer.encode(p) for p in ("ab", "ab", "cd", "cd")]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    for c in r.choices:
        assert c.text == _decode(srv.tokenizer, c.token_ids)
        assert len(c.logprobs.token_logprobs) == len(c.token_ids)


def test_streaming_concatenates_to_the_non_streamed_result(srv):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=11)
    full = srv.openai.chat.completions.create(**kw).choices[0]
    chunks = [c for c in srv.openai.chat.completions.create(stream=True, **kw) if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    assert sum((c.choices[0].token_ids or [] for c in chunks[1:]), []) == full.token_ids
    streamed_logprobs = [e.logprob for c in chunks[1:] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed_logprobs == [e.logprob for e in full.logprobs.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [full.finish_reason]

    # Text completions, n=2: each choice's chunks concatenate to its non-streamed text.
    kw = dict(model=MODEL, prompt="Once", max_tokens=15, temperature=1.0, seed=5, n=2)
    full_choices = srv.openai.completions.create(**kw).choices
    stream = srv.openai.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    texts, ids, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
    for c in full_choices:
        assert texts[c.index] == c.text and ids[c.index] == c.token_ids
    assert usage.completion_tokens == sum(len(c.token_ids) for c in full_choices)

    # The raw event stream ends with `data: [DONE]`.
    raw = _post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}).text
    events = [line for line in raw.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_strings_cut_the_text(srv):
    kw = dict(model=MODEL, prompt="hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    base = srv.openai.completions.create(**kw).choices[0]
    stop = base.text[5:7]
    expected = base.text[: base.text.find(stop)]
    cut = srv.openai.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == expected
    # The tokens run up to and including the one that completed the stop string (char-level tokenizer).
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)]
    assert _decode(srv.tokenizer, cut.token_ids) == expected + stop
    streamed = "".join(c.choices[0].text for c in srv.openai.completions.create(stream=True, stop=stop, **kw))
    assert streamed == expected

    # n samples: each is cut at its own first stop string (or runs to max_tokens), streamed or not.
    kw = dict(model=MODEL, prompt="hello", max_tokens=16, n=3, seed=2, extra_body={"ignore_eos": True})
    bases = srv.openai.completions.create(**kw).choices
    stop = bases[0].text[5:7]
    cut = srv.openai.completions.create(stop=stop, **kw).choices
    streamed = {0: "", 1: "", 2: ""}
    for chunk in srv.openai.completions.create(stream=True, stop=stop, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    for b, c in zip(bases, cut):
        hit = b.text.find(stop)
        assert (c.text, c.finish_reason) == ((b.text[:hit], "stop") if hit >= 0 else (b.text, "length"))
        assert streamed[c.index] == c.text


# ------------------------------------------------------------------ token level


def test_generate_equals_a_local_engine(srv):
    prompt = srv.tokenizer.encode("abcdef")
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5)
    with EngineClient(srv.url) as client:
        remote = client.generate(prompt, params)
    local_engine = ReferenceEngine(tiny_llama(seed=0), max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                                   eos_token_ids=[srv.tokenizer.eos_token_id])
    local = local_engine.generate([GenerationRequest("local", prompt, params)])
    assert [c.token_ids for c in remote] == [c.token_ids for c in local]
    for r, c in zip(remote, local):
        assert r.logprobs == pytest.approx(c.logprobs, abs=1e-5)
        assert r.versions == [0] * len(r.token_ids) and r.finish_reason == c.finish_reason
    assert sorted(c.cached_prompt_tokens for c in remote) == [0, len(prompt), len(prompt)]
    # The OpenAI endpoints run each choice as its own engine request (seed + i): the same samples.
    choices = srv.openai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3, seed=5).choices
    assert [c.token_ids for c in choices] == [c.token_ids for c in remote]
    assert sorted(c.cached_prompt_tokens for c in choices) == [0, len(prompt), len(prompt)]
    raw = _post(srv.url, "/generate", {"prompt_ids": prompt, "max_tokens": 4, "n": 2, "seed": 1}).json()
    assert raw["request_id"].startswith("gen-") and raw["prompt_ids"] == prompt
    assert [len(c["logprobs"]) for c in raw["choices"]] == [len(c["token_ids"]) for c in raw["choices"]]


def test_model_info_and_metrics(srv):
    info = httpx.get(f"{srv.url}/model_info").json()
    assert info["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny_tokenizer())
    assert (info["model"], info["max_model_len"], info["max_num_seqs"]) == (MODEL, MAX_MODEL_LEN, 8)
    assert info["vocab_size"] == len(tiny_tokenizer()) and info["policy_version"] == 0
    assert [m.id for m in srv.openai.models.list().data] == [MODEL]
    assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"

    before = _metrics(srv.url)
    r = srv.openai.completions.create(model=MODEL, prompt="abc", max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = _metrics(srv.url)
    assert len(r.choices[0].token_ids) == 7
    assert after["rollwise_engine_generated_tokens_total"] - before["rollwise_engine_generated_tokens_total"] == 7
    assert after["rollwise_engine_prompt_tokens_total"] - before["rollwise_engine_prompt_tokens_total"] == 3
    assert after["rollwise_engine_running"] == after["rollwise_engine_waiting"] == 0
    assert after["rollwise_engine_policy_version"] == 0


# ------------------------------------------------------------------ errors and control


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages is required"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
         "max_tokens must be >= 1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
         400, "messages[1].role must be one of 'system', 'user', 'assistant' or 'tool'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400,
         "messages[0].content must be a string"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages must not be empty"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
        ("/v1/completions", {"prompt": [5, 6, 100000]}, 400, "prompt[2] = 100000 is outside the vocabulary"),
        # Unknown fields are ignored, as vLLM does (tests/test_openai_compat.py); bad values of known ones are not.
        ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature must be a finite number"),
        ("/v1/completions", {"prompt": "hi", "n": 99}, 400, "n must be <= max_num_seqs (8)"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be > 0"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
        ("/generate", {"prompt_ids": [5, -1]}, 400, "prompt_ids[1] = -1 is outside the vocabulary"),
        ("/generate", {"prompt_ids": [5] * MAX_MODEL_LEN}, 400, "prompt_ids has 128 tokens"),
        ("/generate", b"{not json", 400, "request body is not valid JSON"),
        ("/abort", {"request_id": "nobody"}, 404, "no request with request_id 'nobody' is in flight"),
        ("/update_weights_from_disk", {"path": "/nonexistent/w.safetensors", "version": 1}, 400, "does not exist"),
        ("/update_weights_from_disk", {"path": "/tmp", "version": -1}, 400, "version must be >= 0"),
    ],
)
def test_malformed_requests_name_the_field(srv, path, body, status, message):
    r = _post(srv.url, path, body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_openai_client_sees_bad_requests(srv):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        srv.openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role must be one of"):
        srv.openai.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])


def test_pause_abort_and_request_id_conflicts(srv):
    prompt = srv.tokenizer.encode("pause me")
    client = EngineClient(srv.url)
    client.pause()
    try:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(
            out=client.generate(prompt, SamplingParams(max_tokens=50), request_id="job-1")))
        thread.start()
        deadline = time.monotonic() + 10
        while _metrics(srv.url)["rollwise_engine_waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.get(f"{srv.url}/health").json()["paused"] is True
        conflict = _post(srv.url, "/generate", {"prompt_ids": prompt, "request_id": "job-1"})
        assert conflict.status_code == 409 and "already in flight" in conflict.json()["error"]["message"]
        assert client.abort("job-1") == 1
        thread.join(timeout=10)
        [aborted] = result["out"]
        assert (aborted.finish_reason, aborted.token_ids) == ("abort", [])
        with pytest.raises(EngineServerError, match="no request"):
            client.abort("job-1")
    finally:
        client.resume()
        client.close()
    # Resumed: requests run again; the freed request id is usable again.
    [done] = EngineClient(srv.url).generate(prompt, SamplingParams(max_tokens=3), request_id="job-1")
    assert len(done.token_ids) >= 1 and done.finish_reason in ("stop", "length")


def test_weight_updates_refuse_bad_files_and_apply_good_ones(tmp_path: Path):
    with _running_server() as srv:
        client = EngineClient(srv.url)
        kw = dict(model=MODEL, prompt="weights", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        before = srv.openai.completions.create(**kw).choices[0]

        corrupt = tmp_path / "corrupt.safetensors"
        save_file({"model.embed_tokens.weight": torch.zeros(7, 5)}, str(corrupt))
        with pytest.raises(EngineServerError) as err:
            client.update_weights_from_disk(str(corrupt), version=1)
        assert err.value.status == 400
        assert "still serving policy version 0" in err.value.message and "shape (7, 5)" in err.value.message
        garbage = tmp_path / "garbage.safetensors"
        garbage.write_bytes(b"\x00" * 64)
        with pytest.raises(EngineServerError, match="cannot read"):
            client.update_weights_from_disk(str(garbage), version=1)
        same = srv.openai.completions.create(**kw).choices[0]
        assert same.token_ids == before.token_ids and same.policy_versions == [0] * 8
        assert client.model_info()["policy_version"] == 0

        new_model = tiny_llama(seed=1)
        new_model.save_pretrained(tmp_path / "v1")
        out = client.update_weights_from_disk(str(tmp_path / "v1"), version=1)
        assert out["policy_version"] == 1 and out["previous_version"] == 0
        after = srv.openai.completions.create(**kw).choices[0]
        assert after.policy_versions == [1] * 8
        local = ReferenceEngine(new_model, max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
        [expected] = local.generate([GenerationRequest(
            "x", after.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))])
        assert after.token_ids == expected.token_ids  # really sampled by the new weights
        assert client.model_info()["policy_version"] == 1
        assert _metrics(srv.url)["rollwise_engine_policy_version"] == 1
        client.close()


def test_a_dead_engine_answers_503():
    with _running_server() as srv:
        def boom() -> list:
            raise RuntimeError("simulated engine crash")

        srv.engine.step = boom  # the worker thread dies on its next step
        r = _post(srv.url, "/generate", {"prompt_ids": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 503 and "simulated engine crash" in r.json()["error"]["message"]
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "simulated engine crash" in health.json()["error"]
        assert _post(srv.url, "/pause", {}).status_code == 503


# ------------------------------------------------------------------ the command line


def test_serve_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "engine", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--max-num-seqs", "--max-model-len"):
        assert flag in out


def test_console_script_serves(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(sys.executable).parent / "rollwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        cmd + ["serve", "engine", "--model", MODEL, "--port", str(port), "--max-num-seqs", "4",
               "--max-model-len", "64", "--log-level", "warning"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        info = httpx.get(f"{url}/model_info").json()
        assert (info["model"], info["max_num_seqs"], info["max_model_len"]) == (MODEL, 4, 64)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert len(r.choices[0].token_ids) >= 1
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
