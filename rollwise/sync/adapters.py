"""Adapter-only weight sync (train.lora): the trainer pushes its LoRA adapter, not the model.

An adapter update is an ordinary `WeightUpdate` (manifest + checksummed buckets, versioned) whose
manifest carries an `AdapterSpec` (name, rank, alpha, targets; rollwise.types.weights, which refuses
a rank below 1, a non-finite or absurd alpha and a name that is not a plain path component): every
transport moves it unchanged, and `WeightReceiver.check`/`commit` hand it to `check_adapter` /
`commit_adapter` here. The checks are the full-weight ones (rollwise.types.weight_checks: version only
moves forward, same tokenizer, every tensor's shape and dtype fit the engine's base projection,
checksums, every bucket arrived, finite values), then the engine's `load_adapter(spec, tensors,
version)` loads it without touching the base weights. A rejected adapter leaves the engine serving
what it served before, and a pool stores nothing of it.

The tensors are named by the base model's modules: `model.layers.0.self_attn.q_proj.lora_A.weight`
[rank, in] and `....lora_B.weight` [out, rank] (rollwise.train.lora.adapter_state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from rollwise.protocols import Trainer
from rollwise.sync.buckets import WeightUpdate, build_manifest
from rollwise.types.weight_checks import (
    WeightProblem,
    adapter_spec_problems,
    dtype_problem,
    nonfinite_problems,
    version_problem,
)
from rollwise.types.weights import MAX_LORA_ALPHA, AdapterSpec, WeightManifest

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


def _projections(receiver: WeightReceiver) -> dict[str, tuple[tuple[int, ...], str]]:
    """Base module name -> ((out, in), dtype) of every 2-D `<module>.weight` the engine holds."""
    return {name.removesuffix(".weight"): (shape, dtype) for name, (shape, dtype) in receiver.expected.tensors.items()
            if name.endswith(".weight") and len(shape) == 2}


def adapter_problems(manifest: WeightManifest,
                     projections: Mapping[str, tuple[tuple[int, ...], str]]) -> list[WeightProblem]:
    """Why the manifest's tensors cannot be this adapter on this base (empty: they can). An adapter's tensors
    follow the base's dtype rule (rollwise.types.weight_checks.dtype_problem): the engine casts them to its
    own dtype as they load, never an integer tensor."""
    spec = manifest.adapter
    assert spec is not None
    problems: list[WeightProblem] = []
    seen: dict[str, set[str]] = {}
    for t in manifest.tensors():
        module, part = (t.name.removesuffix(LORA_A), "A") if t.name.endswith(LORA_A) else \
            (t.name.removesuffix(LORA_B), "B") if t.name.endswith(LORA_B) else (t.name, "")
        if not part:
            problems.append(WeightProblem(t.name, f"{t.name!r} is not a LoRA tensor (<module>{LORA_A} or "
                                                  f"<module>{LORA_B})"))
            continue
        seen.setdefault(module, set()).add(part)
        if module not in projections or module.rsplit(".", 1)[-1] not in spec.target_modules:
            problems.append(WeightProblem(t.name, f"{t.name}: {module!r} is not a target projection of the engine's "
                                                  f"model (target_modules {list(spec.target_modules)})"))
            continue
        (out_dim, in_dim), dtype = projections[module]
        want = (spec.rank, in_dim) if part == "A" else (out_dim, spec.rank)
        if t.shape != want:
            problems.append(WeightProblem(t.name, f"{t.name}: shape {t.shape} != {want} (rank {spec.rank} on the "
                                                  "engine's base)"))
        wrong_dtype = dtype_problem(t.name, t.dtype, dtype)
        if wrong_dtype is not None:
            problems.append(wrong_dtype)
    problems += [WeightProblem(module + (LORA_B if "A" in parts else LORA_A),
                               f"{module}: lora_A and lora_B must both be sent")
                 for module, parts in seen.items() if len(parts) != 2]
    if not seen:
        problems.append(WeightProblem("adapter.target_modules", "the adapter has no tensors"))
    return problems


def check_adapter(receiver: WeightReceiver, manifest: WeightManifest) -> None:
    """WeightReceiver.check for an adapter manifest: refuse before any bytes are read."""
    spec = manifest.adapter
    assert spec is not None
    problems = adapter_spec_problems(spec)
    if problems:
        raise receiver.reject(manifest.version, problems, f"Send a LoRA spec with rank >= 1, a finite alpha in "
                                                          f"(0, {MAX_LORA_ALPHA:g}] and a plain name.")
    current = receiver.policy_version if spec.default else _adapter_version(receiver.engine, spec.name)
    backwards = version_problem(manifest.version, current, f"adapter {spec.name!r}")
    if backwards is not None:
        raise receiver.reject(manifest.version, [backwards], "Nothing was applied.")
    fingerprint = receiver.tokenizer_fingerprint
    if fingerprint is not None and manifest.tokenizer_fingerprint != fingerprint:
        raise receiver.reject(manifest.version, [WeightProblem("tokenizer_fingerprint",
                                                               "tokenizer fingerprint differs from the engine's")],
                              "The trainer and the engine tokenize differently: start both from the same model.")
    problems = adapter_problems(manifest, _projections(receiver))
    if problems:
        raise receiver.reject(manifest.version, [p.prefixed(f"adapter {spec.name!r}: ") for p in problems],
                              "The adapter does not fit the engine's base model: train it on the same base, "
                              "with the rank and target_modules its manifest declares.")


def commit_adapter(receiver: WeightReceiver, staged: StagedUpdate) -> None:
    """WeightReceiver.commit for an adapter: check it whole, then load it (or nothing)."""
    manifest = staged.manifest
    spec = manifest.adapter
    assert spec is not None
    check_adapter(receiver, manifest)
    problems = staged.arrival_problems()
    if problems:
        raise receiver.reject(manifest.version, problems, "Nothing was applied; push the adapter again.")
    # Checked here, not only by the engine loading it: a pool stores the adapter for engines that load it later.
    problems = nonfinite_problems(staged.tensors)
    if problems:
        raise receiver.reject(manifest.version, [p.prefixed(f"adapter {spec.name!r}: ") for p in problems],
                              "Nothing was applied.")
    state = dict(staged.tensors)
    engine = receiver.engine
    if not hasattr(getattr(engine, "engine", engine), "load_adapter"):
        raise receiver.reject(manifest.version, [WeightProblem("adapter", f"{type(engine).__name__} cannot serve "
                                                                          "LoRA adapters")],
                              "Use the reference or vLLM engine for train.lora runs.")
    try:
        if hasattr(engine, "call_here"):  # an EngineWorker: load between two steps
            engine.call_here(lambda e: e.load_adapter(spec, state, manifest.version))
        else:
            engine.load_adapter(spec, state, manifest.version)
    except ValueError as exc:  # the engine's own validation; it also leaves everything as it was
        raise receiver.reject(manifest.version, [WeightProblem("adapter", str(exc))], "Nothing was applied.") from exc
