"""The service's durable state: every accepted request is a row, so a killed API process loses nothing.

The API process (stateless) inserts rows and reads results; the worker process claims rows, runs them and
writes results back. SQLAlchemy Core over SQLite (a file under --data-dir, WAL so readers never wait for the
writer) by default, or Postgres by URL (`--database postgresql://...`).

Exactly once: a request is identified by what the SDK numbers it with (`dedup_key`: a model's seq_id, a
sampling session's seq_id, a session's model_seq_id), unique in the table. A client that resends after the
API died before answering gets the row it already has (same body) instead of a second execution.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from sqlalchemy import (BigInteger, Boolean, Column, Float, Integer, LargeBinary, MetaData, Table, Text, create_engine,
                        event, func, insert, select, update)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, ProgrammingError

Status = Literal["queued", "running", "done", "failed"]
ResultKind = Literal["json", "proto"]

meta = MetaData()
# Strings are Text (unbounded): ids, names and paths come from clients, and Postgres enforces a VARCHAR(n) length
# that SQLite ignores, so a bound would be a Postgres-only 500.

sessions = Table(
    "sessions", meta,
    Column("session_id", Text, primary_key=True),
    Column("owner", Text, nullable=False, index=True),
    Column("created_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    Column("finished", Boolean, nullable=False, default=False),
)

models = Table(
    "models", meta,
    Column("model_id", Text, primary_key=True),
    Column("owner", Text, nullable=False, index=True),
    Column("session_id", Text, nullable=False),
    Column("base_model", Text, nullable=False),
    Column("is_lora", Boolean, nullable=False),
    Column("lora_rank", Integer, nullable=True),
    Column("lora_config", Text, nullable=True),  # JSON of the SDK's LoraConfig (None: full-parameter)
    Column("user_metadata", Text, nullable=True),  # JSON
    Column("created_at", Float, nullable=False),
    Column("last_request_at", Float, nullable=False),
)

requests = Table(
    "requests", meta,
    Column("id", Integer, primary_key=True, autoincrement=True),  # the worker's claim order
    Column("request_id", Text, nullable=False, unique=True),
    Column("owner", Text, nullable=False, index=True),
    Column("kind", Text, nullable=False),
    Column("model_id", Text, nullable=True, index=True),
    Column("seq_id", Integer, nullable=True),
    Column("sampler_id", Text, nullable=True),
    Column("dedup_key", Text, nullable=True, unique=True),
    Column("body_hash", Text, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("status", Text, nullable=False, index=True),
    Column("result", LargeBinary, nullable=True),
    Column("result_kind", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("category", Text, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
)

samplers = Table(
    "samplers", meta,
    Column("sampler_id", Text, primary_key=True),
    Column("owner", Text, nullable=False, index=True),
    Column("base_model", Text, nullable=False),
    Column("model_path", Text, nullable=True),
    Column("created_at", Float, nullable=False),
)

checkpoints = Table(
    "checkpoints", meta,
    Column("tinker_path", Text, primary_key=True),
    Column("owner", Text, nullable=False, index=True),
    Column("model_id", Text, nullable=False, index=True),
    Column("checkpoint_id", Text, nullable=False),  # `weights/{name}` or `sampler_weights/{name}`
    Column("kind", Text, nullable=False),  # "training" | "sampler"
    Column("directory", Text, nullable=False),
    Column("size_bytes", BigInteger, nullable=True),  # checkpoints pass 2 GiB
    Column("created_at", Float, nullable=False),
)

bases = Table(  # written by the worker once its base models are loaded; the API answers capabilities from it
    "bases", meta,
    Column("name", Text, primary_key=True),
    Column("tokenizer_id", Text, nullable=False),
    Column("max_context_length", Integer, nullable=False),
)


@dataclass(frozen=True)
class RequestRow:
    id: int
    request_id: str
    owner: str
    kind: str
    model_id: str | None
    seq_id: int | None
    sampler_id: str | None
    body: bytes
    status: Status
    result: bytes | None
    result_kind: ResultKind | None
    error: str | None
    category: str | None


class DuplicateRequest(Exception):
    """The dedup key is taken by a request with another body: the seq_id (or model_seq_id) was used already."""


def sqlite_url(path: str) -> str:
    return f"sqlite:///{path}"


def engine_url(url: str) -> str:
    """The SQLAlchemy URL to connect with. A bare `postgresql://` (or `postgres://`) gets the psycopg 3 driver, the one
    the `postgres` extra installs (SQLAlchemy's default for a bare URL is psycopg2)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(f"--database: {url!r} is not a database URL; give e.g. postgresql://user:pass@host/db or "
                         "sqlite:///path/requests.sqlite") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if not parsed.drivername.startswith(("sqlite", "postgresql")):
        raise ValueError(f"--database: {parsed.drivername!r} is not supported; use a postgresql:// or sqlite:/// URL")
    return parsed.render_as_string(hide_password=False)


def _on_connect_sqlite(dbapi_connection: object, _record: object) -> None:
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")  # readers (the API) never wait for the writer (the worker)
    cursor.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process kill
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


class Store:
    """Rows of sessions, models, requests, samplers, checkpoints. Safe to use from several threads and processes."""

    def __init__(self, url: str) -> None:
        connect = engine_url(url)
        self.url = make_url(connect).render_as_string(hide_password=True)  # printed at start: no password in logs
        sqlite = connect.startswith("sqlite")
        try:  # pre-ping: a Postgres restarted under a running service costs a reconnect, not a failed request
            self.engine: Engine = create_engine(connect, future=True, pool_pre_ping=not sqlite)
        except ModuleNotFoundError as exc:
            raise ValueError(f"--database: the driver for {self.url} is not installed ({exc.name}); "
                             "pip install 'rollwise[postgres]'") from None
        if sqlite:
            event.listen(self.engine, "connect", _on_connect_sqlite)
        self._create_tables()

    def _create_tables(self) -> None:
        """Create what is missing. The API child and the worker may both do it at once: the loser of that race sees
        "already exists" (SQLite: OperationalError; Postgres: a unique violation in its catalog) and looks again."""
        for attempt in range(3):
            try:
                meta.create_all(self.engine)
                return
            except (IntegrityError, ProgrammingError, OperationalError) as exc:
                if attempt == 2:  # not a race: the database cannot be reached or used
                    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
                    raise ValueError(f"--database: cannot open {self.url}: {reason}") from None
                time.sleep(0.05 * (attempt + 1))

    # --- sessions and models (the API's synchronous writes) ---
    def create_session(self, owner: str) -> str:
        session_id = uuid.uuid4().hex[:16]
        now = time.time()
        with self.engine.begin() as c:
            c.execute(insert(sessions).values(session_id=session_id, owner=owner, created_at=now, heartbeat_at=now,
                                              finished=False))
        return session_id

    def session_owner(self, session_id: str) -> tuple[str, bool] | None:
        with self.engine.connect() as c:
            row = c.execute(select(sessions.c.owner, sessions.c.finished)
                            .where(sessions.c.session_id == session_id)).first()
        return None if row is None else (row.owner, bool(row.finished))

    def touch_session(self, session_id: str, *, finished: bool = False) -> None:
        values: dict[str, object] = {"heartbeat_at": time.time()}
        if finished:
            values["finished"] = True
        with self.engine.begin() as c:
            c.execute(update(sessions).where(sessions.c.session_id == session_id).values(**values))

    def add_model(self, model_id: str, owner: str, session_id: str, base_model: str,
                  lora_config: dict[str, object] | None, user_metadata: dict[str, object] | None) -> None:
        """Record a model (idempotent: a resent create keeps the first row)."""
        now = time.time()
        try:
            with self.engine.begin() as c:
                c.execute(insert(models).values(
                    model_id=model_id, owner=owner, session_id=session_id, base_model=base_model,
                    is_lora=lora_config is not None, lora_rank=None if lora_config is None else lora_config["rank"],
                    lora_config=None if lora_config is None else json.dumps(lora_config),
                    created_at=now, last_request_at=now,
                    user_metadata=None if user_metadata is None else json.dumps(user_metadata)))
        except IntegrityError:
            pass

    def model(self, model_id: str) -> dict[str, object] | None:
        with self.engine.connect() as c:
            row = c.execute(select(models).where(models.c.model_id == model_id)).mappings().first()
        return None if row is None else dict(row)

    def touch_model(self, model_id: str) -> None:
        with self.engine.begin() as c:
            c.execute(update(models).where(models.c.model_id == model_id).values(last_request_at=time.time()))

    # --- requests ---
    def submit(self, *, owner: str, kind: str, body: bytes, model_id: str | None = None, seq_id: int | None = None,
               sampler_id: str | None = None, dedup_key: str | None = None, failed: tuple[str, str] | None = None
               ) -> str:
        """Insert a request row and return its request_id. A resent request (same dedup key, same body) returns the
        first one's id; another body under a taken key raises DuplicateRequest. `failed` = (error, category): the row
        is born failed (refused on arrival) but still takes its place in the model's seq order."""
        body_hash = hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()
        request_id = uuid.uuid4().hex
        now = time.time()
        values: dict[str, object] = dict(
            request_id=request_id, owner=owner, kind=kind, model_id=model_id, seq_id=seq_id, sampler_id=sampler_id,
            dedup_key=dedup_key, body_hash=body_hash, body=body, status="queued", created_at=now)
        if failed is not None:
            values.update(status="failed", error=failed[0], category=failed[1], finished_at=now)
        try:
            with self.engine.begin() as c:
                c.execute(insert(requests).values(**values))
        except IntegrityError:
            if dedup_key is None:
                raise
            with self.engine.connect() as c:
                row = c.execute(select(requests.c.request_id, requests.c.body_hash, requests.c.owner)
                                .where(requests.c.dedup_key == dedup_key)).first()
            if row is None or row.body_hash != body_hash or row.owner != owner:
                raise DuplicateRequest(dedup_key) from None
            return str(row.request_id)
        return request_id

    def queued_count(self, owner: str, kinds: Iterable[str] | None = None) -> int:
        q = select(func.count()).select_from(requests).where(requests.c.owner == owner,
                                                             requests.c.status.in_(("queued", "running")))
        if kinds is not None:
            q = q.where(requests.c.kind.in_(tuple(kinds)))
        with self.engine.connect() as c:
            return int(c.execute(q).scalar_one())

    def request(self, request_id: str) -> RequestRow | None:
        with self.engine.connect() as c:
            row = c.execute(select(requests).where(requests.c.request_id == request_id)).mappings().first()
        return None if row is None else _row(row)

    def claimable(self) -> list[RequestRow]:
        """Queued rows in arrival order, without their bodies (rows waiting for a seq gap are read on every pass of
        the worker: `with_body` loads a body when its row runs). The worker is the only claimant."""
        columns = [col for col in requests.c if col.name != "body"]
        with self.engine.connect() as c:
            rows = c.execute(select(*columns).where(requests.c.status == "queued")
                             .order_by(requests.c.id)).mappings().all()
        return [_row({**r, "body": b""}) for r in rows]

    def with_body(self, row: RequestRow) -> RequestRow:
        with self.engine.connect() as c:
            body = c.execute(select(requests.c.body).where(requests.c.id == row.id)).scalar_one()
        return replace(row, body=bytes(body))

    def finished_among(self, request_ids: Iterable[str]) -> set[str]:
        """Which of `request_ids` are done or failed (one query for every future the API is waiting on)."""
        ids = tuple(request_ids)
        with self.engine.connect() as c:
            rows = c.execute(select(requests.c.request_id).where(
                requests.c.request_id.in_(ids), requests.c.status.in_(("done", "failed")))).all()
        return {str(r.request_id) for r in rows}

    def ended_models(self, model_ids: Iterable[str], heartbeat_before: float) -> set[str]:
        """Which of `model_ids` belong to a session that finished or sent no heartbeat since `heartbeat_before`."""
        ids = tuple(model_ids)
        with self.engine.connect() as c:
            rows = c.execute(select(models.c.model_id).join(sessions, sessions.c.session_id == models.c.session_id)
                             .where(models.c.model_id.in_(ids),
                                    sessions.c.finished.is_(True) | (sessions.c.heartbeat_at < heartbeat_before))).all()
        return {str(r.model_id) for r in rows}

    def mark_running(self, ids: Iterable[int]) -> None:
        with self.engine.begin() as c:
            c.execute(update(requests).where(requests.c.id.in_(tuple(ids)), requests.c.status == "queued")
                      .values(status="running"))

    def finish(self, row_id: int, result: bytes, kind: ResultKind = "json") -> None:
        with self.engine.begin() as c:
            c.execute(update(requests).where(requests.c.id == row_id).values(
                status="done", result=result, result_kind=kind, finished_at=time.time()))

    def fail(self, row_id: int, error: str, category: str) -> None:
        with self.engine.begin() as c:
            c.execute(update(requests).where(requests.c.id == row_id).values(
                status="failed", error=error, category=category, finished_at=time.time()))

    def fail_interrupted(self) -> int:
        """At worker start: rows a previous worker was running when it died cannot be resumed (the in-memory
        model state they changed is gone); they fail with a server error rather than hang."""
        with self.engine.begin() as c:
            res = c.execute(update(requests).where(requests.c.status == "running").values(
                status="failed", error="the server's worker restarted while this request ran; resubmit it",
                category="server", finished_at=time.time()))
        return int(res.rowcount or 0)

    # --- samplers and checkpoints ---
    def add_sampler(self, sampler_id: str, owner: str, base_model: str, model_path: str | None) -> None:
        try:
            with self.engine.begin() as c:
                c.execute(insert(samplers).values(sampler_id=sampler_id, owner=owner, base_model=base_model,
                                                  model_path=model_path, created_at=time.time()))
        except IntegrityError:
            pass

    def sampler(self, sampler_id: str) -> dict[str, object] | None:
        with self.engine.connect() as c:
            row = c.execute(select(samplers).where(samplers.c.sampler_id == sampler_id)).mappings().first()
        return None if row is None else dict(row)

    def add_checkpoint(self, tinker_path: str, owner: str, model_id: str, checkpoint_id: str, kind: str,
                       directory: str, size_bytes: int | None) -> None:
        with self.engine.begin() as c:
            c.execute(checkpoints.delete().where(checkpoints.c.tinker_path == tinker_path))
            c.execute(insert(checkpoints).values(tinker_path=tinker_path, owner=owner, model_id=model_id,
                                                 checkpoint_id=checkpoint_id, kind=kind, directory=directory,
                                                 size_bytes=size_bytes, created_at=time.time()))

    def checkpoint(self, tinker_path: str) -> dict[str, object] | None:
        with self.engine.connect() as c:
            row = c.execute(select(checkpoints).where(checkpoints.c.tinker_path == tinker_path)).mappings().first()
        return None if row is None else dict(row)

    def checkpoints_of(self, model_id: str) -> list[dict[str, object]]:
        with self.engine.connect() as c:
            rows = c.execute(select(checkpoints).where(checkpoints.c.model_id == model_id)
                             .order_by(checkpoints.c.created_at)).mappings().all()
        return [dict(r) for r in rows]

    def delete_checkpoint(self, tinker_path: str) -> None:
        with self.engine.begin() as c:
            c.execute(checkpoints.delete().where(checkpoints.c.tinker_path == tinker_path))

    # --- base models ---
    def set_bases(self, entries: Iterable[tuple[str, str, int]]) -> None:
        with self.engine.begin() as c:
            c.execute(bases.delete())
            for name, tokenizer_id, max_len in entries:
                c.execute(insert(bases).values(name=name, tokenizer_id=tokenizer_id, max_context_length=max_len))

    def bases(self) -> list[dict[str, object]]:
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(select(bases).order_by(bases.c.name)).mappings().all()]


def _row(r: object) -> RequestRow:
    m = dict(r)  # type: ignore[call-overload]
    return RequestRow(id=m["id"], request_id=m["request_id"], owner=m["owner"], kind=m["kind"], model_id=m["model_id"],
                      seq_id=m["seq_id"], sampler_id=m["sampler_id"], body=m["body"], status=m["status"],
                      result=m["result"], result_kind=m["result_kind"], error=m["error"], category=m["category"])
