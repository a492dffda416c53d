"""verifiers 0.4.0 / prime-rl's token route: POST /inference/v1/generate as their train client calls it (issue 40).

The client (the `renderers` package behind verifiers' TrainClient) posts {model, token_ids, sampling_params{...,
stop_token_ids, logprobs: 1, skip_special_tokens: false}, cache_salt} with the header X-Session-ID, reads
`choices[0].token_ids`, `finish_reason` and `logprobs.content[i]` whose `token` must be "token_id:<id>" with a
numeric `logprob`, and reads `max_model_len` from GET /v1/models. Real engine servers (tiny random model, prefix
cache on) and rollwise's router on loopback ports.
"""

from __future__ import annotations

import pytest

from engine_cluster import MODEL, engine_cluster

ROUTE = "/inference/v1/generate"
PROMPT = list(range(5, 45))  # 40 tokens: more than one prefix-cache block

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def cluster():
    with engine_cluster("consistent_hash") as c:  # sessions by key: X-Session-ID
        yield c


def verifiers_body(token_ids: list[int], max_tokens: int = 6, **extra) -> dict:
    """The body renderers.client.generate posts (sampling args from verifiers' SamplingConfig)."""
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens, "stop_token_ids": [2],
                "logprobs": 1, "skip_special_tokens": False}
    return {"model": MODEL, "token_ids": token_ids, "sampling_params": sampling, **extra}


def completion_logprobs(choice: dict) -> list[float]:
    """What renderers' parser accepts: one entry per token, token == "token_id:<id>", a numeric logprob."""
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for token, entry in zip(choice["token_ids"], content):
        assert entry["token"] == f"token_id:{token}"
        assert isinstance(entry["logprob"], float)
    return [entry["logprob"] for entry in content]


def test_verifiers_request_gets_the_engines_greedy_tokens(cluster):
    http, url = cluster.http, cluster.replicas[0]
    r = http.post(f"{url}{ROUTE}", json=verifiers_body(PROMPT, cache_salt="rollout-1", priority=5),
                  headers={"X-Session-ID": "episode-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    ignored = r.headers["x-rollwise-ignored-fields"].split(",")
    assert "priority" in ignored and "sampling_params.skip_special_tokens" in ignored  # accepted, reported
    choice = out["choices"][0]
    assert out["request_id"] and choice["finish_reason"] in ("stop", "length")
    logprobs = completion_logprobs(choice)

    # The engine's own token route, greedy, same prompt: the same tokens and logprobs.
    ref = http.post(f"{url}/generate", json={"prompt_ids": PROMPT, "temperature": 0, "max_tokens": 6,
                                             "stop_token_ids": [2]}).json()["choices"][0]
    assert choice["token_ids"] == ref["token_ids"] and choice["finish_reason"] == ref["finish_reason"]
    assert logprobs == pytest.approx(ref["logprobs"], abs=1e-5)
    with_ids = http.post(f"{url}{ROUTE}", json=verifiers_body(PROMPT, return_token_ids=True)).json()
    assert with_ids["prompt_token_ids"] == PROMPT

    models = http.get(f"{cluster.router}/v1/models").json()["data"]  # renderers' pre-flight length check
    assert next(card for card in models if card["id"] == MODEL)["max_model_len"] == 256


def test_cache_salt_separates_prefix_cache_entries(cluster):
    http, url = cluster.http, cluster.replicas[1]
    http.post(f"{url}/flush_cache").raise_for_status()

    def cached(**extra) -> tuple[int, list[int]]:
        out = http.post(f"{url}{ROUTE}", json=verifiers_body(PROMPT, max_tokens=2, **extra)).json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["token_ids"]

    first = cached(cache_salt="tenant-a")
    assert first[0] == 0
    again = cached(cache_salt="tenant-a")
    assert again[0] >= 32  # the same salt shares the prompt's blocks
    other, unsalted = cached(cache_salt="tenant-b"), cached()
    assert other[0] == 0 and unsalted[0] == 0  # another salt, or none, shares nothing with tenant-a's entries
    assert first[1] == again[1] == other[1] == unsalted[1]  # the salt changes caching, never the tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": [5], "cache_salt": "", "sampling_params": {}}, "cache_salt"),
    ({"token_ids": [5], "sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
    # what verifiers' SamplingConfig passes through and the engine cannot honour: refused, never silently ignored
    ({"token_ids": [5], "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ({"token_ids": [5], "sampling_params": {"stop": ["</answer>"]}}, "sampling_params.stop"),
    ({"token_ids": [5], "sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias"),
])
def test_bad_fields_are_a_400_naming_them(cluster, body, param):
    r = cluster.http.post(f"{cluster.replicas[0]}{ROUTE}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    off = {"min_p": 0.0, "stop": [], "logit_bias": None}  # the same fields switched off are served
    if param.split(".")[-1] in off:
        body = {**body, "sampling_params": {param.split(".")[-1]: off[param.split(".")[-1]], "max_tokens": 1}}
        assert cluster.http.post(f"{cluster.replicas[0]}{ROUTE}", json=body).status_code == 200


def test_router_keeps_a_session_on_one_replica(cluster):
    """X-Session-ID is the router's session key: every turn of a session lands where its first one did, whatever
    its tokens (the prompt alone would hash elsewhere)."""
    http, router = cluster.http, cluster.router
    placed: dict[str, set[str]] = {}
    for session in range(6):
        for turn in range(3):
            prompt = [7 + session, 60 + 11 * turn + session, *range(30 + turn, 40 + turn)]
            r = http.post(f"{router}{ROUTE}", json=verifiers_body(prompt, max_tokens=1),
                          headers={"X-Session-ID": f"episode-{session}"})
            assert r.status_code == 200, r.text
            assert completion_logprobs(r.json()["choices"][0])
            placed.setdefault(f"episode-{session}", set()).add(r.headers["x-rollwise-replica"])
    # By the first prompt tokens alone, a session's 3 turns would share a replica with odds 1/4 each: 6 sessions
    # all on one replica each means the header placed them.
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
