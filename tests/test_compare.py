"""`rollwise compare` over arms of several seeds: the held-out table lines evaluations up by step,
averages an arm's runs, and counts the samples each had taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollwise.observe.compare import against_first, held_out_table, load_arms, parse_arm
from test_cli import _run


def _fake_run(directory: Path, strict: list[float], batch: int = 128) -> Path:
    """A run directory as `rollwise train` writes it: one metrics record per step, evals every 3 steps."""
    directory.mkdir(parents=True)
    records = [{"step": s, "elapsed_s": 10.0 * s, "reward_mean": 0.1 * s, "batch_samples": batch} for s in range(1, 7)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    evals = [{"step": step, "elapsed_s": 10.0 * step, "strict_accuracy": acc} for step, acc in zip((0, 3, 6), strict)]
    (directory / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return directory


def test_arms_average_their_seeds_step_by_step(tmp_path):
    a0 = _fake_run(tmp_path / "a0", [0.1, 0.5, 0.7])
    a1 = _fake_run(tmp_path / "a1", [0.1, 0.7, 0.9])
    b0 = _fake_run(tmp_path / "b0", [0.1, 0.4, 0.8], batch=64)
    arms = load_arms([f"a={a0},{a1}", str(b0)])
    assert [arm.label for arm in arms] == ["a", "b0"]
    rows = held_out_table(arms)
    assert [r["step"] for r in rows] == [0, 3, 6, "mean after step 0"]
    assert rows[1]["a"]["strict_mean"] == pytest.approx(0.6)
    assert rows[1]["a"]["strict_std"] == pytest.approx(0.1414, abs=1e-3)
    assert rows[1]["a"]["samples"] == 3 * 128 and rows[2]["b0"]["samples"] == 6 * 64
    assert rows[3]["a"]["runs"] == pytest.approx([0.6, 0.8])  # each seed's mean over steps 3 and 6
    assert rows[3]["b0"]["strict_mean"] == pytest.approx(0.6)
    final, area = against_first(rows, arms)
    assert final["at"] == "step 6" and final["difference"] == pytest.approx(0.0)
    assert area["difference"] == pytest.approx(-0.1) and area["standard_error"] is None  # b0 is one run
    two = load_arms([f"a={a0},{a1}", f"b={a1},{a0}"])
    assert [d["difference"] for d in against_first(held_out_table(two), two)] == [0.0, 0.0]
    assert against_first(held_out_table(two), two)[1]["standard_error"] == pytest.approx((2 * 0.1414**2 / 2) ** 0.5, abs=1e-3)


def test_an_arm_that_is_not_a_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="LABEL=RUN_DIR"):
        parse_arm("sync=")
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        load_arms([f"x={tmp_path}"])


def test_the_cli_prints_the_table_and_writes_the_plot(tmp_path):
    a0 = _fake_run(tmp_path / "a0", [0.06, 0.64, 0.79])
    a1 = _fake_run(tmp_path / "a1", [0.06, 0.60, 0.75])
    out = _run(["compare", f"sync={a0},{a1}", "--out", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")],
               tmp_path)
    assert out.returncode == 0, out.stderr
    c = _run(["compare", f"sync={a0},{a1}", f"other={a1},{a0}", "--out", str(tmp_path / "d.png")], tmp_path)
    assert "held-out strict, other - sync, step 6: +0.0 points ± 2.8 (standard error: 0.0 of them)" in c.stdout
    assert "sync (2 runs)" in out.stdout and "77.0% ± 2.8% (768)" in out.stdout
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "c.json").read_text())["arms"] == {"sync": [str(a0), str(a1)]}
    bad = _run(["compare", str(tmp_path / "missing")], tmp_path)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stdout
