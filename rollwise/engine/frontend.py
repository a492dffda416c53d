"""The engine server's front end over one EngineWorker: requests in from asyncio, results back to it.

An EngineWorker steps the engine on its own thread; this hands it requests between steps and routes what
comes back to the waiting HTTP request: finished samples (one thread drains `worker.completions`) and, for
streaming and stop strings, the tokens as they are sampled (the engine's `on_tokens` hook). Request ids: the
engine only ever sees fresh uuid ids, so clients cannot collide; the public id is what /abort takes.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollwise.engine.contract import add_all
from rollwise.engine.core import EngineWorker
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.serve.errors import APIError


@dataclass(eq=False)
class Generation:
    """One HTTP request in flight: its engine requests, with sizes[k] samples in engine_ids[k]."""

    public_id: str
    engine_ids: list[str]
    sizes: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: set[tuple[str, int]] = field(default_factory=set)  # (engine id, index) not yet returned
    aborting: set[str] = field(default_factory=set)


RECENT_IDS = 4096


class EngineFrontend:
    """Routes an EngineWorker's output to asyncio: finished samples by request id, and optionally
    each token as it is sampled. Everything but the two hand-offs runs on the event loop."""

    def __init__(self, engine: Any) -> None:
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
        self._stop = threading.Event()
        self._drain_thread: threading.Thread | None = None
        self._background: set[asyncio.Future] = set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.on_tokens = self._on_tokens
        self.worker = EngineWorker(self.engine, name="engine-server")
        self._drain_thread = threading.Thread(target=self._drain, name="engine-server-drain", daemon=True)
        self._drain_thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.close)
        if self._drain_thread is not None:
            await asyncio.to_thread(self._drain_thread.join, 5)
        self.engine.on_tokens = None

    # ------------------------------------------------------------ other threads

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _on_tokens(self, rid: str, index: int, token: int, logprob: float, version: int) -> None:
        """Engine thread, inside step(): forward the token if its request streams."""
        queue = self._token_routes.get(rid)
        if queue is not None:
            self._post(queue.put_nowait, ("token", rid, index, token, logprob, version))

    def _drain(self) -> None:
        """Drain thread: worker.completions -> the event loop. A sample's tokens were posted during
        the step that finished it, before the step returned, so they reach the loop first."""
        while not self._stop.is_set():
            try:
                completion = self.worker.next_completion(timeout=0.1)
            except RuntimeError as exc:  # the engine thread died
                self._post(self._fail_all, str(exc))
                return
            if completion is not None:
                self._post(self._deliver, completion)

    # ------------------------------------------------------------ event loop

    def _deliver(self, completion: Completion) -> None:
        queue = self._routes.get(completion.request_id)
        if queue is not None:
            queue.put_nowait(("done", completion))

    def _fail_all(self, message: str) -> None:
        self.error = message
        for queue in {id(q): q for q in self._routes.values()}.values():
            queue.put_nowait(("error", message))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread, between two steps."""
        if self.worker is None or self.error is not None:
            raise APIError(503, f"the engine is not running: {self.error or 'not started'}", kind="server_error")
        try:
            return await asyncio.to_thread(self.worker.call, fn)
        except RuntimeError as exc:
            raise APIError(503, f"the engine is not running: {exc}", kind="server_error") from exc

    async def submit(
        self, public_id: str, units: list[tuple[list[int], SamplingParams]], stream_tokens: bool,
        adapter: str | None = None,
    ) -> Generation:
        """Add one engine request per (prompt ids, params) unit, under fresh uuid request ids; `adapter`:
        the loaded LoRA adapter they run with (None: the engine's default policy)."""
        if public_id in self._public:
            raise APIError(409, f"request_id {public_id!r} is already in flight; use another one", "request_id")
        gen = Generation(public_id, [uuid.uuid4().hex for _ in units], [params.n for _, params in units])
        gen.pending = {(rid, i) for rid, size in zip(gen.engine_ids, gen.sizes) for i in range(size)}
        self._public[public_id] = gen
        for rid in gen.engine_ids:
            self._routes[rid] = gen.queue
            if stream_tokens:
                self._token_routes[rid] = gen.queue
        requests = [GenerationRequest(rid, ids, params, adapter=adapter)
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
        if abort and unfinished and self.worker is not None and self.error is None:
            future = self._loop.run_in_executor(None, self._abort_quietly, unfinished)
            self._background.add(future)
            future.add_done_callback(self._background.discard)

    def _abort_quietly(self, engine_ids: list[str]) -> None:
        try:
            self.worker.abort(engine_ids)
        except Exception:  # noqa: BLE001 - best effort: the client is gone either way
            pass

    async def abort_engine(self, engine_ids: list[str]) -> int:
        """Abort engine requests; their samples come back (finish_reason 'abort') through the routes."""
        completions = await self.call(lambda engine: [c for rid in engine_ids for c in engine.abort(rid)])
        for completion in completions:
            self._deliver(completion)
        return len(completions)

    def engine_ids_of(self, public_id: str) -> list[str]:
        """The engine request ids of a finished request (public id as /generate returned it); [] if unknown."""
        return list(self._recent.get(public_id, []))

    async def abort(self, public_id: str) -> int:
        gen = self._public.get(public_id)
        if gen is None:
            raise APIError(404, f"no request with request_id {public_id!r} is in flight", "request_id",
                           kind="not_found_error")
        return await self.abort_engine(gen.engine_ids)
