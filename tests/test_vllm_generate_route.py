"""vLLM's token-in route, POST /inference/v1/generate, on the engine server and through routers (issue 25).

Real parts only: engine servers (tiny random model, prefix cache on) on loopback ports, rollwise's router
in front of two of them, and, when the optional extra is installed, vLLM's own router (`vllm-router`, a
Rust binary) as a real subprocess in front of the same engines.

- the route answers vLLM's GenerateTokensResponse shape with the tokens and logprobs /generate samples
  for the same seeded request, usage counts and the cached prompt tokens;
- the fields vllm-router adds (`"stream": false`) and other vLLM fields are accepted, unknown ones
  reported; what cannot be honoured is a 400 naming the field;
- rollwise's router routes it by its token_ids: a repeated prefix goes to the replica that cached it;
- vllm-router forwards it to rollwise engines unchanged.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time

import httpx
import pytest

from rollwise.local_server import free_port

from engine_cluster import MODEL, engine_cluster

ROUTE = "/inference/v1/generate"
PROMPT = list(range(5, 45))  # 40 tokens: more than one cache block

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def cluster():
    with engine_cluster("prefix") as c:
        yield c


def test_route_answers_vllms_shape_with_generates_samples(cluster):
    http, url = cluster.http, cluster.replicas[0]
    http.post(f"{url}/flush_cache").raise_for_status()
    sampling = {"max_tokens": 5, "temperature": 1.0, "seed": 7, "logprobs": 2, "ignore_eos": True}
    body = {"token_ids": PROMPT, "stream": False, "return_token_ids": True, "request_id": "vllm-shape-1",
            "sampling_params": {**sampling, "skip_special_tokens": True}}  # a vLLM field rollwise ignores
    r = http.post(f"{url}{ROUTE}", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-rollwise-ignored-fields"] == "sampling_params.skip_special_tokens"
    out = r.json()
    assert out["request_id"] == "vllm-shape-1" and out["output_mode"] == "tokens" and out["model"] == MODEL
    assert out["prompt_token_ids"] == PROMPT
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert out["usage"] == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 5}]  # one policy, every token

    # /generate with the same seed samples the same tokens and logprobs; the prompt is now cached.
    native = {k: v for k, v in sampling.items() if k != "logprobs"}
    ref = http.post(f"{url}/generate", json={"prompt_ids": PROMPT, **native, "top_logprobs": 2}).json()
    assert ref["choices"][0]["token_ids"] == choice["token_ids"]
    assert ref["choices"][0]["logprobs"] == pytest.approx([c["logprob"] for c in content])
    again = http.post(f"{url}{ROUTE}", json={"token_ids": PROMPT, "sampling_params": sampling}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["logprobs"] is not None and again["prompt_token_ids"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": [5], "stream": True, "sampling_params": {}}, "stream"),
    ({"token_ids": [5], "output_mode": "text", "sampling_params": {}}, "output_mode"),
    ({"token_ids": [5], "features": {"mm": 1}, "sampling_params": {}}, "features"),
    ({"token_ids": [5, 100000], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [5], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"token_ids": [5]}, "sampling_params"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(cluster, body, param):
    r = cluster.http.post(f"{cluster.replicas[0]}{ROUTE}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_router_routes_it_by_token_ids(cluster):
    http, router = cluster.http, cluster.router
    http.post(f"{router}/flush_cache").raise_for_status()
    answered = []
    for i in range(4):  # one shared 40-token prefix, different last tokens
        body = {"token_ids": PROMPT + [50 + i], "stream": False, "sampling_params": {"max_tokens": 2}}
        r = http.post(f"{router}{ROUTE}", json=body)
        assert r.status_code == 200, r.text
        answered.append((r.headers["x-rollwise-replica"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
    replicas = {replica for replica, _ in answered}
    assert len(replicas) == 1, f"a shared prefix was spread over replicas: {answered}"
    assert all(cached > 0 for _, cached in answered[1:])


@pytest.mark.skipif(shutil.which("vllm-router") is None,
                    reason="vllm-router is not installed (pip install 'rollwise[vllm-router]')")
def test_vllm_router_fronts_rollwise_engines(cluster):
    port = free_port()
    proc = subprocess.Popen(["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *cluster.replicas, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "vllm-router did not start in 60 s"
            time.sleep(0.2)
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "temperature": 0}}
        r = httpx.post(f"{url}{ROUTE}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["choices"][0]["token_ids"]) == 3 and out["usage"]["prompt_tokens"] == len(PROMPT)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_weight_versions_are_spans_of_output_tokens():
    from rollwise.engine.vllm_generate import weight_versions

    assert weight_versions([]) == []
    assert weight_versions([3, 3, 4, 4, 4]) == [{"version": "3", "start": 0, "end": 2},
                                                {"version": "4", "start": 2, "end": 5}]
