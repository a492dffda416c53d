"""`rollwise bench index [--check]`: docs/benchmarks.md, every goal with its latest measured figure.

The page is generated from docs/benchmarks/goals.yaml (each goal: its target, the JSON file in docs/bench/ its figure
is read from and where in it, the command and the date of that run, its page under docs/benchmarks/) and from those
JSON files, so a figure on it is always the one the repository's JSON holds. `--check` writes nothing and exits 1
naming what is stale; tests/test_benchmark_index.py runs the same check.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INDEX = Path("docs/benchmarks.md")
PAGES = Path("docs/benchmarks")
GOALS = PAGES / "goals.yaml"
DATA = Path("docs/bench")
NO_JSON = "figure in page, no JSON"

JSON = Union[dict[str, "JSON"], list["JSON"], str, int, float, bool, None]
Unit = Literal["ratio", "number", "percent", "points", "seconds"]


class GoalsError(ValueError):
    """goals.yaml, a page or a JSON file it names is not what the index needs; the message says which and why."""


class Target(BaseModel):
    """`>= N`, `<= N` or `between A and B`: the bounds a goal's value must lie within (None: open)."""

    low: float | None
    high: float | None

    @classmethod
    def parse(cls, text: str) -> Target:
        number = r"([-+]?\d+(?:\.\d+)?)"
        if m := re.fullmatch(rf"\s*>=\s*{number}\s*", text):
            return cls(low=float(m[1]), high=None)
        if m := re.fullmatch(rf"\s*<=\s*{number}\s*", text):
            return cls(low=None, high=float(m[1]))
        if m := re.fullmatch(rf"\s*between\s+{number}\s+and\s+{number}\s*", text):
            low, high = float(m[1]), float(m[2])
            if low <= high:
                return cls(low=low, high=high)
        raise ValueError(f"target {text!r}: write '>= N', '<= N' or 'between A and B' (A <= B)")

    @property
    def two_sided(self) -> bool:
        """A range around a value (an error around 0): figures are shown with their sign."""
        return self.low is not None and self.high is not None

    def met(self, value: float) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def shortfall(self, value: float) -> float:
        """How far `value` is from meeting the target, or how close to its edge: larger is worse."""
        if self.low is not None and self.high is not None:
            return abs(value - (self.low + self.high) / 2)
        return -value if self.low is not None else value


class Run(BaseModel):
    """A JSON file in docs/bench/ that goals read: when it was measured, and the command where the JSON's is missing
    or names another output path."""

    model_config = ConfigDict(extra="forbid")
    date: datetime.date
    command: str | None = None


class Goal(BaseModel):
    """A goal, where its figure is read from and how it is shown (goals.yaml's header says each field)."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(pattern=r"^[a-z0-9_-]+(\.[a-z0-9_-]+)*$")
    goal: str = Field(min_length=1)
    page: str
    target: Target
    unit: Unit
    digits: int | None = Field(default=None, ge=0, le=6)
    run: str | None = None
    value: str | None = None
    over: str | None = None
    minus: str | None = None
    reduce: Literal["worst", "mean", "median"] | None = None
    command: str | None = None

    @field_validator("target", mode="before")
    @classmethod
    def _parse_target(cls, text: object) -> Target:
        if not isinstance(text, str):
            raise ValueError(f"target {text!r}: write it as a string, '>= N', '<= N' or 'between A and B'")
        return Target.parse(text)

    @model_validator(mode="after")
    def _consistent(self) -> Goal:
        if (self.run is None) != (self.value is None):
            raise ValueError("give both `run` (the JSON file) and `value` (the pointer into it), or neither")
        if self.over is not None and self.minus is not None:
            raise ValueError("give `over` or `minus`, not both")
        pointers = [p for p in (self.value, self.over, self.minus) if p is not None]
        if self.run is None and (self.over or self.minus or self.reduce):
            raise ValueError("`over`, `minus` and `reduce` need a `run` and a `value`")
        if self.run is not None and self.command is not None:
            raise ValueError("`command` is for a goal without a run; a run's command is the JSON's (or `runs:`)")
        for pointer in pointers:
            if not pointer.startswith("/"):
                raise ValueError(f"pointer {pointer!r} must start with '/' (a JSON pointer, RFC 6901)")
        wildcard = any("*" in p.split("/") for p in pointers)
        if wildcard and self.reduce is None:
            raise ValueError("a pointer with '*' reaches several numbers: say which counts with `reduce`")
        if not wildcard and self.reduce is not None:
            raise ValueError("`reduce` is for pointers with '*'")
        if self.reduce == "worst" and (self.over or self.minus):
            raise ValueError("`reduce: worst` picks one number against the target; with `over` or `minus` use "
                             "mean or median")
        return self


class GoalsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    intro: str
    pages: list[str] = Field(min_length=1)
    runs: dict[str, Run]
    goals: list[Goal] = Field(min_length=1)


class Row(BaseModel):
    """One line of the index's table, as shown."""

    key: str
    goal: str
    target: str
    latest: str
    met: str
    command: str
    date: str
    page: str


def resolve(document: JSON, pointer: str) -> list[JSON]:
    """What a JSON pointer (RFC 6901) reaches in `document`; a `*` step takes every item of a list or object."""
    nodes = [document]
    for raw in pointer.split("/")[1:]:
        step = raw.replace("~1", "/").replace("~0", "~")
        reached: list[JSON] = []
        for node in nodes:
            if step == "*" and isinstance(node, (dict, list)):
                reached.extend(node.values() if isinstance(node, dict) else node)
            elif isinstance(node, dict) and step in node:
                reached.append(node[step])
            elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
                reached.append(node[int(step)])
            else:
                raise KeyError(step)
        nodes = reached
    return nodes


def _numbers(document: JSON, pointer: str, where: str) -> list[float]:
    try:
        reached = resolve(document, pointer)
    except KeyError as missing:
        raise GoalsError(f"{where}: {pointer} is not in the JSON (no {missing.args[0]!r} there)") from None
    if not reached:
        raise GoalsError(f"{where}: {pointer} reaches nothing (an empty list or object)")
    numbers = []
    for node in reached:
        if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
            raise GoalsError(f"{where}: {pointer} holds {str(node)[:60]!r}, not a finite number")
        numbers.append(float(node))
    return numbers


def _reduce(numbers: list[float], goal: Goal) -> float:
    if goal.reduce == "mean":
        return statistics.fmean(numbers)
    if goal.reduce == "median":
        return statistics.median(numbers)
    return max(numbers, key=goal.target.shortfall)  # worst, or the one number a plain pointer reaches


def measure(goal: Goal, document: JSON, where: str) -> float:
    """The goal's latest figure from its run's JSON (its value, divided by `over` or less `minus`)."""
    assert goal.value is not None
    value = _reduce(_numbers(document, goal.value, where), goal)
    if goal.over is not None:
        over = _reduce(_numbers(document, goal.over, where), goal)
        if over == 0:
            raise GoalsError(f"{where}: {goal.over} is 0, so `over` cannot divide by it")
        return value / over
    if goal.minus is not None:
        return value - _reduce(_numbers(document, goal.minus, where), goal)
    return value


def show(value: float, unit: Unit, digits: int | None, signed: bool = False) -> str:
    """A goal's figure in its unit: 1.87x, 0.09, 52.9% (+9.6% for an error, `signed`), +58 points, 592 s."""
    if unit == "ratio":
        return f"{value:.{2 if digits is None else digits}f}x"
    if unit == "number":
        return f"{value:.{2 if digits is None else digits}f}"
    if unit == "percent":
        return f"{value * 100:{'+' if signed else ''}.{1 if digits is None else digits}f}%"
    if unit == "points":
        return f"{value * 100:+.{0 if digits is None else digits}f} points"
    return f"{value:.{0 if digits is None else digits}f} s"


def _plain(x: float) -> str:
    """A target's number as written: no trailing zeros."""
    return f"{x:.6f}".rstrip("0").rstrip(".")


def show_target(target: Target, unit: Unit) -> str:
    """A target in its unit: ≥ 1.5x, ≤ 10%, -10% to +10%, ≥ +40 points."""
    both = target.two_sided

    def bound(x: float) -> str:
        sign = "+" if x > 0 and (both or unit == "points") else ""
        if unit == "ratio":
            return f"{_plain(x)}x"
        if unit == "number":
            return _plain(x)
        if unit == "percent":
            return f"{sign}{_plain(x * 100)}%"
        if unit == "points":
            return f"{sign}{_plain(x * 100)} points"
        return f"{_plain(x)} s"

    if target.low is not None and target.high is not None:
        return f"{bound(target.low)} to {bound(target.high)}"
    if target.low is not None:
        return f"≥ {bound(target.low)}"
    assert target.high is not None
    return f"≤ {bound(target.high)}"


def load(root: Path) -> GoalsFile:
    """goals.yaml under `root` (the repository), checked against the pages and JSON files it names."""
    path = root / GOALS
    if not path.is_file():
        raise GoalsError(f"no {GOALS} under {root}: run from the repository root or pass --root")
    try:
        raw = yaml.safe_load(path.read_text())
        spec = GoalsFile.model_validate(raw)
    except yaml.YAMLError as exc:
        raise GoalsError(f"{GOALS} is not valid YAML: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"]
        field = f"field {'.'.join(str(p) for p in loc)}" if loc else "top level"
        goals = raw.get("goals") if isinstance(raw, dict) else None
        if loc[:1] == ("goals",) and len(loc) > 1 and isinstance(loc[1], int) and isinstance(goals, list):
            key = goals[loc[1]].get("key", loc[1]) if isinstance(goals[loc[1]], dict) else loc[1]
            field = f"goal {key!r}" + (f", field {'.'.join(str(p) for p in loc[2:])}" if loc[2:] else "")
        raise GoalsError(f"{GOALS}: {field}: {first['msg']}") from None
    on_disk = sorted(p.name for p in (root / PAGES).glob("*.md"))
    for page in spec.pages:
        if page not in on_disk:
            raise GoalsError(f"{GOALS}: page {page!r} is not in {PAGES}/: add it or remove it from `pages`")
    for page in on_disk:
        if page not in spec.pages:
            raise GoalsError(f"{PAGES}/{page} is not in {GOALS}'s `pages`: list it there")
    if len(set(spec.pages)) != len(spec.pages):
        raise GoalsError(f"{GOALS}: a page is listed twice under `pages`")
    keys = [g.key for g in spec.goals]
    for key in keys:
        if keys.count(key) > 1:
            raise GoalsError(f"{GOALS}: goal key {key!r} is used twice: keys are stable names, one per goal")
    for goal in spec.goals:
        if goal.page not in spec.pages:
            raise GoalsError(f"{GOALS}: goal {goal.key!r}: page {goal.page!r} is not under `pages`")
        if goal.run is not None and goal.run not in spec.runs:
            raise GoalsError(f"{GOALS}: goal {goal.key!r}: run {goal.run!r} is not under `runs` (give its date there)")
    for run in spec.runs:
        if run not in {g.run for g in spec.goals}:
            raise GoalsError(f"{GOALS}: run {run!r} is read by no goal: remove it from `runs`")
    return spec


def rows(root: Path, spec: GoalsFile) -> list[Row]:
    """The table: each goal with its figure read from its run's JSON now."""
    documents: dict[str, JSON] = {}
    for name in spec.runs:
        path = root / DATA / name
        try:
            documents[name] = json.loads(path.read_text())
        except FileNotFoundError:
            raise GoalsError(f"{GOALS}: run {name!r}: {DATA / name} does not exist") from None
        except json.JSONDecodeError as exc:
            raise GoalsError(f"{DATA / name} is not valid JSON: {exc}") from None
    table = []
    for goal in spec.goals:
        page = f"[{goal.page.removesuffix('.md')}](benchmarks/{goal.page})"
        wanted = show_target(goal.target, goal.unit)
        if goal.run is None:
            table.append(Row(key=goal.key, goal=goal.goal, target=wanted, latest=NO_JSON, met="see page",
                             command=f"`{goal.command}`" if goal.command else "—", date="—", page=page))
            continue
        run, document = spec.runs[goal.run], documents[goal.run]
        value = measure(goal, document, f"goal {goal.key!r} ({DATA / goal.run})")
        own = document.get("command") if isinstance(document, dict) else None
        command = run.command or (own if isinstance(own, str) else None)
        if command is None:
            raise GoalsError(f"{GOALS}: run {goal.run!r}: the JSON has no `command`: give it under `runs`")
        latest = show(value, goal.unit, goal.digits, signed=goal.target.two_sided)
        table.append(Row(key=goal.key, goal=goal.goal, target=wanted, latest=latest,
                         met="yes" if goal.target.met(value) else "**no**", command=f"`{' '.join(command.split())}`",
                         date=run.date.isoformat(), page=page))
    return table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _title(root: Path, page: str) -> str:
    first = (root / PAGES / page).read_text().split("\n", 1)[0]
    if not first.startswith("# "):
        raise GoalsError(f"{PAGES}/{page}: its first line must be its title ('# ...')")
    return first[2:].strip()


def render(root: Path) -> str:
    """docs/benchmarks.md as goals.yaml and the JSON files under `root` say it should be."""
    spec = load(root)
    table = rows(root, spec)
    met = sum(r.met == "yes" for r in table)
    measured = sum(r.latest != NO_JSON for r in table)
    lines = [
        "# Benchmarks and measured runs",
        "",
        "<!-- Generated by `rollwise bench index` from docs/benchmarks/goals.yaml and docs/bench/*.json:"
        " edit those and rerun it. -->",
        "",
        spec.intro.strip(),
        "",
        "## Goals",
        "",
        f"{len(table)} goals, {measured} read from JSON files; {met} met by their latest figure.",
        "",
        "| key | goal | target | latest | met | command | date | page |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append("| " + " | ".join(_cell(c) for c in (f"`{r.key}`", r.goal, r.target, r.latest, r.met, r.command,
                                                              r.date, r.page)) + " |")
    lines += ["", "## Pages", ""]
    lines += [f"- [{_title(root, page)}](benchmarks/{page})" for page in spec.pages]
    return "\n".join(lines) + "\n"


def stale(current: str, expected: str) -> str:
    """What differs between the index on disk and the one the JSON files give, in a few lines."""
    key = re.compile(r"^\| `([^`]+)` \|")
    old = {m[1]: line for line in current.splitlines() if (m := key.match(line))}
    new = {m[1]: line for line in expected.splitlines() if (m := key.match(line))}
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
    parts = [f"goal rows that differ: {', '.join(changed[:10])}{more}"] if changed else []
    diff = [line for line in difflib.unified_diff(current.splitlines(), expected.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    if diff:
        parts.append("\n".join(diff[:20]) + ("\n..." if len(diff) > 20 else ""))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(
        prog="rollwise bench index",
        description="Write docs/benchmarks.md (every goal with its latest figure) from docs/benchmarks/goals.yaml "
        "and the JSON files in docs/bench/.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming what is stale when docs/benchmarks.md is not current")
    parser.add_argument("--root", type=Path, default=Path("."),
                        help="the repository root (default: the current directory)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    console = Console()
    try:
        expected = render(args.root)
    except GoalsError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return 2
    path = args.root / INDEX
    current = path.read_text() if path.is_file() else ""
    if args.check:
        if current == expected:
            console.print(f"{INDEX} is current", highlight=False)
            return 0
        console.print(f"[bold red]stale:[/] {INDEX} does not say what {GOALS} and the JSON files in {DATA}/ say; "
                      "run `rollwise bench index`", highlight=False)
        console.print(stale(current, expected), highlight=False, markup=False, soft_wrap=True)
        return 1
    if current != expected:
        path.write_text(expected)
        console.print(f"wrote {INDEX}", highlight=False)
    else:
        console.print(f"{INDEX} is current", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
