"""Session and client routes of the Tinker API: client config, sessions and heartbeats, telemetry, health,
capabilities. Answered by the API process from the store alone (no worker round trip)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from rollwise.service.api_common import PREFIX, caller, owned_session, store_of

router = APIRouter(prefix=PREFIX)

# What this server speaks (tinker_verifiers fact sheet §3): API keys (no JWT), plain protobuf fwd/bwd bodies
# (no zstd), httpx transport, polling retrieve_future per request, custom losses run client-side.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


@router.post("/client/config")
async def client_config() -> dict[str, object]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, object]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/create_session")
def create_session(request: Request, body: types.CreateSessionRequest) -> dict[str, object]:
    session_id = store_of(request).create_session(caller(request))
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
def session_heartbeat(request: Request, body: types.SessionHeartbeatRequest) -> Response:
    owned_session(request, body.session_id)
    owner_finished = store_of(request).session_owner(body.session_id)
    if owner_finished is not None and owner_finished[1]:
        return JSONResponse({"error": "session finished"}, status_code=410)
    store_of(request).touch_session(body.session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
def finish_session(request: Request, session_id: str) -> dict[str, object]:
    owned_session(request, session_id)
    store_of(request).touch_session(session_id, finished=True)
    return {}


@router.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}  # accepted and dropped: nothing leaves the machine, nothing is kept


@router.get("/healthz")
def healthz(request: Request) -> JSONResponse:
    """200 once the worker has loaded its base models (503 before). pid: which API process answered (the
    supervisor restarts it if it dies)."""
    bases = [b["name"] for b in store_of(request).bases()]
    if not bases:
        return JSONResponse({"status": "starting", "pid": os.getpid()}, status_code=503)
    return JSONResponse({"status": "ok", "pid": os.getpid(), "base_models": bases})


@router.get("/get_server_capabilities")
def server_capabilities(request: Request) -> dict[str, object]:
    return {"supported_models": [
        {"model_name": b["name"], "max_context_length": b["max_context_length"], "trainable": True,
         "sampleable": True} for b in store_of(request).bases()]}
