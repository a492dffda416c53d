"""Test helper: a private one-node Ray cluster (the `ray_cluster` fixture) and a tiny `placement: ray`
run config (tests/run_configs.py's tiny run, on Ray). Imported by the Ray test modules; not a test
module itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rollwise.local_server import free_port
from run_configs import tiny_run_config

STEPS, PROMPTS, GROUP = 3, 4, 4


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster (`ray start --head --block`) in its own process group and temp dir; killed
    by that process group at the end (never `ray stop`, which would stop every cluster on the machine)."""
    temp = tempfile.mkdtemp(prefix="rwray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = free_port()
    ports = {flag: free_port() for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                             "--dashboard-agent-grpc-port", "--metrics-export-port",
                                             "--runtime-env-agent-port", "--node-manager-port",
                                             "--object-manager-port")}
    ray_bin = Path(sys.executable).parent / "ray"
    cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--head", "--block", f"--port={port}",
           "--num-cpus=2", "--object-store-memory=200000000", "--include-dashboard=false",
           f"--temp-dir={temp}", "--disable-usage-stats", *(f"{k}={v}" for k, v in ports.items())]
    # A private cluster for the test: no token auth (a ~/.ray/auth_token left by another local cluster
    # would otherwise switch one side to token mode); drivers here and in subprocesses inherit this.
    saved_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0", "ROLLWISE_CACHE": os.path.join(temp, "rollwise-cache")}
    log = open(os.path.join(temp, "ray-start.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in Path(log.name).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.3)
        yield address
    finally:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # the process group we started: ray start, GCS, raylet, workers
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        if saved_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth


def ray_config(tmp_path: Path, address: str, mode: str, steps: int = STEPS) -> Path:
    return tiny_run_config(
        tmp_path, "ray.yaml",
        rollout={"prompts_per_step": PROMPTS, "group_size": GROUP, "max_tokens": 32, "mode": mode},
        # kl_coef > 0: every step updates the weights (the tiny random model earns no reward signal),
        # so policy versions move and the re-sync after a restart is to a version > 0.
        train={"steps": steps, "lr": 1e-3, "kl_coef": 0.01},
        eval={"size": 2},
        tensorboard=False,
        placement="ray",
        ray={"address": address, "num_engines": 2, "engine_cpus": 0.5, "trainer_cpus": 0.5,
             "reward_workers": 1, "reward_cpus": 0.25, "max_restarts": 2},
    )
