"""The declared shape of the code (.importlinter; DESIGN.md "Shape of the code") holds: layers, the
simulator's narrow imports, bench -> sim one way, no package cycles; and no module imports another
package's private names."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTRACTS = REPO / ".importlinter"

# `from rollwise.<a>... import _name` in a module of another package <b>: the remaining ones, each in
# a file another item of issue 17 is rewriting, as (importer module, imported module, name). A line
# that no longer matches must go (the test says so), so this list only shrinks.
PRIVATE_IMPORTS_REMAINING: set[tuple[str, str, str]] = set()


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """import-linter's own command, with this venv's Python, on the `rollwise` package found from `cwd`."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the package under `cwd` first (the planted copy below)
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--config", str(cwd / ".importlinter"), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_import_contracts_are_kept():
    out = lint_imports(REPO)
    assert out.returncode == 0, f"lint-imports (.importlinter) failed:\n{out.stdout}\n{out.stderr}"
    assert "0 broken" in out.stdout


def test_a_simulator_module_importing_bench_breaks_the_contract(tmp_path: Path):
    """The contract bites: the same check on a copy of the code with one planted sim -> bench import fails,
    naming the import."""
    shutil.copytree(REPO / "rollwise", tmp_path / "rollwise", ignore=shutil.ignore_patterns("__pycache__", "configs"))
    shutil.copy(CONTRACTS, tmp_path / ".importlinter")
    (tmp_path / "rollwise" / "sim" / "planted.py").write_text("from rollwise.bench import mux  # noqa: F401\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "rollwise.sim.planted -> rollwise.bench.mux" in out.stdout


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The package under rollwise a module belongs to (rollwise.sim.cli -> sim; rollwise.cli -> cli)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def private_imports_across_packages() -> set[tuple[str, str, str]]:
    found = set()
    for path in sorted((REPO / "rollwise").rglob("*.py")):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "rollwise"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and _package(node.module) != _package(importer):
                    found.add((importer, node.module, alias.name))
    return found


def test_no_module_imports_another_packages_private_names():
    found = private_imports_across_packages()
    new = sorted(found - PRIVATE_IMPORTS_REMAINING)
    assert not new, ("private names imported across packages (make the name public, or move the code): "
                     + "; ".join(f"{a} imports {c} from {b}" for a, b, c in new))
    fixed = sorted(PRIVATE_IMPORTS_REMAINING - found)
    assert not fixed, f"fixed, now remove them from PRIVATE_IMPORTS_REMAINING: {fixed}"


def test_the_private_name_check_finds_a_planted_import(tmp_path: Path, monkeypatch):
    """The check reads what it should: a cross-package private import is found, a same-package one is not."""
    fake = tmp_path / "rollwise"
    (fake / "sim").mkdir(parents=True)
    (fake / "sim" / "a.py").write_text("from rollwise.engine.server import _Body\nfrom rollwise.sim.cost import _x\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert private_imports_across_packages() == {("rollwise.sim.a", "rollwise.engine.server", "_Body")}
