"""Engine handles are typed with the engine contract, and engines describe themselves (issue 44 item 6).

- No parameter or attribute that holds an engine, an engine worker, a trainer or an actor is typed `Any` outside
  rollwise/bench and rollwise/sim: the contract (rollwise.engine.contract.Engine, rollwise.types.contracts) names
  what each side may call, so a caller never probes with getattr.
- What callers used to probe for with getattr is on every engine: `device`, `describe()`, the prefix cache's
  size and flush, `close()`, and the LoRA calls (an engine that serves no adapters lists none and refuses to
  load or unload one, naming it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from rollwise.engine.contract import Engine, run_to_completion
from rollwise.engine.factory import describe_engine
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.model.tiny import tiny_llama
from rollwise.sim.cost import CostModel
from rollwise.sim.engine import SimEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.types.weights import AdapterSpec

ROOT = Path(__file__).resolve().parent.parent / "rollwise"
HANDLES = {"engine", "inst", "worker", "trainer", "actor", "current", "fleet", "backend"}
COST = CostModel(step_overhead_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3, decode_s_per_ctx_token=1e-6,
                 max_num_seqs=4, max_model_len=64, weight_update_s=0.25)


def _any_typed_handles(path: Path) -> list[str]:
    """`name: Any` (or Any | None) for a handle name, as a parameter or an annotated assignment."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        pairs: list[tuple[str, ast.expr | None, int]] = []
        if isinstance(node, ast.arg):
            pairs.append((node.arg, node.annotation, node.lineno))
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            pairs.append((name, node.annotation, node.lineno))
        for name, annotation, line in pairs:
            if name.lstrip("_") in HANDLES and annotation is not None and "Any" in ast.unparse(annotation).split(" "):
                found.append(f"{path.relative_to(ROOT.parent)}:{line}: {name}: {ast.unparse(annotation)}")
    return found


def test_no_engine_handle_is_typed_any() -> None:
    files = [p for p in ROOT.rglob("*.py") if not {"bench", "sim"} & set(p.relative_to(ROOT).parts)]
    assert len(files) > 100
    found = [hit for p in files for hit in _any_typed_handles(p)]
    assert found == [], "type these with the engine contract (rollwise.engine.contract.Engine) or rollwise.types" \
                        ".contracts instead of Any:\n" + "\n".join(found)


def test_reference_engine_describes_itself() -> None:
    engine = ReferenceEngine(tiny_llama(seed=0), max_num_seqs=2, max_model_len=32, seed=0)
    assert isinstance(engine, Engine)
    assert engine.device == "cpu"
    assert engine.describe() == f"reference (pure PyTorch, {str(engine.model.dtype).removeprefix('torch.')})"
    assert describe_engine(engine).startswith(engine.describe() + "; ")
    assert engine.loaded_adapters() == {}


def test_prefix_cache_is_counted_and_flushed_through_the_contract() -> None:
    engine = ReferenceEngine(tiny_llama(seed=0), max_num_seqs=2, max_model_len=64, seed=0, prefix_cache_tokens=256)
    assert engine.prefix_cache_tokens == 0
    prompt = list(range(1, 41))  # longer than a cache block: whole blocks are kept
    run_to_completion(engine, [GenerationRequest("a", prompt, SamplingParams(max_tokens=3, seed=0))])
    held = engine.prefix_cache_tokens
    assert held > 0
    assert engine.flush_prefix_cache() == held
    assert engine.prefix_cache_tokens == 0 and engine.flush_prefix_cache() == 0


def test_an_engine_without_adapters_refuses_them_by_name() -> None:
    engine = SimEngine(COST)
    assert isinstance(engine, Engine)
    assert engine.device == "cpu" and engine.describe().startswith("sim")
    assert describe_engine(engine) == engine.describe()
    assert engine.loaded_adapters() == {}
    assert engine.prefix_cache_tokens == 0 and engine.flush_prefix_cache() == 0
    engine.close()  # nothing to release: a no-op
    spec = AdapterSpec(name="tenant-a", rank=2, alpha=4.0, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="'tenant-a'"):
        engine.load_adapter(spec, {"x.lora_A.weight": torch.zeros(2, 4)}, 1)
    with pytest.raises(ValueError, match="'tenant-a'"):
        engine.unload_adapter("tenant-a")
    assert engine.loaded_adapters() == {}
