"""Sampling routes of the Tinker API: create_sampling_session, samplers/{id}, asample.

A sampler is what `sampling_session_id` names: a base model, a saved checkpoint, or (from an ephemeral
save_weights_for_sampler, see the worker) a training model's weights at that step. Samples are not ordered per
sampler: the worker batches all queued samples across tenants. A key's queue quota is the back-pressure: 429,
after which the SDK waits 1-5 s and resends."""

from __future__ import annotations

from fastapi import APIRouter, Request
from tinker import types

from rollwise.serve.errors import APIError
from rollwise.service.api_common import (PREFIX, caller, dump, future, not_found, owned_checkpoint, owned_session,
                                         store_of, submit)
from rollwise.service.checkpoint_paths import parse_tinker_path
from rollwise.service.errors import ServiceUserError
from rollwise.service.routes_training import checked_base, user_error

router = APIRouter(prefix=PREFIX)


def owned_sampler(request: Request, sampler_id: str) -> dict[str, object]:
    row = store_of(request).sampler(sampler_id)
    if row is None or row["owner"] != caller(request):
        raise not_found("sampling_session_id", sampler_id)
    return row


@router.post("/create_sampling_session")
def create_sampling_session(request: Request, body: types.CreateSamplingSessionRequest) -> dict[str, object]:
    owned_session(request, body.session_id)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    if body.model_path is not None:
        try:
            ref = parse_tinker_path(body.model_path, "model_path")
        except ServiceUserError as exc:
            raise user_error(exc, "model_path") from None
        owned_checkpoint(request, ref.uri, "model_path")
        model = store_of(request).model(ref.model_id)
        if model is None:
            raise not_found("model_path", body.model_path)
        base = str(model["base_model"])
    elif body.base_model is not None:
        base = checked_base(request, body.base_model)
    else:
        raise APIError(400, "give base_model (sample the base) or model_path (a tinker://... checkpoint)",
                       "base_model")
    existing = store_of(request).sampler(sampler_id)
    if existing is None:
        store_of(request).add_sampler(sampler_id, caller(request), base, body.model_path)
        # the worker loads what the sampler serves before any later sample (rows run in arrival order)
        submit(request, "create_sampling_session", dump(body), sampler_id=sampler_id,
               dedup_key=f"sampler:{sampler_id}")
    elif existing["owner"] != caller(request):
        raise not_found("sampling_session_id", sampler_id)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(request: Request, sampler_id: str) -> dict[str, object]:
    row = owned_sampler(request, sampler_id)
    return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}


@router.post("/asample")
def asample(request: Request, body: types.SampleRequest) -> dict[str, object]:
    if body.sampling_session_id is None:
        raise APIError(400, "sampling_session_id is missing: create a sampling session (create_sampling_session or "
                            "save_weights_for_sampler) and sample from it", "sampling_session_id")
    owned_sampler(request, body.sampling_session_id)
    if body.num_samples < 1:
        raise APIError(400, f"num_samples must be >= 1, got {body.num_samples}", "num_samples")
    dedup = None if body.seq_id is None else f"sample:{body.sampling_session_id}#{body.seq_id}"
    rid = submit(request, "sample", dump(body), sampler_id=body.sampling_session_id, dedup_key=dedup,
                 what="sample requests")
    out = future(rid)
    out["sample_sequence_ids"] = [f"{rid}:{i}" for i in range(body.num_samples)]
    return out
