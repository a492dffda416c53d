"""Training routes of the Tinker API: create_model, get_info, forward_backward (protobuf), optim_step, save and
load, training_runs REST. Each operation on a model is a row numbered by the SDK's seq_id (create = seq 0); the
worker runs a model's rows in that order. What can be checked without the model (ownership, names, base model,
protobuf framing) is checked here, before a row exists."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from rollwise.serve.errors import APIError
from rollwise.service.api_common import (PREFIX, caller, dump, future, not_found, owned_checkpoint, owned_model,
                                         owned_session, store_of, submit)
from rollwise.service.checkpoint_paths import checked_name, parse_tinker_path
from rollwise.service.errors import ServiceUserError

router = APIRouter(prefix=PREFIX)


def user_error(exc: ServiceUserError, field: str) -> APIError:
    return APIError(400, str(exc), field, "invalid_request_error", "invalid_value")


def checked_base(request: Request, base_model: str | None, field: str = "base_model") -> str:
    names = [str(b["name"]) for b in store_of(request).bases()]
    if not names:
        raise APIError(503, "the server is loading its base models; retry shortly (GET /api/v1/healthz turns 200)",
                       None, "server_error", "starting", headers={"Retry-After": "2"})
    if base_model not in names:
        raise APIError(400, f"{field} {base_model!r} is not served here; choose one of {names} (the server's "
                            "--base-model)", field, "invalid_request_error", "unknown_model")
    return base_model


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"  # the SDK builds this itself for create-via-load


def seq_key(model_id: str, seq_id: int) -> str:
    return f"{model_id}#{seq_id}"


def submit_in_order(request: Request, kind: str, body: BaseModel, model_id: str,
                    seq_id: int | None) -> dict[str, object]:
    """A request the worker runs in `model_id`'s seq_id order: one durable row, answered as a future."""
    seq = seq_of(seq_id)
    rid = submit(request, kind, dump(body), model_id=model_id, seq_id=seq, dedup_key=seq_key(model_id, seq))
    return future(rid, model_id)


def check_save_name(path: str | None) -> None:
    """A checkpoint name, when given, is one path segment (it becomes tinker://MODEL_ID/weights/NAME)."""
    if path is not None:
        try:
            checked_name(path)
        except ServiceUserError as exc:
            raise user_error(exc, "path") from None


@router.post("/create_model")
def create_model(request: Request, body: types.CreateModelRequest) -> dict[str, object]:
    owned_session(request, body.session_id)
    base = checked_base(request, body.base_model)
    if body.optimizer_config.type != "adamw":
        raise APIError(400, f"optimizer_config.type {body.optimizer_config.type!r} is not supported; use 'adamw'",
                       "optimizer_config.type", "invalid_request_error", "unsupported")
    model_id = model_id_of(body.session_id, body.model_seq_id)
    lora = None if body.lora_config is None else body.lora_config.model_dump(mode="json")
    store_of(request).add_model(model_id, caller(request), body.session_id, base, lora, body.user_metadata)
    rid = submit(request, "create_model", dump(body), model_id=model_id, seq_id=0, dedup_key=seq_key(model_id, 0))
    return future(rid, model_id)


@router.post("/get_info")
def get_info(request: Request, body: types.GetInfoRequest) -> dict[str, object]:
    row = owned_model(request, body.model_id)
    base = next((b for b in store_of(request).bases() if b["name"] == row["base_model"]), None)
    tokenizer_id = None if base is None else base["tokenizer_id"]
    return {"type": "get_info", "model_id": row["model_id"], "is_lora": row["is_lora"], "lora_rank": row["lora_rank"],
            "model_name": row["base_model"], "optimizer_config": {"type": "adamw"},
            "model_data": {"model_name": row["base_model"], "tokenizer_id": tokenizer_id}}


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict[str, object]:
    raw = await request.body()
    try:
        msg = pb.ForwardBackwardRequest.FromString(raw)
    except DecodeError as exc:
        # Not even the model is known: the future is born failed (a user error), no model is touched.
        rid = submit(request, "forward_backward", raw, failed=(
            f"body: not a ForwardBackwardRequest protobuf ({exc}); send the SDK's serialized request with "
            "Content-Type: application/x-protobuf", "user"))
        return future(rid)
    owned_model(request, msg.model_id)
    rid = submit(request, "forward_backward", raw, model_id=msg.model_id, seq_id=msg.seq_id,
                 dedup_key=seq_key(msg.model_id, msg.seq_id))
    return future(rid, msg.model_id)


def seq_of(seq_id: int | None) -> int:
    if seq_id is None:
        raise APIError(400, "seq_id is missing: number every operation on a model (1, 2, ...)", "seq_id")
    return seq_id


@router.post("/optim_step")
def optim_step(request: Request, body: types.OptimStepRequest) -> dict[str, object]:
    owned_model(request, body.model_id)
    if not isinstance(body.optim_params, types.AdamParams):
        raise APIError(400, f"optimizer_params.type {body.optim_params.type!r} is not supported; send adam_params",
                       "optimizer_params", "invalid_request_error", "unsupported")
    return submit_in_order(request, "optim_step", body, body.model_id, body.seq_id)


@router.post("/save_weights")
def save_weights(request: Request, body: types.SaveWeightsRequest) -> dict[str, object]:
    owned_model(request, body.model_id)
    check_save_name(body.path)
    return submit_in_order(request, "save_weights", body, body.model_id, body.seq_id)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(request: Request, body: types.SaveWeightsForSamplerRequest) -> dict[str, object]:
    owned_model(request, body.model_id)
    if body.path is None and body.sampling_session_seq_id is None:
        raise APIError(400, "give path (a name: saved to disk) or sampling_session_seq_id (an ephemeral sampler)",
                       "path")
    check_save_name(body.path)
    return submit_in_order(request, "save_weights_for_sampler", body, body.model_id, body.seq_id)


@router.post("/load_weights")
def load_weights(request: Request, body: types.LoadWeightsRequest) -> dict[str, object]:
    try:
        ref = parse_tinker_path(body.path)
    except ServiceUserError as exc:
        raise user_error(exc, "path") from None
    if ref.segment != "weights":
        raise APIError(400, f"path {body.path!r} holds sampler weights; load_weights takes a training state "
                            "(tinker://MODEL_ID/weights/NAME, from save_state)", "path")
    source = owned_checkpoint(request, ref.uri)
    if body.model_id is not None:  # into an existing model, in its seq order
        owned_model(request, body.model_id)
        return submit_in_order(request, "load_weights", body, body.model_id, body.seq_id)
    if body.session_id is None or body.model_seq_id is None:
        raise APIError(400, "give model_id + seq_id (load into a model) or session_id + model_seq_id (create a "
                            "model from the checkpoint)", "model_id")
    owned_session(request, body.session_id)
    src = store_of(request).model(str(source["model_id"]))
    if src is None:
        raise not_found("path", body.path)
    base = checked_base(request, body.base_model or str(src["base_model"]))
    model_id = model_id_of(body.session_id, body.model_seq_id)
    lora = None if src["lora_config"] is None else json.loads(str(src["lora_config"]))
    store_of(request).add_model(model_id, caller(request), body.session_id, base, lora, body.user_metadata)
    rid = submit(request, "load_weights", dump(body), model_id=model_id, seq_id=0, dedup_key=seq_key(model_id, 0))
    return future(rid, model_id)


def checkpoint_json(row: dict[str, object]) -> dict[str, object]:
    return {"checkpoint_id": row["checkpoint_id"], "checkpoint_type": row["kind"],
            "time": dt.datetime.fromtimestamp(float(str(row["created_at"])), dt.UTC).isoformat(),
            "tinker_path": row["tinker_path"], "size_bytes": row["size_bytes"], "public": False}


@router.get("/training_runs/{model_id}")
def training_run(request: Request, model_id: str) -> dict[str, object]:
    row = owned_model(request, model_id)
    cps = store_of(request).checkpoints_of(model_id)
    last = {kind: next((checkpoint_json(c) for c in reversed(cps) if c["kind"] == kind), None)
            for kind in ("training", "sampler")}
    return {"training_run_id": model_id, "base_model": row["base_model"], "model_owner": row["owner"],
            "is_lora": row["is_lora"], "corrupted": False, "lora_rank": row["lora_rank"],
            "last_request_time": dt.datetime.fromtimestamp(float(str(row["last_request_at"])), dt.UTC).isoformat(),
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": None if row["user_metadata"] is None else json.loads(str(row["user_metadata"]))}


@router.get("/training_runs/{model_id}/checkpoints")
def list_checkpoints(request: Request, model_id: str) -> dict[str, object]:
    owned_model(request, model_id)
    return {"checkpoints": [checkpoint_json(c) for c in store_of(request).checkpoints_of(model_id)]}


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(request: Request, model_id: str, checkpoint_id: str) -> dict[str, object]:
    owned_model(request, model_id)
    uri = f"tinker://{model_id}/{checkpoint_id}"
    row = owned_checkpoint(request, uri, "checkpoint_id")
    store_of(request).delete_checkpoint(uri)
    shutil.rmtree(Path(str(row["directory"])), ignore_errors=True)
    return {}
