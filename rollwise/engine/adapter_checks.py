"""Whether a LoRA adapter's manifest fits an engine's base model (rollwise.sync.adapters: adapter-only sync).

Pure checks on the manifest and the engine's expected weights; WeightReceiver (rollwise.engine.weight_receiver)
runs them, with the full-weight ones, before it loads an adapter.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollwise.types.weight_checks import WeightProblem, dtype_problem
from rollwise.types.weights import ExpectedWeights, WeightManifest

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def base_projections(expected: ExpectedWeights) -> dict[str, tuple[tuple[int, ...], str]]:
    """Base module name -> ((out, in), dtype) of every 2-D `<module>.weight` the engine holds."""
    return {name.removesuffix(".weight"): (shape, dtype) for name, (shape, dtype) in expected.tensors.items()
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
