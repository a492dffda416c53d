"""Live migration between engine servers (issue 42 item 3): the routes that move a server's in-flight requests to
another engine server, over rollwise.engine.migration's coordinator.

    POST /migrate            {target}: move every request in flight here to the engine server at `target` (same
                             model and tokenizer); answers what moved, streamed requests (stream=true, stop strings)
                             included: their tokens are relayed to their client's stream as the target samples them.
    POST /migration/stage    (on the target) a request's exported state: prefill what of it is not in the KV yet
    POST /migration/commit   (on the target) take the request over from its final state; it decodes on here
                             (stream_tokens: its tokens are kept for /migration/result as they are sampled)
    POST /migration/cancel   {request_id}: free what was staged (it finished on the source, or stays there), or drop
                             a request committed here whose source took it back (the commit's answer was lost)
    POST /migration/abort    {request_id}: abort a committed request (its client aborted it on the source)
    POST /migration/result   {request_id, timeout_s?}: a committed request's samples once all are back (a long poll:
                             {done: false} after timeout_s; the source polls again and relays them to its client);
                             a streamed one's tokens sampled since the last poll as soon as there are any
    POST /migration/results  {request_ids, timeout_s?}: the same for several requests in one long poll, answered as
                             soon as any has something (rollwise.engine.migration_relay: the source's one relay loop)
    GET  /migration/info     the engine's ModelInfo, which migration checks both ends against

The source runs the coordinator (`migrate_between`: its engine keeps decoding on its own thread while the target
prefills), with the target as a `RemoteTarget` (stage/commit/cancel over HTTP). A migrated request's client still
waits on the source: the source asks the target for its samples (/migration/result) and answers the client with
them, so a client (or a router relaying it) sees one answer: its tokens, logprobs and versions as one engine would
have produced them. A streamed request's tokens go the same way, one poll per batch of tokens (one poll shared by
all the requests of a /migrate: /migration/results), into the queue its
client's stream reads (EngineFrontend.relay): the stream goes on uninterrupted, the stop-string check on this
server sees each token once, and a stop string (or the client gone) aborts the request where it runs
(EngineFrontend.moved_away). The source's engine is empty once /migrate answers: it can sleep or be removed; its
process stays up until the migrated requests are answered.

Every call to the target carries the caller's own Authorization header (one key for the engine servers of a
deployment, as the router's --upstream-api-key). An engine that cannot migrate (neither the reference engine nor the
vLLM backend) answers 409 with what to do instead: abort and resubmit its requests (the fallback: tokens
regenerated). Requests an engine will not move (the vLLM backend's with frequency/presence penalties:
rollwise.engine.vllm_migration) stay and finish where they run, named in the answer's `stayed` and counted in
its still_here.

Every request in flight is accounted for once in /migrate's answer, by engine request id: `migrated` (its client here
gets the target's answer), `finished_on_source`, `stayed` (request id -> why: the target refused it, even after others
had moved, or at the handover itself: this engine kept its slot and KV until the target confirmed, so it runs on here
from where it stopped), `failed` (request id -> why: neither engine runs it, i.e. this engine failed taking it back;
its client was answered with that error); `client_ids` maps each of those engine ids to the request_id its client
gave /generate (several engine ids share one when a /generate held several prompts; one migrated in from another
server, whose client waits there, is not in it). A
/migrate that moved nothing and kept some answers 409 (nothing changed). /metrics counts them
(rollwise_engine_migration_*).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import httpx
from fastapi import FastAPI, Request
from pydantic import AnyHttpUrl, Base64Bytes, BaseModel, ConfigDict, Field

from rollwise.engine.core import EngineWorker
from rollwise.engine.migration import MigratingSample, Migratable, MigrationResult, MigrationState, migrate_between
from rollwise.engine.migration_relay import Adopted, MigrationCollector, MigrationCounts, relay_all, wait_any
from rollwise.engine.service import EngineService
from rollwise.serve.errors import APIError, error_responses
from rollwise.engine.contract import Engine
from rollwise.types.generation import Completion, GenerationRequest, ModelInfo, SamplingParams

class MigrationUnsupported(Exception):
    """The engine behind this server cannot migrate requests (answered 409, code migration_unsupported)."""


NOT_MIGRATABLE = ("this engine does not support live migration (the reference engine and the vLLM backend do): "
                  "abort its requests and resubmit them elsewhere instead (their tokens are regenerated)")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SampleBody(_Strict):
    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] = []
    rng_state: Base64Bytes
    cached_prompt_tokens: int = 0


class StateBody(_Strict):
    """A request in flight, as exported between two steps of its source engine (MigrationState)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    cache_salt: str | None = None
    samples: list[SampleBody]
    session_id: str | None = None
    max_model_len: int | None = None  # the source's (MigrationState.max_model_len); an older peer sends none

    @classmethod
    def of(cls, state: MigrationState) -> StateBody:
        r = state.request
        return cls(request_id=r.request_id, prompt_ids=r.prompt_ids, params=r.params, adapter=r.adapter,
                   cache_salt=r.cache_salt, session_id=state.session_id,
                   max_model_len=state.max_model_len,
                   samples=[SampleBody(**{**asdict(s), "rng_state": base64.b64encode(s.rng_state)})
                            for s in state.samples])

    def state(self) -> MigrationState:
        request = GenerationRequest(self.request_id, list(self.prompt_ids), self.params, self.adapter, self.cache_salt)
        samples = [MigratingSample(s.index, s.token_ids, s.logprobs, s.versions, [list(t) for t in s.top_logprobs],
                                   s.rng_state, s.cached_prompt_tokens) for s in self.samples]
        return MigrationState(request, samples, self.session_id, self.max_model_len)


class CommitBody(StateBody):
    stream_tokens: bool = False  # its client streams tokens: /migration/result returns them as they are sampled


class RequestIdBody(_Strict):
    request_id: str


class ResultBody(RequestIdBody):
    timeout_s: float = Field(30.0, ge=0, le=60)  # a long poll: {done: false} when the samples are not all back by then


class ResultsBody(_Strict):
    request_ids: list[str] = Field(min_length=1, max_length=4096)
    timeout_s: float = Field(30.0, ge=0, le=60)  # a long poll: answered once any request has something, or by then


class MigrateBody(_Strict):
    target: AnyHttpUrl  # the engine server the requests move to


class SleepBody(_Strict):
    migrate_to: AnyHttpUrl | None = None  # POST /sleep: move the requests in flight to this engine server first


# ==================================================================== the source's view of the target


class RemoteTarget:
    """The target end of a migration, over HTTP (the coordinator's target CommandRunner: `call(fn)` runs fn on
    this proxy). Only the target's half of Migratable answers; a refusal (409) is a ValueError, as in process."""

    def __init__(self, url: str, authorization: str | None, timeout_s: float = 120.0,
                 streamed: frozenset[str] = frozenset()) -> None:
        self.url = url.rstrip("/")
        self.streamed = streamed  # the requests whose client streams their tokens
        headers = {"Authorization": authorization} if authorization else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def call(self, fn: Any) -> Any:
        return fn(self)

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot migrate to {self.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise ValueError(f"the target {self.url} refused {path}: {message}")
        return response.json()

    def model_info(self) -> ModelInfo:
        try:
            response = self.http.get("/migration/info")
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot migrate to {self.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise ValueError(f"cannot migrate to {self.url}: GET /migration/info answered {response.status_code} "
                             f"({response.text[:200]}); it must be a rollwise engine server that supports migration")
        return ModelInfo(**response.json())

    def stage_migration(self, state: MigrationState) -> int:
        return int(self._post("/migration/stage", StateBody.of(state).model_dump(mode="json"))["prefilled"])

    def commit_migration(self, state: MigrationState) -> None:
        self._post("/migration/commit", {**StateBody.of(state).model_dump(mode="json"),
                                         "stream_tokens": state.request.request_id in self.streamed})

    def cancel_migration(self, request_id: str) -> None:
        self._post("/migration/cancel", {"request_id": request_id})

    # The source's half: never asked of a target.
    def step(self) -> list[Completion]:
        raise NotImplementedError("a remote engine is only ever a migration target")

    def migratable_requests(self) -> list[str]:
        raise NotImplementedError("a remote engine is only ever a migration target")

    def export_running(self, request_id: str) -> MigrationState | None:
        raise NotImplementedError("a remote engine is only ever a migration target")

    def suspend_migrating(self, request_id: str) -> MigrationState | None:
        raise NotImplementedError("a remote engine is only ever a migration target")

    def resume_migrating(self, request_id: str) -> None:
        raise NotImplementedError("a remote engine is only ever a migration target")

    def release_migrated(self, request_id: str) -> int:
        raise NotImplementedError("a remote engine is only ever a migration target")


# ==================================================================== routes


class MigrationRoutes:
    """The routes' logic for one engine server: its side as a source (`migrate_out`) and as a target."""

    def __init__(self, server: EngineService) -> None:
        self.server = server
        self.adopted: dict[str, Adopted] = {}  # engine id -> a request migrated here, until its result is taken
        self.here: set[str] = set()  # engine ids migrated here and not answered yet
        self.relays: set[asyncio.Task] = set()  # each /migrate's relay of its requests' tokens and samples
        self.counts = MigrationCounts()  # /metrics
        self.migrating = asyncio.Lock()  # one /migrate (or /sleep migrate_to) at a time: each sees what it moves

    async def _engine(self, fn: Callable[[Migratable], Any]) -> Any:
        """fn(engine) on the engine thread, refused with 409 when the engine cannot migrate."""
        def run(engine: Engine) -> Any:
            if not isinstance(engine, Migratable):
                raise MigrationUnsupported(NOT_MIGRATABLE)
            return fn(engine)
        try:
            return await self.server.frontend.call(run)
        except MigrationUnsupported as exc:
            raise APIError(409, str(exc), None, kind="conflict", code="migration_unsupported") from exc
        except ValueError as exc:  # the engine's refusal names what does not fit
            raise APIError(409, str(exc), "request_id", kind="conflict") from exc

    async def migrate_out(self, target: str, authorization: str | None, source: str) -> dict[str, Any]:
        """Move every request in flight here to `target`; `source`: this server's URL as its caller named it,
        recorded on each moved sample as (source, target)."""
        async with self.migrating:
            return await self._migrate_out(target.rstrip("/"), authorization, source)  # (a validated URL ends in /)

    async def _migrate_out(self, target: str, authorization: str | None, source: str) -> dict[str, Any]:
        frontend = self.server.frontend
        ids = await self._engine(lambda e: e.migratable_requests())
        remote = RemoteTarget(target, authorization, streamed=frozenset(r for r in ids if frontend.streams(r)))
        worker: EngineWorker | None = frontend.worker
        assert worker is not None  # the server is started
        try:
            # (with nothing to move, still checks that the target could take them: a wrong target is refused)
            result: MigrationResult = await asyncio.to_thread(migrate_between, worker, remote, ids)
        except ValueError as exc:  # refused whole: nothing moved, every request still runs here
            remote.close()
            raise APIError(409, f"nothing was migrated: {exc}", "target", kind="conflict") from exc
        except BaseException:
            remote.close()
            raise
        remote.close()
        clients = frontend.client_ids(ids)  # (before a failed one's client is answered: it is forgotten then)
        self.counts.migrated_requests += len(result.migrated)
        self.counts.stayed_requests += len(result.stayed)
        self.counts.failed_requests += len(result.failed)
        for rid, why in result.failed.items():  # on neither engine: its client is answered, never left waiting
            frontend.fail_engine_request(rid, f"request {rid!r} was lost migrating to {target}: {why}")
        if result.migrated:
            headers = {"Authorization": authorization} if authorization else {}
            http = httpx.AsyncClient(base_url=target, headers=headers, timeout=None)
            for rid in result.migrated:  # from now on, aborting it (a stop string, its client gone) aborts it there
                frontend.moved_away(rid, lambda rid=rid: self._abort_there(http, rid))
            task = asyncio.get_running_loop().create_task(
                relay_all(frontend, http, (source.rstrip("/"), target), list(result.migrated), self._answered))
            self.relays.add(task)
            task.add_done_callback(self.relays.discard)
            # a client that went away while it moved (its abort reached this engine too late): abort it there
            for rid in [r for r in result.migrated if not frontend.routed(r)]:
                await self._abort_there(http, rid)
        stayed = await self._engine(lambda e: e.migratable_requests())
        return {"target": target, "migrated": result.migrated, "finished_on_source": result.finished_on_source,
                "stayed": result.stayed, "failed": result.failed, "rounds": result.rounds,
                "tokens_prefilled": result.tokens_prefilled, "still_here": len(stayed), "client_ids": clients}

    def _answered(self, rid: str, ok: bool) -> None:
        """A migrated request's last events were relayed (or its client got the error): nothing of it runs elsewhere."""
        self.server.frontend.came_back(rid)
        if not ok:
            self.counts.relay_failures += 1

    async def _abort_there(self, http: httpx.AsyncClient, rid: str) -> int:
        """Abort a request that migrated away from here, where it runs; returns its samples aborted (they come back
        through its relay). A target that cannot be reached: its relay fails, and so does the client's answer."""
        try:
            response = await http.post("/migration/abort", json={"request_id": rid}, timeout=30)
        except httpx.HTTPError:
            return 0
        return int(response.json()["aborted_samples"]) if response.status_code == 200 else 0

    # ------------------------------------------------------------ the target's side

    def _checked(self, body: StateBody) -> MigrationState:
        """The state, its token ids checked as a prompt's are (in the vocabulary, room left): 400 naming them."""
        if self.server.frontend.routed(body.request_id) and body.request_id not in self.here:
            # its client waits here (it migrated away from this server): a second route would strand that client
            raise APIError(409, f"request {body.request_id!r} started on this server and migrated away: it cannot "
                                "migrate back here; migrate it to another engine server", "request_id",
                           kind="conflict")
        self.server.check_prompt(body.prompt_ids, "prompt_ids")
        seen: set[int] = set()
        for i, sample in enumerate(body.samples):
            if len({len(sample.token_ids), len(sample.logprobs), len(sample.versions)}) != 1:
                raise APIError(400, f"samples[{i}]: token_ids, logprobs and versions must be as long as each other",
                               f"samples[{i}]")
            if not 1 <= len(sample.token_ids) <= body.params.max_tokens:
                raise APIError(400, f"samples[{i}].token_ids must hold 1 to params.max_tokens={body.params.max_tokens} "
                                    "tokens (a running sample's)", f"samples[{i}].token_ids")
            if not 0 <= sample.index < body.params.n or sample.index in seen:
                raise APIError(400, f"samples[{i}].index must be a distinct sample index in [0, params.n="
                                    f"{body.params.n})", f"samples[{i}].index")
            seen.add(sample.index)
            self.server.check_prompt(body.prompt_ids + sample.token_ids, f"samples[{i}].token_ids")
        return body.state()

    async def stage(self, body: StateBody) -> dict[str, Any]:
        state = self._checked(body)
        return {"request_id": body.request_id, "prefilled": await self._engine(lambda e: e.stage_migration(state))}

    async def commit(self, body: CommitBody) -> dict[str, Any]:
        state = self._checked(body)
        # before the commit: its first sample may end at once
        queue = self.server.frontend.adopt(body.request_id, body.stream_tokens)
        try:
            await self._engine(lambda e: e.commit_migration(state))
        except BaseException:
            self.server.frontend.disown(body.request_id)
            raise
        self.adopted[body.request_id] = Adopted(queue, len(state.samples) or state.request.params.n)
        self.here.add(body.request_id)
        self.counts.adopted_requests += 1
        return {"request_id": body.request_id, "samples": len(state.samples)}

    async def abort(self, body: RequestIdBody) -> dict[str, Any]:
        if body.request_id not in self.here:
            raise APIError(404, f"no request {body.request_id!r} was migrated here and is running", "request_id",
                           kind="not_found_error")
        return {"request_id": body.request_id, "aborted_samples": await self.server.frontend.abort_engine([body.request_id])}

    async def cancel(self, body: RequestIdBody) -> dict[str, Any]:
        rid = body.request_id
        if rid in self.here and rid in self.adopted:
            # committed here, but its source took it back (the commit's answer never reached it): it runs there,
            # so it must not run here too; its samples aborted here go nowhere (no client waits on them here)
            self._forget(rid)
            await self.server.frontend.abort_engine([rid])
        await self._engine(lambda e: e.cancel_migration(rid))
        return {"request_id": rid, "cancelled": True}

    async def result(self, body: ResultBody) -> dict[str, Any]:
        entry = self.adopted.get(body.request_id)
        if entry is None:
            raise APIError(404, f"no request {body.request_id!r} was migrated here (or its result was taken)",
                           "request_id", kind="not_found_error")
        await wait_any([entry], body.timeout_s)
        self.counts.result_polls += 1
        item = self._collected(body.request_id, entry)
        if "error" in item:
            raise APIError(503, item["error"], kind="server_error")
        return item

    async def results(self, body: ResultsBody) -> dict[str, Any]:
        """/migration/result for several requests in one long poll: each named request's news once any has some (a
        request not migrated here, or whose result was taken: an error of its own, the others unaffected)."""
        entries = {rid: self.adopted[rid] for rid in dict.fromkeys(body.request_ids) if rid in self.adopted}
        unknown = [{"request_id": rid, "done": True, "tokens": [], "completions": [],
                    "error": f"no request {rid!r} was migrated here (or its result was taken)"}
                   for rid in dict.fromkeys(body.request_ids) if rid not in entries]
        if not unknown:
            await wait_any(list(entries.values()), body.timeout_s)
        self.counts.result_polls += 1
        return {"results": unknown + [self._collected(rid, e) for rid, e in entries.items() if e.ready]}

    def _collected(self, rid: str, entry: Adopted) -> dict[str, Any]:
        item = entry.collect(rid)
        if item["done"]:
            self._forget(rid)
        return item

    def _forget(self, rid: str) -> None:
        self.adopted.pop(rid, None)
        self.server.frontend.disown(rid)
        self.here.discard(rid)

    async def info(self) -> dict[str, Any]:
        return asdict(await self._engine(lambda e: e.model_info()))


def add_migration_routes(app: FastAPI, server: EngineService) -> MigrationRoutes:
    routes = MigrationRoutes(server)
    server.registry.register(MigrationCollector(routes.counts))
    refusals = error_responses(400, 404, 409, 413, 503)

    @app.post("/migrate", responses=refusals)
    async def migrate(request: Request, body: MigrateBody) -> dict[str, Any]:
        return await routes.migrate_out(str(body.target), request.headers.get("authorization"), str(request.base_url))

    app.add_api_route("/migration/stage", routes.stage, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/commit", routes.commit, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/cancel", routes.cancel, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/abort", routes.abort, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/result", routes.result, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/results", routes.results, methods=["POST"], responses=refusals)
    app.add_api_route("/migration/info", routes.info, methods=["GET"], responses=refusals)
    return routes


__all__ = ["add_migration_routes", "Adopted", "MigrationRoutes", "MigrationUnsupported", "RemoteTarget", "SleepBody",
           "StateBody"]
