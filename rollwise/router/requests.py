"""What the router reads from a generation request, and the errors it answers with.

The router parses a body only to route it: its own fields come out (the engine refuses fields it does
not know), everything else is forwarded untouched. Parsing and tokenizing happen on one worker thread,
not on the event loop: a multi-megabyte prompt must not stall `/health` or other requests, and one
thread also keeps the tokenizer (not thread-safe) to a single user. The exception is a small token-in
body (no tokenizer, under INLINE_PARSE_BYTES), parsed on the loop: the thread hop would cost more.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from rollwise.router.policies import RouteRequest
from rollwise.router.tokens import prompt_tokens
from rollwise.serve.json_bounds import MAX_JSON_DEPTH

# Token-in bodies this small are parsed on the event loop (no tokenizing; parsing costs less than a thread
# hop); larger ones, and every text prompt (tokenized), on the reader's thread.
TOKEN_IN_ENDPOINTS = frozenset({"/generate", "/inference/v1/generate"})
INLINE_PARSE_BYTES = 64 * 1024

# The engine's own prefixes for the ids it makes: an id the router chooses looks like one it would.
ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl", "/generate": "gen",
               "/inference/v1/generate": "gen"}


class RouterError(Exception):
    """An error answered as OpenAI's error JSON (with Retry-After when the client should come back)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else None
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class RequestMeta:
    """The router's view of one generation request."""

    session: str | None
    group: str | None
    min_version: int
    stream: bool
    forward: bytes  # the body to send on
    request_id: str | None  # the engine's request id (for /abort), when the body names one


def loads(raw: bytes) -> Any:
    """JSON from bytes, on the hot path: orjson (C, ~5x less CPU than json for a prompt of token ids), and the
    standard library where orjson refuses what json accepts (UTF-16 bodies, NaN), so what the router accepts
    and its error messages stay as json has them. orjson reads an integer beyond 64 bits as a float: fine to
    route by, never to forward (parse_object(exact=True) where a body is re-serialised)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def parse_object(raw: bytes, exact: bool = False) -> dict[str, Any]:
    try:
        body = json.loads(raw) if exact else loads(raw)
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON ({exc})") from exc
    except RecursionError as exc:  # nesting past Python's recursion limit (the replicas accept 64 levels)
        raise RouterError(400, f"request body nests too deeply to parse; at most {MAX_JSON_DEPTH} levels of objects "
                          "and lists are accepted") from exc
    if not isinstance(body, dict):
        raise RouterError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _key_field(body: dict[str, Any], headers: Mapping[str, str], name: str, header: str) -> str | None:
    value = body.pop(name, None)
    if value is not None and (not isinstance(value, str) or not value):
        raise RouterError(400, f"{name} must be a non-empty string, got {value!r}", name)
    return value or headers.get(header) or None


def _min_version(body: dict[str, Any], headers: Mapping[str, str]) -> int:
    version: Any = body.pop("min_policy_version", None)
    if version is None:
        header = headers.get("x-min-policy-version")
        if header is not None:
            try:
                version = int(header)
            except ValueError:
                raise RouterError(400, f"X-Min-Policy-Version header must be an integer, got {header!r}",
                                  "X-Min-Policy-Version") from None
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise RouterError(400, f"min_policy_version must be an integer >= 0, got {version!r}", "min_policy_version")
    return version or 0


def _with_request_id(raw: bytes, body: dict[str, Any], request_id: str) -> bytes:
    """`raw` with `"request_id"` added in front, every other byte as the client sent it."""
    stripped = raw.lstrip()
    if body and stripped.startswith(b"{"):  # UTF-8 (a UTF-16 body would not start with this byte)
        return b'{"request_id": ' + json.dumps(request_id).encode() + b", " + stripped[1:]
    return json.dumps({"request_id": request_id, **body}).encode()


def read_meta(endpoint: str, raw: bytes, headers: Mapping[str, str],
              own_request_id: bool) -> tuple[dict[str, Any], RequestMeta]:
    """With `own_request_id`, a non-streamed body without a request_id gets one the router chooses, so that
    the router can abort it at the engine (POST /abort) when its client leaves."""
    body = parse_object(raw)
    had = {k for k in ("session_id", "group_id", "min_policy_version") if k in body}
    if had:  # the body is re-serialised below: every number must come back as the client wrote it
        body = parse_object(raw, exact=True)
    session = _key_field(body, headers, "session_id", "x-session-id")
    group = _key_field(body, headers, "group_id", "x-group-id")
    version = _min_version(body, headers)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RouterError(400, f"stream must be true or false, got {stream!r}", "stream")
    # Untouched bytes unless a router field had to come out (the engine rejects fields it does not know).
    forward = json.dumps(body).encode() if had else raw
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        request_id = None
        if own_request_id and not stream and "request_id" not in body:  # a stream is stopped by closing it
            request_id = f"{ID_PREFIXES[endpoint]}-{uuid.uuid4().hex}"
            forward = _with_request_id(forward, body, request_id)
    return body, RequestMeta(session, group, version, stream, forward, request_id)


def build_route(endpoint: str, body: dict[str, Any], meta: RequestMeta, tokenizer: Any | None,
                max_chars: int, default_max_tokens: int, pinned: str | None) -> RouteRequest:
    tokens = prompt_tokens(endpoint, body, tokenizer, max_chars)
    if endpoint == "/inference/v1/generate":  # vLLM's token-in shape: sampling fields in sampling_params
        params = body.get("sampling_params")
        body = params if isinstance(params, dict) else {}
    n = body.get("n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    prompts = body.get("prompt") if endpoint == "/v1/completions" else None
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        n *= len(prompts)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = default_max_tokens
    return RouteRequest(tokens, meta.session, meta.group, pinned, n, max_tokens)


class RequestReader:
    """Parses generation requests and tokenizes their prompts on one worker thread."""

    def __init__(self, max_route_chars: int, default_max_tokens: int) -> None:
        self.max_route_chars, self.default_max_tokens = max_route_chars, default_max_tokens
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="router-parse")

    def run(self, fn: Any, *args: Any) -> asyncio.Future:
        """fn(*args) on the reader's thread (also for loading the tokenizer it will use)."""
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def read(self, endpoint: str, raw: bytes, headers: Mapping[str, str], tokenizer: Any | None,
                   own_request_id: bool) -> tuple[RequestMeta, RouteRequest]:
        """The request's meta and its route (`pinned` left for the caller: the affinity table lives on the
        event loop)."""
        def work() -> tuple[RequestMeta, RouteRequest]:
            body, meta = read_meta(endpoint, raw, headers, own_request_id)
            route = build_route(endpoint, body, meta, tokenizer, self.max_route_chars, self.default_max_tokens,
                                None)
            return meta, route

        if endpoint in TOKEN_IN_ENDPOINTS and len(raw) <= INLINE_PARSE_BYTES:
            return work()  # no tokenizer, tens of microseconds: cheaper here than a hop to the thread and back
        return await self.run(work)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
