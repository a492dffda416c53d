"""The receiving side of a weight update: stage its buckets (`StagedUpdate`), then check the whole
manifest against the engine and apply it at once or not at all (`WeightReceiver`, the checked two-phase
commit every transport ends in; a LoRA adapter's manifest is checked with rollwise.engine.adapter_checks
and loaded beside the base). rollwise.sync.buckets describes the format. The rules themselves (names,
shapes, dtypes, finite values, versions only forward) are rollwise.types.weight_checks', shared with the
engine server's disk route and the engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from torch import Tensor

from rollwise.engine.adapter_checks import adapter_problems, base_projections
from rollwise.types.contracts import AdapterEngine, WeightEngine
from rollwise.types.bucket_layout import bucket_checksum, unflatten_bucket
from rollwise.types.weight_checks import (
    WeightProblem,
    adapter_spec_problems,
    missing_problems,
    nonfinite_problems,
    tensor_problems,
    version_problem,
)
from rollwise.types.adapter_limits import MAX_LORA_ALPHA
from rollwise.types.weights import BucketSpec, ExpectedWeights, WeightManifest, WeightUpdateError, dtype_name


class CarriedUpdate(Protocol):
    """What `WeightReceiver.receive` reads of an update: rollwise.types.weight_update.WeightUpdate, which is built
    on this module, named by its shape so that the receiving side imports nothing above it."""

    @property
    def manifest(self) -> WeightManifest: ...

    def tensors(self) -> Mapping[str, Tensor]: ...


# ---------------------------------------------------------------------------- receiving


def _shown(problems: Sequence[str], limit: int = 8) -> str:
    more = f"; ... ({len(problems)} problems in all)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def _spoiled(spec: BucketSpec) -> str:
    """The tensors of a bad bucket, as a refusal names them."""
    names = [t.name for t in spec.tensors]
    return ", ".join(names[:8]) + (f", ... ({len(names)} tensors)" if len(names) > 8 else "")


class StagedUpdate:
    """Phase one: the buckets of one update as they arrive. Problems are recorded, not raised, so a
    collective transport keeps receiving (every rank must join every broadcast) and the error names
    everything that went wrong at once.

    Bytes that crossed a transport (HTTP, files, a broadcast) are only as good as their checksum, so
    every bucket of such an update must carry one: a manifest without is refused, whatever its bytes.
    `in_memory`: the tensors are the sender's own, in this process (WeightReceiver.apply_state), and
    nothing moved that could be damaged."""

    def __init__(self, manifest: WeightManifest, *, in_memory: bool = False) -> None:
        self.manifest = manifest
        self.tensors: dict[str, Tensor] = {}
        self.problems: list[WeightProblem] = []
        self._received: set[int] = set()
        unchecked = [b.index for b in manifest.buckets if b.checksum is None]
        if unchecked and not in_memory:
            self.problems.append(WeightProblem(
                f"buckets[{unchecked[0]}].checksum",
                f"manifest: bucket(s) {unchecked[:8]} carry no checksum; an update that moves bytes must checksum "
                "every bucket (build_manifest(checksum=True), as every rollwise sender does)"))

    def add_flat(self, index: int, buf: Tensor) -> None:
        spec = self.manifest.buckets[index]
        try:
            tensors = unflatten_bucket(spec, buf)
        except ValueError as exc:
            self.fail(index, str(exc))
            return
        self.add(index, tensors, source=f"bucket {index}")

    def add(self, index: int, tensors: Mapping[str, Tensor], source: str) -> None:
        """Stage bucket `index`, checking its names, shapes, dtypes and checksum against the manifest."""
        spec = self.manifest.buckets[index]
        self._received.add(index)
        wanted = {t.name: t for t in spec.tensors}
        problems = [WeightProblem(n, f"{source}: unexpected tensor {n!r}") for n in tensors if n not in wanted]
        problems += [WeightProblem(n, f"{source}: missing tensor {n!r}") for n in wanted if n not in tensors]
        for name, t in wanted.items():
            got = tensors.get(name)
            if got is not None and (tuple(got.shape) != t.shape or dtype_name(got.dtype) != t.dtype):
                problems.append(WeightProblem(name, f"{source}: {name} is {tuple(got.shape)} {dtype_name(got.dtype)}, "
                                                    f"the manifest says {t.shape} {t.dtype}"))
        if not problems and spec.checksum is not None:
            checksum = bucket_checksum(spec, tensors)
            if checksum != spec.checksum:
                problems.append(WeightProblem(
                    f"buckets[{index}]", f"{source}: checksum mismatch (xxh3 {checksum:016x}, manifest "
                                         f"{spec.checksum:016x}): the bytes were damaged in transit or on disk, "
                                         f"spoiling {_spoiled(spec)}"))
        if problems:
            self.problems += problems
        else:
            self.tensors.update(tensors)

    def fail(self, index: int, message: str) -> None:
        self._received.add(index)
        self.problems.append(WeightProblem(f"buckets[{index}]", message))

    def arrival_problems(self) -> list[WeightProblem]:
        """What went wrong while staging, and every bucket that never arrived."""
        return [*self.problems, *(WeightProblem(f"buckets[{i}]", f"bucket {i} never arrived")
                                  for i in self.missing_buckets())]

    def missing_buckets(self) -> list[int]:
        return [b.index for b in self.manifest.buckets if b.index not in self._received]


class WeightReceiver:
    """The engine side shared by all transports: check a manifest, then apply a staged update whole.

    `engine` (a WeightEngine) takes full-weight updates: a ReferenceEngine, a VllmEngine, an EngineWorker
    (then the apply runs on its thread between two steps), a pool job. `adapters` (an AdapterEngine, most
    often the same object) takes LoRA adapter updates; without one they are refused. `tokenizer_fingerprint`
    is the engine's own tokenizer's (rollwise.model.loading.tokenizer_fingerprint); None only for an
    engine built without one (tests, benchmarks): then the fingerprint is the one thing not checked."""

    def __init__(self, engine: WeightEngine, tokenizer_fingerprint: str | None, *,
                 adapters: AdapterEngine | None = None) -> None:
        self.engine = engine
        self.adapters = adapters
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.expected: ExpectedWeights = engine.expected_weights

    @property
    def policy_version(self) -> int | None:
        return self.engine.policy_version

    def reject(self, version: int, problems: Sequence[WeightProblem], hint: str) -> WeightUpdateError:
        """The error refusing `version` for `problems` (the first one's field is the error's)."""
        return WeightUpdateError(
            f"weight update to version {version} rejected; the engine keeps serving version "
            f"{self.policy_version}: {_shown(problems)}. {hint}",
            field=problems[0].field if problems else None,
        )

    def check(self, manifest: WeightManifest) -> None:
        """Reject a manifest this engine cannot take, before any bytes are read."""
        if manifest.adapter is not None:  # a LoRA adapter, not the model (rollwise.sync.adapters)
            self._check_adapter(manifest)
            return
        version = manifest.version
        backwards = version_problem(version, self.policy_version)
        if backwards is not None:
            raise self.reject(version, [backwards], "Nothing was applied.")
        if self.tokenizer_fingerprint is not None and manifest.tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise self.reject(
                version,
                [WeightProblem("tokenizer_fingerprint",
                               f"tokenizer fingerprint {manifest.tokenizer_fingerprint[:16]}... != the engine's "
                               f"{(self.tokenizer_fingerprint or '')[:16]}...")],
                "The trainer and the engine tokenize differently: start both from the same model/tokenizer.",
            )
        problems = [p for t in manifest.tensors() for p in tensor_problems(t.name, t.shape, t.dtype, self.expected)]
        for alias, source in manifest.aliases.items():
            if alias not in self.expected.tensors:
                problems.append(WeightProblem(alias, f"unexpected weight {alias!r} (tied to {source!r})"))
            elif self.expected.tensors[alias][0] != manifest.spec_of(source).shape:
                problems.append(WeightProblem(alias, f"{alias}: shape {manifest.spec_of(source).shape} != the "
                                                     f"engine's {self.expected.tensors[alias][0]}"))
        problems += missing_problems([*(t.name for t in manifest.tensors()), *manifest.aliases], self.expected)
        if problems:
            raise self.reject(version, problems,
                              "The trainer's model does not match the engine's: load the same model spec "
                              "(and dtype) on both sides.")

    def commit(self, staged: StagedUpdate) -> None:
        """Phase two: verify everything, then apply the whole update at once (or nothing)."""
        manifest = staged.manifest
        if manifest.adapter is not None:  # a LoRA adapter: loaded beside the base (rollwise.sync.adapters)
            self._commit_adapter(staged)
            return
        self.check(manifest)
        problems = staged.arrival_problems()
        if problems:
            raise self.reject(manifest.version, problems, "Nothing was applied; push the version again.")
        problems = nonfinite_problems(staged.tensors)  # (an alias is its source's tensor: read once)
        if problems:
            raise self.reject(manifest.version, problems, "Nothing was applied.")
        state = dict(staged.tensors)
        for alias, source in manifest.aliases.items():
            # Sent once on the wire; handed to the engine under both names unless the engine declares that
            # they share memory (then loading one updates both). vLLM declares no ties: its CPU backend
            # keeps a repacked lm_head of its own, which loading only the embedding left stale.
            if self.expected.ties.get(alias) != source and self.expected.ties.get(source) != alias:
                state[alias] = state[source]
        try:
            self.engine.apply_weights(state, manifest.version)
        except ValueError as exc:  # the engine's own validation; it also leaves the weights untouched
            raise self.reject(manifest.version, [WeightProblem("weights", str(exc))], "Nothing was applied.") from exc

    def receive(self, update: CarriedUpdate) -> None:
        """The one entry every transport ends in: stage the update's tensors, check it whole, apply it."""
        self.apply_state(update.manifest, update.tensors())

    def apply_state(self, manifest: WeightManifest, state: Mapping[str, Tensor]) -> None:
        """Stage tensors that are already in memory (one process) and commit them."""
        staged = StagedUpdate(manifest, in_memory=True)
        for bucket in manifest.buckets:
            staged.add(bucket.index, {t.name: state[t.name] for t in bucket.tensors if t.name in state},
                       source=f"bucket {bucket.index}")
        self.commit(staged)

    # ------------------------------------------------------------ LoRA adapters (rollwise.sync.adapters)

    def _check_adapter(self, manifest: WeightManifest) -> None:
        """WeightReceiver.check for an adapter manifest: refuse before any bytes are read."""
        spec = manifest.adapter
        assert spec is not None
        problems = adapter_spec_problems(spec)
        if problems:
            raise self.reject(manifest.version, problems, f"Send a LoRA spec with rank >= 1, a finite alpha in "
                                                          f"(0, {MAX_LORA_ALPHA:g}] and a plain name.")
        held = self.adapters.loaded_adapters().get(spec.name) if self.adapters is not None else None
        current = self.policy_version if spec.default else held
        backwards = version_problem(manifest.version, current, f"adapter {spec.name!r}")
        if backwards is not None:
            raise self.reject(manifest.version, [backwards], "Nothing was applied.")
        fingerprint = self.tokenizer_fingerprint
        if fingerprint is not None and manifest.tokenizer_fingerprint != fingerprint:
            raise self.reject(manifest.version, [WeightProblem("tokenizer_fingerprint",
                                                               "tokenizer fingerprint differs from the engine's")],
                              "The trainer and the engine tokenize differently: start both from the same model.")
        problems = adapter_problems(manifest, base_projections(self.expected))
        if problems:
            raise self.reject(manifest.version, [p.prefixed(f"adapter {spec.name!r}: ") for p in problems],
                              "The adapter does not fit the engine's base model: train it on the same base, "
                              "with the rank and target_modules its manifest declares.")

    def _commit_adapter(self, staged: StagedUpdate) -> None:
        """WeightReceiver.commit for an adapter: check it whole, then load it (or nothing)."""
        manifest = staged.manifest
        spec = manifest.adapter
        assert spec is not None
        self._check_adapter(manifest)
        problems = staged.arrival_problems()
        if problems:
            raise self.reject(manifest.version, problems, "Nothing was applied; push the adapter again.")
        # Checked here, not only by the engine loading it: a pool stores the adapter for engines that load it later.
        problems = nonfinite_problems(staged.tensors)
        if problems:
            raise self.reject(manifest.version, [p.prefixed(f"adapter {spec.name!r}: ") for p in problems],
                              "Nothing was applied.")
        state = dict(staged.tensors)
        if self.adapters is None:
            raise self.reject(manifest.version, [WeightProblem("adapter", f"{type(self.engine).__name__} cannot "
                                                                          "serve LoRA adapters")],
                              "Use the reference or vLLM engine for train.lora runs.")
        try:
            self.adapters.load_adapter(spec, state, manifest.version)  # an EngineWorker: between two steps
        except ValueError as exc:  # the engine's own validation; it also leaves everything as it was
            raise self.reject(manifest.version, [WeightProblem("adapter", str(exc))], "Nothing was applied.") from exc
