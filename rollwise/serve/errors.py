"""The OpenAI-style error envelope every rollwise HTTP server answers with, and its OpenAPI description.

Every refusal is `{"error": {"message", "type", "param", "code"}}` with a message that names the field and the
fix. `install_error_handlers` makes FastAPI's own errors (validation, unknown route, wrong method) use it too,
and `error_responses` / `honest_openapi` make the OpenAPI schema list the status codes a route really returns
(FastAPI would otherwise document a 422 the servers never send, and none of their 400/404/413/503).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollwise.serve.json_bounds import MAX_JSON_DEPTH


class APIError(Exception):
    """An error answered as OpenAI's error JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers  # e.g. Retry-After on a 429, WWW-Authenticate on a 401

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ==================================================================== the envelope, for OpenAPI


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    """What every non-2xx JSON answer of a rollwise server looks like."""

    error: ErrorDetail


_MEANING = {
    400: "invalid request: the message names the field and the fix",
    401: "an API key is needed: send `Authorization: Bearer KEY` with one of the server's keys",
    403: "this token does not belong to the job",
    404: "unknown model, job or request id",
    409: "conflict: the request id is in flight already, or the server is in a state that refuses this",
    413: "request body over the server's --max-request-bytes (refused before it is parsed)",
    429: "too many requests: retry later",
    502: "the engine behind this server failed; nothing was recorded, so retrying is safe",
    503: "the engine is not running (see /health)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a route: each status with the error envelope as its body."""
    return {status: {"model": ErrorEnvelope, "description": _MEANING[status]} for status in statuses}


def honest_openapi(app: FastAPI) -> None:
    """Serve an OpenAPI schema without FastAPI's automatic 422 entries: invalid requests get a 400 here (the
    routes list it with `error_responses`), so a client or a fuzzer reading the schema expects what comes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ==================================================================== validation errors, described


def loc_path(loc: tuple | list) -> str:
    """('body', 'messages', 1, 'role') -> 'messages[1].role'."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


_PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not a supported field",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be one of {expected}",
    "too_short": "must have at least {min_length} item(s)",
    "string_too_short": "must have at least {min_length} character(s)",
    "string_too_long": "must have at most {max_length} characters",
    "string_pattern_mismatch": "must match {pattern}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
}


class ProblemAt(ValueError):
    """A validator's error about a place inside the value it checks (e.g. one message of a body checked whole):
    `path` is that place, below the validated field's own location, so the 400 names it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def error_path(err: dict[str, Any]) -> str:
    """The field path a pydantic error is about, including a ProblemAt's place inside the field."""
    path = loc_path(err.get("loc", ()))
    inner = (err.get("ctx") or {}).get("error")
    if isinstance(inner, ProblemAt) and inner.path:
        path = path + inner.path if inner.path.startswith("[") or not path else f"{path}.{inner.path}"
    return path


def describe(err: dict[str, Any]) -> str:
    """One pydantic error as '<field path> <problem>'."""
    path = error_path(err) or "request body"
    kind, ctx = err.get("type"), err.get("ctx") or {}
    if kind == "json_invalid":
        return f"request body is not valid JSON ({ctx.get('error', err.get('msg'))})"
    if kind == "value_error":  # our validators' messages, written to follow the field path
        return f"{path} {ctx.get('error', err.get('msg'))}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return f"{path} must not be empty"
    try:
        return f"{path} {_PHRASES[kind].format(**ctx)}"
    except (KeyError, IndexError):
        return f"{path}: {err.get('msg')}"


# ==================================================================== handlers


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    message = "; ".join(describe(e) for e in errors) or "invalid request"
    param = error_path(errors[0]) if errors else None
    return APIError(400, message, param or None).response()


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown route, wrong method) in the same envelope."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    detail = exc.detail
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's JSON parsing of the body hit Python's recursion limit
        detail = (f"the request body nests too deeply to parse; at most {MAX_JSON_DEPTH} levels of objects and "
                  "lists are accepted")
    response = APIError(exc.status_code, f"{request.method} {request.url.path}: {detail}", None, kind).response()
    for name, value in (exc.headers or {}).items():  # e.g. 405's Allow
        response.headers[name] = value
    return response


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
