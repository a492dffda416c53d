"""`placement: ray` on a real local Ray cluster (CPU only), with real engines and the tiny model.

- a short `rollwise train placement=ray` run (the CLI, as a user runs it) against a cluster started
  here with `ray start --head`: it finishes, writes summary.json, and its sample ledger accounts for
  every sample (trained, or dropped at the end with a reason), with engines, trainer and reward
  workers as actors;
- an engine actor is killed mid-rollout: Ray restarts it, the fleet re-syncs it to the current policy
  version and resubmits its requests; the run finishes, every request id / sample is delivered
  exactly once, and the samples generated after the restart carry the trainer's current version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="placement: ray needs Ray: pip install -e '.[ray]'")

from rollwise.config import load_config  # noqa: E402
from rollwise.control.ray import placement as ray_placement  # noqa: E402
from rollwise.control.train_loop import train  # noqa: E402
from ray_local import GROUP, PROMPTS, STEPS, ray_cluster, ray_config  # noqa: E402,F401 (the fixture)

def _check_ledger(summary: dict, steps: int = STEPS) -> None:
    counts = summary["samples"]
    total = sum(counts.values())
    assert counts["trained"] == steps * PROMPTS * GROUP, counts
    # Nothing left in between: every sample was trained or dropped at the end of the run (with a reason).
    assert counts["queued"] == counts["running"] == counts["finished"] == counts["batched"] == 0, counts
    assert counts["trained"] + counts["dropped"] == total, counts


def test_train_on_ray_cluster_end_to_end(ray_cluster, tmp_path):
    """The CLI run, async rollout (pause/abort/continue across updates all go through the fleet)."""
    config = ray_config(tmp_path, ray_cluster, mode="async", steps=2)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "ROLLWISE_CACHE": str(tmp_path / "rollwise-cache")}
    script = Path(sys.executable).parent / "rollwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]
    proc = subprocess.run(cmd + ["train", "--config", str(config)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in proc.stderr, out[-6000:]
    # Where the actors run is printed.
    assert "1 trainer actor(s)" in out and "2 engine actor(s)" in out and "reward actor(s) on" in out, out[-4000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["policy_version"] for r in records] == [1, 2]
    assert summary["policy_version"] == 2 and summary["engine_restarts"] == 0
    assert all(r["staleness_max"] <= 1 for r in records)  # eta = 1 holds across engine actors
    # Each reward actor scores in its own reward pool's worker processes (reward.executor: pool, the default).
    assert all(r["reward_worker_pids"] and r["reward_errors"] == 0 for r in records)
    _check_ledger(summary, steps=2)
    # Checkpoints are written by the trainer actor.
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["policy_version"] == 2 and (run_dir / "checkpoints" / "step_000002" / "model").is_dir()
    assert 0.0 <= summary["bubble_ratio_run"] <= 1.0


def test_engine_actor_killed_mid_rollout_is_restarted_and_resynced(ray_cluster, tmp_path, monkeypatch):
    """Sync rollout (each group is one request, so the ledger counts are exact); the kill lands in step 2,
    after the first weight update, while the killed engine still has samples to generate."""
    # max_restarts=1: the first kill is restarted; a second kill of the same engine is for good, and
    # its requests move to the other engine.
    cfg = load_config(ray_config(tmp_path, ray_cluster, mode="sync"), ["ray.max_restarts=1"])
    seen: dict = {}

    def kill_mid_rollout(fleet, slot, completion):
        if "killed" in seen or fleet._version < 1 or not completion.request_id.startswith("g"):
            return
        busy = [s for s in fleet.slots if s.alive and fleet.pending_samples(s.index) > 0]
        if busy:  # mid-rollout: that engine still owes samples
            victim = busy[0]
            seen["killed"] = (victim.index, victim.info["token"], fleet._version, fleet.pending_samples(victim.index))
            ray.kill(victim.actor, no_restart=False)

    def hook(fleet):
        seen["fleet"] = fleet
        fleet.deliveries = []
        fleet.on_deliver = kill_mid_rollout
        submit = fleet.submit

        def submit_then_kill_again(requests):
            submit(requests)
            if "killed" in seen and "killed_again" not in seen and fleet.restarts == 1:
                victim = fleet.slots[seen["killed"][0]]
                if fleet.pending_samples(victim.index) > 0:  # the next rollout's requests reached it
                    seen["killed_again"] = fleet.pending_samples(victim.index)
                    ray.kill(victim.actor, no_restart=False)

        fleet.submit = submit_then_kill_again

    monkeypatch.setattr(ray_placement, "FLEET_HOOKS", [hook])
    monkeypatch.chdir(tmp_path)
    summary = train(cfg)

    fleet = seen["fleet"]
    assert "killed" in seen, "no engine had samples in flight in steps 2-3 to kill"
    victim, old_token, version_at_kill, _ = seen["killed"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2, 3]

    # Restarted once, re-synced to the trainer's version at that moment, its requests resubmitted.
    assert fleet.restarts == 1 and len(fleet.restart_log) == 1, fleet.restart_log
    entry = fleet.restart_log[0]
    print(f"restart: {entry}")
    assert entry["engine"] == victim and entry["requests_resubmitted"] >= 1
    assert entry["policy_version"] == version_at_kill
    assert entry["policy_version"] in [r["policy_version"] for r in records[:-1]]  # a version the trainer pushed
    new_token = fleet.slots[victim].info["token"]
    assert new_token != old_token
    after = [c for s, token, c in fleet.deliveries if s == victim and token == new_token
             and c.request_id.startswith("g") and c.token_ids]
    step_of_kill = version_at_kill  # sync: step k+1 generates with version k
    resubmitted = [c for c in after if int(c.request_id[1:].split("/")[0]) // PROMPTS == step_of_kill]
    assert resubmitted, "nothing generated by the restarted engine in the step it died"
    for c in resubmitted:
        assert set(c.versions) == {version_at_kill}, (c.request_id, c.versions)

    # Nothing lost, nothing twice: every training sample delivered exactly once, nothing owed at the end.
    keys = [(c.request_id, c.index) for _, _, c in fleet.deliveries]
    assert len(keys) == len(set(keys)), "a completion was delivered twice"
    train_keys = {k for k in keys if k[0].startswith("g")}
    assert train_keys == {(f"g{g}", i) for g in range(STEPS * PROMPTS) for i in range(GROUP)}
    assert not fleet.owed.requests
    _check_ledger(summary)
    assert summary["samples"]["dropped"] == 0
    assert summary["engine_restarts"] == 1 and records[-1]["engine_restarts"] == 1

    # The second kill: restarts used up, the engine is gone for good; its requests were generated by
    # the survivor (counted above: every sample delivered once, every sample trained).
    assert "killed_again" in seen, "the restarted engine got no requests in the next step"
    assert not fleet.slots[victim].alive and fleet.slots[1 - victim].alive
    assert summary["engines_alive"] == 1


def _cli(config: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "ROLLWISE_CACHE": str(tmp_path / "rollwise-cache")}
    script = Path(sys.executable).parent / "rollwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]
    return subprocess.run(cmd + ["train", "--config", str(config), *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_two_trainer_rank_actors_train_then_a_killed_rank_fails_clearly_and_resume_continues(ray_cluster, tmp_path):
    """`ray.trainer_ranks=2`: the sharded trainer as two Ray actors forming one gloo group (issue 18
    item 5). The run trains and checkpoints sharded (dcp/); a rank actor killed mid-step fails the
    run with an error naming the rank and the resume command; `checkpoint.resume=auto` continues."""
    config = ray_config(tmp_path, ray_cluster, mode="sync", steps=2)
    ranks = ["ray.trainer_ranks=2", "ray.num_engines=1"]  # 2 x 0.5 CPU trainers + 0.5 engine + 0.25 reward
    run_dir = tmp_path / "run"

    # Step 1 trains and checkpoints; rank 1's actor is killed during step 2's train step (the commands
    # are out, rank 0 waits in a collective).
    from rollwise.control.ray.trainer_ranks import RayRankGroup
    from rollwise.train.rank_group import TrainerRankError

    get, train_calls = RayRankGroup._get, []

    def kill_rank_1_in_step_2(group, refs, what):
        if what == "train":
            train_calls.append(True)
            if len(train_calls) == 2:  # the step's commands are out: kill at once
                ray.kill(group.actors[1], no_restart=True)
        return get(group, refs, what)

    cfg = load_config(config, ranks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RayRankGroup, "_get", kill_rank_1_in_step_2)
        mp.chdir(tmp_path)
        # The step's train or the gather right after it (a tiny model's step can finish before the
        # kill lands): either way the death is named and the run stops.
        with pytest.raises(TrainerRankError, match=r"trainer rank 1 \(a Ray actor\) died during "
                                                   r"(train|the weight gather).*checkpoint.resume=auto"):
            train(cfg)
    assert len(train_calls) == 2
    assert (run_dir / "checkpoints" / "step_000001" / "dcp").is_dir()  # every rank's shard
    assert not (run_dir / "checkpoints" / "step_000002").exists()

    proc = _cli(config, tmp_path, *ranks, "checkpoint.resume=auto")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "2 trainer actor(s)" in out, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2]
    assert all(r["trainer_rank_token_imbalance"] >= 1.0 for r in records)  # the steps ran on the ranks
    assert (run_dir / "checkpoints" / "step_000002" / "dcp").is_dir()
    _check_ledger(json.loads((run_dir / "summary.json").read_text()), steps=1)  # the resumed process's step


# ---------------------------------------------------------------- the engine actor's own class, no cluster


def _actor_cfg() -> dict:
    from rollwise.config import dump_config
    from rollwise.config import load_config as load

    cfg = load(None, ["model=tiny:0", "engine.kind=reference", "engine.max_num_seqs=4", "engine.max_model_len=64",
                      "rollout.group_size=4", "rollout.max_tokens=16", "threads=1", "task.name=basic_arithmetic"])
    return dump_config(cfg)


def test_engine_actor_refuses_a_different_tokenizer():
    """Invariant 1: an engine whose tokenizer differs from the trainer's says so on its first call."""
    from rollwise.control.ray.engine_actor import EngineActor

    actor = EngineActor(_actor_cfg(), 0, "0" * 64, None, 0)
    with pytest.raises(RuntimeError, match="tokenizer fingerprint mismatch"):
        actor.info()


def test_engine_actor_resends_until_acknowledged():
    """A drain reply lost in transit is sent again; what the fleet acknowledged is never sent twice; an
    abort hands back the samples that finished before it."""
    from rollwise.control.ray.engine_actor import EngineActor
    from rollwise.types.generation import GenerationRequest, SamplingParams
    from rollwise.model.loading import load_model, tokenizer_fingerprint

    _, tokenizer = load_model("tiny:0")
    actor = EngineActor(_actor_cfg(), 0, tokenizer_fingerprint(tokenizer), None, 0)
    try:
        assert actor.info()["policy_version"] == 0
        actor.submit([GenerationRequest("a", [5, 6, 7], SamplingParams(max_tokens=4, n=2, seed=1))])
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got = actor.drain(0, 1.0)  # never acknowledged: everything comes back every time
        assert sorted((c.request_id, c.index) for _, c in got) == [("a", 0), ("a", 1)]
        assert [s for s, _ in actor.drain(0, 0.1)] == [s for s, _ in got]
        assert actor.drain(max(s for s, _ in got), 0.1) == []  # acknowledged: gone
        # Finished before the abort: not an abort completion, but in the unacknowledged list.
        actor.submit([GenerationRequest("b", [5, 6], SamplingParams(max_tokens=2, n=1, seed=2))])
        deadline = time.monotonic() + 30
        while actor.worker.completions.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        aborted, unacked = actor.abort(["b"], max(s for s, _ in got))
        assert aborted == [] and [(c.request_id, c.finish_reason) for _, c in unacked] == [("b", "length")]
        # A call meant for a previous incarnation (the actor died and was restarted) does nothing.
        from rollwise.control.ray.engine_actor import IncarnationChanged

        with pytest.raises(IncarnationChanged):
            actor.submit([GenerationRequest("c", [5], SamplingParams(max_tokens=2))], "an-older-incarnation")
        assert actor.worker.call(lambda e: e.has_unfinished()) is False
    finally:
        actor.worker.close()
