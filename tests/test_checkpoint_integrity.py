"""A run resumes only from a whole checkpoint, and its logs hold every step, evaluation and sample once.

Every checkpoint carries manifest.json (each file's size and xxh3-64 checksum), verified before a run
resumes from it. `checkpoint.resume=auto` skips a damaged checkpoint with a warning naming the file and
resumes from the one before, exactly as a straight run; a damaged checkpoint named explicitly is a
one-line error naming the file, with nothing written. Damage is flipped bytes, truncated or garbled files
(caught by the manifest), and the same files re-sealed with a matching manifest (caught when parsed).
A resumed run cuts its logs back to the checkpoint; one stopped before its first checkpoint starts over.

The runs use test_resume's warmed-up tiny model, so resumed weights are compared on a run that learns.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from rollwise.config import RunError, load_config
from rollwise.control.train_loop import train
from rollwise.train.checkpoint import write_checkpoint
from rollwise.train.checkpoint_manifest import CheckpointError, verify_checkpoint, write_manifest
from test_cli import _rollwise_cmd
from test_resume import _write_config, setup  # noqa: F401  (setup: test_resume's warmed-up tiny model fixture)

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL_FILE = "model/model.safetensors"
STEPS = 3


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=400, force_terminal=False), buf


def _text(buf: io.StringIO) -> str:
    return " ".join(buf.getvalue().split())


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):  # noqa: F811
    """A finished 3-step run with a checkpoint after every step: the reference, copied by each test."""
    task_path, model_dir = setup
    root = tmp_path_factory.mktemp("straight")
    run_dir = root / "run"
    train(load_config(_write_config(root / "c.yaml", task_path, str(model_dir), run_dir, steps=STEPS, every=1)),
          _console()[0])
    return run_dir


@pytest.fixture
def run(setup, straight, tmp_path):  # noqa: F811
    """(run directory, config): a copy of the straight run, to damage and resume."""
    task_path, model_dir = setup
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    return run_dir, _write_config(tmp_path / "c.yaml", task_path, str(model_dir), run_dir, steps=STEPS, every=1)


# ---------------------------------------------------------------- damage


def _flip(path: Path) -> None:
    """64 bytes inverted in the middle of the file (tensor data: the file still parses)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_header(path: Path) -> None:
    """safetensors' 8-byte header length: nonsense, the size unchanged."""
    path.write_bytes(b"\xff" * 8 + path.read_bytes()[8:])


def _malformed_json(path: Path) -> None:
    path.write_text(path.read_text()[:20])


def _negative_version(path: Path) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), "policy_version": -1}))


DAMAGE = {
    "safetensors-header": (MODEL_FILE, _garble_header),
    "safetensors-truncated": (MODEL_FILE, _truncate),
    "optimizer-truncated": ("optimizer.pt", _truncate),
    "rng-truncated": ("rng.pt", _truncate),
    "state-malformed": ("state.json", _malformed_json),
    "state-negative-version": ("state.json", _negative_version),
}


def _damage(ckpt: Path, kind: str, sealed: bool) -> str:
    """Damage one file of `ckpt`; `sealed`: then write a manifest that matches the damaged files (as a
    writer that wrote them wrong would), so only parsing the file can find it. Returns the file's name."""
    file, damage = DAMAGE[kind]
    damage(ckpt / file)
    if sealed:
        write_manifest(ckpt)
    return file


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- what a run's logs and checkpoints hold


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_logs_once(run_dir: Path, straight: Path) -> None:
    """Every step, evaluation and sample once, as in the straight run."""
    metrics, reference = _records(run_dir / "metrics.jsonl"), _records(straight / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    for got, want in zip(metrics, reference):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), (got["step"], key)
        assert got["policy_version"] == want["policy_version"] and got["trained_tokens"] == want["trained_tokens"]
    evals = [(e["step"], e["label"]) for e in _records(run_dir / "evals.jsonl")]
    assert evals == [(0, "before"), (STEPS, "after")]
    for name in ("samples.jsonl", "eval_samples.jsonl"):
        got = [(r["step"], r["response"]) for r in _records(run_dir / name)]
        assert got == [(r["step"], r["response"]) for r in _records(straight / name)], name


def _assert_checkpoint_as_straight(run_dir: Path, straight: Path, step: int) -> None:
    ckpt, reference = run_dir / "checkpoints" / f"step_{step:06d}", straight / "checkpoints" / f"step_{step:06d}"
    verify_checkpoint(ckpt)
    got, want = load_file(ckpt / MODEL_FILE), load_file(reference / MODEL_FILE)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    opt, opt_ref = (torch.load(c / "optimizer.pt", weights_only=False) for c in (ckpt, reference))
    assert opt["scheduler"] == opt_ref["scheduler"]
    for pid, state in opt_ref["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(opt["optimizer"]["state"][pid][key], value, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("file, kind, sealed", [
    (MODEL_FILE, "flipped", False),
    ("optimizer.pt", "flipped", False),
    ("rng.pt", "rng-truncated", True),
    ("state.json", "state-negative-version", True),
])
def test_resume_auto_skips_a_damaged_checkpoint_for_the_one_before(run, straight, file, kind, sealed):
    run_dir, cfg = run
    damaged = run_dir / "checkpoints" / "step_000003"
    if kind == "flipped":
        _flip(damaged / file)
    else:
        assert _damage(damaged, kind, sealed) == file
    console, out = _console()
    train(load_config(cfg, ["checkpoint.resume=auto"]), console)
    text = _text(out)
    assert f"warning: checkpoint step_000003 is damaged and is skipped: {file} " in text
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} at step 2" in text
    # Step 3 was trained again from step 2's checkpoint, exactly as the straight run did it, and logged once.
    _assert_checkpoint_as_straight(run_dir, straight, 3)
    _assert_logs_once(run_dir, straight)


@pytest.mark.parametrize("sealed", [False, True], ids=["manifest", "parse"])
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_named_damaged_checkpoint_is_a_one_line_error_and_nothing_is_written(run, kind, sealed):
    run_dir, cfg = run
    ckpt = run_dir / "checkpoints" / "step_000003"
    file = _damage(ckpt, kind, sealed)
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError) as caught:
        train(load_config(cfg, [f"checkpoint.resume={ckpt}"]), _console()[0])
    message = str(caught.value)
    assert isinstance(caught.value, RunError) and "\n" not in message
    assert f"checkpoint {ckpt} is damaged: {file} " in message and "checkpoint.resume=auto" in message
    if kind == "state-negative-version" and sealed:  # else the manifest finds it first
        assert "policy_version" in message
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("change", ["manifest-removed", "file-added", "file-removed"])
def test_a_checkpoint_that_is_not_what_its_manifest_lists_is_refused(run, change):
    run_dir, cfg = run
    ckpt = run_dir / "checkpoints" / "step_000003"
    file = {"manifest-removed": "manifest.json", "file-added": "model/extra.safetensors", "file-removed": "rng.pt"}[change]
    if change == "file-added":
        shutil.copy(ckpt / MODEL_FILE, ckpt / file)  # would be loaded with the model's own shard
    else:
        (ckpt / file).unlink()
    before = _snapshot(run_dir)
    with pytest.raises(CheckpointError, match=f"is damaged: {file} "):
        train(load_config(cfg, [f"checkpoint.resume={ckpt}"]), _console()[0])
    assert _snapshot(run_dir) == before


def test_no_whole_checkpoint_left_is_said_and_nothing_is_written(run):
    run_dir, cfg = run
    for step in range(1, STEPS + 1):
        _flip(run_dir / "checkpoints" / f"step_{step:06d}" / MODEL_FILE)
    before = _snapshot(run_dir)
    console, out = _console()
    with pytest.raises(RunError) as caught:
        train(load_config(cfg, ["checkpoint.resume=auto"]), console)
    message = str(caught.value)
    assert "\n" not in message and "no whole checkpoint left" in message
    assert all(f"step_{s:06d}: {MODEL_FILE}" in message for s in range(1, STEPS + 1))
    assert _text(out).count("is damaged and is skipped") == STEPS
    assert _snapshot(run_dir) == before


def test_a_negative_policy_version_is_never_written(tmp_path):
    def write(tmp: Path) -> None:
        (tmp / "model.bin").write_bytes(b"w")

    with pytest.raises(ValueError, match="policy_version"):
        write_checkpoint(tmp_path, 1, -1, {}, keep_last=2, write_trainer=write)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_a_run_stopped_before_its_first_checkpoint_starts_over_with_its_logs_cut(run, straight):
    """Killed during its first save: logs of the steps it ran, the hidden partial folder, no checkpoint."""
    run_dir, cfg = run
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step_000001").rename(checkpoints / ".step_000001.k1ll3d")
    for step in range(2, STEPS + 1):
        shutil.rmtree(checkpoints / f"step_{step:06d}")
    console, out = _console()
    train(load_config(cfg, ["checkpoint.resume=auto"]), console)
    assert "no checkpoint in" in _text(out) and "starting it again from step 0" in _text(out)
    _assert_logs_once(run_dir, straight)  # the "before" evaluation and step 1 once
    _assert_checkpoint_as_straight(run_dir, straight, STEPS)
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{s:06d}" for s in range(1, STEPS + 1)]


def test_a_run_stopped_after_its_last_checkpoint_evaluates_once(run, straight):
    """Killed after the last checkpoint (during or after the final evaluation): resumed, it evaluates again
    and the log holds that evaluation once."""
    run_dir, cfg = run
    console, out = _console()
    train(load_config(cfg, ["checkpoint.resume=auto"]), console)
    assert f"at step {STEPS}" in _text(out)
    _assert_logs_once(run_dir, straight)


def test_the_cli_says_which_file_is_damaged_in_one_line(run):
    run_dir, cfg = run
    ckpt = run_dir / "checkpoints" / "step_000003"
    _truncate(ckpt / "optimizer.pt")
    env = {**os.environ, "COLUMNS": "2000", "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(_rollwise_cmd() + ["train", "--config", str(cfg), f"checkpoint.resume={ckpt}"],
                          cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=120)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 1, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert out.startswith(f"error: checkpoint {ckpt} is damaged: optimizer.pt is ") and "truncated" in out
