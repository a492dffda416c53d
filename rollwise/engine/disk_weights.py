"""What `POST /update_weights_from_disk` loads: the safetensors files a path names, read into one whole update
and checked by the rules every weight path shares (rollwise.types.weight_checks) before the engine sees it.

A path is one .safetensors file or a model directory (a flat checkpoint's model.flat.json, of
rollwise.model.flat_format; else its model.safetensors.index.json, else every *.safetensors in it). The files
must hold every weight of the engine's model (a file with only some of them would leave the engine serving a
mix of two versions under one version number), each tensor once (two files naming the same tensor: which one
is the model?), with the engine's dtypes and finite values. Refusals are 400s naming the field (`path`, or
`version` for a version older than the engine's), the file and the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from rollwise.model.flat_format import INDEX_FILE as FLAT_INDEX_FILE
from rollwise.model.flat_reader import FlatCheckpointError, read_flat
from rollwise.serve.errors import APIError
from rollwise.types.weight_checks import WeightProblem, state_problems, version_problem
from rollwise.types.weights import ExpectedWeights


@dataclass
class DiskWeights:
    """Every tensor the files hold, and which file each came from."""

    state: dict[str, Tensor]
    origin: dict[str, Path]


def weight_files(path: Path) -> list[Path]:
    if not path.exists():
        raise APIError(400, f"path {str(path)!r} does not exist", "path")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise APIError(400, f"path must be a .safetensors file or a model directory, got {path.name!r}", "path")
        return [path]
    if (path / FLAT_INDEX_FILE).is_file():
        return [path / FLAT_INDEX_FILE]  # a flat checkpoint: read whole by read_weights
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise APIError(400, f"path: unreadable {index.name}: {exc}", "path") from exc
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise APIError(400, f"path: no *.safetensors files in {path}", "path")
    return files


def _unreadable(file: Path, exc: Exception) -> APIError:
    return APIError(400, f"path: cannot read {file}: {exc}", "path")


def read_weights(files: list[Path]) -> DiskWeights:
    """Every file's tensors; refused (APIError 400) when a file cannot be read or two files hold the same name,
    which the headers tell before any tensor's bytes are read."""
    if len(files) == 1 and files[0].name == FLAT_INDEX_FILE:
        return _read_flat(files[0].parent)
    from safetensors import safe_open
    from safetensors.torch import load_file

    origin: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as handle:
                names = list(handle.keys())
        except Exception as exc:  # noqa: BLE001 - missing, truncated or not safetensors at all
            raise _unreadable(file, exc) from exc
        for name in names:
            if name in origin:
                raise APIError(400, f"path: tensor {name!r} is in both {origin[name].name} and {file.name}; a model "
                                    "holds each tensor once: remove the stale file (or fix the index's weight_map)",
                               "path")
            origin[name] = file
    state: dict[str, Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - damaged after its header
            raise _unreadable(file, exc) from exc
    return DiskWeights(state, origin)


def _read_flat(directory: Path) -> DiskWeights:
    """A flat checkpoint, read in parallel and checksummed; a truncated or damaged chunk is a 400 naming its
    tensors, before any of them reaches the engine."""
    try:
        weights = read_flat(directory)
    except FlatCheckpointError as exc:
        raise APIError(400, f"path: {exc}", "path") from exc
    data = directory / weights.index.data_file
    return DiskWeights(weights.state, {name: data for name in weights.state})


def refusal(weights: DiskWeights, expected: ExpectedWeights, version: int, current: int) -> APIError | None:
    """The 400 refusing these weights as `version` of an engine at `current` (None: they may load). Names, shapes,
    dtypes and completeness first; values (NaN, inf) only when all of that fits."""
    backwards = version_problem(version, current)
    if backwards is not None:
        return APIError(400, f"weights rejected, still serving policy version {current}: {backwards}", "version")
    problems = state_problems(weights.state, expected, complete=True)
    if not problems:
        return None
    shown = "; ".join(_where(p, weights) for p in problems[:8])
    more = f"; ... ({len(problems)} problems in all)" if len(problems) > 8 else ""
    return APIError(400, f"weights rejected, still serving policy version {current}: {shown}{more}. The files must "
                         "hold every weight of the served model, once, in its dtypes, with finite values", "path")


def _where(problem: WeightProblem, weights: DiskWeights) -> str:
    file = weights.origin.get(problem.field)
    return f"{problem} (in {file.name})" if file is not None else str(problem)
