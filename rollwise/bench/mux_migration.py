"""`rollwise bench mux --migration` (issue 42): a pool slot drained for another job, three ways.

One pool (`EnginePool`, 2 reference-engine slots, on loopback HTTP as `rollwise serve pool` serves it), job A on
both slots, A's long greedy requests running on one of them; then job B asks for a slot. The slot A's requests run
on drains for B:

    migration  the pool moves A's running requests to A's other slot (rollwise.pool.slot_migration: the target
               prefills their tokens while the source keeps decoding, then they continue there) and switches to B
    wait       the pool lets them finish where they are, then switches (`--drain-by wait`)
    abort      what callers did before live migration: A's client aborts its running requests (getting the tokens
               so far, which it throws away) and submits them again; they regenerate from their prompt on A's
               other slot, and the emptied slot switches to B at once

Measured from B's submit: B's first answer (how long the incoming job waited for the slot, plus its own few tokens),
the last of A's long requests done, and the drain episode = the later of the two (the slot handed over AND the
drained work done). Tokens regenerated: the sampled tokens the abort threw away (0 for the other two); tokens
prefilled: what the migration cost the target instead. A's samples must be equal in every arm (greedy: nothing lost,
nothing duplicated, the same tokens as one engine) -- the run stops if they are not.

Goals (issue 42: "draining a slot by migration instead of abort and regenerate: tokens regenerated -> 0 and the
drain's wall time cut by >= 2x"): `goals.migration_tokens_regenerated` (tokens, target 0) and
`goals.drain_episode_abort_vs_migration` (abort's drain episode / migration's, target >= 2). The drain is started
when A's requests are about DRAIN_AT of the way through (from a timed run of the same requests first; both timed
from when all of them run on the engines, not from their submission), so what an
abort throws away is that share of their work; the JSON has the tokens actually sampled at the drain.
Arms interleave over rounds; medians reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from rich.table import Table

from rollwise.control.pool_backend import PoolClient
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.pool.app import create_app
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.scheduler import Policy
from rollwise.types.generation import GenerationRequest, SamplingParams

ARMS = ("migration", "wait", "abort")
DRAIN_AT = 0.75  # share of A's requests' tokens sampled when B arrives
GOAL_EPISODE_RATIO = 2.0


def _requests(prefix: str, count: int, tokens: int, prompt_len: int = 16) -> list[GenerationRequest]:
    out = []
    for i in range(count):
        prompt = torch.randint(5, 90, (prompt_len,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        out.append(GenerationRequest(f"{prefix}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                               ignore_eos=True)))
    return out


class _Poller:
    """A job's samples as the pool posts them, each with the time it was seen."""

    def __init__(self, client: PoolClient) -> None:
        self.client, self.seen, self.got = client, 0, []

    def until(self, count: int, timeout: float = 600.0) -> list[tuple[float, dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        while len(self.got) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.got)} of {count} samples arrived within {timeout:.0f} s")
            out = self.client.poll(self.seen, 1.0)
            now = time.perf_counter()
            self.got += [(now, e) for e in out["completions"]]
            self.seen = max([self.seen] + [e["seq"] for e in out["completions"]])
        return self.got


def _wait_running(pool: EnginePool, job: str, count: int, timeout: float = 120.0) -> None:
    """Until `count` of `job`'s requests run on the pool's engines. The drain is timed from here, in every arm and
    in the run alone: on a loaded machine admission can take a varying share of the requests' time, and a drain
    timed from their submission then found them still queued (nothing to abort or migrate) or already done."""
    deadline = time.monotonic() + timeout
    while sum(s["running_by_job"].get(job, 0) for s in pool.state()["slots"]) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} of job {job!r}'s requests were running after {timeout:.0f} s")
        time.sleep(0.005)


def _one_run(arm: str, model_spec: str, requests: int, tokens: int, drain_after_s: float | None) -> dict[str, Any]:
    """One pool, one drain: the arm's measurements (drain_after_s None: time A's requests alone instead)."""
    model, tok = load_model(model_spec)
    fp = tokenizer_fingerprint(tok)
    state = model.state_dict()
    pool = EnginePool(2, max_num_seqs=max(8, requests), max_model_len=tokens + 64,
                      policy=Policy(min_slice_s=0.0, drain_by="migration" if arm == "migration" else "wait"))
    with serve_in_thread(create_app(pool)) as (url, _):
        a, b = PoolClient(url), PoolClient(url)
        try:
            a.attach("a", model_spec, 1.0, fp)
            b.attach("b", model_spec, 1.0, fp)
            a.push_weights(state, 0, fp)
            b.push_weights(state, 0, fp)
            pa, pb = _Poller(a), _Poller(b)
            for attempt in range(6):  # both slots serving A (A's engine active on each), as in a busy pool
                a.submit(_requests(f"warm{attempt}", 16, 2))
                pa.until(len(pa.got) + 16)
                if [s["job"] for s in pool.state()["slots"]] == ["a", "a"]:
                    break
            else:
                raise RuntimeError("the pool never put job A on both slots")
            pa.got.clear()
            long = _requests("long", requests, tokens)
            a.submit(long)
            _wait_running(pool, "a", requests)
            started = time.perf_counter()
            if drain_after_s is None:
                done = pa.until(requests)
                return {"alone_s": max(t for t, _ in done) - started}
            time.sleep(drain_after_s)
            t0 = time.perf_counter()
            regenerated = 0
            if arm == "abort":
                aborted = a.abort([r.request_id for r in long])["aborted"]
                regenerated = sum(len(e["token_ids"]) for e in aborted)
                b.submit(_requests("b", 1, 4))
                a.submit(_requests("again", requests, tokens))
            else:
                b.submit(_requests("b", 1, 4))
            b_done = pb.until(1)[0][0] - t0
            finished = pa.until(requests)
            a_done = max(t for t, _ in finished) - t0
            migrations = pool.state()["migrations"]
            samples = sorted((e["request_id"].split("-")[1], e["token_ids"]) for _, e in finished)
        finally:
            for client in (a, b):
                try:
                    client.detach()
                except Exception:  # noqa: BLE001 - the run's result (or its error) matters, not the cleanup's
                    pass
            pool.close()
    log = migrations["log"]
    return {"arm": arm, "drain_after_s": drain_after_s, "b_first_answer_s": b_done, "a_done_s": a_done,
            "episode_s": max(a_done, b_done), "tokens_regenerated": regenerated,
            "tokens_at_drain": sum(int(m["tokens"]) for m in log) if log else regenerated or None,
            "tokens_migrated": [int(m["tokens"]) for m in log],
            "tokens_prefilled": sum(int(m["tokens_prefilled"]) for m in log), "migrations": len(log),
            "samples": samples}


def run_migration_bench(quick: bool = False, model: str = "bundled:smollm2-135m-instruct",
                        rounds: int | None = None, drain_at: float = DRAIN_AT) -> dict[str, Any]:
    """--quick: the tiny model, whose 900 tokens take about a second: it checks the arms run and agree, its times
    are too short to read."""
    spec = "tiny:0" if quick else model
    requests, tokens = (4, 900) if quick else (4, 256)
    rounds = rounds or (1 if quick else 3)
    alone = _one_run("wait", spec, requests, tokens, None)["alone_s"]
    drain_after = drain_at * alone
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            runs[arm].append(_one_run(arm, spec, requests, tokens, drain_after))
    reference = runs["wait"][0]["samples"]
    for arm, arm_runs in runs.items():
        for run in arm_runs:
            if run["samples"] != reference:
                raise RuntimeError(f"arm {arm}: job A's samples differ from the wait arm's (lost, duplicated or "
                                   "changed tokens)")
            run.pop("samples")
    median = {arm: {k: statistics.median(r[k] for r in arm_runs)
                    for k in ("b_first_answer_s", "a_done_s", "episode_s", "tokens_regenerated", "tokens_prefilled")}
              for arm, arm_runs in runs.items()}
    if not all(r["migrations"] for r in runs["migration"]):
        raise RuntimeError("the migration arm's drain did not migrate (see the pool's slot errors)")
    goals = {"migration_tokens_regenerated": median["migration"]["tokens_regenerated"],
             "drain_episode_abort_vs_migration": median["abort"]["episode_s"] / median["migration"]["episode_s"],
             "drain_episode_wait_vs_migration": median["wait"]["episode_s"] / median["migration"]["episode_s"]}
    return {"benchmark": "mux_migration", "quick": quick, "model": spec,
            "workload": {"requests": requests, "tokens": tokens, "drain_at": drain_at, "alone_s": alone,
                         "drain_after_s": drain_after, "rounds": rounds},
            "runs": runs, "median": median, "goals": goals,
            "goal_targets": {"migration_tokens_regenerated": 0, "drain_episode_abort_vs_migration": GOAL_EPISODE_RATIO}}


def format_migration_bench(result: dict[str, Any]) -> Table:
    w = result["workload"]
    table = Table(title=f"a pool slot drained for another job ({result['model']}, {w['requests']} greedy requests of "
                        f"{w['tokens']} tokens, drained at {w['drain_at']:.0%}; medians of {w['rounds']} rounds)")
    for col in ("arm", "B's first answer s", "A's requests done s", "drain episode s", "tokens regenerated",
                "tokens prefilled"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, m in result["median"].items():
        table.add_row(arm, f"{m['b_first_answer_s']:.2f}", f"{m['a_done_s']:.2f}", f"{m['episode_s']:.2f}",
                      f"{m['tokens_regenerated']:.0f}", f"{m['tokens_prefilled']:.0f}")
    g = result["goals"]
    table.caption = (f"drain episode: abort / migration {g['drain_episode_abort_vs_migration']:.2f}x (goal >= "
                     f"{GOAL_EPISODE_RATIO:g}x), wait / migration {g['drain_episode_wait_vs_migration']:.2f}x; tokens "
                     f"regenerated by migration {g['migration_tokens_regenerated']:.0f} (goal 0)")
    return table
