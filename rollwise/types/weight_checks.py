"""What every weight update must satisfy before anything of it is applied, whichever path brings it.

One set of rules, called by every path that hands weights to an engine:

- rollwise.sync's WeightReceiver (`check` / `commit`): every transport (in-process, files, broadcast, Ray),
  the pool's `PUT /jobs/J/weights`, and LoRA adapters (rollwise.sync.adapters);
- the engine server's `POST /update_weights_from_disk` (rollwise.engine.service), which has no manifest;
- the engines' own `apply_weights` (rollwise.engine.contract), for callers that hold an engine directly.

The rules: a tensor's name, shape and dtype are the engine's (`tensor_problems`; a float tensor wider than the
engine's float dtype is cast down as it loads, as the engine was configured to serve: `dtype_problem`); a
complete update misses nothing (`missing_problems`); every value is finite (`nonfinite`); versions never go
back (`version_problem`: every sampled token carries its version, and the staleness bound counts on them).

Each problem is a `WeightProblem`: its message, which names the tensor or field, and that field on its own
(`.field`), which the HTTP servers answer as the error's `param`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from pydantic import ValidationError
from torch import Tensor

from rollwise.types.weights import AdapterSpec, ExpectedWeights, dtype_from_name, dtype_name

# Non-learned buffers some checkpoints carry; the engine's load_weights skips them too.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightProblem(str):
    """One reason to refuse an update: a str (the message, joined and shown like any other) that also says
    which field or tensor is at fault (`field`)."""

    field: str

    def __new__(cls, field: str, message: str) -> WeightProblem:
        problem = super().__new__(cls, message)
        problem.field = field
        return problem

    def prefixed(self, prefix: str) -> WeightProblem:
        return WeightProblem(self.field, prefix + self)


def dtype_problem(name: str, sent: str, held: str) -> WeightProblem | None:
    """None if a `sent` tensor may load into the engine's `held` one: the same dtype, or a float wider than the
    engine's float (a float32 trainer, a bfloat16 engine: engine.dtype chose to serve the narrower type, and
    the copy casts). Everything else is refused: an integer or bool tensor is another kind of data, float16
    and bfloat16 each lose what the other keeps, and a narrower float than the engine's (float16 into a
    float32 engine), although exact, says the trainer and the engine run different precisions, which the
    configuration must say instead (engine.dtype), so one rule holds for every path."""
    if sent == held:
        return None
    a, b = dtype_from_name(sent), dtype_from_name(held)
    if a.is_floating_point and b.is_floating_point and a.itemsize > b.itemsize:
        return None
    if not a.is_floating_point and b.is_floating_point:
        fix = f"send the weights as floating-point tensors ({held}); integer data is never cast into a weight"
    elif a.is_floating_point and b.is_floating_point and a.itemsize < b.itemsize:
        fix = f"push {held} tensors, or start the engine with engine.dtype={sent} to serve that precision"
    else:
        fix = f"push {held} tensors"
    return WeightProblem(name, f"{name}: dtype {sent} != the engine's {held} ({fix})")


def tensor_problems(name: str, shape: tuple[int, ...], dtype: str, expected: ExpectedWeights) -> list[WeightProblem]:
    """Why a tensor called `name` of this shape and dtype cannot load into the engine (empty: it can)."""
    if name.endswith(IGNORED_SUFFIXES):
        return []
    if name not in expected.tensors:
        return [WeightProblem(name, f"unexpected weight {name!r}")]
    held_shape, held_dtype = expected.tensors[name]
    problems = []
    if tuple(shape) != tuple(held_shape):
        problems.append(WeightProblem(name, f"{name}: shape {tuple(shape)} != the engine's {tuple(held_shape)}"))
    wrong_dtype = dtype_problem(name, dtype, held_dtype)
    if wrong_dtype is not None:
        problems.append(wrong_dtype)
    return problems


def missing_problems(sent: Iterable[str], expected: ExpectedWeights) -> list[WeightProblem]:
    """Names a complete update must hold and does not (a name the engine ties to a sent one loads through it)."""
    names = set(sent)
    return [WeightProblem(n, f"missing weight {n!r}") for n in expected.tensors
            if n not in names and expected.ties.get(n) not in names]


def nonfinite(tensors: Mapping[str, Tensor]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity, in order.

    One sum per tensor, read back at once per device (a NaN or inf makes the sum non-finite; one pass,
    no bool buffer: ~8% of a copy of the same bytes); only a tensor whose sum is not finite is checked
    element by element, since finite values can also overflow a sum."""
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append((name, t))
    suspects: set[str] = set()
    for group in by_device.values():
        sums = torch.stack([t.detach().sum().float() for _, t in group])
        suspects.update(name for (name, t), ok in zip(group, torch.isfinite(sums).tolist())
                        if not ok and not bool(torch.isfinite(t).all()))
    return [name for name in tensors if name in suspects]


def nonfinite_problems(tensors: Mapping[str, Tensor]) -> list[WeightProblem]:
    return [WeightProblem(name, f"non-finite values in {name} (NaN or inf): the run that made these weights "
                                "diverged; push weights from a step before it") for name in nonfinite(tensors)]


def state_problems(state: Mapping[str, Tensor], expected: ExpectedWeights, *, complete: bool) -> list[WeightProblem]:
    """Everything wrong with `state` as an update of the engine: names, shapes, dtypes, and (`complete`) what
    is missing; then, only if all of that fits (so a refused update is not read whole), the values."""
    problems = [p for name, t in state.items() for p in tensor_problems(name, tuple(t.shape), dtype_name(t.dtype),
                                                                        expected)]
    if complete:
        problems += missing_problems(state, expected)
    return problems or nonfinite_problems(state)


def adapter_spec_problems(spec: AdapterSpec) -> list[WeightProblem]:
    """An adapter spec's own problems (rank, alpha, name, targets: AdapterSpec's validation), checked again on the
    receiving side: a spec made in-process with model_copy (which does not validate) gets the same refusal as
    one parsed from a manifest."""
    try:
        AdapterSpec.model_validate(spec.model_dump())
    except ValidationError as exc:
        return [WeightProblem("adapter." + ".".join(str(part) for part in e["loc"]),
                              f"adapter.{'.'.join(str(part) for part in e['loc'])}: {e['msg']}") for e in exc.errors()]
    return []


def version_problem(version: int, current: int | None, holder: str = "the engine") -> WeightProblem | None:
    """Versions only move forward: every token carries the version that sampled it, and the ledger's staleness
    is measured by them. Re-pushing the current version is allowed (a retry)."""
    if current is None or version >= current:
        return None
    return WeightProblem("version", f"version {version} is older than the one served: {holder} is already at "
                                    f"version {current}; push a version >= {current} (versions only move forward)")
