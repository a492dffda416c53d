"""Weights and adapters that must never get in (issue 43): every path refuses them the same way, before
anything is applied (the shared rules of rollwise.types.weight_checks and AdapterSpec).

The bad updates: non-finite values (NaN, +inf, -inf), an int32 or float16 tensor for a float32 engine, a
version older than the engine's (16 -> 15), a file holding only some tensors and two files holding the same
tensor (`/update_weights_from_disk`), a byte-moving push whose manifest carries no checksum or whose bytes
were damaged, and LoRA adapters with rank 0, alpha NaN or 1e38, int32 or NaN tensors, or a name with path
characters (`../../x`).

Through the public surfaces: the engine server's HTTP route on loopback, the pool's `PUT /jobs/J/weights`
(a full-parameter job and a LoRA job), and the Python API (in-process push, the file transport, an adapter
push, the engine's own apply_weights). Each refusal is a 4xx (or WeightUpdateError / ValueError) naming the
field; afterwards the version is still 16 and greedy generation gives the same tokens and logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from adapters import random_adapter
from safetensors.torch import save_file

from rollwise.types.train_config import LoraConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.server import build_engine, create_app
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.model.tiny import tiny_llama
from rollwise.control.pool_backend import PoolClient
from rollwise.pool.scheduler import Policy
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.app import create_app as create_pool_app
from rollwise.sync.buckets import InProcessTransport
from rollwise.sync.files import FileReceiver, FileTransport
from rollwise.engine.weight_receiver import WeightReceiver
from rollwise.types.weights import WeightUpdateError
from rollwise.sync.adapters import adapter_update
from rollwise.types.bucket_layout import build_manifest, flatten_bucket
from rollwise.train.lora import adapter_spec
from rollwise.types.weights import AdapterSpec

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MODEL = "tiny:0"
MAX_LEN = 64
PROMPT = [5, 6, 7, 8, 9]
TOKENS = 6
VERSION = 16  # every engine serves this version; no refused update may change it
BAD = "model.layers.0.self_attn.q_proj.weight"  # the tensor a bad full update spoils
LORA = LoraConfig(rank=4, alpha=8.0)
BAD_A = "model.layers.0.self_attn.q_proj.lora_A.weight"  # the first tensor of an adapter


def _state() -> dict[str, torch.Tensor]:
    """Good weights for the tiny:0 model (another seed: they change its outputs); every tensor its own memory."""
    return {name: t.detach().clone() for name, t in tiny_llama(seed=1).state_dict().items()}


def _spoil(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(kind)
    if value is not None:
        return tensor.clone().index_fill_(0, torch.tensor([1]), value)
    return (tensor * 100).to(getattr(torch, kind))  # int32 / float16


# kind -> (what the message says); each spoils BAD in an otherwise good full update
TENSOR_CASES = {"nan": "non-finite", "inf": "non-finite", "-inf": "non-finite",
                "int32": "dtype int32 != the engine's float32", "float16": "dtype float16 != the engine's float32"}


def _adapter() -> dict[str, torch.Tensor]:
    return random_adapter(load_model(MODEL)[0], LORA, seed=3)


def _bad_adapter(kind: str, name: str) -> tuple[AdapterSpec, dict[str, torch.Tensor], str, str]:
    """(spec, tensors, the field named, words of the message) of one bad adapter. The specs are made with
    model_copy, which does not validate: as a careless or hostile client would send them."""
    spec, state = adapter_spec(LORA, name, default=False), _adapter()
    if kind == "rank-0":  # shapes that agree with rank 0: only the rank itself can be refused
        state = {k: (v[:0] if k.endswith("lora_A.weight") else v[:, :0]) for k, v in state.items()}
        return spec.model_copy(update={"rank": 0}), state, "adapter.rank", "greater than or equal to 1"
    if kind == "alpha-nan":
        return spec.model_copy(update={"alpha": float("nan")}), state, "adapter.alpha", "alpha"
    if kind == "alpha-1e38":
        return spec.model_copy(update={"alpha": 1e38}), state, "adapter.alpha", "less than or equal to 65536"
    if kind == "path-name":
        return spec.model_copy(update={"name": "../../x"}), state, "adapter.name", "'../../x'"
    if kind == "int32":
        return spec, {k: (v * 100).to(torch.int32) for k, v in state.items()}, BAD_A, "dtype int32"
    assert kind == "nan"
    return spec, {k: torch.full_like(v, float("nan")) for k, v in state.items()}, BAD_A, "non-finite values in"


ADAPTER_CASES = ["rank-0", "alpha-nan", "alpha-1e38", "path-name", "int32", "nan"]


# ==================================================================== the engine server: /update_weights_from_disk


def _server_greedy(url: str) -> tuple[list[int], list[float]]:
    out = httpx.post(f"{url}/generate", json={"prompt_ids": PROMPT, "max_tokens": TOKENS, "temperature": 0.0,
                                              "ignore_eos": True}, timeout=60).json()["choices"][0]
    assert out["versions"] == [VERSION] * TOKENS
    return out["token_ids"], out["logprobs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[SimpleNamespace]:
    engine, tokenizer = build_engine(MODEL, max_num_seqs=4, max_model_len=MAX_LEN, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, MODEL)) as (url, _):
        good = tmp_path_factory.mktemp("good") / "model.safetensors"
        save_file(_state(), str(good))
        r = httpx.post(f"{url}/update_weights_from_disk", json={"path": str(good), "version": VERSION}, timeout=60)
        assert r.status_code == 200, r.text
        yield SimpleNamespace(url=url, before=_server_greedy(url))


def _disk_case(kind: str) -> tuple[dict[str, dict[str, torch.Tensor]], int, str, str]:
    """(files, version, the field named, words of the message) of one bad load from disk."""
    state = _state()
    if kind in TENSOR_CASES:
        return {"model.safetensors": {**state, BAD: _spoil(kind, state[BAD])}}, VERSION + 1, "path", TENSOR_CASES[kind]
    if kind == "some-tensors":
        some = {n: t for n, t in state.items() if n != "model.norm.weight"}
        return {"model.safetensors": some}, VERSION + 1, "path", "missing weight 'model.norm.weight'"
    if kind == "a-tensor-twice":
        return ({"model-1.safetensors": state, "model-2.safetensors": {BAD: state[BAD]}}, VERSION + 1, "path",
                f"{BAD!r} is in both model-1.safetensors and model-2.safetensors")
    assert kind == "older-version"
    return {"model.safetensors": state}, VERSION - 1, "version", f"already at version {VERSION}"


@pytest.mark.parametrize("kind", [*TENSOR_CASES, "some-tensors", "a-tensor-twice", "older-version"])
def test_the_engine_server_refuses_bad_weights_from_disk(server, tmp_path: Path, kind: str):
    files, version, field, words = _disk_case(kind)
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / name))
    r = httpx.post(f"{server.url}/update_weights_from_disk", json={"path": str(tmp_path), "version": version},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error
    if kind in TENSOR_CASES:
        assert BAD in error["message"] and "model.safetensors" in error["message"]  # the tensor and its file
    if kind != "a-tensor-twice":  # (refused from the files' headers, before any weight is read)
        assert f"still serving policy version {VERSION}" in error["message"]
    assert httpx.get(f"{server.url}/model_info").json()["policy_version"] == VERSION
    assert _server_greedy(server.url) == server.before


# ==================================================================== the pool: PUT /jobs/J/weights


def _upload(url: str, client: PoolClient, state: dict[str, torch.Tensor], version: int, fp: str, *,
            checksum: bool = True, adapter: AdapterSpec | None = None,
            damage: Callable[[bytearray], None] | None = None) -> httpx.Response:
    """The pool's upload as PoolClient.push_weights frames it, with what a careless client might change."""
    manifest = build_manifest(state, version, fp, bucket_mb=None, checksum=checksum)
    if adapter is not None:
        manifest = manifest.model_copy(update={"adapter": adapter})
    head = manifest.model_dump_json().encode()
    data = bytearray(b"".join(flatten_bucket(b, state).numpy().tobytes() for b in manifest.buckets))
    if damage is not None:
        damage(data)
    return httpx.put(f"{url}/jobs/{client.job}/weights", content=len(head).to_bytes(8, "big") + head + bytes(data),
                     headers={"Authorization": f"Bearer {client.token}"}, timeout=60)


@pytest.fixture(scope="module")
def pool() -> Iterator[SimpleNamespace]:
    fp = tokenizer_fingerprint(load_model(MODEL)[1])
    engines = EnginePool(1, max_num_seqs=8, max_model_len=MAX_LEN, policy=Policy(min_slice_s=0.05))
    with serve_in_thread(create_pool_app(engines)) as (url, _):
        full, lora = PoolClient(url), PoolClient(url)
        full.attach("full", MODEL, 1.0, fp)
        full.push_weights(_state(), VERSION, fp)
        lora.attach("lora", MODEL, 1.0, fp, lora=True)
        lora.push_weights(_adapter(), VERSION, fp, adapter=adapter_spec(LORA, "lora", default=False))
        jobs = {"full": full, "lora": lora}
        ns = SimpleNamespace(url=url, fp=fp, jobs=jobs)
        ns.before = _pool_greedy(ns)
        try:
            yield ns
        finally:
            for client in jobs.values():
                client.detach()
                client.close()


def _pool_greedy(pool: SimpleNamespace) -> dict[str, tuple[list[int], list[float]]]:
    out = {}
    for name, client in pool.jobs.items():
        [c] = client.generate(PROMPT, max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        assert c.versions == [VERSION] * TOKENS
        out[name] = (c.token_ids, c.logprobs)
    return out


def _flip_a_byte(data: bytearray) -> None:
    data[100] ^= 0xFF


def _pool_case(kind: str, pool: SimpleNamespace) -> tuple[httpx.Response, str, str]:
    """Send one bad upload; (the answer, the field it must name, words of its message)."""
    full, lora, fp = pool.jobs["full"], pool.jobs["lora"], pool.fp
    state = _state()
    if kind in TENSOR_CASES:
        return (_upload(pool.url, full, {**state, BAD: _spoil(kind, state[BAD])}, VERSION + 1, fp), BAD,
                TENSOR_CASES[kind])
    if kind == "no-checksum":
        return _upload(pool.url, full, state, VERSION + 1, fp, checksum=False), "buckets[0].checksum", "no checksum"
    if kind == "flipped-byte":
        return (_upload(pool.url, full, state, VERSION + 1, fp, damage=_flip_a_byte), "buckets[0]",
                "checksum mismatch")
    if kind == "older-version":
        return _upload(pool.url, full, state, VERSION - 1, fp), "version", f"already at version {VERSION}"
    if kind == "adapter-older-version":
        spec = adapter_spec(LORA, "lora", default=False)
        return (_upload(pool.url, lora, _adapter(), VERSION - 1, fp, adapter=spec), "version",
                f"already at version {VERSION}")
    spec, tensors, field, words = _bad_adapter(kind.removeprefix("adapter-"), "lora")
    return _upload(pool.url, lora, tensors, VERSION + 1, fp, adapter=spec), field, words


@pytest.mark.parametrize("kind", [*TENSOR_CASES, "no-checksum", "flipped-byte", "older-version",
                                  *(f"adapter-{k}" for k in ADAPTER_CASES), "adapter-older-version"])
def test_the_pool_refuses_bad_uploads_and_stores_nothing(pool, kind: str):
    r, field, words = _pool_case(kind, pool)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error
    jobs = httpx.get(f"{pool.url}/state", timeout=30).json()["jobs"]
    assert {name: jobs[name]["policy_version"] for name in pool.jobs} == {"full": VERSION, "lora": VERSION}
    assert all(jobs[name]["fault"] is None for name in pool.jobs)
    assert _pool_greedy(pool) == pool.before


# ==================================================================== the Python API: in-process pushes


def _local_greedy(engine: ReferenceEngine) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    done = engine.generate([GenerationRequest("base", PROMPT, params),
                            GenerationRequest("side", PROMPT, params, adapter="side")])
    assert all(c.versions == [VERSION] * TOKENS for c in done)
    return [(c.token_ids, c.logprobs) for c in done]


@pytest.fixture(scope="module")
def local() -> SimpleNamespace:
    model, tokenizer = load_model(MODEL)
    fp = tokenizer_fingerprint(tokenizer)
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=MAX_LEN, seed=0, tokenizer_fingerprint=fp)
    receiver = WeightReceiver(engine, fp)
    InProcessTransport([receiver], fp).push(_state(), VERSION)
    WeightReceiver(engine, fp, adapters=engine).receive(
        adapter_update(_adapter(), adapter_spec(LORA, "side", default=False), VERSION, fp))
    return SimpleNamespace(engine=engine, fp=fp, receiver=receiver, before=_local_greedy(engine))


def _no_checksums(tmp: Path, fp: str) -> None:
    """The file transport's version 17, with its manifest's checksums taken out."""
    directory = FileTransport(tmp, fp).push(_state(), VERSION + 1)
    manifest = json.loads((directory / "manifest.json").read_text())
    for bucket in manifest["buckets"]:
        bucket["checksum"] = None
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _local_case(kind: str, local: SimpleNamespace, tmp: Path) -> tuple[Callable[[], None], type[Exception], str, str]:
    """(the bad push, the exception, the field it names (WeightUpdateError.field; "" for the engine's own
    ValueError), words of its message)."""
    engine, fp, state = local.engine, local.fp, _state()
    push = InProcessTransport([local.receiver], fp).push
    if kind in TENSOR_CASES:
        bad = {**state, BAD: _spoil(kind, state[BAD])}
        return lambda: push(bad, VERSION + 1), WeightUpdateError, BAD, TENSOR_CASES[kind]
    if kind.startswith("engine-") and kind != "engine-older-version":  # the engine held directly: it checks the same
        tensor_kind = kind.removeprefix("engine-")
        bad = {**state, BAD: _spoil(tensor_kind, state[BAD])}
        return lambda: engine.apply_weights(bad, VERSION + 1), ValueError, "", TENSOR_CASES[tensor_kind]
    if kind == "older-version":
        return lambda: push(state, VERSION - 1), WeightUpdateError, "version", f"already at version {VERSION}"
    if kind == "engine-older-version":
        return lambda: engine.apply_weights(state, VERSION - 1), ValueError, "", f"already at version {VERSION}"
    if kind == "files-no-checksum":
        _no_checksums(tmp, fp)
        return (lambda: FileReceiver(local.receiver).load_latest(tmp), WeightUpdateError, "buckets[0].checksum",
                "no checksum")
    spec, tensors, field, words = _bad_adapter(kind.removeprefix("adapter-"), "side")
    receiver = WeightReceiver(engine, fp, adapters=engine)
    return lambda: receiver.receive(adapter_update(tensors, spec, VERSION + 1, fp)), WeightUpdateError, field, words


@pytest.mark.parametrize("kind", [*TENSOR_CASES, "engine-nan", "engine-int32", "older-version", "engine-older-version",
                                  "files-no-checksum", *(f"adapter-{k}" for k in ADAPTER_CASES)])
def test_in_process_pushes_are_refused_and_change_nothing(local, tmp_path: Path, kind: str):
    push, error, field, words = _local_case(kind, local, tmp_path)
    with pytest.raises(error) as refused:
        push()
    assert words in str(refused.value)
    if field:
        assert refused.value.field == field, refused.value
    assert local.engine.policy_version == VERSION and local.engine.loaded_adapters() == {"side": VERSION}
    assert _local_greedy(local.engine) == local.before
