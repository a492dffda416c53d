"""Experiment tracking (issue 41 item 6): one short `rollwise train` run on a tiny random model with
`logging.backends: [tensorboard, wandb, mlflow]`, each read back with its own reader — TensorBoard's
EventAccumulator, the wandb offline run's .wandb record log, MLflow's client on the file store — holding
the same metric names and values at every step as metrics.jsonl and evals.jsonl, the run's config and
versions, and each step's table of sampled completions. wandb runs with no credentials (a fresh HOME) and
so offline; its server address points at a closed local port, so no call leaves the machine.

A backend whose package is missing, an unknown backend and a repeated one are refused when the config
loads, naming the field (and the pip command), before anything is written.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollwise.config import ConfigError, load_config
from run_configs import tiny_run_config

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

BACKENDS = "logging.backends=[tensorboard,wandb,mlflow]"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_")) and k != "NETRC"}
    return {**env, "HOME": str(tmp_path / "home"),  # no ~/.netrc: not logged in to wandb
            "WANDB_BASE_URL": "http://127.0.0.1:9",  # were anything to reach for the network, it finds a closed port
            "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "ROLLWISE_CACHE": str(tmp_path / "rollwise-cache")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trackers")
    config = tiny_run_config(tmp, checkpoint={"every": 0}, eval={"size": 2},
                             train={"steps": 2, "lr": 1e-3})
    proc = subprocess.run([sys.executable, "-m", "rollwise.cli", "train", "--config", str(config), BACKENDS],
                          cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return tmp / "run"


# ---------------------------------------------------------------- what the run logged, read independently


def _expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's and evals.jsonl's finite numbers, by tracker name (dots to slashes; evals as eval/)."""
    series: dict[str, dict[int, float]] = {}
    rows = [(json.loads(line), "") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows += [(json.loads(line), "eval/") for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    for record, prefix in rows:
        for key, value in record.items():
            if key != "step" and type(value) in (int, float) and math.isfinite(value):
                series.setdefault((prefix + key).replace(".", "/"), {})[record["step"]] = float(value)
    return series


def _tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    texts = {tag: {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
             for tag in acc.Tags()["tensors"]}
    return scalars, texts


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file: wandb's LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB
    blocks of chunks, each with a 7-byte header: CRC, length, kind FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb(run_dir: Path):
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one offline wandb run expected under {run_dir / 'wandb'}: {runs}"
    history: dict[str, dict[int, float]] = {}
    tables: dict[int, str] = {}
    config: dict[str, object] = {}
    for record in _wandb_records(next(runs[0].glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = row["_step"]
            for key, value in row.items():
                if key == "completions/path":
                    tables[step] = value
                elif not key.startswith(("_", "completions/")):
                    history.setdefault(key, {})[step] = value
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    rows = {step: json.loads((runs[0] / "files" / path).read_text()) for step, path in tables.items()}
    return history, rows, config


def _mlflow(run_dir: Path):
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only when asked to
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        [run] = client.search_runs([client.get_experiment_by_name("rollwise").experiment_id])
        history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                   for key in run.data.metrics}
        local = Path(client.download_artifacts(run.info.run_id, "", str(run_dir.parent / "mlflow-artifacts")))
    return history, run, local


# ---------------------------------------------------------------- the tests


def test_every_backend_holds_the_same_metric_series(run_dir):
    expected = _expected(run_dir)
    assert {1, 2} <= set(expected["reward_mean"]) and set(expected["eval/strict_accuracy"]) == {0, 2}
    tensorboard, _ = _tensorboard(run_dir)
    wandb_history, _, _ = _wandb(run_dir)
    mlflow_history, _, _ = _mlflow(run_dir)

    assert set(tensorboard) == set(expected)
    assert set(wandb_history) == set(expected)
    assert set(mlflow_history) == set(expected)
    for name, by_step in expected.items():
        # wandb (JSON) and MLflow keep the float64 value; TensorBoard's scalar summaries are float32.
        assert wandb_history[name] == by_step, name
        assert mlflow_history[name] == by_step, name
        assert tensorboard[name] == {s: float(np.float32(v)) for s, v in by_step.items()}, name


def test_config_versions_and_completions_are_recorded(run_dir):
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    logged = {step: [(s["response"], s["reward"]) for s in samples if s["step"] == step] for step in (1, 2)}
    assert all(logged.values())
    questions = {json.loads(line)["prompt"] for line in (Path(run_dir.parent) / "add.jsonl").read_text().splitlines()}

    # wandb: the resolved config and versions in the run's config; a Table per step.
    _, tables, config = _wandb(run_dir)
    assert config["train"]["lr"] == 1e-3 and config["rollout"]["group_size"] == 4
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["rollwise"]
    assert sorted(tables) == [1, 2]
    for step, table in tables.items():
        assert table["columns"] == ["step", "prompt", "completion", "reward"]
        assert [(row[2], row[3]) for row in table["data"]] == logged[step]
        assert all(row[0] == step and row[1] in questions for row in table["data"])

    # MLflow: params from the flattened config, versions as tags, config.json, one table artifact per step.
    _, run, artifacts = _mlflow(run_dir)
    assert run.data.params["train.lr"] == "0.001" and run.data.params["rollout.group_size"] == "4"
    assert run.data.tags["rollwise.version.torch"] == config["versions"]["torch"]
    assert json.loads((artifacts / "config.json").read_text())["train"]["lr"] == 1e-3
    for step in (1, 2):
        table = json.loads((artifacts / "completions" / f"step_{step:06d}.json").read_text())
        assert [(row[2], row[3]) for row in table["data"]] == logged[step]

    # TensorBoard: the config and versions as text, and a completions table at each step.
    _, texts = _tensorboard(run_dir)
    assert '"lr": 0.001' in texts["run/config/text_summary"][0]
    assert config["versions"]["torch"] in texts["run/versions/text_summary"][0]
    assert sorted(texts["completions/text_summary"]) == [1, 2]
    for step in (1, 2):
        table = texts["completions/text_summary"][step]
        assert table.startswith("| step | prompt | completion | reward |")
        assert table.count("\n") == 1 + len(logged[step]) and all(f"| {reward} |" in table for _, reward in logged[step])


def test_wandb_is_offline_without_credentials(run_dir):
    # No API key and no ~/.netrc: offline, written under the run directory.
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not list((run_dir / "wandb").glob("run-*"))  # an online run's folder


def test_backend_choices_are_refused_with_the_field_named(tmp_path):
    config = tiny_run_config(tmp_path)
    with pytest.raises(ConfigError, match=r"logging\.backends: unknown backend 'wandbb'.*Did you mean 'wandb'"):
        load_config(config, ["logging.backends=[tensorboard,wandbb]"])
    with pytest.raises(ConfigError, match=r"logging\.backends: 'mlflow' is listed twice"):
        load_config(config, ["logging.backends=[mlflow,tensorboard,mlflow]"])
    with pytest.raises(ConfigError, match=r"'logging\.wandb\.projet'.*Did you mean 'project'"):
        load_config(config, ["logging.wandb.projet=x"])
    assert load_config(config, ["logging.backends=wandb"]).logging.backends == ["wandb"]  # one name: a list of one


def test_missing_package_is_a_config_error_with_the_pip_command(tmp_path):
    # mlflow made unimportable in the CLI's process (sys.modules[name] = None is Python's "not installed").
    config = tiny_run_config(tmp_path)
    code = "import sys; sys.modules['mlflow'] = None; from rollwise.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "train", "--config", str(config), BACKENDS],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "Traceback" not in out, out
    assert "logging.backends: mlflow is not installed: run `pip install mlflow-skinny`" in out, out
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_wandb_goes_online_only_when_logged_in(tmp_path, monkeypatch):
    # What `wandb login` leaves: a key in ~/.netrc for the W&B host. Read from disk, with no network call.
    from rollwise.observe.trackers.wandb_tracker import resolve_mode

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / ".netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    assert resolve_mode("auto") == "offline"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'a1' * 20}\n")
    netrc.chmod(0o600)
    assert resolve_mode("auto") == "online"
    assert resolve_mode("offline") == "offline"  # the setting, when not auto
    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb's own switch wins
    assert resolve_mode("auto") == "offline" and resolve_mode("online") == "offline"
    netrc.unlink()
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "b2" * 20)
    assert resolve_mode("auto") == "online"
