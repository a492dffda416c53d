"""Environments as services (issue 40): classic verifiers environments in worker processes, their model calls
recorded token-exact by the agent proxy; whatever an environment does wrong costs that rollout only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rollwise.agent.generator import LocalGenerator
from rollwise.agent.session import SessionLimits
from rollwise.agent.toy import toy_tool_model
from rollwise.agent.verify import RecordingGenerator, verify_trajectory
from rollwise.engine.factory import create_engine
from rollwise.environments.kinds import verifiers_spec
from rollwise.environments.protocol import RolloutRequest, Sampling
from rollwise.environments.runner import MODEL_NAME, EnvRunner, RolloutJob
from rollwise.environments.workers import EnvService, WorkerSpec
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.tasks import TaskConfig
from tests.cli_run import run_rollwise
from tests.run_configs import tiny_run_config

pytest.importorskip("verifiers")
pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[1]
TEST_ENVS = ROOT / "tests" / "env_packages"
CALC_ENV = ROOT / "examples" / "verifiers_calc_env"


class SessionRecorder(RecordingGenerator):
    """RecordingGenerator keeping each session's engine calls apart (sessions run concurrently)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.by_session: dict[str, list] = {}

    def generate(self, prompt_ids, params, session_id=None):
        completion = self.inner.generate(prompt_ids, params, session_id)
        self.by_session.setdefault(session_id, []).append((list(prompt_ids), params, completion))
        return completion


@pytest.fixture(scope="module")
def toy(monkeypatch_module):
    monkeypatch_module.setenv("PYTHONPATH", f"{TEST_ENVS}:{CALC_ENV}")
    model, tokenizer = toy_tool_model(seed=0)
    engine = create_engine("reference", model, tokenizer, max_num_seqs=16, max_model_len=768,
                           eos_token_ids=[tokenizer.eos_token_id], seed=0,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    generator = SessionRecorder(LocalGenerator(engine))
    yield tokenizer, generator
    generator.inner.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def services(toy):
    """One worker per environment kind for the whole module (a worker start imports verifiers: seconds)."""
    made = {}
    for kind in ("single", "multi"):
        spec = verifiers_spec(TaskConfig(kind="verifiers", env="rw-test-envs", args={"kind": kind}))
        made[kind] = EnvService(spec, workers=1, rollout_timeout_s=3.0, ping_timeout_s=1.0)
        made[kind].start()
    yield made
    for service in made.values():
        service.close()


def _run(toy, service, rows, tag):
    tokenizer, generator = toy
    with EnvRunner(generator, tokenizer, service, limits=SessionLimits(max_turns=4, max_tokens_per_turn=16)) as r:
        return r.run([RolloutJob(f"{tag}-{i}-{row}", "g", "p", row, sampling=Sampling(max_tokens=16), seed=i)
                      for i, row in enumerate(rows)])


def tokenizer_text(toy, result) -> str:
    """The rollout's reply as decoded from the tokens the proxy recorded for its own session."""
    seg = result.trajectory.segments[0]
    span = seg.spans[-1]
    return toy[0].decode(seg.token_ids[span.start:span.end], skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_rollouts_carry_the_engines_exact_tokens(toy, services, kind):
    results = _run(toy, services[kind], [0, 1], kind)
    for r in results:
        assert r.reply.ok, r.reply.error
        assert r.reply.reward in (0.0, 1.0)
        assert r.trajectory is not None and r.trajectory.turns == (1 if kind == "single" else 3)
        calls = toy[1].by_session[r.job.rollout_id]
        report = verify_trajectory(r.trajectory, calls)  # the TITO checker: prefix, ids, logprobs, mask
        assert report.ok, report.violations
        assert sum(s.trained_tokens for s in r.samples) == sum(len(c.token_ids) for _, _, c in calls)
    if kind == "single":  # its rubric is a group reward function: the group was run and scored together
        assert services[kind].hello.group_rollouts
        assert all("shortest_in_group" in r.reply.metrics for r in results)
        # each reward reached its own rollout: 1.0 exactly where the rollout's own reply is the group's shortest
        lengths = [len(r.reply.final_text) for r in results]
        assert [r.reply.reward for r in results] == [1.0 if n == min(lengths) else 0.0 for n in lengths]
        texts = [r.samples[0].response_text for r in results]
        assert [tokenizer_text(toy, r).strip() for r in results] == [t.strip() for t in texts]


def test_the_classic_client_reads_the_engines_ids_from_the_proxy(toy, services):
    """verifiers' own chat client, as it asks for training (logprobs, return_token_ids), finds the exact ids."""
    import asyncio

    import verifiers as vf
    from openai import AsyncOpenAI

    tokenizer, generator = toy

    async def ask(url):
        native = AsyncOpenAI(base_url=f"{url}/sessions/direct-0/v1", api_key="unused", max_retries=0)
        try:
            return await vf.OpenAIChatCompletionsClient(native).get_response(
                prompt=[vf.types.UserMessage(role="user", content="1+1?")], model=MODEL_NAME,
                sampling_args={"max_tokens": 8, "logprobs": True, "extra_body": {"return_token_ids": True}})
        finally:
            await native.close()

    with EnvRunner(generator, tokenizer, services["multi"]) as runner:
        tokens = asyncio.run(ask(runner.url)).message.tokens
        seg = runner.store.sessions["direct-0"].trajectory().segments[0]
    span = seg.spans[0]
    assert tokens is not None  # found top-level prompt_token_ids, choices[0].token_ids, logprobs.content
    assert tokens.prompt_ids == seg.token_ids[:span.start]
    assert tokens.completion_ids == seg.token_ids[span.start:span.end]
    assert tokens.completion_logprobs == seg.logprobs[span.start:span.end]


def test_a_misbehaving_environment_costs_its_rollouts_only(toy, services):
    """Rows 2-5 misbehave in the worker (reward function raises / returns a string, garbage reward, a flood of
    output) beside well-behaved rows; then one crashes the worker, then one hangs it: each costs its rollout."""
    service = services["multi"]
    results = _run(toy, service, [0, 2, 3, 4, 5, 1], "bad")
    ok, raised, garbage, bad_state, flood, ok2 = (r.reply for r in results)
    assert ok.ok and ok2.ok and flood.ok, (ok, ok2, flood)
    assert not raised.ok and "reward function exploded" in raised.error
    assert not garbage.ok and "could not convert string to float" in garbage.error
    assert not bad_state.ok and bad_state.error
    assert all(r.samples for r in results)  # failed ones too: what the engine sampled, with the failure reward
    crashed = _run(toy, service, [6], "crash")[0]
    assert not crashed.reply.ok and "worker exited (exit code 3)" in crashed.reply.error
    after = _run(toy, service, [7, 0], "hang")  # the crashed worker was started again for these
    assert not after[0].reply.ok and "timeout" in after[0].reply.error
    assert service.restarts >= 1
    assert _run(toy, service, [1], "again")[0].reply.ok  # the hung worker was replaced


@pytest.mark.parametrize(("mode", "reason"), [("bad_reward", "garbage: reward"), ("huge", "over 1048576 bytes")])
def test_a_garbage_reply_fails_that_rollout(mode, reason):
    service = EnvService(WorkerSpec(argv=[sys.executable, str(TEST_ENVS / "raw_worker.py"), mode]),
                         rollout_timeout_s=10.0)
    service.start()
    try:
        reply = service.run(RolloutRequest(id="r1", index=0, base_url="http://127.0.0.1:9/v1", model="m"))
        assert not reply.ok and reason in reply.error, reply
        assert service.run(RolloutRequest(id="r2", index=0, base_url="http://127.0.0.1:9/v1", model="m")).error
    finally:
        service.close()


def test_an_environment_that_does_not_load_is_named():
    spec = verifiers_spec(TaskConfig(kind="verifiers", env="no-such-env-xyz"))
    with pytest.raises(Exception, match="no-such-env-xyz"):
        EnvService(spec).start()


def test_task_config_names_the_missing_env():
    with pytest.raises(ValueError, match="needs `env`"):
        TaskConfig.model_validate({"kind": "verifiers"})
    with pytest.raises(ValueError, match="`python` only applies to kind 'verifiers'"):
        TaskConfig.model_validate({"kind": "jsonl", "path": "x.jsonl", "python": "python3"})


def test_rollwise_train_runs_the_example_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(CALC_ENV))
    task = {"kind": "verifiers", "env": "verifiers-calc-env", "args": {"num_train": 8, "num_eval": 2, "demo": False},
            "eval_size": 2}
    cfg = tiny_run_config(tmp_path, task=task, rollout={"mode": "sync", "prompts_per_step": 2, "group_size": 2,
                                                        "max_tokens": 8}, eval={"size": 2}, checkpoint={"every": 0},
                          engine={"kind": "reference", "max_num_seqs": 8, "max_model_len": 1024})
    out = run_rollwise(["train", "--config", str(cfg)], tmp_path, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(x) for x in next((tmp_path / "run").rglob("metrics.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["env_failed_rollouts"] == 0.0 and "env_calculator_calls" in r for r in records)
