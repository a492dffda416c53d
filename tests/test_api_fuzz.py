"""A bounded property-based fuzz of the engine server's and the pool's HTTP APIs, from their own OpenAPI schemas
(schemathesis over real servers on loopback): no 5xx, and every answer matches the schema (status codes listed,
bodies of the documented shape, content types) — issue 24's "honest schemas". The pool runs with an API key and
tight tenancy limits (issue 43), so its 401/429/503 answers are fuzzed too: half the attach and /state cases carry
the key.

Bounds: ~20 examples per operation, no deadline; the whole module runs in about a minute here. Requests that would
freeze the server for the cases after them are undone after each case (/pause -> /resume, /sleep -> /wake); the
pool's long poll is capped at 0.2 s so an example cannot wait 30 s. Nothing else is excluded.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.control.pool_backend import PoolClient, PoolWorker
from rollwise.types.weight_update import WeightUpdate
from rollwise.pool.scheduler import Policy
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.app import create_app as create_pool_app
from rollwise.serve.auth import ApiKeys

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny:0"
FUZZ = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]


# The apps are built at import so their schemas can parametrize the tests; the fixtures serve them for real.
ENGINE_APP = create_app(*build_engine(MODEL, max_num_seqs=4, max_model_len=64, seed=0), MODEL)
POOL_KEY = "fuzz-key-0123456789abcdef"
POOL_APP = create_pool_app(EnginePool(1, max_num_seqs=4, max_model_len=64, policy=Policy(min_slice_s=0.05), max_jobs=4,
                                      max_queued_per_job=16), api_keys=ApiKeys([POOL_KEY], "fuzz keys"))
engine_api = schemathesis.openapi.from_dict(ENGINE_APP.openapi())
pool_api = schemathesis.openapi.from_dict(POOL_APP.openapi())


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with serve_in_thread(ENGINE_APP) as (url, _):
        yield url


@pytest.fixture(scope="module")
def pool_job() -> Iterator[tuple[str, str]]:
    """(url, token) of a pool with one job "fuzz" holding weights, so job routes are fuzzed past the token."""
    with serve_in_thread(POOL_APP) as (url, _):
        model, tokenizer = load_model(MODEL)
        fp = tokenizer_fingerprint(tokenizer)
        client = PoolClient(url, api_key=POOL_KEY)
        client.attach("fuzz", MODEL, 1.0, fp)
        PoolWorker(client, fp, poll_s=0.2).load_weights(WeightUpdate.of_state(model.state_dict(), 0, fp))
        yield url, client.token


# What undoes a case that would stall every later one.
UNDO = {"/pause": "/resume", "/sleep": "/wake"}


@engine_api.parametrize()
@FUZZ
def test_engine_api(case, engine_url: str):
    try:
        case.call_and_validate(base_url=engine_url, checks=CHECKS, timeout=60)
    finally:
        if case.path in UNDO:
            httpx.post(f"{engine_url}{UNDO[case.path]}", timeout=30)


@pool_api.parametrize()
@FUZZ
def test_pool_api(case, pool_job: tuple[str, str]):
    url, token = pool_job
    if case.method != "DELETE" and "job" in (case.path_parameters or {}):
        # Half the cases (by the generated name's parity) go to the real job with its token: past the auth check.
        if len(case.path_parameters["job"]) % 2 == 0:
            case.path_parameters["job"] = "fuzz"
            case.headers = {**(case.headers or {}), "authorization": f"Bearer {token}"}
    if case.path in ("/jobs", "/state") and len(repr(case.body)) % 2 == 0:  # half of them past the API key
        case.headers = {**(case.headers or {}), "authorization": f"Bearer {POOL_KEY}"}
    if case.query and isinstance(case.query.get("timeout"), (int, float)):
        case.query["timeout"] = min(max(case.query["timeout"], 0), 0.2)
    try:
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)
    finally:
        if case.path.endswith("/pause"):
            httpx.post(f"{url}/jobs/fuzz/resume", headers={"authorization": f"Bearer {token}"}, timeout=30)
