"""`rollwise bench sandbox --quick` runs real isolated launches and reports every operation."""

from rich.console import Console

from rollwise.bench.sandbox import format_sandbox_bench, run_sandbox_bench


def test_sandbox_bench_quick_measures_every_operation():
    result = run_sandbox_bench(quick=True)
    for op in ("create", "exec", "fork", "destroy"):
        assert result[op]["n"] == 10 and 0 < result[op]["p50_ms"] <= result[op]["p99_ms"]
    concurrency = result["concurrency"]
    assert concurrency["tried"][0]["sandboxes"] == 8 and concurrency["held"] >= 8
    assert all(step["ok"] <= step["sandboxes"] for step in concurrency["tried"])
    Console(width=120, record=True).print(format_sandbox_bench(result))
