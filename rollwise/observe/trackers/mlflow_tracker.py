"""MLflow: a local file store in <run dir>/mlruns by default (logging.mlflow.tracking_uri: a server or another
store). The run's params are the resolved config, flattened (`train.lr`); its tags the package versions and
the git commit (`mlflow.source.git.commit`, shown by the UI); config.json the whole config as an artifact;
each step's sampled completions the artifact completions/step_NNNNNN.json (MLflow's table layout:
{"columns": [...], "data": [[...], ...]})."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollwise.observe.trackers.base import COMPLETION_COLUMNS, Completion, RunInfo, completion_rows
from rollwise.types.logging_config import MlflowSettings

MLFLOW_DIR = "mlruns"
MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values; config.json holds them whole


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested sections to dotted params, the way overrides name them (`train.lr`)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            params.update(flatten(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)  # lists, numbers, null as in the YAML
            params[f"{prefix}{key}"] = text[:MAX_PARAM_CHARS]
    return params


class MlflowTracker:
    def __init__(self, run_dir: Path, info: RunInfo, settings: MlflowSettings) -> None:
        uri = settings.tracking_uri or (run_dir / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store only on request (it points users at a database); a local directory
            # per run needs no database, and `mlflow ui --backend-store-uri` reads it the same way.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        tags = {f"rollwise.version.{name}": version or "not installed" for name, version in info.versions.items()}
        if info.git_sha:
            tags["mlflow.source.git.commit"] = info.git_sha
        tags["rollwise.start_step"] = str(info.start_step)
        run = self.client.create_run(experiment_id, run_name=settings.run_name or info.name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten(info.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, {**info.config, "versions": info.versions, "git_sha": info.git_sha},
                             "config.json")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def log_completions(self, step: int, completions: Sequence[Completion]) -> None:
        table = {"columns": list(COMPLETION_COLUMNS), "data": completion_rows(step, completions)}
        self.client.log_dict(self.run_id, table, f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
