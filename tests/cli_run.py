"""Test helper: `rollwise ARGS` as a user runs it, in a subprocess with a run-local model cache. Imported by
the test modules that run the CLI end to end; not a test module itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_rollwise(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "rollwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "ROLLWISE_CACHE": str(cwd / "rollwise-cache")}
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
