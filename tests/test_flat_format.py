"""Loading-optimised (flat) checkpoints: written from a state dict, a model or a Hugging Face directory
(`rollwise model flatten`), read back equal to the source for every dtype and shape (tied weights, MoE
experts, LoRA tensors), loadable wherever a model directory is (load_model, /update_weights_from_disk), and a
damaged or truncated chunk refused with its tensors named and nothing applied."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.flat_format import DATA_FILE, is_flat_dir, write_flat
from rollwise.model.flat_model import flatten_model
from rollwise.model.flat_reader import FlatCheckpointError, read_flat, read_index
from rollwise.model.flatten_cli import main as flatten_cli_main
from rollwise.model.loading import load_model
from rollwise.model.tiny import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SMALL_CHUNKS = 4096 / 2**20  # one page: a tiny model's 16 KB projection spans several chunks
BAD = "model.layers.0.self_attn.q_proj.weight"


def _every_kind() -> dict[str, torch.Tensor]:
    """Every dtype a checkpoint holds, odd shapes, a tensor spanning many chunks, views and aliases."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 100, generator=g)  # 120 KB: larger than a chunk, a chunk of its own
    embed = torch.randn(40, 16, generator=g)
    experts = torch.randn(4, 8, 16, generator=g)  # an MoE's stacked experts; each expert also as a view below
    return {
        "fp32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 33, generator=g).bfloat16(),
        "fp16": torch.randn(65, generator=g).half(),
        "fp64": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "int64": torch.randint(-2**40, 2**40, (5,), generator=g),
        "int32": torch.randint(-9, 9, (3, 1), generator=g, dtype=torch.int32),
        "int8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "big": big,
        "transposed": big.t(),  # a non-contiguous view: stored as its values, not its memory
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: stored once, read back as the same tensor
        "experts": experts,
        "expert.2": experts[2],  # a view into the stack (other memory identity): stored on its own
        "q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
        "q_proj.lora_B.weight": torch.zeros(16, 4),
    }


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_and_shape_round_trips_equal(tmp_path: Path):
    source = _every_kind()
    index = write_flat(source, tmp_path, chunk_mb=SMALL_CHUNKS)
    assert index.layout.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert len(index.checksums) > 50 and index.data_bytes % 4096 == 0
    weights = read_flat(tmp_path, threads=3)  # chunks read and checked out of order
    assert set(weights.state) == set(source)
    for name, t in source.items():
        got = weights.state[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(_raw(got), _raw(t)), name  # bit for bit (fp8 has no ==)
    assert weights.state["lm_head.weight"].data_ptr() == weights.state["model.embed_tokens.weight"].data_ptr()
    # no copies: every tensor is a view into the one buffer
    base, end = weights.buffer.data_ptr(), weights.buffer.data_ptr() + weights.buffer.numel()
    assert all(base <= t.data_ptr() < end for t in weights.state.values() if t.numel())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits


@pytest.mark.parametrize("spec", ["tiny:3", "tiny-moe:1"])
def test_a_flattened_model_loads_equal_through_load_model(tmp_path: Path, spec: str):
    """`rollwise model flatten` (the CLI, for the dense model; the same function in-process for the MoE, to
    spare a second interpreter start) of a tiny dense model and a tiny MoE (its experts); load_model of the flat
    directory gives the same model: outputs equal, the tie a tie (one Parameter), the same parameters."""
    out = tmp_path / "flat"
    if spec.startswith("tiny:"):
        done = subprocess.run([sys.executable, "-m", "rollwise.cli", "model", "flatten", spec, str(out)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "wrote" in done.stdout, done.stdout + done.stderr
    else:
        assert flatten_cli_main(["flatten", spec, str(out)]) == 0
    assert is_flat_dir(out) and not list(out.glob("*.safetensors"))
    source, _ = load_model(spec)
    flat, tokenizer = load_model(str(out))
    assert torch.equal(_logits(flat), _logits(source))
    assert tokenizer.get_vocab() == tiny_tokenizer().get_vocab()
    assert flat.lm_head.weight is flat.get_input_embeddings().weight
    assert {n for n, _ in flat.named_parameters()} == {n for n, _ in source.named_parameters()}


def test_bf16_loads_without_a_copy_and_casts_when_asked(tmp_path: Path):
    model = tiny_llama(seed=2).to(torch.bfloat16)
    flatten_model(model, tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    as_stored, _ = load_model(str(tmp_path), dtype=torch.bfloat16)
    as_fp32, _ = load_model(str(tmp_path), dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(dict(as_stored.named_parameters())[name], p)
        assert torch.equal(dict(as_fp32.named_parameters())[name], p.float())
    ptrs = sorted(p.data_ptr() for p in as_stored.parameters())
    assert ptrs[-1] - ptrs[0] < read_index(tmp_path).data_bytes  # all inside one buffer


def test_weights_read_onto_a_device_are_views_of_one_buffer_there(tmp_path: Path):
    """read_flat(device=) (the GPU load path: each verified chunk copied into one device buffer while the others
    are read, then views) on the CPU as a device: every tensor equal to a plain read's, all of them inside ONE
    buffer of the data file's size, aliases still one tensor; load_flat_model(device=) builds the same model from
    it, its tie a tie; a damaged chunk hands nothing out."""
    from rollwise.model.flat_model import load_flat_model

    model = tiny_llama(seed=4)
    flatten_model(model, tmp_path, chunk_mb=SMALL_CHUNKS)  # many chunks: copies interleave with reads
    tiny_tokenizer().save_pretrained(tmp_path)
    weights = read_flat(tmp_path)
    moved = read_flat(tmp_path, device="cpu", threads=3)
    assert moved.buffer.numel() == read_index(tmp_path).data_bytes and set(moved.state) == set(weights.state)
    start, end = moved.buffer.data_ptr(), moved.buffer.data_ptr() + moved.buffer.numel()
    for name, t in moved.state.items():
        assert torch.equal(t, weights.state[name]) and start <= t.data_ptr() < end, name
    for alias, source in read_index(tmp_path).layout.aliases.items():
        assert moved.state[alias] is moved.state[source]
    unchecked = read_flat(tmp_path, device="cpu", verify=False)
    assert all(torch.equal(unchecked.state[n], t) for n, t in weights.state.items())
    loaded = load_flat_model(tmp_path, device="cpu")
    assert torch.equal(_logits(loaded), _logits(model))
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    _flip_byte_of(tmp_path, "model.norm.weight")
    with pytest.raises(FlatCheckpointError, match="model.norm.weight"):
        read_flat(tmp_path, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU load path)")
def test_a_flat_model_loads_onto_the_gpu_from_one_buffer(tmp_path: Path):
    from rollwise.model.flat_model import load_flat_model

    model = tiny_llama(seed=5)
    flatten_model(model, tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = load_flat_model(tmp_path, device="cuda")
    params = list(loaded.parameters())
    assert all(p.is_cuda for p in params) and all(b.is_cuda for b in loaded.buffers())
    ptrs = sorted(p.data_ptr() for p in params)
    assert ptrs[-1] - ptrs[0] < read_index(tmp_path).data_bytes  # views of one device buffer
    with torch.no_grad():
        got = loaded(torch.tensor([[5, 6, 7, 8, 9, 10]], device="cuda")).logits.cpu()
    assert torch.allclose(got, _logits(model), atol=1e-4)


def _flip_byte_of(directory: Path, name: str) -> None:
    index = read_index(directory)
    chunk = next(b for b in index.layout.buckets if any(t.name == name for t in b.tensors))
    spec = next(t for t in chunk.tensors if t.name == name)
    at = index.bucket_offsets[chunk.index] + spec.offset + spec.nbytes // 2
    with (directory / DATA_FILE).open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


def test_damaged_or_truncated_chunks_are_refused_naming_their_tensors(tmp_path: Path):
    model = tiny_llama(seed=4)
    flatten_model(model, tmp_path, chunk_mb=SMALL_CHUNKS)
    tiny_tokenizer().save_pretrained(tmp_path)
    _flip_byte_of(tmp_path, BAD)
    with pytest.raises(FlatCheckpointError) as damaged:
        read_flat(tmp_path)
    assert damaged.value.tensors == [BAD] and "checksum" in str(damaged.value)
    with pytest.raises(ValueError, match=f"{BAD}.*nothing was loaded"):  # every caller of load_model
        load_model(str(tmp_path))
    _flip_byte_of(tmp_path, BAD)  # repaired
    index = read_index(tmp_path)
    specs = sorted(index.layout.tensors(), key=lambda t: t.offset)  # one bucket: offsets are file offsets
    os.truncate(tmp_path / DATA_FILE, specs[-1].offset + specs[-1].nbytes - 1)
    with pytest.raises(FlatCheckpointError, match="truncated") as truncated:
        read_flat(tmp_path)
    assert specs[-1].name in truncated.value.tensors and specs[0].name not in truncated.value.tensors
    (tmp_path / "model.flat.json").write_text('{"format": "rollwise.flat/v1"}')
    with pytest.raises(FlatCheckpointError, match="model.flat.json.*data_bytes"):
        read_flat(tmp_path)


# ==================================================================== the engine server: /update_weights_from_disk

VERSION = 5


def _greedy(url: str) -> list[int]:
    out = httpx.post(f"{url}/generate", json={"prompt_ids": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0.0,
                                              "ignore_eos": True}, timeout=60).json()["choices"][0]
    return out["token_ids"]


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine, tokenizer = build_engine("tiny:0", max_num_seqs=2, max_model_len=64, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, "tiny:0")) as (url, _):
        yield SimpleNamespace(url=url)


def test_the_engine_server_loads_a_flat_directory_and_refuses_a_damaged_one(server, tmp_path: Path):
    new = tiny_llama(seed=7)
    write_flat(new.state_dict(), tmp_path, chunk_mb=SMALL_CHUNKS)
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"path": str(tmp_path), "version": VERSION},
                   timeout=60)
    assert r.status_code == 200, r.text
    expected = new.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5, do_sample=False)[0, 4:].tolist()
    assert _greedy(server.url) == expected  # the engine serves the flat checkpoint's weights
    _flip_byte_of(tmp_path, BAD)
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"path": str(tmp_path), "version": VERSION + 1},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "path" and BAD in error["message"] and "checksum" in error["message"], error
    assert httpx.get(f"{server.url}/model_info").json()["policy_version"] == VERSION  # nothing applied
    assert _greedy(server.url) == expected


# ==================================================================== the file transport's flat full pushes


def test_a_flat_file_push_applies_and_a_damaged_one_is_refused_naming_the_tensor(tmp_path: Path):
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.model.loading import tokenizer_fingerprint
    from rollwise.sync.files import FileReceiver, FileTransport
    from rollwise.engine.weight_receiver import WeightReceiver
    from rollwise.types.weights import WeightUpdateError

    fingerprint = tokenizer_fingerprint(tiny_tokenizer())
    engine = ReferenceEngine(load_model("tiny:0")[0], max_num_seqs=2, max_model_len=64, seed=0)
    receiver = FileReceiver(WeightReceiver(engine, fingerprint))
    transport = FileTransport(tmp_path, fingerprint, bucket_mb=SMALL_CHUNKS, flat=True)
    new = tiny_llama(seed=8).state_dict()
    pushed = transport.push(new, 1)
    assert is_flat_dir(pushed) and not list(pushed.glob("*.safetensors"))
    receiver.load(pushed)
    held = engine.model.state_dict()
    assert all(torch.equal(held[name], t) for name, t in new.items()) and receiver.receiver.policy_version == 1
    damaged = transport.push(tiny_llama(seed=9).state_dict(), 2)
    _flip_byte_of(damaged, BAD)
    with pytest.raises(WeightUpdateError, match=f"checksum mismatch.*spoiling {BAD}"):
        receiver.load(damaged)
    assert receiver.receiver.policy_version == 1  # nothing applied
    assert all(torch.equal(engine.model.state_dict()[name], t) for name, t in new.items())


def test_a_flat_checkpoint_is_a_weight_source_for_load_weights(tmp_path: Path):
    from rollwise.engine.core import EngineWorker
    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.model.flat_source import flat_weight_update

    worker = EngineWorker(ReferenceEngine(load_model("tiny:0")[0], max_num_seqs=2, max_model_len=64, seed=0))
    try:
        fingerprint = worker.model_info().tokenizer_fingerprint or ""  # an engine built without a tokenizer
        new = tiny_llama(seed=11)
        flatten_model(new, tmp_path, chunk_mb=SMALL_CHUNKS)
        worker.load_weights(flat_weight_update(tmp_path, 3, fingerprint))
        assert worker.policy_version == 3
        assert all(torch.equal(worker.engine.model.state_dict()[n], t) for n, t in new.state_dict().items())
        _flip_byte_of(tmp_path, BAD)
        with pytest.raises(FlatCheckpointError, match=BAD):
            worker.load_weights(flat_weight_update(tmp_path, 4, fingerprint))
        assert worker.policy_version == 3
    finally:
        worker.close()
