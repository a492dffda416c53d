"""The router parses request bodies with orjson on its hot path (issue 25 item 3); what it forwards and what it
accepts stay exactly as with the standard library's json."""

from __future__ import annotations

import json

import pytest

from rollwise.router.requests import RouterError, loads, read_meta
from rollwise.router.tokens import prompt_tokens

HUGE = 123456789012345678901234567890  # over 64 bits: orjson alone would read it as a float


def test_a_rewritten_body_keeps_every_number_exactly():
    raw = json.dumps({"prompt_ids": [5, 6, 7], "seed": HUGE, "temperature": 0.7, "session_id": "s1"}).encode()
    _, meta = read_meta("/generate", raw, {}, own_request_id=False)
    assert meta.session == "s1"
    assert json.loads(meta.forward) == {"prompt_ids": [5, 6, 7], "seed": HUGE, "temperature": 0.7}


def test_bodies_orjson_refuses_are_read_as_json_reads_them():
    assert loads('{"prompt_ids": [1, 2]}'.encode("utf-16")) == {"prompt_ids": [1, 2]}
    assert loads(b'{"t": NaN}')["t"] != loads(b'{"t": NaN}')["t"]  # NaN, as json reads it
    with pytest.raises(RouterError, match="not valid JSON"):
        read_meta("/generate", b'{"prompt_ids": [1,', {}, own_request_id=False)


def test_token_ids_are_exact_ints_only():
    assert prompt_tokens("/inference/v1/generate", {"token_ids": [3, 4, 5]}, None) == [3, 4, 5]
    assert prompt_tokens("/inference/v1/generate", {"token_ids": [3, True]}, None) == []
    assert prompt_tokens("/inference/v1/generate", {"token_ids": [3, 4.0]}, None) == []
    assert prompt_tokens("/generate", {"prompt_ids": list(range(10))}, None, max_chars=4) == [0, 1, 2, 3]
