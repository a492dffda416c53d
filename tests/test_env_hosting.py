"""Where environment workers run (issue 40 item 1): under their own virtual environment's interpreter, and as Ray
actors under `placement: ray`, with one config. The environment is the third-party-style package of
tests/env_packages (multi-turn, never imports rollwise); its venv holds an `openai` whose major version differs
from rollwise's, and the environment reports the version it imported (metric env_openai_major).

- local: a training step; the worker ran under the venv (openai 2), a process of this one.
- ray: the same config with `placement=ray` trains two steps on a one-node cluster; every worker was an actor
  (its pid, not this process's, owns the environment's process), and every trajectory holds exactly the tokens,
  logprobs and policy versions the engine actors delivered (TITO).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import openai
import pytest

from run_configs import tiny_run_config

pytest.importorskip("verifiers")

from ray_local import ray_cluster  # noqa: E402,F401 (the fixture; imports no Ray)

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
TEST_ENVS = ROOT / "tests" / "env_packages"
OTHER_OPENAI = "2.54.0"  # rollwise's own is 3.x (pyproject); verifiers 0.3.1 accepts >= 2.9


@pytest.fixture(scope="module")
def env_python(request) -> str:
    """A virtual environment with openai OTHER_OPENAI, built once and kept in pytest's cache (~5 s to build).
    It sees rollwise's site-packages through a plain path line (verifiers, datasets, httpx...), after its own, so
    its `openai` wins; rollwise itself is not importable there (its editable install's .pth is not processed)."""
    venv = Path(request.config.cache.mkdir(f"rollwise-env-venv-openai-{OTHER_OPENAI}")) / "venv"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():  # built here, or again after a build that did not finish
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                              f"openai=={OTHER_OPENAI}"], capture_output=True, text=True)
        if pip.returncode != 0:
            pytest.skip(f"cannot install openai=={OTHER_OPENAI} into a test venv (no package index?): "
                        f"{pip.stderr[-500:]}")
        Path(site, "rollwise-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        (venv / "ready").touch()
    probe = subprocess.run([str(python), "-c", "import openai; print(openai.__version__)\n"
                            "try:\n import rollwise; print('rollwise')\nexcept ImportError: print('-')"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}, cwd=venv)
    assert probe.stdout.split() == [OTHER_OPENAI, "-"], probe.stdout + probe.stderr
    return str(python)


def env_config(tmp_path: Path, python: str, steps: int) -> Path:
    task = {"kind": "verifiers", "env": "rw-test-envs", "args": {"kind": "clean", "max_turns": 2}, "python": python,
            "workers": 1, "rollout_timeout_s": 120, "eval_size": 2}
    return tiny_run_config(tmp_path, task=task, rollout={"mode": "sync", "prompts_per_step": 2, "group_size": 2,
                                                         "max_tokens": 8},
                           train={"steps": steps, "lr": 1e-3, "kl_coef": 0.01}, eval={"size": 2},
                           checkpoint={"every": 0}, tensorboard=False,
                           engine={"kind": "reference", "max_num_seqs": 8, "max_model_len": 1024})


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_environment_in_its_own_venv_with_another_openai_trains(env_python, tmp_path, monkeypatch):
    assert int(openai.__version__.split(".")[0]) != int(OTHER_OPENAI.split(".")[0])  # a real conflict
    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    monkeypatch.setenv("PYTHONPATH", str(TEST_ENVS))  # where the environment's package is (the worker inherits it)
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    train(load_config(env_config(tmp_path, env_python, steps=1)))
    print(f"train (own venv, 1 step): {time.monotonic() - t0:.1f}s")
    [record] = records_of(tmp_path / "run")
    assert record["env_failed_rollouts"] == 0.0 and record["env_turns_mean"] == 2.0
    assert record["env_openai_major"] == float(OTHER_OPENAI.split(".")[0])  # imported in the venv, not rollwise's
    assert len(record["env_worker_pids"]) == 1
    assert record["env_worker_host_pids"] == [os.getpid()] and record["env_worker_nodes"] == ["local"]


def test_a_worker_actor_that_crashes_hangs_or_dies_is_replaced(ray_cluster):
    """The service's containment, unchanged, over actor-hosted workers: a crash and a hang cost their rollout, a
    killed actor costs nothing; each time the next rollout runs on a fresh actor and its fresh process."""
    ray = pytest.importorskip("ray", reason="placement: ray needs Ray: pip install -e '.[ray]'")
    from rollwise.control.ray.env_workers import RayEnvWorker
    from rollwise.environments.protocol import RolloutRequest
    from rollwise.environments.workers import EnvService, WorkerSpec

    ray.init(address=ray_cluster, logging_level="WARNING")
    options = {"num_cpus": 0.1, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 64}
    spec = WorkerSpec(argv=[sys.executable, str(TEST_ENVS / "raw_worker.py"), "by_index"], label="raw")
    service = EnvService(spec, workers=1, rollout_timeout_s=3.0, ping_timeout_s=1.0,
                         host=lambda spec, index: RayEnvWorker(spec, index, options))

    def rollout(index: int):
        return service.run(RolloutRequest(id=f"r{time.monotonic_ns()}", index=index, base_url="http://127.0.0.1:9/v1",
                                          model="m"))

    def ok_on_a_new_actor(seen: set[int]) -> None:
        reply = rollout(0)
        [place] = service.places()
        assert reply.ok and reply.metrics["pid"] == place.worker_pid, reply
        assert place.host_pid != os.getpid() and place.host_pid not in seen  # a fresh actor process hosts it
        seen.add(place.host_pid)

    try:
        service.start()
        seen: set[int] = set()
        ok_on_a_new_actor(seen)
        crashed = rollout(1)
        assert not crashed.ok and "exited" in crashed.error and "exit code 3" in crashed.error, crashed
        ok_on_a_new_actor(seen)
        hung = rollout(2)
        assert not hung.ok and "timeout" in hung.error, hung
        deadline = time.monotonic() + 60
        while service.restarts < 2 and time.monotonic() < deadline:  # the hung worker is replaced aside
            time.sleep(0.2)
        ok_on_a_new_actor(seen)
        actor = service.workers[0].actor
        ray.kill(actor, no_restart=True)  # the actor (its node) is lost...
        with pytest.raises(ray.exceptions.RayActorError):  # ... and Ray says so (ray.kill lands asynchronously)
            while time.monotonic() < deadline + 60:
                ray.get(actor.__ray_ready__.remote(), timeout=30)
                time.sleep(0.1)
        ok_on_a_new_actor(seen)
        assert service.restarts == 3
    finally:
        service.close()
        ray.shutdown()


def test_ray_placement_runs_the_same_config_with_worker_actors(env_python, ray_cluster, tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="placement: ray needs Ray: pip install -e '.[ray]'")
    from rollwise.config import load_config
    from rollwise.control.ray import placement as ray_placement
    from rollwise.control.train_loop import train
    from rollwise.environments.runner import EnvRunner

    monkeypatch.setenv("PYTHONPATH", str(TEST_ENVS))  # forwarded to the worker actors' environments
    cfg = load_config(env_config(tmp_path, env_python, steps=2),
                      ["placement=ray", f"ray.address={ray_cluster}", "ray.engine_cpus=0.5", "ray.trainer_cpus=0.5",
                       "ray.reward_cpus=0.2", "ray.env_cpus=0.2", "ray.max_restarts=0"])
    fleets = []

    def hook(fleet):
        fleet.deliveries = []  # every completion the engine actors delivered
        fleets.append(fleet)

    results = []
    run = EnvRunner.run

    def spy(self, jobs):  # what the environment service returned, trajectories included (behaviour unchanged)
        out = run(self, jobs)
        results.extend(out)
        return out

    monkeypatch.setattr(ray_placement, "FLEET_HOOKS", [hook])
    monkeypatch.setattr(EnvRunner, "run", spy)
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    train(cfg)
    print(f"train (placement ray, 2 steps): {time.monotonic() - t0:.1f}s")

    records = records_of(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and [r["policy_version"] for r in records] == [1, 2]
    for r in records:
        assert r["env_failed_rollouts"] == 0.0 and r["env_openai_major"] == 2.0
        # The worker is hosted by an actor process (not this driver), each owning its environment's process.
        assert len(r["env_worker_host_pids"]) == 1 and os.getpid() not in r["env_worker_host_pids"]
        assert len(r["env_worker_pids"]) == 1 and "local" not in r["env_worker_nodes"]
        assert not set(r["env_worker_pids"]) & set(r["env_worker_host_pids"])

    # TITO: every sampled span of every trajectory is exactly what an engine actor delivered for that request.
    delivered = {c.request_id: c for _, _, c in fleets[0].deliveries}
    train_results = [r for r in results if r.job.split == "train"]
    assert len(train_results) == 2 * 2 * 2
    spans = 0
    for r in train_results:
        assert r.reply.ok and r.trajectory is not None and r.trajectory.turns == 2, r.reply.error
        for seg in r.trajectory.segments:
            seg.check()
            for span in seg.spans:
                c = delivered[span.request_id]
                assert seg.token_ids[span.start:span.end] == list(c.token_ids)
                assert seg.logprobs[span.start:span.end] == list(c.logprobs)
                assert seg.versions[span.start:span.end] == list(c.versions)
                spans += 1
        assert sum(s.trained_tokens for s in r.samples) == sum(
            len(delivered[sp.request_id].token_ids) for seg in r.trajectory.segments for sp in seg.spans)
    assert spans == 2 * len(train_results)
