"""`rollwise bench sync`'s plumbing on a tiny model (the numbers it prints are measured on an idle machine and
recorded in docs/benchmarks.md): every row is a real push, and the adapter is compared on each path."""

from __future__ import annotations

import pytest

from rollwise.bench.sync import format_sync_bench, load_bench_model, run_sync_bench


def test_adapter_only_bench_pushes_full_weights_and_an_adapter_on_each_path():
    model, tokenizer = load_bench_model("tiny:0")
    result = run_sync_bench(model, tokenizer, model_spec="tiny:0", quick=True, adapter_only=True)
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"gloo broadcast", "adapter gloo broadcast", "gloo broadcast, buffers kept", "in-process",
                         "adapter in-process", "adapter checksummed"}
    assert all(row["seconds"] > 0 for row in rows.values())
    adapter = result["adapter"]
    assert rows["adapter in-process"]["bytes"] == adapter["bytes"] < rows["in-process"]["bytes"]
    assert set(adapter["time_vs_full"]) == {"in-process", "gloo"}
    assert all(ratio > 0 for ratio in adapter["time_vs_full"].values())
    assert "gloo with the engine keeping its receive buffers" in str(format_sync_bench(result).caption)


def test_an_unknown_model_shape_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model shape 'llama-70b': one of \['llama-3.2-1b'\]"):
        load_bench_model("shape:llama-70b")
