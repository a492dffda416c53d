"""Checkpoint names, URIs and directories: `tinker://{model_id}/weights/{name}` (training state, with optimizer),
`tinker://{model_id}/sampler_weights/{name}` (weights a sampler can serve), stored under --data-dir as
`{data}/{model_id}/{weights|sampler_weights}/{name}/`. One parser for every route and the worker."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollwise.service.errors import ServiceUserError

Segment = Literal["weights", "sampler_weights"]
KIND: dict[str, str] = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:=+-]{0,199}$")


@dataclass(frozen=True)
class CheckpointRef:
    model_id: str
    segment: Segment
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def kind(self) -> str:
        return KIND[self.segment]

    def directory(self, data_dir: Path) -> Path:
        return data_dir / self.model_id / self.segment / self.name


def checked_name(name: str, field: str = "path") -> str:
    if not _NAME.match(name) or ".." in name:
        raise ServiceUserError(f"{field} {name!r}: a checkpoint name is 1-200 characters of letters, digits and "
                               "._:=+- (no '/'), starting with a letter or digit")
    return name


def parse_tinker_path(path: str, field: str = "path") -> CheckpointRef:
    """`tinker://MODEL_ID/weights/NAME` or `.../sampler_weights/NAME`, else ServiceUserError naming `field`."""
    prefix = "tinker://"
    parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
    if len(parts) != 3 or parts[1] not in KIND or not parts[0]:
        raise ServiceUserError(f"{field} {path!r} is not a checkpoint path: give tinker://MODEL_ID/weights/NAME "
                               "(training state) or tinker://MODEL_ID/sampler_weights/NAME")
    segment: Segment = "weights" if parts[1] == "weights" else "sampler_weights"
    return CheckpointRef(parts[0], segment, checked_name(parts[2], field))
