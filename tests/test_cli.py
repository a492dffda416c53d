"""The `rollwise` command line as a user runs it: real subprocesses of the installed console script.

- `--help` lists the commands;
- `rollwise train` on a tiny random model and a JSONL task writes every artifact, well-formed;
- config mistakes exit with code 2 and a message naming the key / the allowed values, before any
  model is loaded or any run directory is created;
- `rollwise config` prints YAML that `rollwise config --config` accepts back unchanged.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollwise.config import ConfigError, load_config
from run_configs import tiny_run_config

METRIC_KEYS = [
    "reward_mean", "reward_std", "strict_accuracy", "response_len_mean", "entropy", "kl", "grad_norm",
    "time_generate_s", "time_reward_s", "time_train_s", "time_weight_sync_s", "rollout_tokens_per_s",
    "bubble_ratio", "staleness_mean", "staleness_max", "mismatch_abs_logp",
    "flops_generate", "flops_train", "mfu_step", "mfu_generate", "mfu_train", "idle_core_s",  # issue 23
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rollwise_cmd() -> list[str]:
    script = Path(sys.executable).parent / "rollwise"  # the console script installed next to this python
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]


def _run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "COLUMNS": "200",  # rich wraps at 80 columns without a terminal; keep messages on one line
        "NO_COLOR": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "ROLLWISE_CACHE": str(cwd / "rollwise-cache"),  # never touch the user's cache
    }
    # cwd: a default relative output_dir (runs/...) would land in tmp_path, never in the repo.
    return subprocess.run(_rollwise_cmd() + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _output(proc: subprocess.CompletedProcess) -> str:
    return " ".join((proc.stdout + "\n" + proc.stderr).split())  # whitespace-normalised, both streams


def test_help_lists_commands(tmp_path):
    proc = _run(["--help"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "bench", "config"):
        assert command in proc.stdout
    assert proc.stderr == ""


def test_train_tiny_run_writes_every_artifact(tmp_path):
    config = tiny_run_config(tmp_path)
    proc = _run(["train", "--config", str(config)], tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "run"
    assert run_dir.is_dir()

    # metrics.jsonl: one record per step, every metric present and a finite number.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        missing = [k for k in METRIC_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        for k in METRIC_KEYS:
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r[k])
        assert 0.0 <= r["bubble_ratio"] <= 1.0
        assert r["staleness_max"] == 0  # synchronous loop
        assert r["time_generate_s"] > 0 and r["rollout_tokens_per_s"] > 0
    # The policy version counts optimizer updates; a step whose groups all have equal rewards has
    # nothing to learn and leaves the weights (and the version) as they were.
    updates = [1 - int(r["update_skipped_no_signal"]) for r in records]
    assert [r["policy_version"] for r in records] == [sum(updates[: i + 1]) for i in range(len(updates))]

    # TensorBoard: an event file whose scalars hold the same steps.
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert "reward_mean" in acc.Tags()["scalars"]
    assert [s.step for s in acc.Scalars("reward_mean")] == [1, 2]

    # curve.png and timeline.png are real PNGs.
    assert (run_dir / "curve.png").read_bytes()[:8] == PNG_MAGIC
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC

    # summary.json: held-out accuracy before and after.
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_before", "eval_after"):
        assert summary[key] is not None, key
        assert 0.0 <= summary[key]["strict_accuracy"] <= 1.0
    assert summary["eval_before"]["step"] == 0 and summary["eval_after"]["step"] == 2
    assert summary["steps"] == 2 and summary["policy_version"] == records[-1]["policy_version"]
    # Model-FLOPs utilisation: for the run and per phase, against a measured peak; where the time went.
    assert 0.0 < summary["mfu"]["run"] < 1.0 and summary["peak"]["source"] == "measured"
    assert summary["flops"]["generate"] > 0 and summary["flops"]["eval"] > 0 and summary["idle_core_s"] >= 0
    assert (run_dir / summary["artifacts"]["time_split"]).read_bytes()[:8] == PNG_MAGIC
    # Memory: the run's processes sampled every second (rollwise.observe.memory), the machine never ran short.
    assert summary["peak_rss_run_gb"] > 0 and summary["min_available_memory_gb"] > 0
    assert summary["low_memory_warnings"] == 0 and "memory is nearly exhausted" not in proc.stdout
    assert "model-FLOPs utilisation (run)" in _output(proc)

    # evals.jsonl: the before and after evaluations, on eval.size problems.
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [(e["label"], e["step"]) for e in evals] == [("before", 0), ("after", 2)]
    assert all(e["n"] == 4 for e in evals)

    # checkpoints: every step (checkpoint.every=1); the last is complete and consistent.
    ckpt = run_dir / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == records[-1]["policy_version"]
    assert state["problems_consumed"] == 4
    assert state["tokenizer_fingerprint"] == summary["tokenizer_fingerprint"]
    for name in ("optimizer.pt", "rng.pt", "model/config.json", "model/model.safetensors"):
        assert (ckpt / name).is_file(), name
    assert (run_dir / "checkpoints" / "step_000001" / "state.json").is_file()
    assert not list((run_dir / "checkpoints").glob(".*")), "a temporary checkpoint folder was left behind"

    # The run's config.yaml loads back as the same config.
    assert load_config(run_dir / "config.yaml") == load_config(config)


def test_bad_key_fails_fast_with_suggestion(tmp_path):
    # A model that does not exist: if anything tried to load it, the error would be a different one.
    config = tiny_run_config(tmp_path, model=str(tmp_path / "no-such-model"))
    proc = _run(["train", "--config", str(config), "train.learning_rate=1e-5"], tmp_path, timeout=120)
    out = _output(proc)
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "train.learning_rate" in out
    assert "'lr'" in out  # the allowed keys of `train` are listed, lr among them
    assert not (tmp_path / "run").exists(), "a run directory was created for an invalid config"


def test_bad_value_names_allowed_values(tmp_path):
    config = tiny_run_config(tmp_path, model=str(tmp_path / "no-such-model"))
    proc = _run(["train", "--config", str(config), "train.advantage=median"], tmp_path, timeout=120)
    out = _output(proc)
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "train.advantage" in out and "median" in out
    assert "'mean_std'" in out and "'mean'" in out
    assert not (tmp_path / "run").exists()


def test_bad_key_message_says_did_you_mean_lr():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.learning_rate=1e-5"])
    assert "Did you mean 'lr'" in str(exc.value)


@pytest.mark.parametrize("source", ["default", "tiny_jsonl"])
def test_config_output_round_trips(tmp_path, source):
    args = ["config"]
    if source == "tiny_jsonl":
        args += ["--config", str(tiny_run_config(tmp_path)), "lr=3e-4", "rollout.group_size=6"]
    first = _run(args, tmp_path, timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    printed = yaml.safe_load(first.stdout)
    assert isinstance(printed, dict) and {"model", "task", "train", "rollout"} <= set(printed)
    if source == "tiny_jsonl":
        assert printed["train"]["lr"] == 3e-4 and printed["rollout"]["group_size"] == 6
        assert printed["task"]["kind"] == "jsonl"
        assert not {"name", "params", "train_size"} & set(printed["task"])  # jsonl rejects them
    else:
        assert printed["task"]["kind"] == "reasoning_gym"

    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(first.stdout)
    second = _run(["config", "--config", str(resolved)], tmp_path, timeout=60)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout == first.stdout  # a fixed point: nothing lost or changed in the round trip


def test_train_sorted_mode_accounts_for_every_sample(tmp_path):
    config = tiny_run_config(tmp_path, rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 8,
                                                 "mode": "sorted", "max_staleness": 1},
                              train={"steps": 3, "lr": 1e-3}, checkpoint={"every": 0}, tensorboard=False)
    proc = _run(["train", "--config", str(config)], tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "rollout=sorted (eta=1, correction=tis)" in _output(proc)
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness_max"] <= 1 for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    counts = summary["samples"]
    assert summary["rollout_mode"] == "sorted"
    assert counts["trained"] == 3 * 2 * 4  # steps x groups x samples, each trained once
    # What was still generating when the run ended is recorded as dropped, nothing else is left over.
    assert counts["queued"] == counts["running"] == counts["finished"] == counts["batched"] == 0
    assert 0.0 <= summary["bubble_ratio_run"] <= 1.0
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    # Groups in flight at the checkpoint are regenerated on resume: recorded, not lost.
    assert state["next_group"] == 3 * 2 + len(state["pending_groups"])
