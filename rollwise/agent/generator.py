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

from rollwise.engine.types import Completion, GenerationRequest, SamplingParams
from rollwise.rollout.worker import EngineWorker


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


class LocalGenerator:
    """An engine on an EngineWorker thread, shared by concurrent sessions."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.worker = EngineWorker(engine, name="agent-engine")
        self._futures: dict[str, Future] = {}
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
                    for future in self._futures.values():
                        future.set_exception(exc)
                    self._futures.clear()
                return
            if completion is not None:
                with self._lock:
                    future = self._futures.pop(completion.request_id, None)
                if future is not None:
                    future.set_result(completion)

    def info(self) -> GeneratorInfo:
        m = self.worker.call(lambda e: e.model_info())
        return GeneratorInfo(m.max_model_len, list(m.eos_token_ids), m.tokenizer_fingerprint, m.policy_version)

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None) -> Completion:
        if params.n != 1:
            raise ValueError("an agent turn is one sample: n must be 1")
        rid = f"{session_id or 'agent'}-{uuid.uuid4().hex[:12]}"
        future: Future = Future()
        with self._lock:
            self._futures[rid] = future
        try:
            self.worker.call(lambda e: e.add_request(GenerationRequest(rid, list(prompt_ids), params)))
        except BaseException:
            with self._lock:
                self._futures.pop(rid, None)
            raise
        return future.result()

    def close(self) -> None:
        self._stop.set()
        self._drain.join(timeout=5)
        self.worker.close()


class UpstreamError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"upstream HTTP {status}: {message}")
        self.status, self.message = status, message


class HTTPGenerator:
    """`rollwise serve engine` / `serve router` (or anything speaking POST /generate)."""

    def __init__(self, base_url: str, timeout: float = 600.0, headers: dict[str, str] | None = None) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers or {})

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
                          c["versions"], c["finish_reason"], c.get("cached_prompt_tokens", 0))

    def close(self) -> None:
        self._http.close()
