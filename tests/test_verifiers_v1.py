"""verifiers 0.4.0 (v1) end to end: the example taskset examples/verifiers_v1_echo (a third-party-style package,
synthetic data, a two-turn in-process harness) runs with verifiers' own train client against rollwise's router in
front of two engine servers (tiny random model), through rollwise/environments/verifiers_v1_driver.py under
verifiers' own interpreter (tests/verifiers_v1_venv.py builds it once with uv).

What reaches the router is recorded at the router's ASGI app, so the assertions compare verifiers' traces with
the exact requests and replies on the wire: the token-in route and its X-Session-ID, one replica per session,
turn 2 continuing turn 1's exact tokens (TITO), branch tokens and logprobs equal to the engine's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import defaultdict

import pytest

from engine_cluster import MODEL, engine_cluster
from rollwise.model.tiny import tiny_tokenizer
from verifiers_v1_venv import EXAMPLE, REPO, verifiers_v1_python

ROUTE = "/inference/v1/generate"
DRIVER = REPO / "rollwise" / "environments" / "verifiers_v1_driver.py"
TASKS, ROLLOUTS, TURNS = 2, 2, 2

pytestmark = pytest.mark.usefixtures("single_torch_thread")


class Recorder:
    """ASGI wrapper: every token-route exchange as (request headers, request body, reply body, replica)."""

    def __init__(self, app) -> None:
        self.app, self.calls = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != ROUTE:
            return await self.app(scope, receive, send)
        body, reply, reply_headers = bytearray(), bytearray(), {}

        async def recv():
            message = await receive()
            body.extend(message.get("body", b""))
            return message

        async def snd(message) -> None:
            if message["type"] == "http.response.start":
                reply_headers.update((k.decode().lower(), v.decode()) for k, v in message["headers"])
            else:
                reply.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, recv, snd)
        self.calls.append({"headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]},
                           "request": json.loads(body), "reply": json.loads(reply),
                           "replica": reply_headers.get("x-rollwise-replica")})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    python = verifiers_v1_python()
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer().save_pretrained(tokenizer_dir)  # the engine's tokenizer: verifiers' renderer loads it
    recorder = None

    def wrap(app):
        nonlocal recorder
        recorder = Recorder(app)
        return recorder

    with engine_cluster("consistent_hash", wrap_router=wrap) as cluster:
        spec = {"taskset": "verifiers-v1-echo", "args": {"num_tasks": TASKS}, "base_url": f"{cluster.router}/v1",
                "model": MODEL, "renderer_model": str(tokenizer_dir), "tasks": TASKS, "rollouts": ROLLOUTS,
                "sampling": {"temperature": 1.0, "max_tokens": 8, "seed": 3, "cache_salt": "run-1"}}
        env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}  # the example is pure Python: importable as is
        done = subprocess.run([python, str(DRIVER), json.dumps(spec)], capture_output=True, text=True, env=env,
                              timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = [json.loads(line) for line in done.stdout.splitlines()]
    assert traces and not any("episode_error" in t for t in traces), done.stdout[-2000:]
    sessions = defaultdict(list)
    for call in recorder.calls:
        sessions[call["headers"].get("x-session-id")].append(call)
    return traces, sessions


def test_every_model_call_is_token_in_with_its_session(run):
    traces, sessions = run
    assert len(traces) == TASKS * ROLLOUTS and all(not t["errors"] for t in traces)
    assert None not in sessions and len(sessions) == TASKS * ROLLOUTS  # X-Session-ID: one per rollout
    for calls in sessions.values():
        assert len(calls) == TURNS
        assert len({call["replica"] for call in calls}) == 1  # consistent_hash keeps a session on one replica
        for call in calls:
            sampling = call["request"]["sampling_params"]
            assert sampling["logprobs"] == 1 and sampling["seed"] == 3 and call["request"]["model"] == MODEL
            assert call["request"]["cache_salt"] == "run-1"  # prime-rl's: top level, as vLLM takes it
            choice = call["reply"]["choices"][0]
            assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_turn_two_continues_turn_ones_tokens_and_traces_hold_the_engines(run):
    traces, sessions = run
    by_tokens = {}
    for (first, second) in sessions.values():
        prompt1, prompt2 = first["request"]["token_ids"], second["request"]["token_ids"]
        out1, out2 = first["reply"]["choices"][0], second["reply"]["choices"][0]
        assert prompt2[: len(prompt1) + len(out1["token_ids"])] == prompt1 + out1["token_ids"]  # TITO
        by_tokens[tuple(prompt2 + out2["token_ids"])] = (prompt1, out1, prompt2, out2)
    for trace in traces:
        (branch,) = trace["branches"]  # one training sample per rollout: both turns in one sequence
        prompt1, out1, prompt2, out2 = by_tokens[tuple(branch["token_ids"])]
        sampled = [i for i, m in enumerate(branch["sampled_mask"]) if m]
        turn1 = list(range(len(prompt1), len(prompt1) + len(out1["token_ids"])))
        turn2 = list(range(len(prompt2), len(prompt2) + len(out2["token_ids"])))
        assert sampled == turn1 + turn2
        engine_logprobs = [e["logprob"] for out in (out1, out2) for e in out["logprobs"]["content"]]
        assert [branch["logprobs"][i] for i in sampled] == pytest.approx(engine_logprobs, abs=1e-6)


def test_rewards_are_the_tasksets_own(run):
    traces, sessions = run
    tokenizer = tiny_tokenizer()
    rewards = {}
    for first, second in sessions.values():
        word = re.search(r"Say the word: (\w+)", tokenizer.decode(first["request"]["token_ids"])).group(1)
        answer = tokenizer.decode(second["reply"]["choices"][0]["token_ids"], skip_special_tokens=True)
        rewards[tuple(second["request"]["token_ids"] + second["reply"]["choices"][0]["token_ids"])] = float(
            word in answer.lower())
    assert sorted(t["reward"] for t in traces) == sorted(rewards[tuple(t["branches"][0]["token_ids"])]
                                                        for t in traces)


@pytest.mark.parametrize(("spec", "field"), [({"taskset": "verifiers-v1-echo", "base_url": "http://127.0.0.1:9/v1",
                                               "model": MODEL}, "renderer_model"),
                                             ({"taskset": "verifiers-v1-echo", "base_url": 7}, "base_url")])
def test_a_bad_spec_is_a_one_line_error_naming_it(spec, field):
    done = subprocess.run([verifiers_v1_python(), str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    assert done.returncode != 0 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("verifiers_v1_driver: ") and field in last and "Traceback" not in done.stderr
