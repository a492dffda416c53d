"""A bounded property-based fuzz of the router's HTTP API from its own OpenAPI schema (issue 24): schemathesis
against a real router over a real `tiny:0` engine replica, both on loopback. No 5xx, and every answer matches
the schema (status codes listed, bodies of the documented shape, content types).

Bounds: 25 examples per operation, no deadline, derandomized; the module runs in about a minute here. A /pause
is undone after its case (a paused replica would hold every later generation); nothing else is excluded.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.router.config import RouterConfig
from rollwise.router.app import bind_socket
from rollwise.router.app import create_app as create_router_app

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny:0"
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]
UNDO = {"/pause": "/resume"}

# The schema does not depend on the replicas: one built here parametrizes the tests, the fixture serves a real one.
router_api = schemathesis.openapi.from_dict(create_router_app(RouterConfig(replicas=["http://127.0.0.1:1"])).openapi())


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=64, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, MODEL)) as (replica, _):
        config = RouterConfig(replicas=[replica], model=MODEL, health_interval_s=0.5, queue_timeout_s=5.0)
        with serve_in_thread(create_router_app(config), bind_socket("127.0.0.1", 0, reuse_port=False)) as (url, _):
            yield url


@router_api.parametrize()
@FUZZ
def test_router_api(case, router_url: str):
    try:
        case.call_and_validate(base_url=router_url, checks=CHECKS, timeout=60)
    finally:
        if case.path in UNDO:
            httpx.post(f"{router_url}{UNDO[case.path]}", timeout=30)
