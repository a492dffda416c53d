"""Weights & Biases: offline by default, online once the user has logged in. An offline run is written under
<run dir>/wandb (upload it later with `wandb sync <run dir>/wandb/offline-run-*`); nothing reaches the network.
The run's config holds the resolved run config, the package versions and the git commit; each step's sampled
completions are a wandb.Table under "completions"."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from rollwise.observe.trackers.base import COMPLETION_COLUMNS, Completion, RunInfo, completion_rows
from rollwise.types.logging_config import WandbSettings

DEFAULT_HOST = "https://api.wandb.ai"


def logged_in() -> bool:
    """Whether wandb has credentials, read without any network call: an API key or identity token in the
    environment, or the key `wandb login` wrote to ~/.netrc (or $NETRC) for the host in WANDB_BASE_URL."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib.wbauth import read_netrc_auth

    try:
        return read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST) is not None
    except AuthenticationError:  # a malformed key in .netrc: wandb would refuse it online too
        return False


def resolve_mode(setting: Literal["auto", "offline", "online"]) -> str:
    """WANDB_MODE when set (wandb's own switch), else the setting; auto: online only when logged in."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if setting == "auto":
        return "online" if logged_in() else "offline"
    return setting


class WandbTracker:
    def __init__(self, run_dir: Path, info: RunInfo, settings: WandbSettings) -> None:
        import wandb

        self._wandb = wandb
        self.mode = resolve_mode(settings.mode)
        self._run = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name or info.name, tags=settings.tags,
            dir=str(run_dir), mode=self.mode,  # type: ignore[arg-type]  # WANDB_MODE's values are wandb's to check
            config={**info.config, "versions": info.versions, "git_sha": info.git_sha, "start_step": info.start_step},
            # The console stays rollwise's (no capture of stdout), and no system-metrics sampler runs.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False),
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_completions(self, step: int, completions: Sequence[Completion]) -> None:
        table = self._wandb.Table(columns=list(COMPLETION_COLUMNS), data=completion_rows(step, completions))
        self._run.log({"completions": table}, step=step)

    def close(self) -> None:
        self._run.finish()
