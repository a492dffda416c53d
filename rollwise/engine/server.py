"""`rollwise serve engine`: the engine contract over HTTP, on the reference engine.

One process, one engine. This module is the app (routes only) and its start; the work is done by
rollwise.engine.service (the endpoints' logic) over rollwise.engine.frontend (an EngineWorker stepping the
engine on its own thread, its results routed to asyncio), with samples.py (detokenizing, stop strings),
openai_responses.py (response shapes) and metrics.py (/metrics).

Endpoints (JSON unless noted):

    POST /v1/completions         OpenAI text completions (prompt: text, token ids, or a list of either)
    POST /v1/chat/completions    OpenAI chat completions (messages through the tokenizer's chat template)
        Both: stream=true sends server-sent events in OpenAI's chunk format ending with `data: [DONE]`.
        Every choice also carries token_ids (exactly the sampled ids), prompt_token_ids,
        policy_versions (one per token) and cached_prompt_tokens; the sampled tokens' logprobs are
        always returned, in OpenAI's logprobs layout.
    POST /generate               token level: {prompt_ids, sampling params, n} -> token ids, logprobs, versions
    POST /inference/v1/generate  vLLM's token-in route: {token_ids, sampling_params} (vllm_generate.py)
    GET  /v1/models, /model_info (incl. the tokenizer fingerprint), /health, /metrics (Prometheus text)
    POST /pause, /resume, /abort {request_id}, /update_weights_from_disk {path, version}
    POST /flush_cache            empty the prefix cache (benchmarks compare routing policies from a cold cache)
    POST /retain                 {session_id, request_id, tool_name, expected_latency_s}: that turn ended in a
                                 tool call; preserve/swap/discard its KV, reported (rollwise.engine.retention)
    POST /release_session        {session_id}: the session ended; release what the engine holds for it
    POST /sleep                  {migrate_to?}: release memory; with migrate_to, requests in flight move there first
    POST /migrate, /migration/*  live migration of requests in flight to another engine server (migration_http.py)

Request ids: the engine only ever sees fresh uuid ids, so clients cannot collide. The public id
(a response's `id` / `request_id`, or a client's own `request_id` while no other request in flight
uses it) is what /abort takes.

The serving front (rollwise.serve.front) gives it the flags, API keys, limits, /ready, request metrics and
SIGTERM drain every rollwise server shares. /update_weights_from_disk reads server-side paths: without API keys
it binds only loopback (for a trainer on the same machine) unless --insecure-no-auth.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rollwise.engine.contract import Engine
from rollwise.engine.core import Command
from rollwise.engine.factory import describe_engine
from rollwise.engine.migration_http import SleepBody, add_migration_routes
from rollwise.engine.retention import ReleaseSessionBody, RetainBody, RetentionRequest
from rollwise.engine.scoring_http import add_score_route
from rollwise.engine.service import EngineService
from rollwise.engine.vllm_generate import add_vllm_generate_route
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.serve.disconnect import ClientGone, client_gone
from rollwise.serve.drain import serve_app
from rollwise.serve.errors import APIError, error_responses
from rollwise.serve.front import Front, install_front
from rollwise.serve.settings import FrontSettings
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_request_bytes
from rollwise.serve.openai_schemas import (  # the request bodies
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsRequest,
)
from rollwise.serve.openai_schemas import report_ignored
from rollwise.serve.responses import FiniteJSONResponse, as_response

__all__ = ["build_engine", "create_app", "serve"]

# What each route can answer besides 200 (the OpenAPI schema lists them; the envelope is rollwise.serve.errors').
_STREAMS = {200: {"content": {"text/event-stream": {}},  # chunk objects, then the text [DONE]
                  "description": "JSON, or server-sent events with stream=true"}}
_OPENAI_ERRORS = error_responses(400, 404, 409, 413, 503)
_ENGINE_CALL = error_responses(503)  # the engine thread is not running
_HEALTH_DOWN = {503: {"description": "the engine thread died: {status: error, error}",
                      "content": {"application/json": {"schema": {"type": "object"}}}}}


def _switch_route(server: EngineService, switch: Command[None], state: dict[str, bool]
                  ) -> Callable[[], Awaitable[dict[str, bool]]]:
    async def route() -> dict[str, bool]:
        await server.frontend.call(switch)
        return dict(state)
    return route


def create_app(engine: Engine, tokenizer: Any, model_name: str,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, front: Front | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (a ReferenceEngine not yet driven by any other thread), behind `front`
    (default: loopback, no keys, bodies over `max_request_bytes` refused with 413 before they are read)."""
    check_max_request_bytes(max_request_bytes)
    front = front or Front(FrontSettings(max_request_bytes=max_request_bytes))
    server = EngineService(engine, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        server.frontend.start()
        try:
            yield
        finally:
            await server.frontend.close()
            engine.close()  # vLLM: shut its engine core down, remove its weight directory

    app = FastAPI(title="rollwise engine", summary="the rollwise engine contract over HTTP", lifespan=lifespan,
                  default_response_class=FiniteJSONResponse)
    app.state.server = server

    app.add_exception_handler(ClientGone, client_gone)

    @app.post("/v1/chat/completions", responses={**_STREAMS, **_OPENAI_ERRORS})
    async def chat_completions(request: Request, body: ChatCompletionRequest):  # noqa: ANN202
        return report_ignored(body, as_response(await server.chat_completions(request, body)))

    @app.post("/v1/completions", responses={**_STREAMS, **_OPENAI_ERRORS})
    async def completions(request: Request, body: CompletionRequest):  # noqa: ANN202
        return report_ignored(body, as_response(await server.completions(request, body)))

    @app.post("/generate", response_model=dict[str, Any], responses=error_responses(400, 409, 413, 503))
    async def generate(request: Request, body: GenerateRequest) -> Response:
        return FiniteJSONResponse(await server.generate(request, body))

    add_vllm_generate_route(app, server)  # POST /inference/v1/generate: vLLM's token-in shape (vllm-router's)
    add_score_route(app, server)  # POST /score: Engine.score_tokens (a teacher engine, rollwise.control.teacher)
    migration = add_migration_routes(app, server)  # POST /migrate, /migration/*: live migration (issue 42)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": model_name, "object": "model", "created": server.created, "owned_by": "rollwise",
                "max_model_len": engine.max_model_len}
        # Loaded LoRA adapters, as vLLM lists them: their own id, the base model as parent.
        adapters = [{**base, "id": name, "parent": model_name, "policy_version": version}
                    for name, version in sorted(server.adapters().items())]
        return {"object": "list", "data": [base, *adapters]}

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

    # The state switches: each runs one engine method on the engine thread and answers the state it set.
    switches: list[tuple[str, Command[None], dict[str, bool]]] = [
        ("pause", lambda e: e.pause(), {"paused": True}),
        ("resume", lambda e: e.resume(), {"paused": False}),
        ("wake", lambda e: e.wake(), {"sleeping": False}),
    ]
    for name, switch, state in switches:
        app.add_api_route(f"/{name}", _switch_route(server, switch, state), methods=["POST"], name=name,
                          responses=_ENGINE_CALL)

    @app.post("/sleep", responses=error_responses(400, 409, 503))
    async def sleep(request: Request, body: SleepBody | None = None) -> dict[str, Any]:
        """Release the memory the backend can (vLLM on GPU: weights to host, KV freed; reference: KV). With
        migrate_to, the requests in flight move to that engine server first (live migration)."""
        moved = None
        if body is not None and body.migrate_to is not None:
            moved = await migration.migrate_out(str(body.migrate_to), request.headers.get("authorization"),
                                                str(request.base_url))
        try:
            freed = await server.frontend.call(lambda e: e.sleep())
        except RuntimeError as exc:  # requests in flight
            if moved is not None:  # some moved (their clients get the target's answers); these stayed, named
                raise APIError(409, f"{exc}: the migration to {moved['target']} moved {len(moved['migrated'])} and "
                                    f"left {moved['still_here']} here ({'; '.join(moved['stayed'].values())}); "
                                    "let them finish, then sleep", "migrate_to", kind="conflict") from exc
            raise APIError(409, f"{exc}; pass migrate_to (an engine server's URL) to move them there first",
                           "migrate_to", kind="conflict") from exc
        return {"sleeping": True, "memory_released": freed, **({"migration": moved} if moved is not None else {})}

    @app.get("/load", responses=_ENGINE_CALL)
    async def load() -> dict[str, Any]:
        """The engine contract's load snapshot, read between two engine steps."""
        return (await server.frontend.call(lambda e: e.load())).as_dict()

    @app.post("/abort", responses=error_responses(400, 404, 413, 503))
    async def abort(body: AbortRequest) -> dict[str, Any]:
        # (its engine requests that migrated away are aborted where they run; their samples come back here)
        return {"request_id": body.request_id, "aborted_samples": await server.frontend.abort(body.request_id)}

    @app.post("/update_weights_from_disk", responses=error_responses(400, 413, 503))
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict[str, Any]:
        return await server.update_weights_from_disk(body)

    @app.post("/flush_cache", responses=_ENGINE_CALL)
    async def flush_cache() -> dict[str, Any]:
        return {"flushed_tokens": await server.frontend.call(lambda e: e.flush_prefix_cache())}

    @app.post("/retain", responses=error_responses(400, 413, 503))
    async def retain(body: RetainBody) -> dict[str, Any]:
        """The turn `request_id` ended in a tool call: the engine's decision (discard, 0 tokens, when the
        turn is unknown or its KV is gone: the next turn recomputes, nothing is lost)."""
        engine_id = (server.frontend.engine_ids_of(body.request_id) or [body.request_id])[0]
        req = RetentionRequest(body.session_id, engine_id, body.tool_name, body.expected_latency_s)
        return (await server.frontend.call(lambda e: e.retain(req))).as_dict()

    @app.post("/release_session", responses=error_responses(400, 413, 503))
    async def release_session(body: ReleaseSessionBody) -> dict[str, Any]:
        held = await server.frontend.call(lambda e: e.release_session(body.session_id))
        return {"session_id": body.session_id, "released": held}

    install_front(app, front, ready=lambda: server.frontend.error is None, registry=server.registry)
    return app


def build_engine(
    model: str, max_num_seqs: int, max_model_len: int | None, seed: int | None = None, prefix_cache_tokens: int = 0,
    kind: str = "reference", kv_cache_gib: int = 2, retention: str = "off", dtype: str = "float32",
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
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), kv_cache_gib=kv_cache_gib,
                           retention=retention, dtype=dtype)
    return engine, tokenizer


def serve(
    model: str, front: Front | None = None, max_num_seqs: int = 16,
    max_model_len: int | None = None, served_model_name: str | None = None, seed: int | None = None,
    prefix_cache_tokens: int = 16384, engine_kind: str = "auto", retention: str = "off", dtype: str = "float32",
) -> None:
    """Build the engine and serve it behind `front` (default: 127.0.0.1:8000, no keys) until SIGTERM drains it."""
    front = front or Front.from_settings(FrontSettings())
    who = front.who_may_call()  # refuses an open non-loopback server before the model loads
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    if prefix_cache_tokens < 0:
        raise ValueError(f"--prefix-cache-tokens must be >= 0 (0 disables the cache), got {prefix_cache_tokens}")
    engine, tokenizer = build_engine(model, max_num_seqs, max_model_len, seed, prefix_cache_tokens, engine_kind,
                                     retention=retention, dtype=dtype)
    print(f"rollwise serve engine: {describe_engine(engine)}; {who}", flush=True)
    app = create_app(engine, tokenizer, served_model_name or model, front=front)
    serve_app(app, front)
