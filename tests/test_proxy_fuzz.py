"""A bounded property-based fuzz of the agent proxy's HTTP API from its own OpenAPI schema (schemathesis over a
real proxy on loopback, in front of a real engine server with a tiny model), as tests/test_api_fuzz.py does for
the engine server and the pool: no 5xx, and every answer matches the schema (status codes listed, bodies of the
documented shape, content types).

Bounds: 15 examples per operation, no deadline; a few seconds here. Half the session ids are one real session
(by the generated id's parity), so trajectory/finish/delete are fuzzed past the 404 too. 
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from rollwise.agent.generator import HTTPGenerator, LocalGenerator
from rollwise.agent.proxy import create_proxy_app
from rollwise.agent.session import SessionLimits
from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import tokenizer_fingerprint

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny:0"
FUZZ = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]
SESSION = "fuzz-session"


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    """A proxy over a real engine server, with one session that already has a turn."""
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=96, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, MODEL)) as (engine_url, _):
        upstream = HTTPGenerator(engine_url)
        app = create_proxy_app(upstream, tokenizer, model_name=MODEL,
                               limits=SessionLimits(max_turns=64, max_tokens=100_000, max_tokens_per_turn=8),
                               fingerprint=tokenizer_fingerprint(tokenizer), max_request_bytes=256 * 1024)
        with serve_in_thread(app) as (url, _):
            r = httpx.post(f"{url}/sessions/{SESSION}/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            yield url
        upstream.close()


def _openapi() -> dict:
    """The proxy's schema, read at import to parametrize the test: from a proxy over an in-process engine (the
    proxy asks its engine for the model's facts when it is built); the fixture serves one over HTTP."""
    engine, tokenizer = build_engine(MODEL, max_num_seqs=1, max_model_len=96, seed=0)
    generator = LocalGenerator(engine)
    try:
        return create_proxy_app(generator, tokenizer, model_name=MODEL).openapi()
    finally:
        generator.close()


proxy_api = schemathesis.openapi.from_dict(_openapi())


@proxy_api.parametrize()
@FUZZ
def test_proxy_api(case, proxy_url: str):
    if "session_id" in (case.path_parameters or {}) and len(str(case.path_parameters["session_id"])) % 2 == 0:
        case.path_parameters["session_id"] = SESSION
    case.call_and_validate(base_url=proxy_url, checks=CHECKS, timeout=60)
