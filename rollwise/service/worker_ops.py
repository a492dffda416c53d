"""What each kind of request row does to the worker's models and samplers (rollwise.service.worker orders and
batches them). Each op returns the result bytes and their kind; a ServiceUserError is the caller's mistake
(nothing was applied), any other exception a server error."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tinker import types

from rollwise.service.base_models import BaseModels
from rollwise.service.checkpoint_paths import CheckpointRef, checked_name, parse_tinker_path
from rollwise.service.errors import ServiceUserError
from rollwise.service.sampler import Samplers
from rollwise.service.store import RequestRow, ResultKind, Store
from rollwise.service.tenant_model import TenantModel

Result = tuple[bytes, ResultKind]


def json_result(value: dict[str, object]) -> Result:
    return json.dumps(value).encode(), "json"


@dataclass
class WorkerState:
    """The worker's live objects: base models, tenant models by model_id, samplers; and where checkpoints go."""

    store: Store
    data_dir: Path
    bases: BaseModels
    samplers: Samplers
    models: dict[str, TenantModel] = field(default_factory=dict)

    def model(self, model_id: str) -> TenantModel:
        tm = self.models.get(model_id)
        if tm is None:
            raise ServiceUserError(f"model_id {model_id!r} is not loaded (its creation failed, or the server restarted "
                                   "since): create it again, or create it from a checkpoint")
        return tm

    def model_config(self, model_id: str) -> tuple[str, types.LoraConfig | None]:
        row = self.store.model(model_id)
        if row is None:
            raise ServiceUserError(f"model_id {model_id!r} does not exist")
        lora = None if row["lora_config"] is None else types.LoraConfig(**json.loads(str(row["lora_config"])))
        return str(row["base_model"]), lora

    def checkpoint_dir(self, uri: str, owner: str, field_name: str = "path") -> Path:
        row = self.store.checkpoint(uri)
        if row is None or row["owner"] != owner:
            raise ServiceUserError(f"{field_name} {uri!r}: no such checkpoint for this API key")
        return Path(str(row["directory"]))


def create_model(state: WorkerState, row: RequestRow) -> Result:
    body = types.CreateModelRequest.model_validate_json(row.body)
    base = state.bases.get(body.base_model)
    seed = None if body.lora_config is None else body.lora_config.seed
    assert row.model_id is not None
    state.models[row.model_id] = TenantModel(base, body.lora_config, seed)
    return json_result({"type": "create_model", "model_id": row.model_id})


def optim_step(state: WorkerState, row: RequestRow) -> Result:
    body = types.OptimStepRequest.model_validate_json(row.body)
    if not isinstance(body.optim_params, types.AdamParams):
        raise ServiceUserError("optimizer_params: only adam_params are supported")
    metrics = state.model(body.model_id).optim_step(body.optim_params)
    return json_result({"type": "optim_step", "metrics": metrics})


def _save(state: WorkerState, row: RequestRow, ref: CheckpointRef, tm: TenantModel, *, optimizer: bool,
          overwrite: bool) -> str:
    directory = ref.directory(state.data_dir)
    if directory.exists():
        if not overwrite:
            raise ServiceUserError(f"path {ref.name!r}: checkpoint {ref.uri} exists; choose another name or pass "
                                   "overwrite")
        shutil.rmtree(directory)
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tm.save_state(tmp, optimizer=optimizer)
    tmp.rename(directory)  # a checkpoint is listed only once it is complete
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    state.store.add_checkpoint(ref.uri, row.owner, ref.model_id, ref.checkpoint_id, ref.kind, str(directory), size)
    return ref.uri


def save_weights(state: WorkerState, row: RequestRow) -> Result:
    body = types.SaveWeightsRequest.model_validate_json(row.body)
    tm = state.model(body.model_id)
    name = checked_name(body.path if body.path is not None else f"seq-{row.seq_id}")
    uri = _save(state, row, CheckpointRef(body.model_id, "weights", name), tm, optimizer=True,
                overwrite=body.overwrite)
    return json_result({"type": "save_weights", "path": uri})


def save_weights_for_sampler(state: WorkerState, row: RequestRow) -> Result:
    body = types.SaveWeightsForSamplerRequest.model_validate_json(row.body)
    tm = state.model(body.model_id)
    if body.path is not None:
        uri = _save(state, row, CheckpointRef(body.model_id, "sampler_weights", checked_name(body.path)), tm,
                    optimizer=False, overwrite=True)
        return json_result({"type": "save_weights_for_sampler", "path": uri})
    # Ephemeral: a weight push into the sampler's engine, nothing written to disk.
    model_row = state.store.model(body.model_id)
    assert model_row is not None
    sampler_id = f"{model_row['session_id']}:sample:{body.sampling_session_seq_id}"
    weights = tm.sampler_weights()
    state.samplers.publish(sampler_id, weights, str(model_row["base_model"]))
    state.store.add_sampler(sampler_id, row.owner, str(model_row["base_model"]), None)
    return json_result({"type": "save_weights_for_sampler", "sampling_session_id": sampler_id})


def load_weights(state: WorkerState, row: RequestRow) -> Result:
    body = types.LoadWeightsRequest.model_validate_json(row.body)
    ref = parse_tinker_path(body.path)
    directory = state.checkpoint_dir(ref.uri, row.owner)
    assert row.model_id is not None
    if body.model_id is not None:
        state.model(body.model_id).load_state(directory, optimizer=body.optimizer)
        return json_result({"type": "load_weights", "path": body.path})
    base_name, lora = state.model_config(row.model_id)  # the API copied the source model's config
    tm = TenantModel(state.bases.get(base_name), lora, None if lora is None else lora.seed)
    tm.load_state(directory, optimizer=body.optimizer)
    state.models[row.model_id] = tm
    return json_result({"type": "load_weights", "path": body.path, "model_id": row.model_id})


def create_sampling_session(state: WorkerState, row: RequestRow) -> Result:
    body = types.CreateSamplingSessionRequest.model_validate_json(row.body)
    assert row.sampler_id is not None
    if body.model_path is None:
        assert body.base_model is not None
        state.bases.get(body.base_model)
        state.samplers.publish(row.sampler_id, None, body.base_model)
        return json_result({})
    ref = parse_tinker_path(body.model_path, "model_path")
    directory = state.checkpoint_dir(ref.uri, row.owner, "model_path")
    base_name, lora = state.model_config(ref.model_id)
    tm = TenantModel(state.bases.get(base_name), lora, None)
    tm.load_state(directory, optimizer=False)
    state.samplers.publish(row.sampler_id, tm.sampler_weights(), base_name)
    return json_result({})


SINGLE_OPS = {
    "create_model": create_model,
    "optim_step": optim_step,
    "save_weights": save_weights,
    "save_weights_for_sampler": save_weights_for_sampler,
    "load_weights": load_weights,
    "create_sampling_session": create_sampling_session,
}
