"""A job's priority is checked once, in EnginePool.attach, for in-process and HTTP attaches alike: the scheduler
divides engine time by it, so a priority of 0 (or negative, NaN, inf) would never schedule the job (or break the
shares). Refused with a 400 naming `priority`, nothing attached, the caller's job quota given back."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest

from rollwise.local_server import serve_in_thread
from rollwise.pool.app import create_app
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.jobs import PoolError

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[str, EnginePool]]:
    pool = EnginePool(1, max_num_seqs=2, max_model_len=64, max_jobs=1)
    with serve_in_thread(create_app(pool)) as (url, _):
        yield url, pool


def _state(url: str) -> dict:
    return httpx.get(f"{url}/state", timeout=30).json()


@pytest.mark.parametrize("priority", [0.0, -1.0, math.nan, math.inf])
def test_the_in_process_attach_refuses_a_priority_the_scheduler_cannot_use(pool, priority):
    url, engine_pool = pool
    with pytest.raises(PoolError) as refused:
        engine_pool.attach("a", "tiny:0", priority, None)
    assert refused.value.status == 400 and refused.value.param == "priority"
    assert "priority must be a finite number > 0" in refused.value.message
    state = _state(url)  # nothing attached; max_jobs=1 is not used up by the refusals
    assert state["jobs"] == {} and state["limits"]["jobs_by_key"] == {}


@pytest.mark.parametrize("body", ['{"job": "a", "model": "tiny:0", "priority": 0}',
                                  '{"job": "a", "model": "tiny:0", "priority": -1.5}'], ids=["zero", "negative"])
def test_http_gets_the_same_refusal_from_the_same_check(pool, body):
    url, engine_pool = pool
    r = httpx.post(f"{url}/jobs", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    with pytest.raises(PoolError) as in_process:
        engine_pool.attach("a", "tiny:0", float(json.loads(body)["priority"]), None)
    assert error["param"] == "priority" and error["message"] == in_process.value.message
    assert _state(url)["jobs"] == {}


def test_a_positive_priority_attaches_after_the_refusals(pool):
    url, engine_pool = pool
    job = engine_pool.attach("a", "tiny:0", 0.5, None)
    try:
        assert _state(url)["jobs"]["a"]["priority"] == 0.5
    finally:
        engine_pool.detach(job)
