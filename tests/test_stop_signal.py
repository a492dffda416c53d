"""Stopping a run from outside: `rollwise train` with two trainer rank processes, stopped mid-run the
way a batch scheduler does (SIGTERM) after its ranks got a terminal's Ctrl-C (SIGINT to the whole group).
It must close its child processes, print one line saying how to continue (no tracebacks from the
ranks), exit with the shell's code for the signal, and the hint it prints must work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil

from rollwise.config import load_config
from rollwise.control.stop_signal import stop_on_sigterm
from rollwise.control.run_dir import how_to_continue
from run_configs import tiny_run_config
from test_cli import _rollwise_cmd

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _steps_logged(run_dir) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_stopped_run_closes_its_ranks_and_resumes(tmp_path):
    config = tiny_run_config(tmp_path, trainer={"world_size": 2, "device": "cpu"}, train={"steps": 10_000, "lr": 1e-3},
                             tensorboard=False)  # a checkpoint every step (the tiny config's checkpoint.every=1)
    log = (tmp_path / "out.log").open("w")
    proc = subprocess.Popen(_rollwise_cmd() + ["train", "--config", str(config)], cwd=tmp_path, env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "run"

    def wait_for_steps(n: int) -> None:
        deadline = time.monotonic() + 240
        while _steps_logged(run_dir) < n:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()
            assert time.monotonic() < deadline, f"not {n} training steps within 240 s"
            time.sleep(0.2)

    try:
        wait_for_steps(1)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the two trainer ranks (and what multiprocessing starts beside them)
        # Ctrl-C in a terminal reaches the whole foreground group: the ranks leave it to the controller, which
        # stops them in order (a rank that took it would die mid-collective, with a traceback). Here they get
        # it alone, and the run goes on.
        for child in children:
            child.send_signal(signal.SIGINT)
        wait_for_steps(_steps_logged(run_dir) + 1)
        proc.send_signal(signal.SIGTERM)  # the controller's stop: what Ctrl-C does too, with code 130
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = " ".join((tmp_path / "out.log").read_text().split())
    assert code == 143, out
    assert "stopped by SIGTERM: engines and child processes closed" in out
    last = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    assert f"run {run_dir} stopped; the same command with checkpoint.resume=auto continues from step_{last:06d}" in out
    assert "Traceback" not in out
    # multiprocessing's resource tracker leaves when its pipe from the (now ended) run closes: a moment later
    _, alive = psutil.wait_procs(children, timeout=10)
    assert [" ".join(c.cmdline()) for c in alive] == []

    # The hint works: the same command with checkpoint.resume=auto continues after the last checkpoint.
    resumed = subprocess.run(_rollwise_cmd() + ["train", "--config", str(config), "checkpoint.resume=auto",
                                                f"train.steps={last + 1}"],
                             cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {run_dir}" in " ".join(resumed.stdout.split())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 2))  # the steps after the checkpoint were dropped and done again once


def test_a_run_stopped_before_its_first_checkpoint_says_which_setting_writes_them(tmp_path):
    cfg = load_config(tiny_run_config(tmp_path, checkpoint={"every": 0}), [])
    assert how_to_continue(cfg, tmp_path / "run") == (
        f"run {tmp_path / 'run'} stopped before its first checkpoint: checkpoint.every=N saves one every N steps "
        "(now 0: only at the end)")
    cfg = load_config(tiny_run_config(tmp_path, checkpoint={"every": 8}), [])
    assert "(now 8: the first after step 8)" in how_to_continue(cfg, tmp_path / "run")


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
