"""The engine server's front end over one EngineWorker: requests in from asyncio, results back to it.

vLLM v1's shape: the event loop puts each command (a submit, an abort, a weight update, a snapshot) on the
worker's submit queue and awaits an asyncio future, no thread in between; the engine thread runs the
commands between two steps, and at the end of each pass posts everything the pass produced (command
answers, the tokens streaming requests wait for, finished samples) to the loop in one
`call_soon_threadsafe`, one per step, never per token. Nothing else runs on a thread of its own (no
thread pool for the calls, no drain thread). Request ids: the engine only ever sees fresh uuid ids, so
clients cannot collide; the public id is what /abort takes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollwise.engine.contract import Engine, add_all
from rollwise.engine.core import Command, EngineStopped, EngineWorker
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.serve.errors import APIError


@dataclass(eq=False)
class Generation:
    """One HTTP request in flight: its engine requests, with sizes[k] samples in engine_ids[k]. Its queue
    holds, per engine step, the list of that step's events for it: ("token", rid, index, token, logprob,
    version), ("done", Completion), ("error", message)."""

    public_id: str
    engine_ids: list[str]
    sizes: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: set[tuple[str, int]] = field(default_factory=set)  # (engine id, index) not yet returned
    aborting: set[str] = field(default_factory=set)


RECENT_IDS = 4096
T = TypeVar("T")


class EngineFrontend:
    """Routes an EngineWorker's output to asyncio: finished samples by request id, and optionally
    each token as it is sampled. Everything but `passed`, `failed` and `_on_tokens` (the engine thread's
    side, which only appends to this pass's batch and posts it) runs on the event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.worker: EngineWorker | None = None
        self.error: str | None = None
        self.finished_samples: Counter[str] = Counter()  # finish_reason -> samples returned to clients
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, asyncio.Queue] = {}  # engine request id -> its HTTP request's events
        self._token_routes: dict[str, asyncio.Queue] = {}  # the subset that wants tokens as sampled
        self._public: dict[str, Generation] = {}
        # Finished requests' engine ids by public id (the newest RECENT_IDS): POST /retain names a turn by
        # the request_id /generate returned, the engine knows it by its own id (issue 21).
        self._recent: OrderedDict[str, list[str]] = OrderedDict()
        self._batch: list[tuple] = []  # this pass's events; only the engine thread touches it
        self._waiting: set[asyncio.Future] = set()  # calls not answered yet (failed if the engine dies)
        # Engine requests that migrated away (rollwise.engine.migration_http): how to abort each where it now runs
        # (it answers with its aborted samples' count); their events come back through `relay`.
        self._away: dict[str, Callable[[], Awaitable[int]]] = {}
        self._away_aborts: set[asyncio.Task] = set()  # aborts sent for clients gone (release: not awaited)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_tokens = self._on_tokens
        self.worker = EngineWorker(self.engine, name="engine-server", outputs=self)

    async def close(self) -> None:
        if self.worker is not None:
            await asyncio.to_thread(self.worker.close)  # once, at shutdown: joining may take a step
        self.engine.on_tokens = None
        self._fail_waiting("the engine server is shutting down")

    # ------------------------------------------------------------ the engine thread

    def _on_tokens(self, rid: str, index: int, token: int, logprob: float, version: int) -> None:
        """Inside step(): keep the token if its request streams."""
        if rid in self._token_routes:
            self._batch.append(("token", rid, index, token, logprob, version))

    def passed(self, finished: list[Completion]) -> None:
        """The end of a pass (StepOutputs): post its batch, one hand-off per step."""
        for completion in finished:
            self._batch.append(("done", completion))
        if self._batch:
            batch, self._batch = self._batch, []
            self._post(self._apply, batch)

    def failed(self, error: BaseException) -> None:
        """The engine thread died (StepOutputs): the answers it gave on the way out, then every request fails."""
        self.passed([])
        self._post(self._fail_all, f"{error!r}")

    def _answered(self, waiter: asyncio.Future, future: Future) -> None:
        """A command ran (or was refused): its answer goes with this pass's batch."""
        self._batch.append(("answer", waiter, future))

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    # ------------------------------------------------------------ event loop

    def _apply(self, batch: list[tuple]) -> None:
        """One pass's events, in order: answers resolve their callers; tokens and finished samples go to their
        HTTP requests' queues, one list per request per step."""
        per_request: dict[int, tuple[asyncio.Queue, list[tuple]]] = {}
        for event in batch:
            kind = event[0]
            if kind == "answer":
                _, waiter, future = event
                if not waiter.done():  # its handler may have been cancelled (client gone)
                    error = future.exception()
                    waiter.set_exception(error) if error is not None else waiter.set_result(future.result())
                continue
            queue = (self._token_routes if kind == "token" else self._routes).get(
                event[1] if kind == "token" else event[1].request_id)
            if queue is not None:
                per_request.setdefault(id(queue), (queue, []))[1].append(event)
        for queue, events in per_request.values():
            queue.put_nowait(events)

    def _deliver(self, completion: Completion) -> None:
        queue = self._routes.get(completion.request_id)
        if queue is not None:
            queue.put_nowait([("done", completion)])

    def _fail_all(self, message: str) -> None:
        self.error = message
        for queue in {id(q): q for q in self._routes.values()}.values():
            queue.put_nowait([("error", message)])
        self._fail_waiting(message)

    def _fail_waiting(self, message: str) -> None:
        """Calls queued after the worker's last look at its queue get no answer from it: answer them here."""
        for waiter in list(self._waiting):
            if not waiter.done():
                waiter.set_exception(EngineStopped(message))
        self._waiting.clear()

    def _not_running(self, reason: object) -> APIError:
        return APIError(503, f"the engine is not running: {reason}", kind="server_error")

    async def call(self, fn: Command[T]) -> T:
        """fn(engine) on the engine thread, between two steps: queued without a thread hop, answered with
        the pass's batch. What fn raises is raised here (the engine keeps serving); a dead engine is a 503."""
        if self.worker is None or self.error is not None:
            raise self._not_running(self.error or "not started")
        waiter = self._loop.create_future()
        self._waiting.add(waiter)
        try:
            self.worker.post(fn, lambda future: self._answered(waiter, future))
            return await waiter
        except EngineStopped as exc:
            raise self._not_running(exc) from exc
        finally:
            self._waiting.discard(waiter)

    async def submit(
        self, public_id: str, units: list[tuple[list[int], SamplingParams]], stream_tokens: bool,
        adapter: str | None = None, cache_salt: str | None = None,
    ) -> Generation:
        """Add one engine request per (prompt ids, params) unit, under fresh uuid request ids; `adapter`:
        the loaded LoRA adapter they run with (None: the engine's default policy); `cache_salt`: the prefix-cache
        salt they share entries under (GenerationRequest.cache_salt)."""
        if public_id in self._public:
            raise APIError(409, f"request_id {public_id!r} is already in flight; use another one", "request_id")
        gen = Generation(public_id, [uuid.uuid4().hex for _ in units], [params.n for _, params in units])
        gen.pending = {(rid, i) for rid, size in zip(gen.engine_ids, gen.sizes) for i in range(size)}
        self._public[public_id] = gen
        for rid in gen.engine_ids:
            self._routes[rid] = gen.queue
            if stream_tokens:
                self._token_routes[rid] = gen.queue
        requests = [GenerationRequest(rid, ids, params, adapter=adapter, cache_salt=cache_salt)
                    for rid, (ids, params) in zip(gen.engine_ids, units)]
        try:
            await self.call(lambda engine: add_all(engine, requests))
        except ValueError as exc:  # the engine's own checks (the handlers check first, naming fields)
            self.release(gen, abort=False)
            raise APIError(400, str(exc)) from exc
        except BaseException:
            self.release(gen)
            raise
        return gen

    def release(self, gen: Generation, abort: bool = True) -> None:
        """Forget a request; samples still running are aborted in the background (client gone)."""
        if self._public.get(gen.public_id) is gen:
            del self._public[gen.public_id]
        self._recent[gen.public_id] = gen.engine_ids
        while len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)
        for rid in gen.engine_ids:
            self._routes.pop(rid, None)
            self._token_routes.pop(rid, None)
        unfinished = sorted({rid for rid, _ in gen.pending})
        for rid in [r for r in unfinished if r in self._away] if abort else []:  # runs elsewhere: abort it there
            task = self._loop.create_task(self._away[rid]())
            self._away_aborts.add(task)
            task.add_done_callback(self._away_aborts.discard)
        unfinished = [rid for rid in unfinished if rid not in self._away]
        if abort and unfinished and self.worker is not None and self.error is None:
            try:  # queued, not awaited: the client is gone either way (its routes are, too)
                self.worker.post(lambda engine: [c for rid in unfinished for c in engine.abort(rid)])
            except EngineStopped:
                pass

    async def abort_engine(self, engine_ids: list[str]) -> int:
        """Abort engine requests, where they run (here, or the engine they migrated to); their samples come back
        (finish_reason 'abort') through the routes. Returns the samples aborted."""
        away = [self._away[rid] for rid in engine_ids if rid in self._away]
        here = [rid for rid in engine_ids if rid not in self._away]
        completions = await self.call(lambda engine: [c for rid in here for c in engine.abort(rid)]) if here else []
        for completion in completions:
            self._deliver(completion)
        return len(completions) + sum([await abort() for abort in away])

    def engine_ids_of(self, public_id: str) -> list[str]:
        """The engine request ids of a finished request (public id as /generate returned it); [] if unknown."""
        return list(self._recent.get(public_id, []))

    # ------------------------------------------------------------ live migration (rollwise.engine.migration_http)

    def routed(self, engine_id: str) -> bool:
        """Whether some client here waits for the engine request's samples."""
        return engine_id in self._routes

    def client_ids(self, engine_ids: list[str]) -> dict[str, str]:
        """The request id its client gave /generate (its public id) of each engine request a client waits for here;
        those migrated in (their client waits on another server) are left out."""
        wanted = set(engine_ids)
        return {rid: gen.public_id for gen in self._public.values() for rid in gen.engine_ids if rid in wanted}

    def streams(self, engine_id: str) -> bool:
        """Whether the engine request's tokens are streamed to its client as sampled (a migration relays them)."""
        return engine_id in self._token_routes

    def adopt(self, engine_id: str, stream_tokens: bool = False) -> asyncio.Queue:
        """Route the engine request's events to a new queue: a request migrated in, whose client waits elsewhere
        (`stream_tokens`: each token too, as sampled, for a client that streams them)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._routes[engine_id] = queue
        if stream_tokens:
            self._token_routes[engine_id] = queue
        return queue

    def disown(self, engine_id: str) -> None:
        self._routes.pop(engine_id, None)
        self._token_routes.pop(engine_id, None)

    def moved_away(self, engine_id: str, abort: Callable[[], Awaitable[int]]) -> None:
        """The engine request migrated to another engine: aborting it (abort_engine, or its client gone) runs
        `abort` there, until `came_back`."""
        self._away[engine_id] = abort

    def came_back(self, engine_id: str) -> None:
        """The migrated request's last events are relayed (or failed): nothing of it runs elsewhere any more."""
        self._away.pop(engine_id, None)

    def relay(self, engine_id: str, events: list[tuple]) -> None:
        """Events of a request that migrated away, as the engine it runs on produced them (its tokens, for a
        client that streams them, then its finished samples): to its client here, in order, as if local."""
        queue = self._routes.get(engine_id)
        if queue is None:
            return
        if engine_id not in self._token_routes:
            events = [e for e in events if e[0] != "token"]
        if events:
            queue.put_nowait(events)

    def fail_engine_request(self, engine_id: str, message: str) -> None:
        """The request migrated away and its samples will not come back: its client gets the error."""
        queue = self._routes.get(engine_id)
        if queue is not None:
            queue.put_nowait([("error", message)])

    async def abort(self, public_id: str) -> int:
        gen = self._public.get(public_id)
        if gen is None:
            raise APIError(404, f"no request with request_id {public_id!r} is in flight", "request_id",
                           kind="not_found_error")
        return await self.abort_engine(gen.engine_ids)
