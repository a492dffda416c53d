"""docs/benchmarks.md stays true (issue 44 item 4): it is exactly what `rollwise bench index` makes of
docs/benchmarks/goals.yaml and the JSON files in docs/bench/, every page and file it links exists, and every goal's
figure is the number its JSON holds. A stale index or a goal that points at nothing is refused by name, and the
refusal writes nothing."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollwise.bench.index import DATA, GOALS, INDEX, NO_JSON, PAGES, GoalsError, load, measure, render, show

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rows(index: str) -> dict[str, list[str]]:
    """The goals table by key: its cells, as written."""
    rows = {}
    for line in index.splitlines():
        if m := re.match(r"^\| `([^`]+)` \|", line):
            rows[m[1]] = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return rows


def test_the_index_is_current_with_the_json_files():
    assert render(ROOT) == (ROOT / INDEX).read_text(), (
        "docs/benchmarks.md is stale: run `rollwise bench index` and commit it with the JSON and goals.yaml")


def test_every_page_and_file_linked_exists_and_every_page_is_in_the_index():
    """Links of the index, its pages and the README's into docs/benchmarks*."""
    index = ROOT / INDEX
    pages = sorted((ROOT / PAGES).glob("*.md"))
    assert len(pages) >= 20  # the 20 sections of the old single page, one page each
    for doc in [index, *pages]:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"
    linked = {(index.parent / t).resolve() for t in LINK.findall(index.read_text())}
    assert {p.resolve() for p in pages} <= linked, "a page under docs/benchmarks/ is not linked from the index"
    for target in LINK.findall((ROOT / "README.md").read_text()):
        if target.startswith("docs/bench"):
            assert (ROOT / target.split("#", 1)[0]).exists(), f"README.md links {target}, which does not exist"


def test_every_goal_shows_the_number_its_json_holds():
    spec = load(ROOT)
    rows = _rows((ROOT / INDEX).read_text())
    assert [g.key for g in spec.goals] == list(rows)
    read = 0
    for goal in spec.goals:
        latest = rows[goal.key][3]
        if goal.run is None:
            assert latest == NO_JSON
            continue
        document = json.loads((ROOT / DATA / goal.run).read_text())
        value = measure(goal, document, goal.key)
        assert latest == show(value, goal.unit, goal.digits, signed=goal.target.two_sided), goal.key
        assert rows[goal.key][6] == spec.runs[goal.run].date.isoformat()
        read += 1
    assert read >= 50  # every benchmark with a measured goal is read from its JSON, not copied by hand


def _copy(tmp_path: Path) -> Path:
    """The index, its pages and the JSON files its goals read, as a repository of their own."""
    shutil.copytree(ROOT / PAGES, tmp_path / PAGES)
    shutil.copy(ROOT / INDEX, tmp_path / INDEX)
    (tmp_path / DATA).mkdir(parents=True)
    for name in load(ROOT).runs:
        shutil.copy(ROOT / DATA / name, tmp_path / DATA / name)
    return tmp_path


def _index(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollwise.cli", "bench", "index", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60)


def test_a_new_figure_makes_the_index_stale_until_it_is_regenerated(tmp_path):
    root = _copy(tmp_path)
    before = (root / INDEX).read_bytes()
    run = root / DATA / "engine_quick_r2.json"
    data = json.loads(run.read_text())
    data["vllm"]["contract_vs_native"] = 0.5
    run.write_text(json.dumps(data))

    check = _index(root, "--check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "stale" in check.stdout and "engine.contract_vs_native" in check.stdout
    assert (root / INDEX).read_bytes() == before  # --check writes nothing

    write = _index(root)
    assert write.returncode == 0, write.stdout + write.stderr
    row = _rows((root / INDEX).read_text())["engine.contract_vs_native"]
    assert row[3:5] == ["50.0%", "**no**"]
    assert _index(root, "--check").returncode == 0


def _edit_goal(root: Path, key: str, **fields) -> None:
    spec = yaml.safe_load((root / GOALS).read_text())
    goal = next(g for g in spec["goals"] if g["key"] == key)
    goal.update(fields)
    (root / GOALS).write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))


@pytest.mark.parametrize("break_it, named", [
    (lambda root: _edit_goal(root, "engine.contract_vs_native", value="/vllm/no_such_figure"),
     ["engine.contract_vs_native", "no_such_figure"]),
    (lambda root: _edit_goal(root, "engine.contract_vs_native", value="/config/quick"),
     ["engine.contract_vs_native", "/config/quick", "not a finite number"]),
    (lambda root: _edit_goal(root, "engine.contract_vs_native", unit="furlongs"),
     ["engine.contract_vs_native", "unit"]),
    (lambda root: _edit_goal(root, "engine.contract_vs_native", target="at least 0.9"),
     ["engine.contract_vs_native", "target"]),
    (lambda root: _edit_goal(root, "mux.2x1.max_slowdown", reduce=None),
     ["mux.2x1.max_slowdown", "reduce"]),
    (lambda root: _edit_goal(root, "engine.contract_vs_native", run="engine_lost.json"),
     ["engine.contract_vs_native", "engine_lost.json"]),
    (lambda root: (root / DATA / "trainer.json").unlink(), ["trainer.json", "does not exist"]),
    (lambda root: (root / PAGES / "orphan.md").write_text("# Orphan\n"), ["orphan.md", "pages"]),
], ids=["missing-pointer", "not-a-number", "unknown-unit", "bad-target", "wildcard-without-reduce", "unknown-run",
        "json-gone", "page-not-listed"])
def test_a_goal_that_reads_nothing_is_refused_by_name_and_nothing_is_written(tmp_path, break_it, named):
    root = _copy(tmp_path)
    before = (root / INDEX).read_bytes()
    break_it(root)
    with pytest.raises(GoalsError) as refused:
        render(root)
    for word in named:
        assert word in str(refused.value), (word, str(refused.value))
    assert (root / INDEX).read_bytes() == before


def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path):
    root = _copy(tmp_path)
    before = (root / INDEX).read_bytes()
    _edit_goal(root, "loop.wall", value="/wall_minutes")
    result = _index(root)
    assert result.returncode == 2
    assert "loop.wall" in result.stdout and "wall_minutes" in result.stdout and "Traceback" not in result.stderr
    assert (root / INDEX).read_bytes() == before
