"""The `logging:` section of the run config: which experiment trackers a run writes to
(`logging.backends: [tensorboard, wandb, mlflow]`) and each tracker's settings. rollwise.config puts it into
the run config; rollwise.observe.trackers reads it. Here, beside the base every section shares, so that the
observe layer imports no config.

A backend whose package is not installed is refused when the config loads, before anything starts, with the
pip command that installs it.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from rollwise.types.algorithms import check_choice
from rollwise.types.config_section import ConfigSection

TRACKING_BACKENDS = ("tensorboard", "wandb", "mlflow")
# The module each backend imports, and what installs it (the `tracking` extra pins the versions tested).
BACKEND_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (wandb and mlflow take a second or more)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


class WandbSettings(ConfigSection):
    project: str = Field("rollwise", min_length=1, description="the Weights & Biases project")
    entity: str | None = Field(None, description="team or user (default: the logged-in user's default entity)")
    name: str | None = Field(None, description="the run's name (default: the run directory's name)")
    tags: list[str] = Field(default_factory=list)
    mode: Literal["auto", "offline", "online"] = Field(
        "auto", description="auto: online when you are logged in (`wandb login`, or WANDB_API_KEY), offline "
        "otherwise; offline runs are written under <run dir>/wandb and uploaded later with `wandb sync`. "
        "A WANDB_MODE environment variable wins over this")


class MlflowSettings(ConfigSection):
    tracking_uri: str | None = Field(
        None, description="where runs are recorded (a server URL, or file:/path); default: a local file store "
        "in <run dir>/mlruns (view it with `mlflow ui --backend-store-uri <run dir>/mlruns`)")
    experiment: str = Field("rollwise", min_length=1, description="the MLflow experiment the run is recorded in")
    run_name: str | None = Field(None, description="default: the run directory's name")


class LoggingConfig(ConfigSection):
    backends: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="experiment trackers, each holding the same metric names and values per step, the run's "
        "config and versions, and a table of sampled completions per step: any of tensorboard, wandb, mlflow")
    wandb: WandbSettings = WandbSettings()
    mlflow: MlflowSettings = MlflowSettings()

    @field_validator("backends", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # `logging.backends=wandb` on the command line

    @field_validator("backends")
    @classmethod
    def _known_installed_once(cls, backends: list[str]) -> list[str]:
        for name in backends:
            check_choice(name, TRACKING_BACKENDS, "backend")
        repeated = sorted({b for b in backends if backends.count(b) > 1})
        if repeated:
            raise ValueError(f"{repeated[0]!r} is listed twice: name each backend once")
        missing = [b for b in backends if not installed(BACKEND_MODULES[b])]
        if missing:
            packages = " ".join(BACKEND_PACKAGES[b] for b in missing)
            raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: run "
                             f"`pip install {packages}` (in a rollwise checkout: pip install -e \".[tracking]\"), or "
                             f"remove {', '.join(missing)} from logging.backends")
        return backends
