"""Where an agent session's turns are generated: token ids in, a Completion out.

- LocalGenerator: an in-process engine (reference or vLLM) stepping on its own thread; many
  sessions may generate at once (continuous batching), each waiting for its own request.
- HTTPGenerator: `rollwise serve engine` or `rollwise serve router` over HTTP (POST /generate). The
  session id goes in the X-Session-Id header, so the router keeps a session on the replica whose
  prefix cache holds its history (the engine itself ignores the header).

Both speak token ids only: the agent layer never sends text to an engine.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import httpx

from rollwise.engine.retention import RetentionDecision, RetentionRequest
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.engine.contract import Engine
from rollwise.engine.core import EngineWorker
from rollwise.types.contracts import RolloutBackend
from rollwise.serve.settings import client_auth_headers
from rollwise.types.routing import RoutedExperts


@dataclass
class GeneratorInfo:
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer_fingerprint: str | None
    policy_version: int


class Generator(Protocol):
    def info(self) -> GeneratorInfo: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> Completion:
        """One sample (params.n must be 1). Raises ValueError for a request the engine refuses."""
        ...


@dataclass
class _Waiting:
    samples: int  # completions still to come (a request's n samples)
    done: list[Completion]
    future: Future


class LocalGenerator:
    """An engine on an EngineWorker thread, shared by concurrent sessions. Pass `worker` to borrow
    one that already drives the engine (the training loop's): this generator then takes over routing
    its completions, so every request on that engine must go through here."""

    def __init__(self, engine: Engine | None = None, *, worker: RolloutBackend | None = None) -> None:
        if (engine is None) == (worker is None):
            raise ValueError("LocalGenerator needs an engine or a worker (not both)")
        self._owns_worker = worker is None
        self.worker: RolloutBackend = worker or EngineWorker(engine, name="agent-engine")
        self._waiting: dict[str, _Waiting] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drain = threading.Thread(target=self._route, name="agent-engine-drain", daemon=True)
        self._drain.start()

    def _route(self) -> None:
        while not self._stop.is_set():
            try:
                completion = self.worker.next_completion(timeout=0.05)
            except RuntimeError as exc:  # the engine thread died: fail everyone waiting
                with self._lock:
                    for waiting in self._waiting.values():
                        waiting.future.set_exception(exc)
                    self._waiting.clear()
                return
            if completion is None:
                if not self.worker._thread.is_alive():  # the worker was closed: nothing more will come
                    return
                continue
            with self._lock:
                waiting = self._waiting.get(completion.request_id)
                if waiting is None:
                    continue
                waiting.done.append(completion)
                waiting.samples -= 1
                if waiting.samples == 0:
                    del self._waiting[completion.request_id]
                    waiting.future.set_result(sorted(waiting.done, key=lambda c: c.index))

    def info(self) -> GeneratorInfo:
        m = self.worker.model_info()
        return GeneratorInfo(m.max_model_len, list(m.eos_token_ids), m.tokenizer_fingerprint, m.policy_version)

    def submit(self, requests: list[GenerationRequest]) -> list[Future]:
        """Queue requests; each future gives that request's completions (ordered by sample index)."""
        futures = []
        with self._lock:
            for request in requests:
                if request.request_id in self._waiting:
                    raise ValueError(f"request id {request.request_id!r} is already in flight")
            for request in requests:
                future: Future = Future()
                self._waiting[request.request_id] = _Waiting(request.params.n, [], future)
                futures.append(future)
        try:
            self.worker.submit(requests)
        except BaseException:
            with self._lock:
                for request in requests:
                    self._waiting.pop(request.request_id, None)
            raise
        return futures

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> Completion:
        if params.n != 1:
            raise ValueError("an agent turn is one sample: n must be 1")
        rid = f"{session_id or 'agent'}-{uuid.uuid4().hex[:12]}"
        [future] = self.submit([GenerationRequest(rid, list(prompt_ids), params)])
        return future.result()[0]

    def retain(self, req: RetentionRequest) -> RetentionDecision | None:
        """The turn req.request_id ended in a tool call: the engine keeps, swaps or drops its KV (issue 21).
        None where the backend has no engine to call in process (a fleet of engine actors)."""
        call = getattr(self.worker, "call", None)
        return call(lambda engine: engine.retain(req)) if call is not None else None

    def release_session(self, session_id: str) -> None:
        call = getattr(self.worker, "call", None)
        if call is not None:
            call(lambda engine: engine.release_session(session_id))

    def close(self) -> None:
        self._stop.set()
        self._drain.join(timeout=5)
        if self._owns_worker:
            self.worker.close()


class UpstreamError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"upstream HTTP {status}: {message}")
        self.status, self.message = status, message


class HTTPGenerator:
    """`rollwise serve engine` / `serve router` (or anything speaking POST /generate)."""

    def __init__(self, base_url: str, timeout: float = 600.0, headers: dict[str, str] | None = None) -> None:
        # `headers` None: $ROLLWISE_API_KEY, for an engine or router with API keys (rollwise.serve.front)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                  headers=client_auth_headers() if headers is None else headers)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> Any:
        response = self._http.request(method, path, json=body, headers=headers)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            if response.status_code == 400:
                raise ValueError(message)
            raise UpstreamError(response.status_code, message)
        return response.json()

    def info(self) -> GeneratorInfo:
        m = self._request("GET", "/model_info")
        return GeneratorInfo(m["max_model_len"], list(m["eos_token_ids"]), m.get("tokenizer_fingerprint"),
                             m.get("policy_version", 0))

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> Completion:
        if params.n != 1:
            raise ValueError("an agent turn is one sample: n must be 1")
        body = {"prompt_ids": list(prompt_ids), **asdict(params)}
        out = self._request("POST", "/generate", body, headers={"X-Session-Id": session_id} if session_id else None)
        c = out["choices"][0]
        return Completion(out["request_id"], c["index"], out["prompt_ids"], c["token_ids"], c["logprobs"],
                          c["versions"], c["finish_reason"], c.get("cached_prompt_tokens", 0),
                          routed_experts=RoutedExperts.from_choice(c, out["request_id"]))

    def retain(self, req: RetentionRequest) -> RetentionDecision | None:
        """POST /retain (the engine's id for the turn is the request_id /generate returned); the session
        header keeps a router's call on the replica that holds the session. None: the upstream has no /retain."""
        try:
            out = self._request("POST", "/retain", asdict(req), headers={"X-Session-Id": req.session_id})
        except UpstreamError as exc:
            if exc.status == 404:
                return None
            raise
        return RetentionDecision(**out)

    def release_session(self, session_id: str) -> None:
        try:
            self._request("POST", "/release_session", {"session_id": session_id}, headers={"X-Session-Id": session_id})
        except UpstreamError as exc:
            if exc.status != 404:
                raise

    def close(self) -> None:
        self._http.close()
