"""OpenEnv environments (`task.kind: openenv`, issue 40): a third-party-style environment package served over
OpenEnv's HTTP/WebSocket API, driven by rollwise's OpenEnv worker with the policy's text from a real engine.

- examples/openenv_arith (no rollwise import) trained two steps by `rollwise train` with its config;
- every multi-turn episode's trajectory is token-exact (TITO: the engine's sampled ids, logprobs and versions,
  loss mask on exactly the sampled spans, the trainer's recomputed logprobs equal);
- a server that crashes, hangs or answers garbage costs that rollout (failed, with the reason), and the next
  rollout on a fresh worker and server succeeds;
- config mistakes are refused naming the field.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rollwise.agent.generator import LocalGenerator
from rollwise.agent.verify import RecordingGenerator, verify_trajectory
from rollwise.config import ConfigError
from rollwise.engine.factory import create_engine
from rollwise.environments.kinds import worker_spec
from rollwise.environments.protocol import Sampling
from rollwise.environments.runner import EnvRunner, RolloutJob
from rollwise.environments.workers import EnvService
from rollwise.model.loading import load_model
from rollwise.tasks import TaskConfig

from cli_run import run_rollwise

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openenv_arith"
MODEL = "tiny:0"

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(120)]


def arith_task(**args) -> TaskConfig:
    return TaskConfig.model_validate({"kind": "openenv", "start": {"app": "arith_env.server:app", "cwd": str(EXAMPLE)},
                                      "args": {"max_turns": 3, "observation_field": "prompt", **args}})


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = load_model(MODEL)
    generator = LocalGenerator(create_engine("reference", model, tokenizer, max_num_seqs=8, max_model_len=1024,
                                             eos_token_ids=[tokenizer.eos_token_id], seed=0))
    yield model, tokenizer, generator
    generator.close()


def test_multi_turn_episodes_are_token_exact(engine):
    model, tokenizer, generator = engine
    recorder = RecordingGenerator(generator)
    service = EnvService(worker_spec(arith_task(system_prompt="Answer in <answer></answer> tags.")),
                         rollout_timeout_s=60)
    service.start()
    try:
        with EnvRunner(recorder, tokenizer, service) as runner:
            for index in range(2):  # one at a time: each episode's engine calls are its own
                recorder.calls.clear()
                [result] = runner.run([RolloutJob(f"tito-{index}", "g", f"p{index}", index, "train",
                                                  Sampling(temperature=1.0, max_tokens=12), seed=index)])
                assert result.reply.ok, result.reply.error
                # A random model never answers right: three attempts, each one engine call, reward 0.
                assert result.reply.turns == 3 == len(recorder.calls) and result.reply.reward == 0.0
                report = verify_trajectory(result.trajectory, recorder.calls, model=model)
                assert report.ok, report.violations
                assert report.masked_tokens == sum(len(c.token_ids) for _, _, c in recorder.calls)
                [sample] = result.samples  # one segment: the episode's turns in one sequence, loss on sampled spans
                seg = result.trajectory.segments[0]
                assert [*sample.prompt_ids, *sample.response_ids] == seg.token_ids
                assert sum(sample.loss_mask) == report.masked_tokens
    finally:
        service.close()


def test_more_episodes_at_once_than_a_connection_pool(engine):
    """Each episode holds a WebSocket while it calls the policy: 110 at once (over aiohttp's default pool of 100
    connections, which deadlocked) all finish."""
    _, tokenizer, generator = engine
    service = EnvService(worker_spec(arith_task(max_turns=2)), rollout_timeout_s=60)
    service.start()
    try:
        with EnvRunner(generator, tokenizer, service, concurrency=110) as runner:
            results = runner.run([RolloutJob(f"many-{i}", "g", "p", i, "train", Sampling(max_tokens=2), seed=i)
                                  for i in range(110)])
    finally:
        service.close()
    assert [r.reply.error for r in results if not r.reply.ok] == []
    assert all(r.reply.turns == 2 for r in results)


CHAOS_SERVER = textwrap.dedent('''
    """An OpenEnv server that misbehaves by episode seed: 0 fine, 1 crashes, 2 hangs, 3 garbage, 4 NaN reward."""
    import asyncio, json, os, sys
    import uvicorn
    from fastapi import FastAPI, WebSocket

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "healthy"}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket):
        await websocket.accept()
        seed = json.loads(await websocket.receive_text())["data"]["seed"]
        await websocket.send_text(json.dumps({"type": "observation", "data": {
            "observation": {"prompt": "say anything"}, "reward": None, "done": False}}))
        await websocket.receive_text()  # the step
        if seed == 1:
            os._exit(9)
        if seed == 2:
            await asyncio.sleep(3600)
        if seed == 3:
            await websocket.send_text("<html>502 Bad Gateway</html>")
        reward = float("nan") if seed == 4 else 1.0
        await websocket.send_text(json.dumps({"type": "observation", "data": {
            "observation": {"prompt": "ok"}, "reward": reward, "done": True}}, allow_nan=True))
        await websocket.receive_text()

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def test_crash_hang_and_garbage_cost_that_rollout_only(engine, tmp_path):
    _, tokenizer, generator = engine
    script = tmp_path / "chaos_server.py"
    script.write_text(CHAOS_SERVER)
    cfg = TaskConfig.model_validate({"kind": "openenv", "start": {"command": [sys.executable, str(script), "{port}"]},
                                     "args": {"step_timeout_s": 1.0}})
    service = EnvService(worker_spec(cfg), rollout_timeout_s=30)
    service.start()
    try:
        with EnvRunner(generator, tokenizer, service) as runner:
            def run(seed: int):
                job = RolloutJob(f"chaos-{seed}-{len(outcomes)}", "g", "p", seed, "train",
                                 Sampling(max_tokens=4), seed=0)
                return runner.run([job])[0].reply

            outcomes = []
            for seed in (0, 1, 0, 2, 0, 3, 0, 4, 0):
                outcomes.append((seed, run(seed)))
    finally:
        service.close()
    errors = {seed: reply.error for seed, reply in outcomes if not reply.ok}
    assert all(reply.ok and reply.reward == 1.0 for seed, reply in outcomes if seed == 0), outcomes
    assert set(errors) == {1, 2, 3, 4}
    assert "closed the session on step" in errors[1]  # the server died; its worker started it again
    assert "timeout" in errors[2] and "step" in errors[2]
    assert "not JSON" in errors[3] and "502" in errors[3]
    assert "reward is not a finite number" in errors[4]
    assert service.restarts == 0  # the worker itself never failed


def test_config_mistakes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="exactly one of `url`"):
        TaskConfig.model_validate({"kind": "openenv"})
    with pytest.raises(ValueError, match="args.max_turn: Extra inputs"):
        TaskConfig.model_validate({"kind": "openenv", "url": "http://127.0.0.1:1", "args": {"max_turn": 2}})
    with pytest.raises(ValueError, match=r"\{port\}"):
        TaskConfig.model_validate({"kind": "openenv", "start": {"command": ["serve"]}})
    with pytest.raises(ValueError, match="`start` only applies to kind 'openenv'"):
        TaskConfig.model_validate({"kind": "jsonl", "path": "x.jsonl", "start": {"app": "a.b:app"}})
    missing = TaskConfig.model_validate({"kind": "openenv", "start": {"app": "a.b:app", "python": "/no/such/python"}})
    with pytest.raises(ConfigError, match="task.start.python=/no/such/python"):
        worker_spec(missing)
    unreachable = EnvService(worker_spec(TaskConfig.model_validate(
        {"kind": "openenv", "url": "http://127.0.0.1:9", "args": {"start_timeout_s": 0.5}})), start_timeout_s=30)
    with pytest.raises(Exception, match="not healthy within 0.5s"):
        unreachable.start()


def test_example_trains_two_steps_with_its_config(tmp_path):
    out = tmp_path / "run"
    result = run_rollwise(["train", "--config", str(EXAMPLE / "train.yaml"), f"model={MODEL}",
                           f"task.start.cwd={EXAMPLE}", "train.steps=2", "rollout.prompts_per_step=2",
                           "rollout.group_size=2", "rollout.max_tokens=8", "eval.size=2", "eval.every=0",
                           "checkpoint.every=0", "train.micro_batch_size=4", "engine.max_num_seqs=8", "engine.kind=reference",
                           f"output_dir={out}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["env_failed_rollouts"] == 0.0 and s["env_turns_mean"] == 3.0 and s["env_done"] == 1.0
