"""Scratch directories named after their process: a killed process's are swept by the next one, a live
process's and anything of another shape are left alone (rollwise.scratch)."""

from __future__ import annotations

import os
import subprocess
import sys

from rollwise.engine.vllm_backend import VLLM_DIR_PREFIX
from rollwise.scratch import owner_pid, scratch_dir, sweep_stale


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_process_scratch_is_swept_by_the_next(tmp_path):
    script = ("import os, sys\nfrom rollwise.scratch import scratch_dir\n"
              f"d = scratch_dir({VLLM_DIR_PREFIX!r}, sys.argv[1])\n(d / 'model.safetensors').write_bytes(b'x' * 4096)\n"
              "print(d, flush=True)\nos.kill(os.getpid(), 9)\n")
    killed = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    left = tmp_path / os.path.basename(killed.stdout.strip())
    assert killed.returncode == -9 and (left / "model.safetensors").exists()  # SIGKILL: nothing ran at exit
    mine = scratch_dir(VLLM_DIR_PREFIX, tmp_path)  # the next engine sweeps before it makes its own
    assert not left.exists()
    assert mine.is_dir() and owner_pid(mine.name, VLLM_DIR_PREFIX) == os.getpid()


def test_sweep_keeps_live_owners_and_other_names(tmp_path):
    prefix = "rollwise-test-"
    dead = tmp_path / f"{prefix}{_dead_pid()}-abc"
    live = tmp_path / f"{prefix}{os.getpid()}-abc"
    odd = tmp_path / f"{prefix}notapid-abc"
    other = tmp_path / f"other-{_dead_pid()}-abc"
    for d in (dead, live, odd, other):
        d.mkdir()
    file_like = tmp_path / f"{prefix}{_dead_pid()}-file"
    file_like.write_text("a file, not a directory this code made")
    assert sweep_stale(prefix, tmp_path) == [dead]
    assert not dead.exists() and live.exists() and odd.exists() and other.exists() and file_like.exists()


def test_a_removal_that_fails_is_not_reported_as_swept(tmp_path):
    prefix = "rollwise-test-"
    dead = tmp_path / f"{prefix}{_dead_pid()}-abc"
    dead.mkdir()
    assert sweep_stale(prefix, tmp_path, remove=lambda path: [f"{path}: busy"]) == []
    assert dead.exists()
