"""Stopping a run from outside: `rollwise train` with two trainer rank processes, stopped mid-run the
way a batch scheduler (SIGTERM to the process) and a terminal (Ctrl-C: SIGINT to the process group)
stop it. Each must close its child processes, print one line saying how to continue (no tracebacks
from the ranks), exit with the shell's code for the signal, and the hint it prints must work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from rollwise.control.stop_signal import stop_on_sigterm
from run_configs import tiny_run_config
from test_cli import _rollwise_cmd

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _steps_logged(run_dir) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_stopped_run_closes_its_ranks_and_resumes(tmp_path, how):
    # Checkpoints every step for the stop that resumes; none before the end for the other, whose hint says so.
    config = tiny_run_config(tmp_path, trainer={"world_size": 2, "device": "cpu"}, train={"steps": 10_000, "lr": 1e-3},
                             checkpoint={"every": 1 if how == "sigterm" else 0}, tensorboard=False)
    log = (tmp_path / "out.log").open("w")
    # A session of its own: Ctrl-C reaches a terminal's whole foreground group, so the test signals the group.
    proc = subprocess.Popen(_rollwise_cmd() + ["train", "--config", str(config)], cwd=tmp_path, env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(run_dir) < 2:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the two trainer ranks (and what multiprocessing starts beside them)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = " ".join((tmp_path / "out.log").read_text().split())
    assert code == (143 if how == "sigterm" else 130), out
    assert ("stopped by SIGTERM: engines and child processes closed" if how == "sigterm" else "interrupted") in out
    if how == "ctrl_c":
        assert f"run {run_dir} stopped before its first checkpoint: checkpoint.every=N saves one every N steps (now 0" in out
        assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("step_*"))
    else:
        last = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
        assert f"run {run_dir} stopped; the same command with checkpoint.resume=auto continues from step_{last:06d}" in out
    assert "Traceback" not in out
    # multiprocessing's resource tracker leaves when its pipe from the (now ended) run closes: a moment later
    _, alive = psutil.wait_procs(children, timeout=10)
    assert [" ".join(c.cmdline()) for c in alive] == []

    if how == "ctrl_c":
        return  # the resume below is the same either way: once is enough
    # The hint works: the same command with checkpoint.resume=auto continues after the last checkpoint.
    resumed = subprocess.run(_rollwise_cmd() + ["train", "--config", str(config), "checkpoint.resume=auto",
                                                f"train.steps={last + 1}"],
                             cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {run_dir}" in " ".join(resumed.stdout.split())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 2))  # the steps after the checkpoint were dropped and done again once


def test_sigterm_handler_is_installed_only_where_nobody_chose_one():
    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an embedding program's choice
        assert stop_on_sigterm() is False
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert stop_on_sigterm() is True
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, before)
