"""The agent layer: tool calls (good, malformed, unknown), limits, agent-inserted turns, sandbox tools,
the in-process OpenAI-style client, and the black-box proxy over real HTTP with the `openai` package.

Engines are real (the reference engine with a tiny model taught to call the calculator).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time

import httpx
import openai
import pytest

from rollwise.agent.client import SessionClient
from rollwise.agent.episode import ToolAgent, run_episode
from rollwise.agent.generator import HTTPGenerator, LocalGenerator
from rollwise.agent.proxy import create_proxy_app
from rollwise.agent.session import AgentSession, LimitReached, SessionLimits
from rollwise.agent.toolcalls import HermesToolParser, get_parser
from rollwise.agent.tools import BashTool, CalculatorTool, PythonTool, ToolRegistry, evaluate_arithmetic
from rollwise.agent.toy import toy_question, toy_tool_model
from rollwise.agent.verify import RecordingGenerator, verify_trajectory
from rollwise.engine.factory import create_engine
from rollwise.engine.server import create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.model.tiny import tiny_tokenizer

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(120)]

CALC = CalculatorTool().spec()


@pytest.fixture(scope="module")
def toy():
    model, tokenizer = toy_tool_model(seed=0)
    engine = create_engine("reference", model, tokenizer, max_num_seqs=8, max_model_len=768,
                           eos_token_ids=[tokenizer.eos_token_id], seed=0,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    generator = LocalGenerator(engine)
    yield model, tokenizer, generator, engine
    generator.close()


# ------------------------------------------------------------------ tool calls from untrusted text


def test_parser_reads_good_calls_and_reports_bad_ones():
    p = HermesToolParser()
    good = p.parse('Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    assert good.content == "Let me add." and good.calls[0].name == "calculator"
    assert good.calls[0].arguments == {"expression": "2+3"} and not good.errors
    as_string = p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert as_string.calls[0].arguments == {"x": 1}
    cases = {
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>': "not valid JSON",
        '<tool_call>["calculator"]</tool_call>': "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "no \"name\"",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "calculator", "argu': "not closed",
        "<tool_call>" + "x" * 20_000 + "</tool_call>": "the limit is",
    }
    for text, needle in cases.items():
        parsed = p.parse(text)
        assert not parsed.calls and len(parsed.errors) == 1 and needle in parsed.errors[0].message, text[:60]
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_parser("nope")


def test_registry_turns_every_failure_into_an_error_result():
    reg = ToolRegistry([CalculatorTool()])
    p = HermesToolParser()

    def run(text):
        parsed = p.parse(text)
        return reg.execute((parsed.calls + parsed.errors)[0])

    ok = run('<tool_call>{"name": "calculator", "arguments": {"expression": "(2+3)*4"}}</tool_call>')
    assert not ok.error and ok.content == "20"
    unknown = run('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert unknown.error and "unknown tool 'search'" in unknown.content and "calculator" in unknown.content
    missing = run('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert missing.error and "missing required argument" in missing.content
    wrong_type = run('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>')
    assert wrong_type.error and "must be of type string" in wrong_type.content
    extra = run('<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 2}}</tool_call>')
    assert extra.error and "unknown argument" in extra.content
    for expr, needle in [("__import__('os')", "only numbers"), ("1/0", "division by zero"), ("9**9**9", "too large"),
                         ("2+", "not an arithmetic expression")]:
        r = run(json.dumps({"name": "calculator", "arguments": {"expression": expr}}).join(["<tool_call>", "</tool_call>"]))
        assert r.error and needle in r.content, (expr, r.content)
    malformed = run("<tool_call>{nope</tool_call>")
    assert malformed.error and malformed.message()["role"] == "tool"
    assert evaluate_arithmetic("7 // 2 + 2 ** 3") == 11


def test_malformed_and_unknown_calls_go_back_to_the_model(toy):
    """In a real episode the model's broken calls come back as tool results and the episode goes on."""
    model, tokenizer, generator, _ = toy
    errors = 0
    for seed in range(6):
        recorder = RecordingGenerator(generator)
        session = AgentSession(recorder, tokenizer, seed=seed, limits=SessionLimits(max_turns=3))
        agent = ToolAgent(ToolRegistry([CalculatorTool()]))
        result = run_episode(session, toy_question(random.Random(seed)), agent, max_tokens=120)
        assert verify_trajectory(result.trajectory, recorder.calls).ok
        for r in agent.results:
            if r.error:
                errors += 1
                assert r.content.startswith("error:")
                # the error text is in the conversation the model saw next
                assert any(m["role"] == "tool" and m["content"] == r.content for m in result.trajectory.messages)
    assert errors, "no malformed or unknown tool call in 6 episodes"


# ------------------------------------------------------------------ limits and inserted turns


def test_turn_limit(toy):
    _, tokenizer, generator, _ = toy

    class Chatty(ToolAgent):
        def step(self, turn, session):
            return [{"role": "user", "content": "more"}]

    session = AgentSession(generator, tokenizer, seed=0, limits=SessionLimits(max_turns=2))
    result = run_episode(session, [{"role": "user", "content": "hi"}], Chatty(ToolRegistry()), max_tokens=8)
    assert result.finish_reason == "max_turns" and result.trajectory.turns == 2
    assert result.trajectory.finish_reason == "max_turns"
    with pytest.raises(LimitReached, match="max_turns=2"):
        session.generate()


def test_token_limit_caps_turns(toy):
    _, tokenizer, generator, _ = toy
    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=0, limits=SessionLimits(max_tokens=30, max_turns=10))

    class Chatty(ToolAgent):
        def step(self, turn, session):
            return [{"role": "user", "content": "more"}]

    result = run_episode(session, [{"role": "user", "content": "hi"}], Chatty(ToolRegistry()), max_tokens=12)
    assert result.finish_reason == "max_tokens"
    assert result.trajectory.sampled_tokens <= 30
    assert [p.max_tokens for _, p, _ in recorder.calls][:2] == [12, 12]  # later turns get what is left
    assert sum(len(c.token_ids) for _, _, c in recorder.calls) == result.trajectory.sampled_tokens


def test_context_limit(toy):
    _, tokenizer, generator, _ = toy
    session = AgentSession(generator, tokenizer, seed=0)
    session.start([{"role": "user", "content": "x" * 760}])
    with pytest.raises(LimitReached, match="max_model_len=768") as info:
        session.generate()
    assert info.value.reason == "context"


def test_agent_inserted_turns(toy):
    model, tokenizer, generator, _ = toy

    class Coach(ToolAgent):
        """Adds a system note and a user nudge mid-episode, after the tool results."""

        def step(self, turn, session):
            follow = super().step(turn, session) or []
            if session.builder.turns == 1:
                follow += [{"role": "system", "content": "Note: be brief."}, {"role": "user", "content": "Answer?"}]
            return follow

    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=2, limits=SessionLimits(max_turns=3))
    result = run_episode(session, toy_question(random.Random(2)), Coach(ToolRegistry([CalculatorTool()])),
                         max_tokens=120)
    traj = result.trajectory
    assert verify_trajectory(traj, recorder.calls, model=model).ok
    roles = [m["role"] for m in traj.messages]
    assert roles[:3] == ["system", "user", "assistant"] and "Note: be brief." in [m["content"] for m in traj.messages]
    text = tokenizer.decode(traj.segments[0].token_ids)
    assert "<|im_start|>system\nNote: be brief.<|im_end|>\n<|im_start|>user\nAnswer?<|im_end|>\n" in text


# ------------------------------------------------------------------ sandbox tools


def test_python_and_bash_tools_share_the_rollout_sandbox():
    from rollwise.sandbox.local import LocalSandbox
    from rollwise.sandbox.types import SandboxLimits

    with LocalSandbox(SandboxLimits(timeout_s=10)) as sb:
        if not sb.run("command -v python3").ok:
            pytest.skip("no python3 inside the sandbox (Debian's python3 is what the sandbox sees)")
        reg = ToolRegistry([PythonTool(sb), BashTool(sb), CalculatorTool()])
        p = HermesToolParser()

        def call(name, **arguments):
            text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
            return reg.execute(p.parse(text).calls[0])

        r = call("python", code="open('state.txt', 'w').write('42')\nprint(6 * 7)")
        assert not r.error and r.content == "42"
        assert call("bash", command="cat state.txt").content == "42"  # files persist across turns
        failing = call("python", code="raise SystemExit('boom')")
        assert "boom" in failing.content and "[exit code 1" in failing.content
        slow = BashTool(sb, timeout_s=1).run({"command": "sleep 30"})
        assert "exit code" in slow and "timeout" in slow.lower(), slow


# ------------------------------------------------------------------ OpenAI-style client in process


def test_session_client_speaks_openai_types(toy):
    model, tokenizer, generator, _ = toy
    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=1)
    client = SessionClient(session)
    reg = ToolRegistry([CalculatorTool()])
    messages = toy_question(random.Random(1))
    # agent code as written for OpenAI: call, run tool_calls, append, call again
    for _ in range(3):
        r = client.chat.completions.create(messages=messages, tools=[CALC], max_tokens=120)
        msg = r.choices[0].message
        assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            messages.append({"role": "user", "content": "check it"})
            continue
        for tc in msg.tool_calls:
            parsed = HermesToolParser().parse(
                "<tool_call>" + json.dumps({"name": tc.function.name,
                                            "arguments": json.loads(tc.function.arguments)}) + "</tool_call>")
            result = reg.execute(parsed.calls[0])
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result.content})
    traj = session.trajectory()
    assert traj.turns == 3 and not traj.splits  # each request extended the last: one segment
    assert verify_trajectory(traj, recorder.calls, model=model).ok
    with pytest.raises(ValueError, match="n must be 1"):
        client.chat.completions.create(messages=messages, n=2)
    with pytest.raises(ValueError, match="stop strings"):
        client.chat.completions.create(messages=messages, stop=["\n"])


def test_client_rewriting_history_splits(toy):
    _, tokenizer, generator, _ = toy
    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=0)
    client = SessionClient(session)
    messages = [{"role": "user", "content": "1+1?"}]
    r = client.chat.completions.create(messages=messages, max_tokens=10)
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    client.chat.completions.create(messages=messages, max_tokens=10)
    messages[0] = {"role": "user", "content": "2+2?"}  # an agent framework that edits history
    client.chat.completions.create(messages=messages[:1], max_tokens=10)
    traj = session.trajectory()
    assert len(traj.segments) == 2 and "changed the conversation at message 0" in traj.splits[0]
    assert verify_trajectory(traj, recorder.calls).ok


# ------------------------------------------------------------------ the black-box proxy over HTTP


@contextlib.contextmanager
def _serve(app):
    with serve_in_thread(app) as (url, _):
        yield url


@pytest.fixture(scope="module")
def proxy():
    model, tokenizer = toy_tool_model(seed=0)
    engine = create_engine("reference", model, tokenizer, max_num_seqs=8, max_model_len=768,
                           eos_token_ids=[tokenizer.eos_token_id], seed=0)
    with _serve(create_app(engine, tokenizer, "toy")) as engine_url:
        upstream = HTTPGenerator(engine_url)
        app = create_proxy_app(upstream, tokenizer, model_name="toy", limits=SessionLimits(max_turns=4),
                               fingerprint=tokenizer_fingerprint(tokenizer))
        with _serve(app) as url:
            yield url, tokenizer
        upstream.close()


def test_proxy_captures_a_tool_using_session(proxy):
    url, tokenizer = proxy
    client = openai.OpenAI(base_url=f"{url}/sessions/ep-1/v1", api_key="unused", max_retries=0, timeout=60)
    reg = ToolRegistry([CalculatorTool()])
    messages = toy_question(random.Random(2))
    responses = []
    for _ in range(3):
        r = client.chat.completions.create(model="toy", messages=messages, tools=[CALC], max_tokens=120,
                                           temperature=1.0, seed=7)
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            for tc in msg.tool_calls:
                call = HermesToolParser().parse("<tool_call>" + json.dumps(
                    {"name": tc.function.name, "arguments": json.loads(tc.function.arguments)}) + "</tool_call>")
                messages.append({"role": "tool", "tool_call_id": tc.id,
                                 "content": reg.execute(call.calls[0]).content})
        else:
            messages.append({"role": "user", "content": "and now?"})
    client.close()
    traj = httpx.get(f"{url}/sessions/ep-1/trajectory").json()
    assert traj["turns"] == 3 and traj["splits"] == [] and not traj["finished"]
    seg = traj["segments"][0]
    # every turn's sampled ids and logprobs, as the client received them, sit in the trajectory with mask 1
    for r, span in zip(responses, seg["spans"]):
        choice = r.choices[0]
        ids = choice.model_extra["token_ids"]
        assert seg["token_ids"][span["start"]: span["end"]] == ids
        assert seg["loss_mask"][span["start"]: span["end"]] == [1] * len(ids)
        assert seg["logprobs"][span["start"]: span["end"]] == [t.logprob for t in choice.logprobs.content]
        assert seg["versions"][span["start"]: span["end"]] == choice.model_extra["policy_versions"]
        assert r.usage.prompt_tokens == span["start"]  # the engine's prompt was the trajectory so far
    assert sum(seg["loss_mask"]) == sum(len(r.choices[0].model_extra["token_ids"]) for r in responses)
    done = httpx.post(f"{url}/sessions/ep-1/finish", json={"reward": 1.0}).json()
    assert done["finished"] and done["reward"] == 1.0
    again = httpx.post(f"{url}/sessions/ep-1/v1/chat/completions", json={"messages": messages})
    assert again.status_code == 409
    assert "ep-1" in [s["id"] for s in httpx.get(f"{url}/sessions").json()["sessions"]]
    assert httpx.delete(f"{url}/sessions/ep-1").status_code == 200
    assert httpx.get(f"{url}/sessions/ep-1/trajectory").status_code == 404


def test_proxy_bad_requests_name_the_field(proxy):
    url, _ = proxy
    post = lambda body, sid="bad-1": httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body)  # noqa: E731
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": user, "n": 2}, "n must be 1"),
        ({"messages": user, "stream": True}, "stream"),
        ({"messages": user, "stop": ["x"]}, "stop strings"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text is supported"),
        ({"messages": user, "tool_choice": "required"}, "only 'auto' and 'none'"),
        ({"messages": user, "max_tokens": 0}, "max_tokens"),
    ]
    for body, needle in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], (needle, r.json())
    # Unknown fields are ignored, as vLLM does, and named in a response header.
    r = post({"messages": user, "max_tokens": 2, "frobnicate": 1, "chat_template_kwargs": {}}, sid="extras-1")
    assert r.status_code == 200, r.text
    assert r.headers["x-rollwise-ignored-fields"] == "frobnicate,chat_template_kwargs"
    r = httpx.post(f"{url}/sessions/bad-1/v1/chat/completions", headers={"content-type": "application/json"},
                   content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}')
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/sessions/bad-1/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert post({"messages": user}, sid="bad id!").status_code in (400, 404)
    assert post({"messages": user, "model": "other"}).status_code == 404
    assert httpx.get(f"{url}/sessions/nobody/trajectory").status_code == 404
    # the turn limit is a clear 429 with the reason, and the trajectory stays retrievable
    messages = list(user)
    for i in range(4):
        r = post({"messages": messages, "max_tokens": 4}, sid="limit-1")
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {i}"}]
    r = post({"messages": messages, "max_tokens": 4}, sid="limit-1")
    assert r.status_code == 429 and r.json()["error"]["code"] == "max_turns"
    assert httpx.get(f"{url}/sessions/limit-1/trajectory").json()["turns"] == 4


def test_proxy_refuses_an_engine_with_another_tokenizer(toy):
    _, tokenizer, generator, _ = toy
    other = tiny_tokenizer()
    other.chat_template = other.chat_template + " "
    with pytest.raises(ValueError, match="tokenizer"):
        create_proxy_app(generator, other, fingerprint=tokenizer_fingerprint(other))


# ------------------------------------------------------------------ multi-turn samples in the GRPO trainer


def test_grpo_trains_on_sampled_tokens_only(toy):
    from rollwise.config import AgentConfig
    from rollwise.agent.rollout import run_agent_groups, score_episodes
    from rollwise.agent.samples import assign_episode_advantages
    from rollwise.types.train_config import TrainConfig
    from rollwise.types.task import Problem
    from rollwise.train.trainer import GRPOTrainer

    model, tokenizer, generator, _ = toy
    rng = random.Random(0)
    problems = []
    for i in range(2):
        messages = toy_question(rng)
        a, b = messages[1]["content"].rstrip("?").split("+")
        problems.append(Problem(f"p{i}", messages[1]["content"], str(int(a) + int(b))))
    system = toy_question(random.Random(0))[0]
    cfg = AgentConfig(max_turns=3, max_tokens=200, max_tokens_per_turn=120, describe_tools=False)
    outcomes = run_agent_groups(generator, tokenizer, problems, 4,
                                lambda p: [system, {"role": "user", "content": p.question}], cfg, seed=1)
    assert len(outcomes) == 8 and all(o.samples for o in outcomes)

    def score(s):
        s.reward = 1.0 if next(p for p in problems if p.id == s.problem_id).answer in s.response_text else 0.0

    samples = score_episodes(outcomes, score)
    multi = [s for s in samples if s.extra["turns"] > 1]
    assert multi, "no episode with a tool call and a second turn"
    for s in multi:
        mask = s.loss_mask
        assert len(mask) == len(s.response_ids) == len(s.behaviour_logprobs) == len(s.versions)
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask  # tool turn inside carries no loss
        assert all(v >= 0 for v, m in zip(s.versions, mask) if m) and s.staleness(0) == [0] * sum(mask)
    for s in samples:  # rewards differ within groups so every sample carries signal
        s.reward += 0.01 * int(s.extra["episode_id"].rsplit("-", 1)[1])
    assign_episode_advantages(samples, "mean_std")
    # the trainer owns a copy (the module's other tests compare the engine with the untouched model)
    trainer = GRPOTrainer(copy.deepcopy(model), TrainConfig(lr=1e-4, micro_batch_size=4),
                          pad_token_id=tokenizer.pad_token_id)
    metrics = trainer.train_step(samples)
    assert metrics["trained_tokens"] == sum(s.trained_tokens for s in samples) < sum(len(s.response_ids) for s in samples)
    # the trainer's logprobs on the masked positions are the engine's: the mask is aligned token for token
    assert metrics["mismatch_abs_logp"] < 1e-4
    assert trainer.version == 1 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("tools", ["[calculator]", "[python]"])
def test_rollwise_train_runs_agent_episodes(tmp_path, tools):
    """`rollwise train` with an `agent:` override: episodes roll out, train, evaluate; tool metrics logged. With a
    tool that runs code, the "after" eval (which runs once training's sandboxes are closed) gets its own."""
    from rich.console import Console

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    cfg = load_config(None, [
        "model=tiny:0", f"agent={{tools: {tools}, max_turns: 2, max_tokens_per_turn: 12, max_tokens: 64, demo: "
        "[{role: user, content: '1+1'}, {role: assistant, content: '{answer_open}2{answer_close}'}]}", "steps=1", "prompts_per_step=2",
        "group_size=2", "eval.size=2", "eval.every=0", f"output_dir={tmp_path}/run", "engine.kind=reference",
        "engine.max_model_len=2048", "tensorboard=false", "checkpoint.every=0",
    ])
    summary = train(cfg, Console(quiet=True))
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["steps"] == 1 and record["batch_samples"] == 4
    for key in ("agent_turns_mean", "agent_tool_calls_per_episode", "agent_tool_error_rate",
                "agent_episodes_with_tool_result"):
        assert key in record
    assert 1 <= record["agent_turns_mean"] <= 2
    evals = (tmp_path / "run" / "evals.jsonl").read_text().splitlines()
    assert len(evals) == 2  # before and after, as greedy episodes
    # every episode of the step is accounted for in the sample ledger (one slot per episode)
    assert summary["samples"]["trained"] + summary["samples"]["dropped"] == 4, summary["samples"]


def test_agent_config_errors_name_the_field():
    from rollwise.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.mode=sync"):
        load_config(None, ["agent={}", "rollout.mode=async"])
    with pytest.raises(ConfigError, match="agent.tools.0"):
        load_config(None, ["agent.tools=[browser]"])
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_config(None, ["agent.max_turns=0"])
    assert load_config(None, ["agent={}"]).agent.tools == ["calculator"]


def test_retried_request_gets_the_same_turn_not_a_new_one(toy):
    _, tokenizer, generator, _ = toy
    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=0)
    client = SessionClient(session)
    messages = [{"role": "user", "content": "1+1?"}]
    first = client.chat.completions.create(messages=messages, max_tokens=8)
    again = client.chat.completions.create(messages=messages, max_tokens=8)  # the client never saw `first`
    assert again.id == first.id and len(recorder.calls) == 1
    assert session.trajectory().turns == 1 and verify_trajectory(session.trajectory(), recorder.calls).ok


def test_proxy_serves_concurrent_sessions(proxy):
    from concurrent.futures import ThreadPoolExecutor

    url, _ = proxy

    def episode(k: int) -> tuple[list[list[int]], dict]:
        client = openai.OpenAI(base_url=f"{url}/sessions/conc-{k}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": f"{k}+{k}?"}]
        sampled = []
        for turn in range(2):
            r = client.chat.completions.create(model="toy", messages=messages, max_tokens=10, seed=k)
            sampled.append(r.choices[0].model_extra["token_ids"])
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        client.close()
        return sampled, httpx.get(f"{url}/sessions/conc-{k}/trajectory").json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(episode, range(8)))
    for k, (sampled, traj) in enumerate(results):
        seg = traj["segments"][0]
        assert traj["session_id"] == f"conc-{k}" and traj["turns"] == 2
        assert [seg["token_ids"][s["start"]: s["end"]] for s in seg["spans"]] == sampled
        assert f"{k}+{k}?" in "".join(m["content"] for m in traj["messages"])


def test_proxy_through_the_router_keeps_sessions_on_one_replica():
    """proxy -> router (X-Session-Id) -> two engine replicas: each session's turns stay on one replica."""
    from rollwise.router.config import RouterConfig
    from rollwise.router.app import create_app as create_router_app

    model, tokenizer = toy_tool_model(seed=0)

    def replica():
        engine = create_engine("reference", model, tokenizer, max_num_seqs=4, max_model_len=768,
                               eos_token_ids=[tokenizer.eos_token_id], seed=0, prefix_cache_tokens=4096)
        return engine, serve_in_thread(create_app(engine, tokenizer, "toy"))

    (engine_a, serve_a), (engine_b, serve_b) = replica(), replica()
    with serve_a as (url_a, _), serve_b as (url_b, _):
        config = RouterConfig(replicas=[url_a, url_b], policy="consistent_hash", health_interval_s=0.2)
        with serve_in_thread(create_router_app(config, tokenizer)) as (router_url, _):
            deadline = time.monotonic() + 20
            while httpx.get(f"{router_url}/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            upstream = HTTPGenerator(router_url)
            with serve_in_thread(create_proxy_app(upstream, tokenizer, model_name="toy")) as (url, _):
                for k in range(4):
                    messages = [{"role": "user", "content": f"{k}+1?"}]
                    for _ in range(3):
                        r = httpx.post(f"{url}/sessions/routed-{k}/v1/chat/completions",
                                       json={"messages": messages, "max_tokens": 6}, timeout=60).json()
                        messages += [r["choices"][0]["message"], {"role": "user", "content": "more"}]
                    traj = httpx.get(f"{url}/sessions/routed-{k}/trajectory").json()
                    assert traj["turns"] == 3 and not traj["splits"]
            # the router saw every session id (X-Session-Id) and pinned each to a replica
            assert httpx.get(f"{router_url}/health").json()["sessions"] == 4
            upstream.close()
    # later turns found their history in the replica's prefix cache
    assert engine_a.stats["cached_prompt_tokens"] + engine_b.stats["cached_prompt_tokens"] > 0
