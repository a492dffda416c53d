"""The README's two setup commands stay true: CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n([^\n]*python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    train, test = commands
    assert train.endswith("rollwise train") and "torch==2.13.0" in train
    assert test.endswith("python -m pytest") and "torch==2.13.0" in test


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines
