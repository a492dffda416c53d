"""The pool's HTTP API (the routes over rollwise.pool.engine_pool.EnginePool): parse, call the pool, shape
the answer. The endpoints are listed in rollwise.pool.server's docstring.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import Field

from rollwise.types.generation import SamplingParams
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.jobs import Job, PoolError
from rollwise.pool.metrics import metrics_registry, render
from rollwise.serve.auth import ApiKeys, caller_dependency
from rollwise.serve.disconnect import ClientGone, client_gone, unless_disconnected
from rollwise.serve.errors import APIError, error_responses
from rollwise.serve.front import Front, install_front
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_request_bytes
from rollwise.serve.settings import FrontSettings
from rollwise.serve.openai_schemas import MAX_REPETITION_PENALTY, MAX_TOKEN_COUNT, MIN_REPETITION_PENALTY, GenerateRequest, RequestBody, SamplingChecks


class AttachRequest(RequestBody):
    job: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = Field(min_length=1)
    # > 0, checked by EnginePool.attach (one check for HTTP and in-process attaches); the schema still says so
    priority: float = Field(1.0, json_schema_extra={"exclusiveMinimum": 0})
    tokenizer_fingerprint: str | None = None
    # a LoRA job (train.lora): it pushes adapters on `model` as base and shares that base's engines with the
    # other LoRA jobs on it, in one batch
    lora: bool = False


class PoolSampling(SamplingChecks):
    max_tokens: int = Field(256, ge=1, le=MAX_TOKEN_COUNT)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    n: int = Field(1, ge=1)
    stop_token_ids: list[int] = []
    seed: int | None = Field(None, ge=0, le=2**62)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    top_logprobs: int = Field(0, ge=0, le=20)


class PoolRequest(RequestBody):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: PoolSampling = PoolSampling()


class SubmitRequest(RequestBody):
    requests: list[PoolRequest] = Field(min_length=1)


class AbortIds(RequestBody):
    request_ids: list[str]


def _params(p: PoolSampling | GenerateRequest, max_tokens: int, where: str = "") -> SamplingParams:
    """Engine SamplingParams; its own checks (e.g. min_tokens <= max_tokens) become a 400 naming the field."""
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if p.temperature is None else p.temperature,
                              top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k, n=p.n,
                              stop_token_ids=list(p.stop_token_ids), seed=p.seed, ignore_eos=p.ignore_eos,
                              min_tokens=p.min_tokens, repetition_penalty=p.repetition_penalty or 1.0,
                              frequency_penalty=p.frequency_penalty or 0.0,
                              presence_penalty=p.presence_penalty or 0.0)
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        field_name = str(exc).split(" ", 1)[0]
        raise PoolError(400, f"{where}{exc}", f"{where}{field_name}") from exc


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


class LoopEvent:
    """A Waiter the pool's threads set and the event loop awaits (a /generate call holds no thread)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody waits
            pass

    async def wait(self) -> None:
        await self._event.wait()


# What each route can answer besides 200 (the OpenAPI schema lists them; the envelope is rollwise.serve.errors').
_JOB_CALL = error_responses(403, 404)  # a job's token: unknown job 404, another job's token 403
# + 409 (no weights yet, or the job faulted), 429 (--max-queued-per-job), 503 (its request was on a failed engine twice)
_JOB_BODY = error_responses(400, 403, 404, 409, 413, 429, 503)


def _is_weight_upload(scope: Any) -> bool:
    """PUT /jobs/{job}/weights carries a whole model; it is raw bytes, never parsed as JSON on the loop."""
    return scope.get("method") == "PUT" and str(scope.get("path", "")).endswith("/weights")


def _job_route(method: str, path: str) -> bool:
    """/jobs/{job}/...: guarded by the job's own token (issued at attach, to a key holder), not an API key."""
    return path.startswith("/jobs/")


def create_app(pool: EnginePool, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               api_keys: ApiKeys | None = None, front: Front | None = None) -> FastAPI:
    """The pool's HTTP API behind `front` (rollwise.serve.front; default: loopback, `api_keys`, bodies over
    `max_request_bytes` refused with 413 before they are read). Weight uploads have no size limit (they are as
    large as the model). With keys, attaching a job, /state and every route but the probes need one (401
    otherwise); a job's routes need its token instead."""
    check_max_request_bytes(max_request_bytes)
    front = front or Front(FrontSettings(max_request_bytes=max_request_bytes), api_keys)
    caller = caller_dependency(front.keys)  # the key's label: whose quota an attach counts against

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        pool.start()
        try:
            yield
        finally:
            pool.close()

    app = FastAPI(title="rollwise pool", summary="engines shared by several training jobs", lifespan=lifespan)
    app.state.pool = pool

    async def pool_error(request: Request, exc: PoolError) -> JSONResponse:
        kind = {403: "permission_error", 404: "not_found_error", 409: "conflict", 429: "rate_limit_error",
                503: "server_error"}.get(exc.status, "invalid_request_error")
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else None
        return APIError(exc.status, exc.message, exc.param, kind, headers=headers).response()

    app.add_exception_handler(PoolError, pool_error)
    app.add_exception_handler(ClientGone, client_gone)

    def auth(job: str, authorization: str | None) -> Job:
        return pool.job(job, _bearer(authorization))

    # 401 no/unknown API key, 429 --max-jobs(-per-key), 503 the model does not fit in the pool's memory
    @app.post("/jobs", responses=error_responses(400, 401, 409, 413, 429, 503))
    def attach(body: AttachRequest, owner: str = Depends(caller)) -> dict[str, Any]:
        job = pool.attach(body.job, body.model, body.priority, body.tokenizer_fingerprint, lora=body.lora,
                          owner=owner)
        return {"job": job.name, "token": job.token, "model": job.model, "lora": job.lora, "engines": len(pool.slots),
                "max_num_seqs": pool.max_num_seqs, "max_model_len": job.max_model_len,
                "vocab_size": job.vocab_size, "tokenizer_fingerprint": job.fingerprint, "engine": "reference",
                "eos_token_ids": list(job.eos_ids or [])}

    @app.put("/jobs/{job}/weights", responses=error_responses(400, 403, 404))
    async def weights(job: str, request: Request, authorization: str | None = Header(None)) -> dict[str, Any]:
        j = auth(job, authorization)
        body = await request.body()
        return await asyncio.to_thread(pool.load_weights, j, body)

    @app.get("/jobs/{job}/adapter", responses=_JOB_CALL)
    def adapter(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        """A LoRA job's adapter as the pool serves it (spec and version; the tensors never leave the pool)."""
        j = auth(job, authorization)
        if not j.lora or j.adapter is None:
            raise PoolError(404, f"job {j.name!r} has no adapter" + ("" if j.lora else
                                 " (it attached for full-parameter weights; attach with lora=true for adapters)"))
        return {"job": j.name, "adapter": j.adapter.name, "policy_version": j.version, "base": j.model,
                "rank": j.adapter.rank, "alpha": j.adapter.alpha, "target_modules": list(j.adapter.target_modules)}

    @app.post("/jobs/{job}/requests", responses=_JOB_BODY)
    def submit(job: str, body: SubmitRequest, authorization: str | None = Header(None)) -> dict[str, Any]:
        j = auth(job, authorization)
        reqs = [(r.request_id, r.prompt_ids, _params(r.params, r.params.max_tokens, f"requests[{i}].params."))
                for i, r in enumerate(body.requests)]
        pool.submit(j, reqs)
        return {"queued": len(reqs)}

    @app.post("/jobs/{job}/generate", responses=_JOB_BODY)
    async def generate(job: str, body: GenerateRequest, request: Request,
                       authorization: str | None = Header(None)) -> dict[str, Any]:
        j = auth(job, authorization)
        waiter = LoopEvent()
        rid = body.request_id or f"gen-{uuid.uuid4().hex}"
        params = _params(body, body.max_tokens or j.max_model_len)
        (req,) = pool.submit(j, [(rid, body.prompt_ids, params)], waiter=waiter)
        try:
            await unless_disconnected(request, waiter.wait())
        except ClientGone:  # nobody will read the answer: free the engine now
            await asyncio.to_thread(pool.abort, j, [rid])
            raise
        if req.error is not None:  # its job faulted, or its engine failed twice with it (rollwise.pool.slots)
            raise req.error
        done = sorted(req.done, key=lambda c: c.index)
        return {"request_id": rid, "prompt_ids": body.prompt_ids, "job": j.name, "choices": [
            {"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs, "versions": c.versions,
             "finish_reason": c.finish_reason, "cached_prompt_tokens": c.cached_prompt_tokens,
             **({"routed_experts": c.routed_experts.to_wire()} if c.routed_experts is not None else {})}
            for c in done]}

    @app.get("/jobs/{job}/completions", responses=error_responses(400, 403, 404))
    def completions(job: str, after: int = 0, timeout: float = 1.0,
                    authorization: str | None = Header(None)) -> dict[str, Any]:
        return pool.poll(auth(job, authorization), after, timeout)

    @app.post("/jobs/{job}/abort", responses=error_responses(400, 403, 404, 413, 503))
    def abort(job: str, body: AbortIds, authorization: str | None = Header(None)) -> dict[str, Any]:
        aborted, upto = pool.abort(auth(job, authorization), body.request_ids)
        return {"aborted": aborted, "upto": upto}

    @app.post("/jobs/{job}/pause", responses=_JOB_CALL)
    def pause(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        pool.set_paused(auth(job, authorization), True)
        return {"paused": True}

    @app.post("/jobs/{job}/resume", responses=_JOB_CALL)
    def resume(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        pool.set_paused(auth(job, authorization), False)
        return {"paused": False}

    @app.delete("/jobs/{job}", responses=_JOB_CALL)
    def detach(job: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        return pool.detach(auth(job, authorization))

    @app.get("/state", responses=error_responses(401))
    def state(_caller: str = Depends(caller)) -> dict[str, Any]:
        """Every job's name, queue and accounting: with API keys, only for a key's holder."""
        return pool.state()

    @app.get("/health")
    def health() -> dict[str, Any]:
        errors = [e for s in pool.slots for e in s.errors]
        return {"status": "ok" if not errors else "degraded", "engines": len(pool.slots),
                "jobs": sorted(pool.jobs), "errors": errors[-5:]}

    registry = metrics_registry(pool.state)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        body, content_type = render(registry)
        return Response(body, media_type=content_type)

    install_front(app, front, own_auth=_job_route, size_exempt=_is_weight_upload, registry=registry)
    return app
