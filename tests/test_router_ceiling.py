"""rollwise.bench.router_ceiling: a recorded burst's placement replayed per replica on the real engine code."""

import json

from rollwise.bench.router_ceiling import burst_bound, burst_bounds, main

SHAPE = {"replicas": 2, "groups": 2, "group_size": 4, "group_workers": 2, "sessions": 1, "turns": 1,
         "shared_tokens": 16, "question_tokens": 48, "opening_tokens": 32, "user_tokens": 8, "max_tokens": 2,
         "rounds": 1, "max_num_seqs": 16, "max_model_len": 256}


def _log(placement: list[tuple[str, str, str]]) -> list[dict]:
    """(kind, key, replica) in send order -> a bench router requests_log round; one later request that is
    not part of the burst."""
    rows = [{"kind": kind, "key": key, "replica": replica, "start_s": 0.001 * i, "latency_s": 0.5}
            for i, (kind, key, replica) in enumerate(placement)]
    return rows + [{"kind": "group", "key": "g0", "replica": "B", "start_s": 1.0, "latency_s": 0.1}]


def _bench_json(tmp_path):
    # prefix-like: each group on one replica, the session beside one of them; round robin: every group split
    together = [("session", "s0", "A")] + [("group", "g0", "A")] * 4 + [("group", "g1", "B")] * 4
    spread = [("session", "s0", "A")] + [("group", f"g{g}", "AB"[i % 2]) for g in range(2) for i in range(4)]
    policies = {name: {"requests_log": [_log(placement)], "p99_latency_s_median_round": p99, "p99_latency_s": p99}
                for name, placement, p99 in (("prefix", together, 0.5), ("round_robin", spread, 0.8))}
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"command": "rollwise bench router", "real": {"workload": SHAPE, "policies": policies}}))
    return path


def test_a_burst_is_bounded_by_its_busiest_replica_and_by_the_cores():
    assert burst_bound([1.0, 0.2], cores=2) == 1.0
    assert abs(burst_bound([0.6, 0.6, 0.6], cores=2) - 0.9) < 1e-12


def test_replayed_placements_compute_exactly_the_prompt_tokens_they_cannot_share(tmp_path):
    result = burst_bounds(_bench_json(tmp_path), ["prefix", "round_robin"], cores=2, repeats=1)
    (row,) = result["rounds"]
    prompt = SHAPE["shared_tokens"] + SHAPE["question_tokens"]
    # Identical prompts admitted together share one prefill: a group on one replica computes its prompt once,
    # a group split over two replicas twice (the second group on a replica finds the shared system prompt in
    # its prefix cache); the session's opening is computed wherever it goes. The later request (t = 1 s) is not
    # part of the burst.
    assert sorted(row["prefix"]["prefill_tokens_per_replica"]) == sorted([prompt + SHAPE["opening_tokens"], prompt])
    assert sorted(row["round_robin"]["prefill_tokens_per_replica"]) == sorted(
        [2 * prompt - SHAPE["shared_tokens"] + SHAPE["opening_tokens"], 2 * prompt - SHAPE["shared_tokens"]])
    assert row["prefix"]["requests_per_replica"] == [5, 4]
    for arm in ("prefix", "round_robin"):
        work = row[arm]["replica_cpu_s"]
        assert all(w > 0 for w in work) and row[arm]["bound_s"] == burst_bound(work, 2)


def test_the_command_prints_the_ceiling_and_writes_json(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    main([str(_bench_json(tmp_path)), "--repeats", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "prefix vs round_robin: the burst's work allows" in printed
    result = json.loads(out.read_text())
    assert result["ceiling"]["round_robin"] > 0 and result["measured_p99_s"] == {"prefix": 0.5, "round_robin": 0.8}
