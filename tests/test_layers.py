"""The declared shape of the code (.importlinter; DESIGN.md "Shape of the code") holds: layers, the
simulator's narrow imports, bench -> sim one way, no package cycles; no import circle between modules
(issue 44 item 1); and no module imports another module's private names."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
CONTRACTS = REPO / ".importlinter"

# `from rollwise.<a> import _name` (or `<a>._name` on an imported module) in any other module: the
# remaining ones as (importer module, imported module, name), each with the issue item removing it. A line
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_path(root: Path, module: str) -> Path | None:
    """The file of rollwise module `module` under `root` (a package: its __init__.py), None if not one."""
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def private_imports_across_modules() -> set[tuple[str, str, str]]:
    """(importer, imported module, name) for every private name one rollwise module takes from another:
    `from rollwise.a import _x`, and `m._x` on a module bound by `import rollwise.a as m` or
    `from rollwise import a`."""
    found = set()
    for path in sorted((REPO / "rollwise").rglob("*.py")):
        importer = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        modules: dict[str, str] = {}  # local name -> rollwise module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("rollwise"):
                for alias in node.names:
                    if _is_private(alias.name) and node.module != importer:
                        found.add((importer, node.module, alias.name))
                    if _module_path(REPO, f"{node.module}.{alias.name}") is not None:
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("rollwise.")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                    and modules.get(node.value.id, importer) != importer):
                found.add((importer, modules[node.value.id], node.attr))
    return found


def test_no_module_imports_another_modules_private_names():
    found = private_imports_across_modules()
    new = sorted(found - PRIVATE_IMPORTS_REMAINING)
    assert not new, ("private names imported across modules (make the name public, or move what both sides "
                     "share to a module of its own): " + "; ".join(f"{a} imports {c} from {b}" for a, b, c in new))
    fixed = sorted(PRIVATE_IMPORTS_REMAINING - found)
    assert not fixed, f"fixed, now remove them from PRIVATE_IMPORTS_REMAINING: {fixed}"


def test_the_private_name_check_finds_a_planted_import(tmp_path: Path, monkeypatch):
    """The check reads what it should: a private name taken from another module is found, in its own package
    or another, by `from ... import` or as an attribute of an imported module; a public name is not."""
    fake = tmp_path / "rollwise"
    (fake / "sim").mkdir(parents=True)
    for name in ("__init__", "cost", "other"):
        (fake / "sim" / f"{name}.py").write_text("")
    (fake / "sim" / "a.py").write_text(
        "from rollwise.engine.server import _Body\nfrom rollwise.sim.cost import _x, public\n"
        "import rollwise.sim.other as other\nfrom rollwise.sim import cost\n"
        "other._hidden()\ncost._y\nother.visible\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert private_imports_across_modules() == {
        ("rollwise.sim.a", "rollwise.engine.server", "_Body"), ("rollwise.sim.a", "rollwise.sim.cost", "_x"),
        ("rollwise.sim.a", "rollwise.sim.other", "_hidden"), ("rollwise.sim.a", "rollwise.sim.cost", "_y")}


# ---------------------------------------------------------------------------- import circles between modules


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines under `if TYPE_CHECKING:` (annotations only: they load nothing at run time)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(package: str, root: Path) -> grimp.ImportGraph:
    """Every import between `package`'s modules, as import-linter sees them (grimp, the graph library it
    runs on; TYPE_CHECKING imports excluded as in .importlinter; function-local imports count: a circle
    hidden in a function body is still a circle), plus one edge grimp leaves out: `from pkg import mod`
    also reads `pkg` (its __init__), so a package whose __init__ imports the importer is a circle."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)
    packages = {m for m in graph.modules if _module_path(root, m) is not None
                and _module_path(root, m).name == "__init__.py"}
    for module in graph.modules:
        path = _module_path(root, module)
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in packages
                    and node.module != module and node.lineno not in skip
                    and any(f"{node.module}.{a.name}" in graph.modules for a in node.names)):
                graph.add_import(importer=module, imported=node.module, line_number=node.lineno,
                                 line_contents=ast.get_source_segment(source, node) or "")
    return graph


def import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module: modules that import each other, directly
    or through others, each sorted, shortest first."""
    seen: set[str] = set()
    circles = []
    for module in sorted(graph.modules):
        if module in seen:
            continue
        component = {module} | (graph.find_upstream_modules(module) & graph.find_downstream_modules(module))
        seen |= component
        if len(component) > 1:
            circles.append(sorted(component))
    return sorted(circles, key=lambda c: (len(c), c))


def describe_circle(graph: grimp.ImportGraph, circle: list[str]) -> str:
    imports = [f"{a} -> {b} (line {d['line_number']}: {d['line_contents'].strip()})"
               for a in circle for b in circle if graph.direct_import_exists(importer=a, imported=b)
               for d in graph.get_import_details(importer=a, imported=b)[:1]]
    return " <-> ".join(circle) + ":\n    " + "\n    ".join(imports)


def test_no_import_circle_between_modules():
    """No module of rollwise imports itself back through others (issue 44 item 1). Break a new one by moving
    what both sides need down (types to rollwise.types, shared state to a small module both import, a
    Protocol for what one side needs of the other), not by hiding an import in a function."""
    graph = import_graph("rollwise", REPO)
    circles = import_circles(graph)
    assert not circles, (f"{len(circles)} import circle(s) between modules:\n"
                         + "\n".join(describe_circle(graph, c) for c in circles))


def test_the_circle_check_finds_planted_circles(tmp_path: Path, monkeypatch):
    """The check bites: a circle through a function-local import and one through a package's __init__ are
    found, naming the imports; an import under TYPE_CHECKING makes none."""
    pkg = tmp_path / "circles_demo"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from circles_demo.b import g\n",
        "b.py": "def g():\n    from circles_demo.a import g  # noqa\n",
        "c.py": "import circles_demo.d\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import circles_demo.c\n",
        "sub/__init__.py": "from circles_demo.sub.x import X\n",
        "sub/x.py": "from circles_demo.sub import y\nX = 1\n",
        "sub/y.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = import_graph("circles_demo", tmp_path)
    assert import_circles(graph) == [["circles_demo.a", "circles_demo.b"], ["circles_demo.sub", "circles_demo.sub.x"]]
    text = describe_circle(graph, ["circles_demo.a", "circles_demo.b"])
    assert "circles_demo.b -> circles_demo.a (line 2: from circles_demo.a import g  # noqa)" in text
