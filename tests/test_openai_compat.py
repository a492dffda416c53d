"""What clients send to vLLM works on the engine server (issue 24, item 4), on a real server on loopback.

- unknown fields are ignored (as vLLM does) and named in the x-rollwise-ignored-fields header;
- the common vLLM sampling fields change sampling the way they should: top_logprobs, completions
  logprobs=N and echo, min_tokens, repetition/frequency/presence penalties (returned logprobs are the
  penalised distribution's, checked against a recompute from the HF model), tools to the chat template;
- non-finite or out-of-range values (JSON Infinity/NaN included) are a 400 naming the field.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model
from rollwise.model.tiny import CHATML_TEMPLATE

MODEL = "tiny:0"
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
HEADER = "x-rollwise-ignored-fields"

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@contextlib.contextmanager
def _server(chat_template: str | None = None):
    engine, tokenizer = build_engine(MODEL, max_num_seqs=8, max_model_len=128, seed=0)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    with serve_in_thread(create_app(engine, tokenizer, MODEL)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            yield SimpleNamespace(url=url, tokenizer=tokenizer, openai=client)
        finally:
            client.close()


@pytest.fixture(scope="module")
def srv():
    with _server() as s:
        yield s


def _post(srv, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(srv.url + path, json=body, timeout=30)


# ------------------------------------------------------------------ unknown fields


def test_unknown_fields_are_ignored_and_reported(srv):
    extras = {"guided_json": None, "chat_template_kwargs": {"enable_thinking": False}, "response_format": {}}
    raw = srv.openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi", "weight": 1}], max_tokens=4, temperature=0,
        stream_options=None, extra_body=extras)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].token_ids
    assert set(raw.headers[HEADER].split(",")) == {*extras, "messages[0].weight"}
    # The same request without extras: no header, and the same tokens (the extras changed nothing).
    plain = srv.openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert HEADER not in plain.headers
    assert plain.parse().choices[0].token_ids == raw.parse().choices[0].token_ids
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "max_token": 5})
    assert r.status_code == 200 and r.headers[HEADER] == "max_token"
    # Field names are client text: non-Latin-1 names are percent-encoded, not a 500 (found by the fuzz).
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "poids_é": 1, "x" * 5000: 2})
    assert r.status_code == 200 and r.headers[HEADER].startswith("poids_%C3%A9,")
    assert len(r.headers[HEADER]) < 2100
    # Known fields with bad values are still refused, naming the field.
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": "many", "whatever": 1})
    assert r.status_code == 400 and "max_tokens must be an integer" in r.json()["error"]["message"]


# ------------------------------------------------------------------ sampling fields


def test_chat_top_logprobs_are_sorted_and_hold_the_greedy_token(srv):
    r = srv.openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == len(r.choices[0].token_ids)
    for entry in content:
        alts = [a.logprob for a in entry.top_logprobs]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    r = _post(srv, "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs: true" in r.json()["error"]["message"]


def test_sampled_token_is_among_top_logprobs_when_it_ranks_there(srv):
    r = srv.openai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=3,
                                           logprobs=True, top_logprobs=3)
    for entry in r.choices[0].logprobs.content:
        alts = {a.token: a.logprob for a in entry.top_logprobs}
        if entry.logprob >= min(alts.values()) + 1e-6:
            assert alts[entry.token] == pytest.approx(entry.logprob)
        else:
            assert entry.token not in alts


def test_completions_logprobs_n_and_echo(srv):
    r = srv.openai.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith("abc")
    lp = choice.logprobs
    n_prompt = len(srv.tokenizer.encode("abc"))
    assert lp.token_logprobs[:n_prompt] == [None] * n_prompt and lp.top_logprobs[:n_prompt] == [None] * n_prompt
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert len(top) == 3 and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    plain = srv.openai.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    assert choice.text == "abc" + plain.choices[0].text and plain.choices[0].logprobs.top_logprobs is None


def test_min_tokens_holds_back_stop_tokens(srv):
    prompt = srv.tokenizer.encode("min tokens")
    free = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                          "ignore_eos": True}).json()["choices"][0]["token_ids"]
    stop = free[1]  # greedy reaches this token second: as a stop token it ends the sample at 2 tokens
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}
    early = _post(srv, "/v1/completions", body).json()["choices"][0]
    assert len(early["token_ids"]) <= 2 and early["finish_reason"] == "stop"
    held = _post(srv, "/v1/completions", {**body, "min_tokens": 6}).json()["choices"][0]
    assert len(held["token_ids"]) >= 6 and stop not in held["token_ids"][:6]


def _recompute(prompt: list[int], tokens: list[int], rep: float, freq: float, pres: float) -> list[float]:
    """The logprob of each token under the HF model's logits with vLLM's penalty formulas, written out here."""
    hf_model, _ = load_model(MODEL)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    out = []
    for k, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + k].clone()
        for t in set(prompt + tokens[:k]):
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(tokens[:k]):
            row[t] -= freq * tokens[:k].count(t) + pres
        out.append(float(torch.log_softmax(row, -1)[token]))
    return out


@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": 0.7}])
def test_penalised_logprobs_are_what_was_sampled(srv, penalties):
    prompt = srv.tokenizer.encode("aaaa bbbb aaaa")
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    choice = _post(srv, "/v1/completions", {**body, **penalties}).json()["choices"][0]
    tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    expected = _recompute(prompt, tokens, penalties.get("repetition_penalty", 1.0),
                          penalties.get("frequency_penalty", 0.0), penalties.get("presence_penalty", 0.0))
    assert logprobs == pytest.approx(expected, abs=1e-4)
    unpenalised = _recompute(prompt, tokens, 1.0, 0.0, 0.0)
    assert max(abs(a - b) for a, b in zip(logprobs, unpenalised)) > 1e-2  # the penalties did change something


TOOL_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function') "
                 "| map(attribute='name') | join(',')) + '<|im_end|>\n' }}{% endif %}") + CHATML_TEMPLATE.replace(
    "message['content']", "(message['content'] or '') + (message['tool_calls'][0]['function']['arguments']['city']"
    " if message['tool_calls'] else '')")


def test_tools_reach_the_chat_template():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with _server(TOOL_TEMPLATE) as s:
        r = s.openai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto",
                                             max_tokens=2, temperature=0)
        prompt = s.tokenizer.decode(r.choices[0].prompt_token_ids)
        assert "Tools: get_weather" in prompt and "Oslo" in prompt and "<|im_start|>tool\nsunny" in prompt
        bad = _post(s, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools, "tool_choice": "required"})
        assert bad.status_code == 400 and "tool_choice is not supported" in bad.json()["error"]["message"]


# ------------------------------------------------------------------ bad values


@pytest.mark.parametrize(("body", "field"), [
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature must be a finite number"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature must be a finite number"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "top_p must be a finite number"),
    (b'{"prompt": "hi", "presence_penalty": NaN}', "presence_penalty must be a finite number"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "max_tokens must be"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p must be <= 1"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty must be <= 2"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty must be >= -2"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty must be >= 0.01"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens must be >= 0"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens (9) must be <= max_tokens (4)"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs must be <= 20"),
    ({"prompt": "hi", "logprobs": 2, "stream": True}, "only returned with stream: false"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo is only supported with stream: false"),
    ({"prompt": "hi", "min_p": 0.1}, "min_p is not supported"),  # refused, not ignored: it would change sampling
])
def test_bad_values_are_a_400_naming_the_field(srv, body, field):
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_chat_non_finite_is_a_400(srv):
    r = _post(srv, "/v1/chat/completions",
              b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity, "extra": NaN}')
    assert r.status_code == 400 and "temperature must be a finite number" in r.json()["error"]["message"]
