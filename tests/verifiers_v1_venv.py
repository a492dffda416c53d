"""Test helper: a Python interpreter with verifiers 0.4.0 (v1), for the example taskset examples/verifiers_v1_echo
(pure Python: the tests put it on PYTHONPATH rather than installing it).

verifiers 0.4.0 cannot share rollwise's environment (it pins `openai>=2.54,<3` and `mcp==2.0.0`; rollwise's test
extra has openai 3 and vLLM's mcp>=2.3), and it is the same distribution name as the classic 0.3.1 the other tests
import, so it lives in its own venv, built with `uv` (in the `test` extra) from the package index: ~10-25 s the
first time, then reused from the cache ($ROLLWISE_CACHE or ~/.cache/rollwise), keyed by the pins.
$ROLLWISE_VERIFIERS_V1_PYTHON names a ready interpreter instead (nothing is built).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollwise.model.loading import cache_dir

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "verifiers_v1_echo"
REQUIREMENTS = ["verifiers==0.4.0"]
BUILD_TIMEOUT_S = 300


def _key() -> str:
    return hashlib.sha256("\n".join(REQUIREMENTS + [sys.version]).encode()).hexdigest()[:16]


def verifiers_v1_python() -> str:
    """The interpreter, built on first use; a test that needs it skips when it cannot be built (no uv, no package
    index), except under CI (`$CI` set), where that fails."""
    given = os.environ.get("ROLLWISE_VERIFIERS_V1_PYTHON")
    if given:
        return given
    venv = cache_dir() / "test-venvs" / f"verifiers-v1-{_key()}"
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:  # two pytest runs build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            _build(venv, python)
    return str(python)


def _build(venv: Path, python: Path) -> None:
    uv = [sys.executable, "-m", "uv"]
    try:
        subprocess.run([*uv, "venv", "-q", "--allow-existing", "--python", sys.executable, str(venv)],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        subprocess.run([*uv, "pip", "install", "-q", "--python", str(python), *REQUIREMENTS],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        why = f"cannot build the verifiers 0.4.0 venv at {venv} with uv: {stderr.decode()[-400:] or exc}"
        if os.environ.get("CI"):  # CI has uv (the test extra) and the package index: there it is a failure
            pytest.fail(why)
        pytest.skip(why)
    (venv / ".complete").touch()
