"""A job's weight upload (PUT /jobs/{job}/weights): the body parsed into a staged update, and the
receiver's target that stores the version and applies it to the job's active engines.

The body: an 8-byte big-endian manifest length, the rollwise.weights/v2 manifest (JSON), then every
bucket's flat bytes. The whole update is checked by rollwise.sync.buckets.WeightReceiver (a checksum on every
bucket, names, shapes, dtypes, finite values, versions only forward, tokenizer; an adapter's spec) before
anything is applied or stored, like every other transport's; a refusal is a 400 whose param names the field.

A LoRA job (attached with lora=true) uploads its adapter the same way (the manifest's `adapter` spec,
rollwise.sync.adapters): it is loaded under the job's own name only, whatever name the trainer gave it, so a
job can never replace or serve another job's adapter (`own_adapter`, `JobAdapter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rollwise.engine.contract import Engine
from rollwise.pool.jobs import Job, PoolError, Slot
from rollwise.pool.states import ACTIVE, StateMachine
from rollwise.types.bucket_layout import parse_manifest
from rollwise.engine.weight_receiver import StagedUpdate
from rollwise.types.weights import WeightUpdateError
from rollwise.types.weights import AdapterSpec, ExpectedWeights


def parse_weight_upload(body: bytes) -> StagedUpdate:
    """The upload's manifest and buckets, staged (not yet checked against the job's model); 400 on a bad frame."""
    if len(body) < 8:
        raise PoolError(400, "weights body must start with an 8-byte manifest length", "body")
    size = int.from_bytes(body[:8], "big")
    if size > len(body) - 8:
        raise PoolError(400, f"manifest length {size} exceeds the body ({len(body) - 8} bytes)", "body")
    try:
        manifest = parse_manifest(body[8 : 8 + size].decode("utf-8", "replace"), "manifest")
    except WeightUpdateError as exc:  # param: the manifest's first bad field (e.g. adapter.rank)
        raise PoolError(400, str(exc), exc.field or "manifest") from exc
    data = bytearray(body[8 + size :])
    wanted = sum(b.nbytes for b in manifest.buckets)
    if len(data) != wanted:
        raise PoolError(400, f"weight bytes: got {len(data)}, the manifest's buckets hold {wanted}; "
                             "the update was not applied", "body")
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    staged = StagedUpdate(manifest)
    offset = 0
    for bucket in manifest.buckets:
        staged.add_flat(bucket.index, flat[offset : offset + bucket.nbytes])
        offset += bucket.nbytes
    return staged


class JobTarget:
    """What both WeightReceiver targets of a job share: its version, and calling its active engines."""

    def __init__(self, slots: Sequence[Slot], states: StateMachine, job: Job) -> None:
        self.slots, self.states, self.job = slots, states, job
        self.applied: list[int] = []

    @property
    def policy_version(self) -> int | None:
        return self.job.version

    @property
    def expected_weights(self) -> ExpectedWeights:
        return self.job.expected

    def on_active_engines(self, key: str, call: Callable[[Engine], None]) -> None:
        """Run `call` on every active instance under `key`, between two of its engine's steps."""
        for slot in self.slots:
            inst = slot.instances.get(key)
            # (an engine whose thread died is not changed: its slot's recovery evicts it, and the next one is
            # built from the job's stored version)
            if inst is not None and self.states.state(slot.index, key) is ACTIVE and slot.call_if_alive(
                    lambda _e, inst=inst: call(inst)):
                self.applied.append(slot.index)


class JobWeights(JobTarget):
    """WeightReceiver's target for one job: store the version, apply it to the job's active engines."""

    def apply_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        # caller holds job.lock: no activation or admission of this job interleaves. The version is the job's
        # before an engine holds it: a sample of it may finish (and be checked against versions) at once.
        self.job.versions.add(version)
        self.on_active_engines(self.job.name, lambda inst: inst.apply_weights(state, version))
        self.job.weights, self.job.version = state, version


def own_adapter(staged: StagedUpdate, job: Job) -> None:
    """The upload must match how the job attached (adapter for a LoRA job, full weights otherwise); an adapter
    is renamed to the job (not the pool's default policy): it serves only requests of this job."""
    spec = staged.manifest.adapter
    if job.lora and spec is None:
        raise PoolError(400, f"job {job.name!r} attached as a LoRA job (lora=true): push its adapter (a manifest "
                             "with an `adapter` spec, as train.lora's sender builds it), not full weights", "manifest")
    if not job.lora and spec is not None:
        raise PoolError(400, f"job {job.name!r} attached for full-parameter weights: this upload is LoRA adapter "
                             f"{spec.name!r}; attach the job with lora=true (train.lora) to push adapters", "manifest")
    if spec is not None:
        mine = spec.model_copy(update={"name": job.name, "default": False})
        staged.manifest = staged.manifest.model_copy(update={"adapter": mine})


class JobAdapter(JobTarget):
    """WeightReceiver's target for a LoRA job: store its adapter, load it on the job's base engines that are
    active (a sleeping one loads it when it wakes). Nothing of the base, or of another job's adapter, changes."""

    def apply_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        # own_adapter refuses a full upload to a LoRA job before the receiver is built: never reached
        raise ValueError(f"job {self.job.name!r} attached as a LoRA job (lora=true): it takes adapters only")

    def loaded_adapters(self) -> dict[str, int]:
        return {} if self.job.version is None else {self.job.name: self.job.version}

    def load_adapter(self, spec: AdapterSpec, state: dict[str, torch.Tensor], version: int) -> None:
        # caller holds job.lock (its base's lock): no switch of the shared engine interleaves
        assert spec.name == self.job.name, "own_adapter renames every adapter to its job"
        self.job.versions.add(version)  # before an engine holds it (JobWeights.apply_weights)
        self.on_active_engines(self.job.key, lambda inst: inst.load_adapter(spec, state, version))
        self.job.weights, self.job.version, self.job.adapter = dict(state), version, spec
