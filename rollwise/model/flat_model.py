"""A transformers model whose weights come from a flat checkpoint (rollwise.model.flat_reader), and flat
checkpoints written from a model or from any Hugging Face directory (`rollwise model flatten`).

The model is built with its parameters on the meta device and no random init (from_pretrained's own
contexts), then each parameter becomes the flat buffer's view (`load_state_dict(assign=True)`), and
the model's declared ties are re-made (`tie_weights`), so tied embeddings are one Parameter as they are after
`from_pretrained`. Buffers that are not weights (rotary frequencies) are computed on CPU as usual.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from rollwise.model.flat_format import DEFAULT_CHUNK_MB, FlatIndex, copy_model_files, write_flat
from rollwise.model.flat_reader import FlatCheckpointError, read_flat
from rollwise.types.weight_checks import IGNORED_SUFFIXES


def load_flat_model(directory: str | Path, dtype: torch.dtype = torch.float32, *, pin: bool = False,
                    threads: int | None = None, device: torch.device | str | None = None) -> PreTrainedModel:
    """The model of a flat directory, in `dtype` (tensors stored in another float dtype are cast: a copy; the
    stored dtype loads with none), on `device` (default: the CPU; a GPU gets each chunk from a pinned buffer as
    soon as it is read and verified, into one device buffer whose views the parameters are: ServerlessLLM's load
    path). FlatCheckpointError naming the tensors when the checkpoint is damaged or does not fit the config's
    model."""
    directory = Path(directory)
    weights = read_flat(directory, pin=pin, threads=threads, device=device)
    config = AutoConfig.from_pretrained(directory)
    # Parameters on meta, buffers on CPU; no random init of weights about to be replaced (from_pretrained's own
    # context for the same: its init is most of building a model, even on meta).
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: t if not t.is_floating_point() or t.dtype == dtype else t.to(dtype)
             for name, t in weights.state.items() if not name.endswith(IGNORED_SUFFIXES)}
    expected = model.state_dict()
    wrong = [f"{n}: {tuple(t.shape)} != the model's {tuple(expected[n].shape)}" for n, t in state.items()
             if n in expected and tuple(t.shape) != tuple(expected[n].shape)]
    unexpected = sorted(set(state) - set(expected))
    if wrong or unexpected:
        raise FlatCheckpointError(f"{directory}: the flat checkpoint does not fit its config.json's model "
                                  f"({'; '.join(wrong[:8])}{'; ' if wrong and unexpected else ''}"
                                  f"{'unexpected ' + ', '.join(unexpected[:8]) if unexpected else ''}); "
                                  "flatten the model directory again", [*(w.split(':')[0] for w in wrong), *unexpected])
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # a tied lm_head that the checkpoint stores once (or as an alias) is the embedding again
    if device is not None:
        model.to(device)  # the buffers computed on the CPU (rotary frequencies); the parameters are there already
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise FlatCheckpointError(f"{directory}: the flat checkpoint lacks {', '.join(missing[:8])}"
                                  f"{f' ({len(missing)} in all)' if len(missing) > 8 else ''}; flatten the "
                                  "model directory again", missing)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def flatten_model(model: PreTrainedModel, out_dir: str | Path, *, chunk_mb: float = DEFAULT_CHUNK_MB) -> FlatIndex:
    """Write a live transformers model as out_dir's flat checkpoint: its weights (tied ones once), config and
    generation config; the tokenizer is the caller's (tokenizer.save_pretrained(out_dir))."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    return write_flat(model.state_dict(), out_dir, chunk_mb=chunk_mb)


def safetensors_state(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's *.safetensors files (memory-mapped, in file order)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors files to flatten (save the model with save_pretrained, "
                         "safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                if name in state:
                    raise ValueError(f"{src}: tensor {name!r} is in two files ({file.name} and another): remove the "
                                     "stale file")
                state[name] = handle.get_tensor(name)
    return state


def flatten_directory(src: str | Path, dst: str | Path, *, chunk_mb: float = DEFAULT_CHUNK_MB) -> FlatIndex:
    """Write dst as the flat checkpoint of the Hugging Face directory src (its config and tokenizer files copied,
    its weights in one data file). dst may not be src."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError(f"the flat checkpoint needs a directory of its own, not the source {src}")
    state = safetensors_state(src)
    dst.mkdir(parents=True, exist_ok=True)
    copy_model_files(src, dst)
    return write_flat(state, dst, chunk_mb=chunk_mb)
