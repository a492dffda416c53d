"""Adapter-only weight sync (train.lora): the trainer pushes its LoRA adapter, not the model.

An adapter update is an ordinary `WeightUpdate` (manifest + checksummed buckets, versioned) whose
manifest carries an `AdapterSpec` (name, rank, alpha, targets; rollwise.types.weights): every
transport moves it unchanged, and `WeightReceiver.check`/`commit` hand it to `check_adapter` /
`commit_adapter` here. The checks mirror the full-weight ones (version only moves forward, same
tokenizer, every tensor's shape fits the engine's base projection, checksums, every bucket arrived),
then the engine's `load_adapter(spec, tensors, version)` loads it without touching the base weights.
A rejected adapter leaves the engine serving what it served before.

The tensors are named by the base model's modules: `model.layers.0.self_attn.q_proj.lora_A.weight`
[rank, in] and `....lora_B.weight` [out, rank] (rollwise.train.lora.adapter_state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from rollwise.protocols import Trainer
from rollwise.sync.buckets import WeightUpdate, build_manifest
from rollwise.types.weights import AdapterSpec, WeightManifest

if TYPE_CHECKING:
    from rollwise.sync.receiver import StagedUpdate, WeightReceiver

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
# The name a single LoRA run's policy adapter is pushed under (it serves requests naming no adapter).
POLICY_ADAPTER = "policy"


def adapter_update(state: Mapping[str, Tensor], spec: AdapterSpec, version: int, tokenizer_fingerprint: str,
                   *, checksum: bool = False, bucket_mb: float | None = None) -> WeightUpdate:
    """An update of adapter `state` (detached views; checksum for transports that move bytes)."""
    tensors = {name: t.detach() for name, t in state.items()}
    manifest = build_manifest(tensors, version, tokenizer_fingerprint, bucket_mb, checksum=checksum)
    return WeightUpdate(manifest.model_copy(update={"adapter": spec}), tensors)


class AdapterSender:
    """The WeightSender of a train.lora trainer: its adapter as the engines' default policy adapter."""

    def __init__(self, tokenizer_fingerprint: str, name: str = POLICY_ADAPTER, *, default: bool = True) -> None:
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.name = name
        self.default = default

    def spec(self, trainer: Any) -> AdapterSpec:
        cfg = trainer.lora
        return AdapterSpec(name=self.name, rank=cfg.rank, alpha=cfg.alpha, target_modules=tuple(cfg.target_modules),
                           default=self.default)

    def update(self, trainer: Trainer) -> WeightUpdate:
        return adapter_update(trainer.weights(), self.spec(trainer), trainer.version, self.tokenizer_fingerprint)


def is_lora_trainer(trainer: Any) -> bool:
    return getattr(trainer, "lora", None) is not None


# ---------------------------------------------------------------------------- receiving


def _adapter_version(engine: Any, name: str) -> int | None:
    inner = getattr(engine, "engine", engine)  # an EngineWorker: the engine it wraps
    loaded = getattr(inner, "loaded_adapters", None)
    return loaded().get(name) if callable(loaded) else None


def _projection_shapes(receiver: WeightReceiver) -> dict[str, tuple[int, ...]]:
    """Base module name -> (out, in) of every 2-D `<module>.weight` the engine holds."""
    return {name.removesuffix(".weight"): shape for name, (shape, _) in receiver.expected.tensors.items()
            if name.endswith(".weight") and len(shape) == 2}


def adapter_problems(manifest: WeightManifest, projections: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why the manifest's tensors cannot be this adapter on this base (empty: they can)."""
    spec = manifest.adapter
    assert spec is not None
    problems: list[str] = []
    seen: dict[str, set[str]] = {}
    for t in manifest.tensors():
        module, part = (t.name.removesuffix(LORA_A), "A") if t.name.endswith(LORA_A) else \
            (t.name.removesuffix(LORA_B), "B") if t.name.endswith(LORA_B) else (t.name, "")
        if not part:
            problems.append(f"{t.name!r} is not a LoRA tensor (<module>{LORA_A} or <module>{LORA_B})")
            continue
        seen.setdefault(module, set()).add(part)
        if module not in projections or module.rsplit(".", 1)[-1] not in spec.target_modules:
            problems.append(f"{t.name}: {module!r} is not a target projection of the engine's model "
                            f"(target_modules {list(spec.target_modules)})")
            continue
        out_dim, in_dim = projections[module]
        want = (spec.rank, in_dim) if part == "A" else (out_dim, spec.rank)
        if t.shape != want:
            problems.append(f"{t.name}: shape {t.shape} != {want} (rank {spec.rank} on the engine's base)")
    problems += [f"{module}: lora_A and lora_B must both be sent" for module, parts in seen.items() if len(parts) != 2]
    if not seen:
        problems.append("the adapter has no tensors")
    return problems


def check_adapter(receiver: WeightReceiver, manifest: WeightManifest) -> None:
    """WeightReceiver.check for an adapter manifest: refuse before any bytes are read."""
    spec = manifest.adapter
    assert spec is not None
    current = receiver.policy_version if spec.default else _adapter_version(receiver.engine, spec.name)
    if current is not None and manifest.version < current:
        raise receiver._reject(manifest.version, [f"adapter {spec.name!r} is already at version {current}"],
                               "Versions only move forward (re-pushing the current version is allowed, as a retry).")
    fingerprint = receiver.tokenizer_fingerprint
    if fingerprint is not None and manifest.tokenizer_fingerprint != fingerprint:
        raise receiver._reject(manifest.version, ["tokenizer fingerprint differs from the engine's"],
                               "The trainer and the engine tokenize differently: start both from the same model.")
    problems = adapter_problems(manifest, _projection_shapes(receiver))
    if problems:
        raise receiver._reject(manifest.version, [f"adapter {spec.name!r}: {p}" for p in problems],
                               "The adapter does not fit the engine's base model: train it on the same base, "
                               "with the rank and target_modules its manifest declares.")


def commit_adapter(receiver: WeightReceiver, staged: StagedUpdate) -> None:
    """WeightReceiver.commit for an adapter: check it whole, then load it (or nothing)."""
    manifest = staged.manifest
    spec = manifest.adapter
    assert spec is not None
    check_adapter(receiver, manifest)
    problems = list(staged.problems) + [f"bucket {i} never arrived" for i in staged.missing_buckets()]
    if problems:
        raise receiver._reject(manifest.version, problems, "Nothing was applied; push the adapter again.")
    state = dict(staged.tensors)
    engine = receiver.engine
    if not hasattr(getattr(engine, "engine", engine), "load_adapter"):
        raise receiver._reject(manifest.version, [f"{type(engine).__name__} cannot serve LoRA adapters"],
                               "Use the reference or vLLM engine for train.lora runs.")
    try:
        if hasattr(engine, "call_here"):  # an EngineWorker: load between two steps
            engine.call_here(lambda e: e.load_adapter(spec, state, manifest.version))
        else:
            engine.load_adapter(spec, state, manifest.version)
    except ValueError as exc:  # the engine's own validation; it also leaves everything as it was
        raise receiver._reject(manifest.version, [str(exc)], "Nothing was applied.") from exc
