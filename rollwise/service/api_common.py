"""What every route of the Tinker API shares: the caller, ownership checks, and turning a request into a row.

A key sees only what it created: a model, sampler, session or checkpoint of another key answers 404 exactly as
an unknown id does (nothing tells one key that another key's ids exist).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from rollwise.serve.auth import ANONYMOUS, CALLER_STATE
from rollwise.serve.errors import APIError
from rollwise.service.store import DuplicateRequest, Store

PREFIX = "/api/v1"


@dataclass(frozen=True)
class ApiSettings:
    """The API's own limits (the front's --max-request-bytes etc. are the shared ones)."""

    max_queued_per_key: int = 1024  # requests one key may have queued or running; more get 429
    long_poll_s: float = 25.0  # retrieve_future holds a pending future this long before answering try_again


def caller(request: Request) -> str:
    """The caller's key label, left by the front's gate (ANONYMOUS on a server without keys)."""
    return getattr(request.state, CALLER_STATE, None) or ANONYMOUS


def store_of(request: Request) -> Store:
    return request.app.state.store


def settings_of(request: Request) -> ApiSettings:
    return request.app.state.api_settings


def not_found(what: str, value: str) -> APIError:
    return APIError(404, f"{what} {value!r} does not exist or belongs to another API key; use one this key created",
                    what, "invalid_request_error", "not_found")


def owned_model(request: Request, model_id: str) -> dict[str, object]:
    row = store_of(request).model(model_id)
    if row is None or row["owner"] != caller(request):
        raise not_found("model_id", model_id)
    return row


def owned_session(request: Request, session_id: str) -> None:
    found = store_of(request).session_owner(session_id)
    if found is None or found[0] != caller(request):
        raise not_found("session_id", session_id)


def owned_checkpoint(request: Request, tinker_path: str, field: str = "path") -> dict[str, object]:
    row = store_of(request).checkpoint(tinker_path)
    if row is None or row["owner"] != caller(request):
        raise APIError(404, f"{field} {tinker_path!r}: no such checkpoint for this API key; give a "
                            "tinker://MODEL_ID/weights/NAME path this key saved", field, "invalid_request_error",
                       "not_found")
    return row


def dump(model: BaseModel) -> bytes:
    return json.dumps(model.model_dump(mode="json", by_alias=False)).encode()


def submit(request: Request, kind: str, body: bytes, *, model_id: str | None = None, seq_id: int | None = None,
           sampler_id: str | None = None, dedup_key: str | None = None, failed: tuple[str, str] | None = None,
           what: str = "requests") -> str:
    """Make the request a durable row (the future's request_id), after the key's queue quota (429)."""
    store, label = store_of(request), caller(request)
    limit = settings_of(request).max_queued_per_key
    if failed is None and store.queued_count(label) >= limit:
        raise APIError(429, f"too many {what} queued for this API key (the server's --max-queued-per-key={limit}); "
                            "wait for some futures to finish", None, "rate_limit_error", "quota_exceeded",
                       headers={"Retry-After": "1"})
    if model_id is not None:
        store.touch_model(model_id)  # training_runs' last_request_time
    try:
        return store.submit(owner=label, kind=kind, body=body, model_id=model_id, seq_id=seq_id,
                            sampler_id=sampler_id, dedup_key=dedup_key, failed=failed)
    except DuplicateRequest:
        # A number used already, with another body: the future fails as a user error and nothing runs (the
        # row taking that number is left as it is).
        field = "seq_id" if seq_id is not None else "model_seq_id"
        number = seq_id if seq_id is not None else dedup_key
        message = (f"{field} {number} was used already by another request"
                   f"{' of model ' + repr(model_id) if model_id else ''}; number each operation once, in order")
        return store.submit(owner=label, kind=kind, body=body, failed=(message, "user"))


def future(request_id: str, model_id: str | None = None) -> dict[str, object]:
    out: dict[str, object] = {"request_id": request_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out
