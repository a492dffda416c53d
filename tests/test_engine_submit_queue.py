"""The engine server on vLLM v1's shape (issue 44 item 3), over real HTTP on loopback:

- requests and control calls go onto the engine thread's submit queue straight from the event loop: serving
  them starts no thread besides the engine's (no thread pool, no drain thread);
- concurrent requests each get their own complete answer; a streamed one arrives in pieces and matches its
  non-streamed twin (seeded); an abort of one leaves the others whole;
- `rollwise bench router`'s replica arm: the aiohttp load generator in its own process, and the arm's
  measurement of a server against a baseline checkout (here: this one), with its `goals` object;
  a baseline that is not a checkout is refused naming the flag.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from rollwise.bench.router_replica import ReplicaShape, measure_replica, replica
from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread

pytestmark = pytest.mark.usefixtures("single_torch_thread")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def url():
    engine, tokenizer = build_engine("tiny:0", max_num_seqs=4, max_model_len=128, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, "tiny:0")) as (base, _server):
        yield base


def _generate(base: str, seed: int, max_tokens: int = 6, **extra) -> dict:
    r = httpx.post(f"{base}/generate", json={"prompt_ids": [5, 6, 7, seed % 50 + 8], "max_tokens": max_tokens,
                                             "ignore_eos": True, "seed": seed, **extra}, timeout=60)
    r.raise_for_status()
    return r.json()


def test_serving_starts_no_thread_besides_the_engine(url):
    before = {t.ident for t in threading.enumerate()}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the client's threads, gone when the block ends
        answers = list(pool.map(lambda s: _generate(url, s), range(8)))
        for path in ("/pause", "/resume", "/load", "/metrics"):
            assert httpx.request("GET" if path in ("/load", "/metrics") else "POST", f"{url}{path}").status_code == 200
    new = [t.name for t in threading.enumerate() if t.ident not in before]
    assert new == [], f"serving started threads: {new}"
    assert [len(a["choices"][0]["token_ids"]) for a in answers] == [6] * 8
    assert all(len(a["choices"][0]["versions"]) == 6 for a in answers)


def test_a_stream_matches_its_twin_and_an_abort_leaves_the_others_whole(url):
    # 100 tokens: long enough that the event loop gets the GIL while the engine thread still generates (12
    # once came as one chunk in CI: the engine had finished before the loop pumped the queue, which coalesces).
    body = {"prompt": [5, 9, 11], "max_tokens": 100, "ignore_eos": True, "seed": 3}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == plain["token_ids"] and len(chunks) > 1
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long = pool.submit(_generate, url, 1, 120, request_id="long-one")
        others = [pool.submit(_generate, url, s) for s in (2, 3)]
        while httpx.post(f"{url}/abort", json={"request_id": "long-one"}).status_code == 404:
            pass  # not submitted yet
        aborted = long.result()["choices"][0]
        assert aborted["finish_reason"] == "abort" and len(aborted["token_ids"]) < 120
        assert [len(f.result()["choices"][0]["token_ids"]) for f in others] == [6, 6]


def test_the_load_generator_runs_in_its_own_process(url):
    out = subprocess.run([sys.executable, "-m", "rollwise.bench.load_generator", "--url", url, "--concurrency", "3",
                          "--requests", "7", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["errors"] == [] and len(result["latencies_s"]) == 7 and result["concurrency"] == 3
    assert all(0 < x < result["wall_s"] for x in result["latencies_s"])


def test_the_replica_arm_measures_the_server_against_a_baseline():
    result = measure_replica(ReplicaShape(requests=6, rounds=1, max_num_seqs=4), baseline=REPO, concurrency=(1, 4))
    goal = result["goals"]["server_cpu_ms_per_request"]
    for arm in ("replica", "replica:baseline"):
        for c in ("1", "4"):
            r = result["arms"][arm][c]
            assert r["requests"] == 6 and r["p50_latency_s"] <= r["p99_latency_s"]
            assert 0 < r["server_cpu_ms_per_request"] < r["process_cpu_ms_per_request"]
            assert r["engine_cpu_ms_per_request"] > 0
    assert goal["value"] == max(a["server_cpu_ms_per_request"] for a in result["arms"]["replica"].values())
    assert goal["after_vs_before"] == pytest.approx(goal["value"] / goal["before"])
    assert goal["met"] == (goal["value"] <= 1.0)


def test_a_baseline_that_is_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--replica-baseline .*no rollwise/engine/server.py"):
        with replica("replica:baseline", tmp_path, ReplicaShape(requests=1, rounds=1)):
            pass
