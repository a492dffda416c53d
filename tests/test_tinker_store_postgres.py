"""The service's request store (rollwise/service/store.py) on both of its backends: SQLite (the default) and a
throwaway Postgres 16 that the `pgserver` package (test extra) runs from its bundled binaries.

What the service relies on: a request's dedup key (the SDK's seq numbering) makes it run exactly once, a resend
gets its first request id back, rows are claimed in arrival order, and several API processes and threads insert at
once. Postgres also enforces what SQLite never did (VARCHAR lengths, 32-bit INTEGER), so long client-chosen names
and big checkpoint sizes are checked on both. The Postgres cases skip only when pgserver cannot start a server
here, and say why."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollwise.service.store import DuplicateRequest, Store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A bare postgresql:// URL of a server private to this module (its data dir removed afterwards)."""
    try:
        import pgserver
    except ImportError as exc:
        pytest.skip(f"pgserver is not installed ({exc}); pip install -e '.[test]'")
    pgdata = Path(tempfile.mkdtemp(prefix="rwpg"))
    try:
        server = pgserver.get_server(pgdata, cleanup_mode="delete")
    except Exception as exc:  # noqa: BLE001 - any failure to start is a reason to skip, reported as such
        shutil.rmtree(pgdata, ignore_errors=True)
        pytest.skip(f"pgserver could not start Postgres here: {type(exc).__name__}: {exc}")
    import psycopg

    with psycopg.connect(server.get_uri(), autocommit=True) as conn:  # a throwaway server: no fsync, quick to stop
        conn.execute("ALTER SYSTEM SET fsync = off")
        conn.execute("ALTER SYSTEM SET synchronous_commit = off")
        conn.execute("SELECT pg_reload_conf()")
    yield server.get_uri()
    server.cleanup()
    shutil.rmtree(pgdata, ignore_errors=True)


def fresh_database(admin_url: str) -> str:
    """A URL whose tables land in a new, empty schema (cheaper than a database: no template copy to write)."""
    import psycopg

    name = "t" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    return f"{admin_url}&options=-csearch_path%3D{name}"


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'requests.sqlite'}"
    return fresh_database(request.getfixturevalue("postgres"))


def test_resend_gets_the_first_id_and_a_reused_seq_id_is_refused(url: str) -> None:
    store = Store(url)
    first = store.submit(owner="a", kind="forward_backward", body=b"\x00\x01", model_id="m", seq_id=1,
                         dedup_key="m#1")
    assert store.submit(owner="a", kind="forward_backward", body=b"\x00\x01", model_id="m", seq_id=1,
                        dedup_key="m#1") == first  # a resend after a lost answer: the same request, not a second
    with pytest.raises(DuplicateRequest):  # the seq id again with another body
        store.submit(owner="a", kind="forward_backward", body=b"\x00\x02", model_id="m", seq_id=1, dedup_key="m#1")
    with pytest.raises(DuplicateRequest):  # another key cannot take (or read) a's request by replaying it
        store.submit(owner="b", kind="forward_backward", body=b"\x00\x01", model_id="m", seq_id=1, dedup_key="m#1")
    # the store still works after the refused inserts (on Postgres a failed statement aborts its transaction)
    second = store.submit(owner="a", kind="optim_step", body=b"{}", model_id="m", seq_id=2, dedup_key="m#2")
    assert [(r.request_id, r.seq_id) for r in store.claimable()] == [(first, 1), (second, 2)]
    assert store.queued_count("a") == 2 and store.queued_count("a", ["optim_step"]) == 1
    assert store.queued_count("b") == 0


def test_rows_run_through_their_states_in_arrival_order(url: str) -> None:
    store = Store(url)
    ids = [store.submit(owner="a", kind="sample", body=bytes([i]) * 3, sampler_id="s", dedup_key=f"s#{i}")
           for i in range(5)]
    refused = store.submit(owner="a", kind="forward", body=b"x", model_id="m", seq_id=0, dedup_key="m#0",
                           failed=("unknown loss 'foo'", "user"))
    rows = store.claimable()
    assert [r.request_id for r in rows] == ids and all(r.body == b"" for r in rows)  # refused row never claimable
    assert store.with_body(rows[2]).body == bytes([2]) * 3
    store.mark_running([rows[0].id, rows[1].id])
    store.finish(rows[0].id, b"\x08\x01", "proto")
    store.fail(rows[1].id, "boom", "server")
    assert store.finished_among([*ids, refused]) == {ids[0], ids[1], refused}
    done = store.request(ids[0])
    assert done is not None and (done.status, done.result, done.result_kind) == ("done", b"\x08\x01", "proto")
    gone = store.request(refused)
    assert gone is not None and (gone.status, gone.error, gone.category) == ("failed", "unknown loss 'foo'", "user")
    store.mark_running([rows[2].id])
    assert store.fail_interrupted() == 1  # a restarted worker fails what the dead one was running
    assert [r.request_id for r in store.claimable()] == ids[3:]


def test_threads_resending_and_inserting_at_once_get_one_row_per_request(url: str) -> None:
    store = Store(url)

    def client(t: int) -> tuple[list[str], list[str]]:
        shared = [store.submit(owner="a", kind="forward_backward", body=f"{k}".encode(), model_id="m", seq_id=k,
                               dedup_key=f"m#{k}") for k in range(12)]
        own = [store.submit(owner="a", kind="sample", body=b"s", dedup_key=f"t{t}#{k}") for k in range(4)]
        return shared, own

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(client, range(6)))
    assert all(shared == results[0][0] for shared, _ in results)  # every resend got the first id
    rows = store.claimable()
    assert len(rows) == 12 + 6 * 4 and len({r.id for r in rows}) == len(rows)
    assert sorted(r.seq_id for r in rows if r.kind == "forward_backward") == list(range(12))


CHILD = """
import sys
from rollwise.service.store import Store
store = Store(sys.argv[1])  # every process creates the tables at once, as the API child and the worker may
sys.stdin.readline()
ids = [store.submit(owner="a", kind="forward_backward", body=b"%d" % k, model_id="m", seq_id=k, dedup_key="m#%d" % k)
       for k in range(10)]
ids += [store.submit(owner="a", kind="sample", body=b"s", dedup_key=sys.argv[2] + "#%d" % k) for k in range(5)]
print(" ".join(ids))
"""


def test_processes_creating_and_inserting_at_once_agree(url: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, url, f"p{i}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate("go\n", timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    ids = [out.split() for out, _ in outs]
    assert ids[0][:10] == ids[1][:10]  # the same seq numbers from two API processes: one request each
    rows = Store(url).claimable()
    assert len(rows) == 10 + 2 * 5
    assert {r.request_id for r in rows} == set(ids[0][:10]) | {i for got in ids for i in got[10:]}


def test_long_client_names_and_big_checkpoints_fit(url: str) -> None:
    store = Store(url)
    session = store.create_session("a")
    model_id = f"{session}:train:" + "9" * 300  # ids and names come from clients: no length bound
    store.add_model(model_id, "a", session, "/models/" + "d" * 500, {"rank": 8}, {"note": "x" * 1000})
    store.add_model(model_id, "a", session, "other", None, None)  # a resent create keeps the first row
    row = store.model(model_id)
    assert row is not None and row["lora_rank"] == 8 and str(row["base_model"]).endswith("d" * 500)
    path = f"tinker://{model_id}/weights/" + "n" * 700
    store.add_checkpoint(path, "a", model_id, "weights/" + "n" * 700, "training", "/d/" + "n" * 700, 5 * 2**30)
    store.add_checkpoint(path, "a", model_id, "weights/" + "n" * 700, "training", "/d/" + "n" * 700, 6 * 2**30)
    assert [c["size_bytes"] for c in store.checkpoints_of(model_id)] == [6 * 2**30]  # replaced, past 32 bits
    store.add_sampler("samp:" + "s" * 400, "a", "base", path)
    assert store.sampler("samp:" + "s" * 400)["model_path"] == path  # type: ignore[index]
    store.set_bases([("b" * 450, "/tok/" + "t" * 900, 8192)])
    assert store.bases() == [{"name": "b" * 450, "tokenizer_id": "/tok/" + "t" * 900, "max_context_length": 8192}]


def test_sessions_end_by_finishing_or_by_silence(url: str) -> None:
    store = Store(url)
    live, done, silent = (store.create_session("a") for _ in range(3))
    for s in (live, done, silent):
        store.add_model(f"{s}:train:0", "a", s, "base", None, None)
    store.touch_session(done, finished=True)
    cutoff = time.time()
    time.sleep(0.01)
    store.touch_session(live)
    store.touch_session(done)
    assert store.session_owner(done) == ("a", True) and store.session_owner("nope") is None
    assert store.ended_models([f"{s}:train:0" for s in (live, done, silent)], cutoff) == {
        f"{done}:train:0", f"{silent}:train:0"}


def test_postgres_url_forms_and_refusals(postgres: str) -> None:
    url = fresh_database(postgres)
    assert url.startswith("postgresql://")  # bare: the store picks the psycopg 3 driver itself
    with_password = url.replace("postgres:@", "postgres:s3cret@", 1)
    store = Store(with_password)  # local socket trust auth ignores the password; it must not be printed
    assert "s3cret" not in store.url and store.url.startswith("postgresql+psycopg://")
    with pytest.raises(ValueError, match="--database: 'mysql' is not supported"):
        Store("mysql://u@h/db")
    with pytest.raises(ValueError, match="--database: .* is not a database URL"):
        Store("not a url")
    with pytest.raises(ValueError, match=r"--database: cannot open postgresql\+psycopg://.*nosuchdb"):
        Store(url.replace("/postgres?", "/nosuchdb?", 1))


def test_serve_tinker_runs_on_postgres(postgres: str, tmp_path: Path) -> None:
    """`rollwise serve tinker --database postgresql://...`: the API child and the worker share the Postgres store;
    the unmodified SDK trains and samples, and every request is a row there, once, done, in seq order."""
    import os
    import signal

    import httpx
    import tinker
    from sqlalchemy import select
    from tinker import types

    from rollwise.local_server import free_port
    from rollwise.service.store import requests

    url, key, port = fresh_database(postgres), "tml-" + "p" * 28, free_port()
    (tmp_path / "keys.txt").write_text(key + "\n")
    env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rollwise.cli", "serve", "tinker", "--port", str(port),
                             "--api-keys", str(tmp_path / "keys.txt"), "--base-model", "tiny:0", "--data-dir",
                             str(tmp_path), "--threads", "1", "--log-level", "warning", "--database", url], env=env)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", headers={"X-API-Key": key}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "rollwise serve tinker --database postgresql://... exited during start-up"
            assert time.monotonic() < deadline, "no healthz in 90 s"
            time.sleep(0.2)
        os.environ.setdefault("TINKER_TELEMETRY", "0")
        client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
        tc = client.create_lora_training_client(base_model="tiny:0", rank=4, seed=1).result()
        toks = [(3 * t) % 50 + 5 for t in range(12)]
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 11})]
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        sampled = tc.save_weights_and_get_sampling_client().sample(
            types.ModelInput.from_ints([5, 9, 13]), num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result()
        assert [len(s.tokens) for s in sampled.sequences] == [3, 3]
        with Store(url).engine.connect() as c:
            rows = c.execute(select(requests.c.seq_id, requests.c.status)
                             .where(requests.c.model_id == tc.model_id)).all()
        assert sorted(seq for seq, _ in rows) == list(range(len(rows))) and len(rows) >= 7  # create + 6 + push
        assert {status for _, status in rows} == {"done"}
        client.close("success").result(timeout=30)  # its heartbeat thread would outlive the server otherwise
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
