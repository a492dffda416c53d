"""`rollwise serve engine`: the engine contract over HTTP, on the reference engine.

One process, one engine. An EngineWorker steps the ReferenceEngine on its own thread; this asyncio
front end hands it requests between steps and routes what comes back to the waiting HTTP request:
finished samples (one thread drains `worker.completions`) and, for streaming and stop strings, the
tokens as they are sampled (the engine's `on_tokens` hook).

Endpoints (JSON unless noted):

    POST /v1/completions         OpenAI text completions (prompt: text, token ids, or a list of either)
    POST /v1/chat/completions    OpenAI chat completions (messages through the tokenizer's chat template)
        Both: stream=true sends server-sent events in OpenAI's chunk format ending with `data: [DONE]`.
        Every choice also carries token_ids (exactly the sampled ids), prompt_token_ids,
        policy_versions (one per token) and cached_prompt_tokens; the sampled tokens' logprobs are
        always returned, in OpenAI's logprobs layout.
    POST /generate               token level: {prompt_ids, sampling params, n} -> token ids, logprobs, versions
    GET  /v1/models, /model_info (incl. the tokenizer fingerprint), /health, /metrics (Prometheus text)
    POST /pause, /resume, /abort {request_id}, /update_weights_from_disk {path, version}
    POST /flush_cache            empty the prefix cache (benchmarks compare routing policies from a cold cache)

Request ids: the engine only ever sees fresh uuid ids, so clients cannot collide. The public id
(a response's `id` / `request_id`, or a client's own `request_id` while no other request in flight
uses it) is what /abort takes.

The server has no authentication and /update_weights_from_disk reads server-side paths: it binds
loopback by default, for a trainer on the same machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollwise.engine.contract import add_all
from rollwise.engine.factory import describe_engine
from rollwise.engine.types import Completion, GenerationRequest, SamplingParams
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.engine.core import EngineWorker
from rollwise.serve.openai_schemas import (  # the request bodies
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsRequest,
)
from rollwise.serve.openai_schemas import OpenAISampling as _OpenAISampling
from rollwise.serve.openai_schemas import report_ignored
from rollwise.serve.openai_schemas import SamplingFields as _Sampling
from rollwise.serve.disconnect import ClientGone, client_gone, unless_disconnected
from rollwise.serve.errors import APIError, error_responses, honest_openapi, install_error_handlers
from rollwise.serve.responses import FiniteJSONResponse
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES, RequestSizeLimit, check_max_request_bytes
from rollwise.tasks.prompts import encode_prompt

# ==================================================================== the front end over EngineWorker


@dataclass(eq=False)
class _Generation:
    """One HTTP request in flight: its engine requests, with sizes[k] samples in engine_ids[k]."""

    public_id: str
    engine_ids: list[str]
    sizes: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: set[tuple[str, int]] = field(default_factory=set)  # (engine id, index) not yet returned
    aborting: set[str] = field(default_factory=set)


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
        self._public: dict[str, _Generation] = {}
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
        self, public_id: str, units: list[tuple[list[int], SamplingParams]], stream_tokens: bool
    ) -> _Generation:
        """Add one engine request per (prompt ids, params) unit, under fresh uuid request ids."""
        if public_id in self._public:
            raise APIError(409, f"request_id {public_id!r} is already in flight; use another one", "request_id")
        gen = _Generation(public_id, [uuid.uuid4().hex for _ in units], [params.n for _, params in units])
        gen.pending = {(rid, i) for rid, size in zip(gen.engine_ids, gen.sizes) for i in range(size)}
        self._public[public_id] = gen
        for rid in gen.engine_ids:
            self._routes[rid] = gen.queue
            if stream_tokens:
                self._token_routes[rid] = gen.queue
        requests = [GenerationRequest(rid, ids, params) for rid, (ids, params) in zip(gen.engine_ids, units)]
        try:
            await self.call(lambda engine: add_all(engine, requests))
        except ValueError as exc:  # the engine's own checks (the handlers check first, naming fields)
            self.release(gen, abort=False)
            raise APIError(400, str(exc)) from exc
        except BaseException:
            self.release(gen)
            raise
        return gen

    def release(self, gen: _Generation, abort: bool = True) -> None:
        """Forget a request; samples still running are aborted in the background (client gone)."""
        if self._public.get(gen.public_id) is gen:
            del self._public[gen.public_id]
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

    async def abort(self, public_id: str) -> int:
        gen = self._public.get(public_id)
        if gen is None:
            raise APIError(404, f"no request with request_id {public_id!r} is in flight", "request_id",
                           kind="not_found_error")
        return await self.abort_engine(gen.engine_ids)


# ==================================================================== one sample's text


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` can stand for: its longest vocabulary entry (added
    and special tokens included). Byte-level BPE entries have one character per byte and SentencePiece ones one
    per character (byte-fallback entries like <0x0A> are longer than what they cover), so this is an upper bound."""
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no readable vocabulary: never refuse on length before tokenizing
        return 2**62


class _Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def piece(self, token: int) -> str:
        """The token's own text, for logprob entries."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode([token])
        return text


class _Sample:
    """One choice: its tokens so far, its incremental text, OpenAI stop strings, stream cursors."""

    def __init__(self, index: int, prompt_ids: list[int], detok: _Detokenizer | None, stops: list[str]) -> None:
        self.index, self.prompt_ids, self.detok, self.stops = index, prompt_ids, detok, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # streamed text waits this many chars
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.full = ""  # decoded token_ids (kept current while tokens stream in)
        self.text: str | None = None  # the final text, once finished
        self.finish_reason: str | None = None
        self.cached_prompt_tokens = 0
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per engine token, when asked (top_logprobs)
        self.engine_done = False  # the engine returned this sample's Completion
        self.sent_text, self.sent_tokens, self.announced, self.closed = "", 0, False, False

    @property
    def finished(self) -> bool:
        return self.text is not None

    def add(self, token: int, logprob: float, version: int) -> None:
        if self.finished:  # past a stop string: the rest is not part of the answer
            return
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.detok is None:
            return
        self.full = self.detok.decode(self.token_ids)
        hits = [p for s in self.stops if (p := self.full.find(s)) >= 0]
        if hits:  # OpenAI semantics: the text ends before the stop string; the tokens up to and
            self.text = self.full[: min(hits)]  # including the one that completed it are kept
            self.finish_reason = "stop"

    def finish(self, completion: Completion) -> None:
        self.engine_done = True
        self.cached_prompt_tokens = completion.cached_prompt_tokens
        self.top_logprobs = completion.top_logprobs  # token_ids is a prefix of completion.token_ids
        if self.finished:
            return
        if self.stops:  # replay tokens no event carried (none, normally), watching for stop strings
            start = len(self.token_ids)
            for token, logprob, version in zip(
                completion.token_ids[start:], completion.logprobs[start:], completion.versions[start:]
            ):
                self.add(token, logprob, version)
                if self.finished:
                    return
        else:
            self.token_ids = list(completion.token_ids)
            self.logprobs = list(completion.logprobs)
            self.versions = list(completion.versions)
            self.full = self.detok.decode(self.token_ids) if self.detok is not None else ""
        self.text = self.full
        self.finish_reason = completion.finish_reason

    def take_delta(self) -> tuple[str, int, int]:
        """Streaming: (new text, token range) not sent yet. Text that may still turn out to start a
        stop string, or ends in an incomplete character, waits for the next token."""
        if self.finished:
            ready = self.text
        else:
            safe = min(len(self.full) - self.hold, len(self.full.rstrip("\ufffd")))
            ready = self.full[: max(safe, 0)]
        text = ready[len(self.sent_text):] if ready.startswith(self.sent_text) else ""
        self.sent_text += text
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return text, start, self.sent_tokens


# ==================================================================== the app


class _EngineCollector:
    """Prometheus collector over a snapshot taken on the engine thread just before each scrape."""

    def __init__(self, frontend: EngineFrontend) -> None:
        self.frontend = frontend
        self.snapshot: dict[str, Any] = {
            "running": 0, "waiting": 0, "paused": False, "policy_version": 0,
            "prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
        }

    def collect(self):  # noqa: ANN201 - the prometheus_client protocol
        s = self.snapshot
        yield GaugeMetricFamily("rollwise_engine_running", "sequences generating now", value=s["running"])
        yield GaugeMetricFamily("rollwise_engine_waiting", "samples queued for a KV-cache slot", value=s["waiting"])
        yield GaugeMetricFamily("rollwise_engine_paused", "1 while the engine is paused", value=int(s["paused"]))
        yield GaugeMetricFamily("rollwise_engine_policy_version", "policy version sampling now",
                                value=s["policy_version"])
        for key, doc in (
            ("generated_tokens", "tokens sampled"),
            ("prompt_tokens", "prompt tokens of admitted samples (computed or reused)"),
            ("cached_prompt_tokens", "prompt tokens whose KV was reused, not recomputed"),
            ("steps", "engine steps"),
            ("step_seconds", "seconds spent in engine steps (busy time)"),
            ("prefix_cache_hit_tokens", "prompt tokens reused from the cross-request prefix cache"),
        ):
            yield CounterMetricFamily(f"rollwise_engine_{key}", doc, value=s.get(key, 0))
        yield GaugeMetricFamily("rollwise_engine_prefix_cache_tokens", "tokens held by the prefix cache",
                                value=s.get("prefix_cache_tokens", 0))
        finished = CounterMetricFamily("rollwise_engine_finished_samples", "samples returned, by finish reason",
                                       labels=["finish_reason"])
        for reason in ("stop", "length", "abort"):
            finished.add_metric([reason], self.frontend.finished_samples[reason])
        yield finished


def _sse(payload: dict[str, Any] | str) -> str:
    if not isinstance(payload, str):  # like FiniteJSONResponse: never NaN/Infinity, which JSON does not have
        payload = FiniteJSONResponse(payload).body.decode("utf-8")
    return f"data: {payload}\n\n"


class _Server:
    """The HTTP handlers' logic over one EngineFrontend."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = int(engine.model_info().vocab_size)
        self.frontend = EngineFrontend(engine)
        self.detok = _Detokenizer(tokenizer)
        self.longest_token_chars = longest_token_chars(tokenizer)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = _EngineCollector(self.frontend)
        self.registry.register(self.collector)
        self.created = int(time.time())

    # ------------------------------------------------------------ checks shared by the endpoints

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           "model", kind="not_found_error")

    def check_prompt(self, ids: list[int], name: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{name} must not be empty", name)
        if len(ids) >= self.engine.max_model_len:  # first: a huge list is refused without walking it
            raise APIError(400, f"{name} has {len(ids)} tokens, which leaves no room to generate within "
                                f"max_model_len={self.engine.max_model_len}", name)
        for j, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"{name}[{j}] = {token} is outside the vocabulary [0, {self.vocab_size})", name)
        return ids

    def check_text_length(self, chars: int, name: str) -> None:
        """Refuse, without tokenizing, text that cannot fit: no token covers more than `longest_token_chars`
        characters, so text of chars >= longest * max_model_len has at least max_model_len tokens."""
        limit = self.longest_token_chars * self.engine.max_model_len
        if chars >= limit:
            raise APIError(400, f"{name} has {chars} characters, more than max_model_len="
                                f"{self.engine.max_model_len} tokens can hold (no token of this tokenizer is longer "
                                f"than {self.longest_token_chars} characters); shorten it", name)

    def params(self, body: _Sampling, max_tokens: int | None) -> SamplingParams:
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
        if body.n > self.engine.max_num_seqs:
            raise APIError(400, f"n must be <= max_num_seqs ({self.engine.max_num_seqs}): a request's samples share "
                                "one prefill and run together", "n")
        for j, token in enumerate(body.stop_token_ids):
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"stop_token_ids[{j}] = {token} is outside the vocabulary "
                                    f"[0, {self.vocab_size})", "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens or self.engine.max_model_len,  # the engine stops at max_model_len anyway
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            n=body.n,
            stop_token_ids=list(body.stop_token_ids),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            top_logprobs=body.num_top_logprobs(),
        )

    # ------------------------------------------------------------ running a request

    async def _pump(self, gen: _Generation, samples: dict[tuple[str, int], _Sample]) -> list[_Sample]:
        """Wait for events, apply every one queued; return the samples that changed."""
        events = [await gen.queue.get()]
        while not gen.queue.empty():
            events.append(gen.queue.get_nowait())
        changed: dict[int, _Sample] = {}
        for event in events:
            if event[0] == "error":
                raise APIError(503, f"the engine failed: {event[1]}", kind="server_error")
            if event[0] == "token":
                _, rid, index, token, logprob, version = event
                sample = samples[(rid, index)]
                sample.add(token, logprob, version)
            else:
                completion: Completion = event[1]
                key = (completion.request_id, completion.index)
                sample = samples.get(key)
                if sample is None or sample.engine_done:
                    continue
                sample.finish(completion)
                gen.pending.discard(key)
            changed[id(sample)] = sample
        # Every sample of an engine request past a stop string: stop spending steps on it.
        for rid, size in zip(gen.engine_ids, gen.sizes):
            group = [samples[(rid, i)] for i in range(size)]
            if rid not in gen.aborting and all(s.finished for s in group) and not all(s.engine_done for s in group):
                gen.aborting.add(rid)
                await self.frontend.abort_engine([rid])
        return list(changed.values())

    async def _start(
        self, prefix: str, body: _Sampling, prompts: list[list[int]], max_tokens: int | None,
        stops: list[str], stream: bool, decode: bool = True, split: bool = False,
    ) -> tuple[_Generation, list[_Sample], dict[tuple[str, int], _Sample]]:
        """Submit; choice p * n + i is sample i of prompt p. With `split`, every choice is its own
        engine request (n=1, seed + i: the same samples as one n-sample request, and the engine still
        shares the prefill of requests admitted together), so a stop string can end just that one."""
        params = self.params(body, max_tokens)
        n = params.n
        if split:
            units = [(ids, replace(params, n=1, seed=None if params.seed is None else params.seed + i))
                     for ids in prompts for i in range(n)]
        else:
            units = [(ids, params) for ids in prompts]
        public_id = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        gen = await self.frontend.submit(public_id, units, stream_tokens=stream or bool(stops))
        detok = self.detok if decode else None
        ordered = [_Sample(p * n + i, ids, detok, stops) for p, ids in enumerate(prompts) for i in range(n)]
        if split:
            by_key = {(rid, 0): s for rid, s in zip(gen.engine_ids, ordered)}
        else:
            by_key = {(gen.engine_ids[s.index // n], s.index % n): s for s in ordered}
        return gen, ordered, by_key

    async def _run_to_end(self, gen: _Generation, by_key: dict[tuple[str, int], _Sample]) -> None:
        try:
            while gen.pending:
                await self._pump(gen, by_key)
        finally:
            self.frontend.release(gen)
        self._count(by_key.values())

    def _count(self, samples: Any) -> None:
        for s in samples:
            self.frontend.finished_samples[s.finish_reason or "abort"] += 1

    # ------------------------------------------------------------ OpenAI layout

    def _logprobs(self, chat: bool, s: _Sample, start: int, end: int) -> dict[str, Any]:
        pieces = [self.detok.piece(t) for t in s.token_ids[start:end]]
        tops = s.top_logprobs[start:end] if s.top_logprobs else [[] for _ in pieces]
        if chat:  # OpenAI: top_logprobs is a list of {token, logprob, bytes}, best first
            return {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")),
                 "top_logprobs": [self._logprob_entry(t, alt) for t, alt in top]}
                for p, lp, top in zip(pieces, s.logprobs[start:end], tops)
            ]}
        offset = sum(len(self.detok.piece(t)) for t in s.token_ids[:start])
        offsets = []
        for p in pieces:
            offsets.append(offset)
            offset += len(p)
        # Legacy completions: one {token text: logprob} per token, the best alternatives plus the
        # sampled token (as vLLM returns them); null when no alternatives were asked for.
        top_dicts = None
        if s.top_logprobs:
            top_dicts = [{**{self.detok.piece(t): alt for t, alt in top}, p: lp}
                         for p, lp, top in zip(pieces, s.logprobs[start:end], tops)]
        return {"tokens": pieces, "token_logprobs": s.logprobs[start:end], "top_logprobs": top_dicts,
                "text_offset": offsets}

    def _logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.detok.piece(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    def _echo(self, result: dict[str, Any], body: CompletionRequest, prompts: list[list[int]]) -> None:
        """echo: each choice's text starts with its prompt (as sent, or decoded from ids); its logprobs
        start with the prompt tokens, whose logprobs are null (prompt logprobs are not computed here)."""
        n = body.n
        for choice in result["choices"]:
            p = choice["index"] // n
            sent = body.prompt[p]
            prompt_text = sent if isinstance(sent, str) else self.detok.decode(prompts[p])
            choice["text"] = prompt_text + choice["text"]
            lp = choice["logprobs"]
            pieces = [self.detok.piece(t) for t in prompts[p]]
            offsets = [sum(len(q) for q in pieces[:k]) for k in range(len(pieces))]
            shift = len(prompt_text)
            lp["text_offset"] = offsets + [o + shift for o in lp["text_offset"]]
            lp["tokens"] = pieces + lp["tokens"]
            lp["token_logprobs"] = [None] * len(pieces) + lp["token_logprobs"]
            if lp["top_logprobs"] is not None:
                lp["top_logprobs"] = [None] * len(pieces) + lp["top_logprobs"]

    def _choice(self, chat: bool, s: _Sample) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": s.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": s.text}
        else:
            choice["text"] = s.text
        choice.update(
            logprobs=self._logprobs(chat, s, 0, len(s.token_ids)),
            finish_reason=s.finish_reason,
            token_ids=s.token_ids,
            prompt_token_ids=s.prompt_ids,
            policy_versions=s.versions,
            cached_prompt_tokens=s.cached_prompt_tokens,
        )
        return choice

    @staticmethod
    def _usage(prompts: list[list[int]], samples: list[_Sample]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _delta(self, chat: bool, s: _Sample) -> dict[str, Any] | None:
        if s.closed:
            return None
        text, start, end = s.take_delta()
        closing = s.finished and s.engine_done
        if not text and start == end and not closing and s.announced:
            return None
        choice: dict[str, Any] = {"index": s.index}
        if chat:
            choice["delta"] = {"content": text} if text or not closing else {}
        else:
            choice["text"] = text
        choice.update(
            logprobs=self._logprobs(chat, s, start, end),
            finish_reason=s.finish_reason if closing else None,
            token_ids=s.token_ids[start:end],
            policy_versions=s.versions[start:end],
        )
        if not s.announced:
            s.announced = True
            choice["prompt_token_ids"] = s.prompt_ids
        if closing:
            s.closed = True
            choice["cached_prompt_tokens"] = s.cached_prompt_tokens
        return choice

    async def _stream(
        self, chat: bool, gen: _Generation, samples: list[_Sample], by_key: dict[tuple[str, int], _Sample],
        prompts: list[list[int]], include_usage: bool,
    ) -> AsyncIterator[str]:
        head = {"id": gen.public_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        try:
            if chat:  # OpenAI opens each choice with the assistant role
                yield _sse({**head, "choices": [
                    {"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None, "prompt_token_ids": s.prompt_ids} for s in samples
                ]})
                for s in samples:
                    s.announced = True
            while not all(s.closed for s in samples):
                changed = await self._pump(gen, by_key)
                choices = [c for s in sorted(changed, key=lambda s: s.index) if (c := self._delta(chat, s))]
                if choices:
                    yield _sse({**head, "choices": choices})
            self._count(samples)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage(prompts, samples)})
            yield _sse("[DONE]")
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            self.frontend.release(gen)

    async def openai(self, request: Request, chat: bool, body: _OpenAISampling, prompts: list[list[int]],
                     max_tokens: int | None):
        gen, samples, by_key = await self._start(
            "chatcmpl" if chat else "cmpl", body, prompts, max_tokens, body.stop, body.stream, split=True
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(chat, gen, samples, by_key, prompts, include_usage),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        await unless_disconnected(request, self._run_to_end(gen, by_key))
        return {
            "id": gen.public_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self._choice(chat, s) for s in samples],
            "usage": self._usage(prompts, samples),
        }

    # ------------------------------------------------------------ endpoint bodies

    async def chat_completions(self, request: Request, body: ChatCompletionRequest):
        self.check_model(body.model)
        if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them", "max_tokens")
        messages = [m.for_template() for m in body.messages]
        # The template adds text, so the messages' own text bounds the rendered prompt from below.
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        try:  # off the event loop: rendering and tokenizing a long conversation must not stall /health
            prompt = await asyncio.to_thread(encode_prompt, self.tokenizer, messages, body.tools)
        except Exception as exc:  # noqa: BLE001 - no template, or the template rejects the conversation
            raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages") from exc
        self.check_prompt(prompt, "messages")
        return await self.openai(request, True, body, [prompt], body.max_tokens or body.max_completion_tokens)

    async def completions(self, request: Request, body: CompletionRequest):
        self.check_model(body.model)
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of is not supported (it must equal n)", "best_of")
        names = ["prompt" if len(body.prompt) == 1 else f"prompt[{i}]" for i in range(len(body.prompt))]
        for name, prompt in zip(names, body.prompt):
            if isinstance(prompt, str):
                self.check_text_length(len(prompt), name)
        texts = [p for p in body.prompt if isinstance(p, str)]
        encoded = iter(await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts]) if texts else [])
        prompts = [self.check_prompt(next(encoded) if isinstance(p, str) else p, name)
                   for name, p in zip(names, body.prompt)]
        result = await self.openai(request, False, body, prompts, body.max_tokens)
        if body.echo:  # never streamed (the request model refuses echo with stream)
            self._echo(result, body, prompts)
        return result

    async def generate(self, request: Request, body: GenerateRequest) -> dict[str, Any]:
        prompt = self.check_prompt(body.prompt_ids, "prompt_ids")
        gen, samples, by_key = await self._start("gen", body, [prompt], body.max_tokens, [], False, decode=False)
        await unless_disconnected(request, self._run_to_end(gen, by_key))
        return {
            "request_id": gen.public_id,
            "prompt_ids": prompt,
            "choices": [
                {"index": s.index, "token_ids": s.token_ids, "logprobs": s.logprobs, "versions": s.versions,
                 **({"top_logprobs": s.top_logprobs} if s.top_logprobs else {}),
                 "finish_reason": s.finish_reason, "cached_prompt_tokens": s.cached_prompt_tokens}
                for s in samples
            ],
        }

    async def update_weights_from_disk(self, body: UpdateWeightsRequest) -> dict[str, Any]:
        path = Path(body.path).expanduser()
        files = _weight_files(path)
        try:
            state = await asyncio.to_thread(_load_safetensors, files)
        except Exception as exc:  # noqa: BLE001 - unreadable or not safetensors
            raise APIError(400, f"path: cannot read {path}: {exc}", "path") from exc
        old = self.engine.policy_version
        try:
            await self.frontend.call(lambda engine: engine.update_weights(state, body.version))
        except ValueError as exc:
            raise APIError(400, f"weights rejected, still serving policy version {old}: {exc}", "path") from exc
        return {"policy_version": body.version, "previous_version": old, "tensors": len(state),
                "files": [str(f) for f in files]}

    def model_info(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "engine": self.engine.name,
            "vocab_size": self.vocab_size,
            "tokenizer_vocab_size": len(self.tokenizer),
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
            "eos_token_ids": sorted(self.engine.eos_token_ids),
            "tokenizer_fingerprint": self.fingerprint,
            "policy_version": self.engine.policy_version,
            "paused": self.engine.paused,
        }

    async def metrics(self) -> Response:
        def snapshot(engine: Any) -> dict[str, Any]:
            cache = getattr(engine, "prefix_cache", None)
            return {"running": engine.num_running, "waiting": engine.num_waiting, "paused": engine.paused,
                    "policy_version": engine.policy_version, **engine.stats,
                    "prefix_cache_tokens": cache.num_tokens if cache is not None else 0}

        snap = await self.frontend.call(snapshot)
        snap["step_seconds"] = self.frontend.worker.step_seconds if self.frontend.worker is not None else 0.0
        self.collector.snapshot = snap
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _weight_files(path: Path) -> list[Path]:
    if not path.exists():
        raise APIError(400, f"path {str(path)!r} does not exist", "path")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise APIError(400, f"path must be a .safetensors file or a model directory, got {path.name!r}", "path")
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise APIError(400, f"path: unreadable {index.name}: {exc}", "path") from exc
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise APIError(400, f"path: no *.safetensors files in {path}", "path")
    return files


def _load_safetensors(files: list[Path]) -> dict[str, Any]:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


# What each route can answer besides 200 (the OpenAPI schema lists them; the envelope is rollwise.serve.errors').
_STREAMS = {200: {"content": {"text/event-stream": {}},  # chunk objects, then the text [DONE]
                  "description": "JSON, or server-sent events with stream=true"}}
_OPENAI_ERRORS = error_responses(400, 404, 409, 413, 503)
_ENGINE_CALL = error_responses(503)  # the engine thread is not running
_HEALTH_DOWN = {503: {"description": "the engine thread died: {status: error, error}",
                      "content": {"application/json": {"schema": {"type": "object"}}}}}


def create_app(engine: Any, tokenizer: Any, model_name: str,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving `engine` (a ReferenceEngine not yet driven by any other thread). Request bodies
    over `max_request_bytes` are refused with 413 before they are read (`--max-request-bytes`)."""
    check_max_request_bytes(max_request_bytes)
    server = _Server(engine, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        server.frontend.start()
        try:
            yield
        finally:
            await server.frontend.close()
            getattr(engine, "close", lambda: None)()  # vLLM: remove its weight directory

    app = FastAPI(title="rollwise engine", summary="the rollwise engine contract over HTTP", lifespan=lifespan,
                  default_response_class=FiniteJSONResponse)
    app.state.server = server
    install_error_handlers(app)
    honest_openapi(app)
    app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes, option="--max-request-bytes")

    app.add_exception_handler(ClientGone, client_gone)

    @app.post("/v1/chat/completions", responses={**_STREAMS, **_OPENAI_ERRORS})
    async def chat_completions(request: Request, body: ChatCompletionRequest):  # noqa: ANN202
        return report_ignored(body, await server.chat_completions(request, body))

    @app.post("/v1/completions", responses={**_STREAMS, **_OPENAI_ERRORS})
    async def completions(request: Request, body: CompletionRequest):  # noqa: ANN202
        return report_ignored(body, await server.completions(request, body))

    @app.post("/generate", responses=error_responses(400, 409, 413, 503))
    async def generate(request: Request, body: GenerateRequest) -> dict[str, Any]:
        return await server.generate(request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "rollwise", "max_model_len": engine.max_model_len}]}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return server.model_info()

    @app.get("/health", responses=_HEALTH_DOWN)
    async def health() -> JSONResponse:
        if server.frontend.error is not None:
            return JSONResponse({"status": "error", "error": server.frontend.error}, status_code=503)
        # running/waiting are read without stopping the engine thread: a load hint for routers, not exact.
        return JSONResponse({"status": "ok", "paused": engine.paused, "policy_version": engine.policy_version,
                             "running": engine.num_running, "waiting": engine.num_waiting,
                             "max_num_seqs": engine.max_num_seqs})

    @app.get("/metrics", response_class=PlainTextResponse, responses=_ENGINE_CALL)
    async def metrics() -> Response:
        return await server.metrics()

    @app.post("/pause", responses=_ENGINE_CALL)
    async def pause() -> dict[str, Any]:
        await server.frontend.call(lambda e: e.pause())
        return {"paused": True}

    @app.post("/resume", responses=_ENGINE_CALL)
    async def resume() -> dict[str, Any]:
        await server.frontend.call(lambda e: e.resume())
        return {"paused": False}

    @app.post("/sleep", responses=error_responses(409, 503))
    async def sleep() -> dict[str, Any]:
        """Release the memory the backend can (vLLM on GPU: weights to host, KV freed; reference: KV)."""
        try:
            freed = await server.frontend.call(lambda e: e.sleep())
        except RuntimeError as exc:  # requests in flight
            raise APIError(409, str(exc), None, kind="conflict") from exc
        return {"sleeping": True, "memory_released": freed}

    @app.post("/wake", responses=_ENGINE_CALL)
    async def wake() -> dict[str, Any]:
        await server.frontend.call(lambda e: e.wake())
        return {"sleeping": False}

    @app.get("/load", responses=_ENGINE_CALL)
    async def load() -> dict[str, Any]:
        """The engine contract's load snapshot, read between two engine steps."""
        return (await server.frontend.call(lambda e: e.load())).as_dict()

    @app.post("/abort", responses=error_responses(400, 404, 413, 503))
    async def abort(body: AbortRequest) -> dict[str, Any]:
        return {"request_id": body.request_id, "aborted_samples": await server.frontend.abort(body.request_id)}

    @app.post("/update_weights_from_disk", responses=error_responses(400, 413, 503))
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict[str, Any]:
        return await server.update_weights_from_disk(body)

    @app.post("/flush_cache", responses=_ENGINE_CALL)
    async def flush_cache() -> dict[str, Any]:
        def flush(e: Any) -> int:
            cache = getattr(e, "prefix_cache", None)
            held = cache.num_tokens if cache is not None else 0
            if cache is not None:
                cache.clear()
            return held
        return {"flushed_tokens": await server.frontend.call(flush)}

    return app


def build_engine(
    model: str, max_num_seqs: int, max_model_len: int | None, seed: int | None = None, prefix_cache_tokens: int = 0,
    kind: str = "reference", kv_cache_gib: int = 2,
):
    """(engine, tokenizer) for a model spec, the way `rollwise train` builds its engine."""
    from rollwise.engine.factory import create_engine
    from rollwise.model.loading import load_model

    hf_model, tokenizer = load_model(model)
    if max_model_len is None:
        max_model_len = min(2048, getattr(hf_model.config, "max_position_embeddings", None) or 2048)
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    engine = create_engine(kind, hf_model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           eos_token_ids=eos_ids, seed=seed, model_name=model, prefix_cache_tokens=prefix_cache_tokens,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), kv_cache_gib=kv_cache_gib)
    return engine, tokenizer


def serve(
    model: str, host: str = "127.0.0.1", port: int = 8000, max_num_seqs: int = 16,
    max_model_len: int | None = None, served_model_name: str | None = None, seed: int | None = None,
    log_level: str = "info", prefix_cache_tokens: int = 16384, engine_kind: str = "auto",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    import uvicorn

    check_max_request_bytes(max_request_bytes)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    if prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be >= 0 (0 disables the cache), got {prefix_cache_tokens}")
    engine, tokenizer = build_engine(model, max_num_seqs, max_model_len, seed, prefix_cache_tokens, engine_kind)
    print(f"rollwise serve engine: {describe_engine(engine)}", flush=True)
    app = create_app(engine, tokenizer, served_model_name or model, max_request_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
