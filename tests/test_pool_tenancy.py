"""Pool tenancy (issue 43): who may attach to `rollwise serve pool`, how much each may hold, and that one tenant's
failure stays its own. Real pool servers on loopback, real slot workers, tiny models.

- attaching needs one of the pool's API keys (rollwise.serve.auth): none, a wrong one or another scheme is a 401
  naming `Authorization: Bearer`, nothing is attached; the key attaches, the job's token (not the key) then
  guards the job; a trainer's attach without a key ends in a one-line error naming ROLLWISE_API_KEY;
- jobs per key and in total are bounded (429 + Retry-After naming the option), a model that does not fit in the
  pool's memory is refused (503), a job's requests in flight are bounded (429 + Retry-After), each refusal
  whole: nothing attached or queued;
- `rollwise serve pool` refuses to serve a non-loopback address without keys, and bad key files, one line each;
- containment: a tenant whose adapter breaks an engine step (the slot's engine thread dies), whose adapter
  fails to load when its engine wakes, or whose model the engine cannot build, gets an error (409 naming the
  fault); another LoRA job and a full-parameter job on the same slot keep getting exactly the answers they got
  before; the faulted tenant runs again once it pushes weights that load.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from adapters import random_adapter

from rollwise.config import ConfigError, load_config
from rollwise.types.train_config import LoraConfig
from rollwise.types.generation import SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.pool.cli import main as pool_main
from rollwise.control.pool_backend import PoolClient, attach_to_pool
from rollwise.pool.scheduler import Policy
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.app import create_app
from rollwise.pool.states import check_log
from rollwise.pool.weights import JobAdapter
from rollwise.serve.auth import ApiKeys
from rollwise.sync.adapters import adapter_update
from rollwise.train.lora import adapter_spec

pytestmark = pytest.mark.usefixtures("single_torch_thread")

BASE, FULL = "tiny:0", "tiny:1"
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}
PROMPT = [5, 6, 7, 8]
GREEDY = {"prompt_ids": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _fingerprint(spec: str) -> str:
    return tokenizer_fingerprint(load_model(spec)[1])


# ==================================================================== API keys and limits


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[str, EnginePool]]:
    """A pool with two API keys: at most 3 jobs, 2 per key, 4 requests in flight per job."""
    pool = EnginePool(1, max_num_seqs=4, max_model_len=64, policy=Policy(min_slice_s=0.05), max_jobs=3,
                      max_jobs_per_key=2, max_queued_per_job=4)
    with serve_in_thread(create_app(pool, api_keys=ApiKeys(KEYS.values(), "--api-keys keys.txt"))) as (url, _):
        yield url, pool


def _state(url: str) -> dict:
    r = httpx.get(f"{url}/state", headers=_bearer(KEYS["alice"]), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _attach(url: str, job: str, key: str | None, model: str = BASE) -> httpx.Response:
    return httpx.post(f"{url}/jobs", json={"job": job, "model": model},
                      headers=_bearer(key) if key is not None else {}, timeout=60)


def _detach_all(url: str, tokens: dict[str, str]) -> None:
    for job, token in tokens.items():
        assert httpx.delete(f"{url}/jobs/{job}", headers=_bearer(token), timeout=30).status_code == 200


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-key-of-this-pool-at-all", f"Basic {KEYS['alice']}",
                                           f"Bearer {KEYS['alice'][:-1]}", f"Bearer {KEYS['alice']}x"],
                         ids=["none", "unknown", "basic", "prefix", "longer"])
def test_attaching_needs_one_of_the_pools_api_keys(keyed, authorization):
    url, _ = keyed
    before = _state(url)
    r = httpx.post(f"{url}/jobs", json={"job": "intruder", "model": BASE},
                   headers={"Authorization": authorization} if authorization else {}, timeout=30)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["param"] == "authorization" and error["type"] == "authentication_error"
    assert "Authorization: Bearer KEY" in error["message"] and "--api-keys keys.txt" in error["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert KEYS["alice"] not in r.text  # never echoed
    after = _state(url)
    assert "intruder" not in after["jobs"] and after["limits"]["jobs_by_key"] == before["limits"]["jobs_by_key"]
    # /state lists every tenant: only for a key's holder
    assert httpx.get(f"{url}/state", timeout=30).status_code == 401


def test_a_key_attaches_and_the_jobs_token_then_guards_the_job(keyed, monkeypatch):
    url, _ = keyed
    alice = PoolClient(url, api_key=KEYS["alice"])
    info = alice.attach("alice-job", BASE, 1.0, _fingerprint(BASE))
    monkeypatch.setenv("ROLLWISE_API_KEY", KEYS["bob"])  # how a trainer gets its key
    bob = PoolClient(url)
    bob.attach("bob-job", BASE, 1.0, _fingerprint(BASE))
    try:
        # the API key opens no job: only the token its attach returned does
        r = httpx.post(f"{url}/jobs/alice-job/pause", headers=_bearer(KEYS["alice"]), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["param"] == "authorization"
        assert httpx.post(f"{url}/jobs/alice-job/pause", headers=_bearer(info["token"]), timeout=30).status_code == 200
        jobs = _state(url)["jobs"]
        assert jobs["alice-job"]["api_key"] != jobs["bob-job"]["api_key"]
        assert KEYS["alice"] not in json.dumps(jobs)  # known by its label only
    finally:
        _detach_all(url, {"alice-job": info["token"], "bob-job": bob.token})
        alice.close()
        bob.close()
    # a trainer without a key: one line naming what to set, nothing attached
    monkeypatch.delenv("ROLLWISE_API_KEY")
    cfg = load_config(None, [f"model={BASE}", f"pool.url={url}", "pool.job=keyless"])
    with pytest.raises(ConfigError, match="set ROLLWISE_API_KEY to one of the pool's keys"):
        attach_to_pool(cfg, load_model(BASE)[0], None, fingerprint=_fingerprint(BASE), policy_version=0)
    assert "keyless" not in _state(url)["jobs"]


def test_jobs_per_key_and_in_total_are_bounded(keyed):
    url, _ = keyed
    tokens: dict[str, str] = {}
    try:
        for job in ("a1", "a2"):
            r = _attach(url, job, KEYS["alice"])
            assert r.status_code == 200, r.text
            tokens[job] = r.json()["token"]
        r = _attach(url, "a3", KEYS["alice"])
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "--max-jobs-per-key=2" in r.json()["error"]["message"] and "detach a job" in r.json()["error"]["message"]
        r = _attach(url, "b1", KEYS["bob"])
        assert r.status_code == 200, r.text
        tokens["b1"] = r.json()["token"]
        r = _attach(url, "b2", KEYS["bob"])  # bob holds 1 of his 2, but the pool holds 3 of 3
        assert r.status_code == 429 and "--max-jobs=3" in r.json()["error"]["message"], r.text
        state = _state(url)
        assert sorted(state["jobs"]) == ["a1", "a2", "b1"] and sorted(state["limits"]["jobs_by_key"].values()) == [1, 2]
        # a detach gives its place back
        _detach_all(url, {"a1": tokens.pop("a1")})
        r = _attach(url, "b2", KEYS["bob"])
        assert r.status_code == 200, r.text
        tokens["b2"] = r.json()["token"]
    finally:
        _detach_all(url, tokens)
    assert _state(url)["limits"]["jobs_by_key"] == {}


def test_a_model_that_does_not_fit_in_the_pools_memory_is_refused():
    pool = EnginePool(2, max_num_seqs=4, max_model_len=64, memory_budget_bytes=64 * 1024)
    with serve_in_thread(create_app(pool)) as (url, _):
        for _ in range(2):  # refused whole each time: the job's place is given back (503 again, not 429)
            r = _attach(url, "big", None)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            error = r.json()["error"]
            assert error["param"] == "model" and "--memory-budget" in error["message"]
            assert "GiB" in error["message"] and "big" in error["message"]
        state = httpx.get(f"{url}/state", timeout=30).json()
        assert state["jobs"] == {} and state["limits"]["jobs_by_key"] == {}
        assert state["limits"]["memory_committed_bytes"] == 0


def test_a_jobs_requests_in_flight_are_bounded(keyed):
    url, _ = keyed
    model, tok = load_model(BASE)
    client = PoolClient(url, api_key=KEYS["alice"])
    client.attach("queue", BASE, 1.0, tokenizer_fingerprint(tok))
    try:
        client.push_weights(model.state_dict(), 0, tokenizer_fingerprint(tok))
        client.pause()  # nothing runs: every request stays queued (the 40,000 while paused)
        as_job = _bearer(client.token)

        def submit(ids: range) -> httpx.Response:
            body = {"requests": [{"request_id": f"r{i}", "prompt_ids": PROMPT} for i in ids]}
            return httpx.post(f"{url}/jobs/queue/requests", json=body, headers=as_job, timeout=30)

        for params, param in [({"max_tokens": 2**64}, "max_tokens"), ({"min_tokens": 300}, "min_tokens")]:
            bad = {"requests": [{"request_id": "bad", "prompt_ids": PROMPT, "params": params}]}
            r = httpx.post(f"{url}/jobs/queue/requests", json=bad, headers=as_job, timeout=30)
            assert r.status_code == 400 and param in r.json()["error"]["param"], r.text
        assert submit(range(0, 3)).status_code == 200
        r = submit(range(3, 5))  # 3 + 2 > 4: refused whole
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["param"] == "requests" and "--max-queued-per-job" in r.json()["error"]["message"]
        assert _state(url)["jobs"]["queue"]["requests_in_flight"] == 3
        assert submit(range(3, 4)).status_code == 200
        assert submit(range(4, 5)).status_code == 429
        r = httpx.post(f"{url}/jobs/queue/abort", json={"request_ids": [f"r{i}" for i in range(4)]}, headers=as_job,
                       timeout=30)
        assert len(r.json()["aborted"]) == 4
        assert submit(range(4, 8)).status_code == 200  # room again
        assert _state(url)["jobs"]["queue"]["requests_in_flight"] == 4
    finally:
        client.detach()
        client.close()


# ==================================================================== `rollwise serve pool` refuses to start


def _keys_file(tmp_path: Path, text: str, name: str = "keys.txt") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", ["network-no-keys", "missing-file", "short-key", "empty-file", "keys-and-insecure",
                                  "memory-budget", "max-jobs"])
def test_serve_pool_refuses_an_unsafe_or_bad_setup_in_one_line(case, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("ROLLWISE_API_KEYS", raising=False)
    good = _keys_file(tmp_path, f"# alice\n{KEYS['alice']}  # her laptop\n\n{KEYS['bob']}\n")
    argv, expected = {
        "network-no-keys": (["--host", "0.0.0.0"], "--host 0.0.0.0 accepts connections from other machines"),
        "missing-file": (["--api-keys", str(tmp_path / "nope.txt")], "nope.txt: no such file"),
        "short-key": (["--api-keys", _keys_file(tmp_path, f"{KEYS['alice']}\nsecret\n", "short.txt")],
                      "line 2: an API key must"),
        "empty-file": (["--api-keys", _keys_file(tmp_path, "# nothing yet\n", "empty.txt")], "no API keys in it"),
        "keys-and-insecure": (["--api-keys", good, "--insecure-no-auth"], "choose one"),
        "memory-budget": (["--memory-budget", "nan"], "--memory-budget must be a positive number"),
        "max-jobs": (["--api-keys", good, "--max-jobs", "0"], "--max-jobs must be >= 1"),
    }[case]
    assert pool_main([*argv, "--port", "0"]) == 2
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert KEYS["alice"] not in lines[0]


def test_keys_come_from_a_file_or_the_environment(tmp_path):
    keys = ApiKeys.from_file(_keys_file(tmp_path, f"# alice\n{KEYS['alice']}  # her laptop\n\n{KEYS['bob']}\n"))
    assert len(keys) == 2 and keys.check(KEYS["bob"]) != keys.check(KEYS["alice"])
    assert len(ApiKeys.from_env(f" {KEYS['alice']}, {KEYS['bob']} ,")) == 2


# ==================================================================== containment: a tenant's failure stays its own


class Shared:
    """A one-slot pool with a LoRA job ("good") and a full-parameter job ("full"), and what each answers."""

    def __init__(self, url: str, pool: EnginePool) -> None:
        self.url, self.pool, self.tokens = url, pool, {}
        self.round, self.seen = 0, {}
        self.fp = _fingerprint(BASE)
        self.tokens["good"] = self.lora_job("good", seed=1)
        model, tok = load_model(FULL)
        client = PoolClient(url)
        client.attach("full", FULL, 1.0, tokenizer_fingerprint(tok))
        client.push_weights(model.state_dict(), 0, tokenizer_fingerprint(tok))
        self.tokens["full"] = client.token
        self.expected = {job: self.generate(job) for job in ("good", "full")}

    def lora_job(self, job: str, seed: int, cfg: LoraConfig = LoraConfig(rank=4, alpha=8.0)) -> str:
        client = PoolClient(self.url)
        client.attach(job, BASE, 1.0, self.fp, lora=True)
        self.push_adapter(client, cfg, seed, version=1)
        return client.token

    def push_adapter(self, client: PoolClient, cfg: LoraConfig, seed: int, version: int) -> None:
        spec = adapter_spec(cfg, "policy", default=True)
        update = adapter_update(random_adapter(load_model(BASE)[0], cfg, seed), spec, version, self.fp)
        client.push_weights(update.tensors(), version, self.fp, adapter=update.manifest.adapter)

    def generate(self, job: str) -> httpx.Response | list[int]:
        r = httpx.post(f"{self.url}/jobs/{job}/generate", json=GREEDY, headers=_bearer(self.tokens[job]), timeout=60)
        return r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r

    def store_past_validation(self, job: str, spec, state: dict[str, torch.Tensor], version: int) -> None:
        """Store an adapter through the pool's own adapter target, as if it had passed every upload check
        (what containment is for: whatever gets past validation)."""
        j = self.pool.jobs[job]
        with j.lock:
            JobAdapter(self.pool.slots, self.pool.states, j).load_adapter(spec.model_copy(update={"name": job}),
                                                                         state, version)

    def all_at_once(self, jobs: list[str]) -> dict[str, httpx.Response | list[int]]:
        """/generate for every job at once."""
        out: dict[str, httpx.Response | list[int]] = {}
        threads = [threading.Thread(target=lambda j=j: out.__setitem__(j, self.generate(j))) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return out

    def in_one_batch(self, jobs: list[str]) -> dict[str, dict]:
        """One greedy request per job, all queued before a slot plans again (it needs pool.lock): a LoRA base's
        jobs share one engine batch. Each job's sample, read back through its long poll."""
        params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
        self.round += 1
        with self.pool.lock:
            for job in jobs:
                self.pool.submit(self.pool.jobs[job], [(f"{job}-{self.round}", PROMPT, params)])
        out = {}
        for job in jobs:
            while job not in out:
                r = httpx.get(f"{self.url}/jobs/{job}/completions", params={"after": self.seen.get(job, 0),
                              "timeout": 1.0}, headers=_bearer(self.tokens[job]), timeout=60)
                for entry in r.json()["completions"]:
                    self.seen[job] = entry["seq"]
                    out[job] = entry
        return out


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    pool = EnginePool(1, max_num_seqs=8, max_model_len=64, policy=Policy(min_slice_s=0.05))
    with serve_in_thread(create_app(pool)) as (url, _):
        yield Shared(url, pool)


def _rank_zero(shared: Shared, job: str) -> None:
    """An adapter of rank 0 (scaling alpha/0): it loads, and the first engine step using it raises."""
    spec = adapter_spec(LoraConfig(rank=4, alpha=8.0), job, default=False).model_copy(update={"rank": 0})
    state = {k: (v[:0] if k.endswith("lora_A.weight") else v[:, :0])
             for k, v in random_adapter(load_model(BASE)[0], LoraConfig(rank=4, alpha=8.0), 7).items()}
    shared.store_past_validation(job, spec, state, version=2)


def _non_finite(shared: Shared, job: str) -> None:
    """A NaN adapter stored while the base's engine sleeps: the engine refuses it when it wakes."""
    assert not isinstance(shared.generate("full"), httpx.Response)  # the slot now holds "full": the base sleeps
    cfg = LoraConfig(rank=4, alpha=8.0)
    state = {k: torch.full_like(v, float("nan")) for k, v in random_adapter(load_model(BASE)[0], cfg, 7).items()}
    shared.store_past_validation(job, adapter_spec(cfg, job, default=False), state, version=2)


@pytest.mark.parametrize("case", ["adapter-breaks-a-step", "adapter-fails-to-load", "model-the-engine-cannot-build"])
def test_a_tenant_that_breaks_its_engine_gets_an_error_and_the_others_keep_the_slot(shared, case, tmp_path):
    bad = f"bad-{case}"
    if case == "model-the-engine-cannot-build":  # a Llama with GELU: transformers loads it, the engine does not
        model = tiny_llama(seed=3)
        model.config.hidden_act = "gelu"
        model.save_pretrained(tmp_path / "gelu")
        tiny_tokenizer().save_pretrained(tmp_path / "gelu")
        model, tok = load_model(str(tmp_path / "gelu"))
        client = PoolClient(shared.url)
        client.attach(bad, str(tmp_path / "gelu"), 1.0, tokenizer_fingerprint(tok))
        client.push_weights(model.state_dict(), 0, tokenizer_fingerprint(tok))  # valid weights for its model
        shared.tokens[bad] = client.token
        fixed = None
    else:
        shared.tokens[bad] = shared.lora_job(bad, seed=5)
        (_rank_zero if case == "adapter-breaks-a-step" else _non_finite)(shared, bad)
        fixed = LoraConfig(rank=4, alpha=8.0)
    fault = "breaks the engine" if case == "adapter-breaks-a-step" else "failed to load on the engine"
    try:
        got = shared.in_one_batch([bad, "good", "full"])
        # the tenant: its sample comes back with the error naming its fault; nobody else's answers changed
        assert got[bad]["finish_reason"] == "abort" and got[bad]["token_ids"] == []
        assert f"job {bad!r}" in got[bad]["error"] and fault in got[bad]["error"], got[bad]
        assert got["good"]["token_ids"] == shared.expected["good"] and "error" not in got["good"]
        assert got["full"]["token_ids"] == shared.expected["full"] and "error" not in got["full"]
        r = shared.generate(bad)
        assert isinstance(r, httpx.Response) and r.status_code == 409, r
        assert r.json()["error"]["param"] == "weights" and fault in r.json()["error"]["message"]
        # it stays stopped (409, nothing queued) until it pushes weights that load; the others keep being served
        r = httpx.post(f"{shared.url}/jobs/{bad}/requests", headers=_bearer(shared.tokens[bad]), timeout=30,
                       json={"requests": [{"request_id": "x", "prompt_ids": PROMPT}]})
        assert r.status_code == 409 and r.json()["error"]["param"] == "weights"
        assert shared.all_at_once(["good", "full"]) == shared.expected
        state = httpx.get(f"{shared.url}/state", timeout=30).json()
        assert state["jobs"][bad]["fault"] and state["jobs"][bad]["requests_in_flight"] == 0
        assert state["jobs"]["good"]["fault"] is None and state["jobs"]["full"]["fault"] is None
        assert state["isolation"]["violations"] == [] and check_log(state["transitions"], num_slots=1) == []
        if case == "adapter-breaks-a-step":  # the engine thread died in a step with both LoRA jobs' requests on it:
            # the slot got a fresh one, the good job's request ran again
            assert any("ZeroDivisionError" in e and "2 request(s) rerun or answered" in e
                       for e in state["slots"][0]["errors"]), state["slots"][0]["errors"]
        if fixed is not None:  # a LoRA job pushes a good adapter: served again, beside the others
            client = PoolClient(shared.url)
            client.job, client.token = bad, shared.tokens[bad]
            shared.push_adapter(client, fixed, seed=5, version=3)
            got = shared.all_at_once([bad, "good", "full"])
            assert isinstance(got[bad], list) and len(got[bad]) == GREEDY["max_tokens"]
            assert got["good"] == shared.expected["good"] and got["full"] == shared.expected["full"]
    finally:
        r = httpx.delete(f"{shared.url}/jobs/{bad}", headers=_bearer(shared.tokens.pop(bad)), timeout=30)
        assert r.status_code == 200, r.text
