"""The router's OpenAPI documentation: the status codes it really answers, and the shape of its errors
(OpenAI's error JSON: rollwise.serve.errors.ErrorEnvelope, shared by every rollwise server). Request bodies
are read raw (they are forwarded as sent), so their schema is declared here rather than derived from a model."""

from __future__ import annotations

from typing import Any

from rollwise.serve.errors import ErrorEnvelope

WHY = {
    400: "malformed request (the message names the field); or the replica's own 400, passed on",
    401: "missing or wrong API key (only with --api-keys or ROLLWISE_API_KEYS)",
    404: "no such request in flight (/abort), or the replica's own 404 (e.g. an unknown model)",
    409: "a request with this Idempotency-Key or request_id is still running, or an update is already running",
    413: "request body over --max-request-bytes",
    429: "every replica is at its in-flight cap for --queue-timeout, or the router's queue is full (Retry-After)",
    502: "the request failed on every replica tried; nothing was returned, so retrying is safe (Retry-After)",
    503: "no healthy replica, or none serving the required policy version (Retry-After)",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a route: each status with the serving layer's shared error envelope (the
    one every rollwise server answers with), described as the router means it."""
    return {status: {"model": ErrorEnvelope, "description": WHY[status]} for status in statuses}


GENERATION_DOCS: dict[int | str, dict[str, Any]] = {
    200: {"description": "the replica's answer, as it sent it (JSON, or server-sent events with stream=true)",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **errors(400, 401, 404, 409, 413, 429, 502, 503),
}

CONTROL_DOCS: dict[int | str, dict[str, Any]] = {
    200: {"description": "each healthy replica's status and answer"},
    **errors(401, 413),
}

JSON_OBJECT_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
}
