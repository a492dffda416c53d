"""Weight transport: exact bucket round trips, manifest checks, and the three transports (in-process,
gloo broadcast between real processes, safetensors files) applying updates whole or not at all."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.engine.core import EngineWorker
from rollwise.sync.buckets import InProcessTransport
from rollwise.types.bucket_layout import (
    MIB,
    bucket_checksum,
    build_manifest,
    flatten_bucket,
    parse_manifest,
    plan_buckets,
    unflatten_bucket,
)
from rollwise.engine.weight_receiver import StagedUpdate, WeightReceiver
from rollwise.types.weights import WeightUpdateError
from rollwise.sync.distributed import (
    DistributedReceiver,
    DistributedSender,
    init_weight_group,
    loopback_init_method,
)
from rollwise.sync.files import MANIFEST, FileReceiver, FileTransport, bucket_file, latest_version, version_dir

PROMPTS = [[5, 17, 30, 42, 11], [9, 8, 7]]
SMALL_BUCKET_MB = 0.05  # ~52 KB: the tiny model (~330 KB) spreads over several buckets
WRONG_SHAPE = "model.layers.0.mlp.up_proj.weight"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def fingerprint() -> str:
    return tokenizer_fingerprint(tiny_tokenizer())


@pytest.fixture(scope="module")
def new_state() -> dict[str, torch.Tensor]:
    """The 'trained' weights pushed in every test: another seed of the same architecture."""
    return tiny_llama(seed=1).state_dict()


def _engine(state: dict[str, torch.Tensor] | None = None) -> ReferenceEngine:
    model, _ = load_model("tiny:0")
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=64, seed=0)
    if state is not None:
        engine.apply_weights(state, 1)
    return engine


def _greedy(engine: ReferenceEngine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their exact logprobs: random tiny models often repeat one token whatever their
    weights, so the logprobs are what tell two weight sets apart."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    done = engine.generate([GenerationRequest(f"g{i}", p, params) for i, p in enumerate(PROMPTS)])
    return [(c.token_ids, c.logprobs) for c in done]


def _wrong_shape(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = dict(state)
    bad[WRONG_SHAPE] = torch.zeros(bad[WRONG_SHAPE].shape[0] + 1, bad[WRONG_SHAPE].shape[1])
    return bad


def _assert_same_greedy(got, expected) -> None:
    """Across processes: the same tokens, and logprobs equal up to float summation order (a process
    may run its kernels on another number of threads, e.g. after vLLM pinned this one's)."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, got_lp), (_, want_lp) in zip(got, expected):
        assert got_lp == pytest.approx(want_lp, abs=1e-5)


@pytest.fixture(scope="module")
def expected_greedy(new_state) -> list[tuple[list[int], list[float]]]:
    """What an engine loaded locally with the new weights generates (and the old weights do not)."""
    expected = _greedy(_engine(new_state))
    assert expected != _greedy(_engine())
    return expected


# ---------------------------------------------------------------------------- buckets and manifest


def _mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=g)
    return {
        "a": a,
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(2, 3, generator=g).half(),
        "ints": torch.arange(11, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 10, generator=g).t(),  # not contiguous
        "big": torch.randn(4000, generator=g),  # 16,000 bytes: more than a whole bucket
        "small_after_big": torch.randn(5, generator=g),
        "tied": a,  # the same memory as "a": sent once, as an alias
    }


def test_bucket_round_trip_is_exact_and_honours_the_size_limit():
    state = _mixed_state()
    bucket_mb = 10_000 / MIB
    buckets, aliases = plan_buckets(state, bucket_mb)
    assert aliases == {"tied": "a"}
    assert [t.name for b in buckets for t in b.tensors] == [n for n in state if n != "tied"]  # order kept
    assert len(buckets) > 1
    for bucket in buckets:
        assert bucket.nbytes <= 10_000 or len(bucket.tensors) == 1
    assert [b.tensors[0].name for b in buckets if b.nbytes > 10_000] == ["big"]  # alone in its bucket

    dirty = torch.full((20_000,), 0xAB, dtype=torch.uint8)  # reused buffers: padding must still be zeroed
    for bucket in buckets:
        buf = flatten_bucket(bucket, state)
        assert torch.equal(flatten_bucket(bucket, state, out=dirty), buf)
        restored = unflatten_bucket(bucket, buf.clone())
        assert list(restored) == [t.name for t in bucket.tensors]
        for name, tensor in restored.items():
            assert tensor.dtype == state[name].dtype and tensor.shape == state[name].shape
            assert torch.equal(tensor, state[name]), name
        # The checksum is layout-independent: the flat buffer's views and the originals agree.
        assert bucket_checksum(bucket, restored) == bucket_checksum(bucket, state)

    one, _ = plan_buckets(state, None)
    assert len(one) == 1


def test_manifest_round_trips_through_json_and_rejects_an_inconsistent_layout(fingerprint, new_state):
    manifest = build_manifest(new_state, 3, fingerprint, SMALL_BUCKET_MB)
    assert len(manifest.buckets) > 2 and all(b.checksum is not None for b in manifest.buckets)
    assert manifest.aliases == {"lm_head.weight": "model.embed_tokens.weight"}  # tiny:1 ties its embeddings
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for n, t in new_state.items()
                                       if n != "lm_head.weight")
    assert parse_manifest(manifest.model_dump_json(), "test") == manifest

    overlapping = manifest.model_dump()
    first = overlapping["buckets"][0]["tensors"]
    first[1]["offset"] = first[0]["offset"]
    with pytest.raises(WeightUpdateError, match="not a valid rollwise.weights/v2 manifest"):
        parse_manifest(json.dumps(overlapping), "test")


def test_a_repeated_push_reuses_its_layout_but_checksums_the_new_bytes(fingerprint):
    """build_manifest caches the bucket layout of a state it saw (a trainer pushes the same tensors every
    step): the version and checksums still follow each push, and any change of layout plans again."""
    state = _mixed_state()
    first = build_manifest(state, 1, fingerprint, 10_000 / MIB)
    state["a"].add_(1.0)  # trained in place: same tensors, new bytes
    second = build_manifest(state, 2, fingerprint, 10_000 / MIB)
    assert second.version == 2 and first.version == 1
    assert [b.tensors for b in second.buckets] == [b.tensors for b in first.buckets]
    changed = [b.index for b, old in zip(second.buckets, first.buckets) if b.checksum != old.checksum]
    assert changed == [0]  # the bucket holding "a", and only it
    assert build_manifest(state, 3, fingerprint, 10_000 / MIB, checksum=False).buckets[0].checksum is None

    untied = {**state, "tied": state["a"].clone()}  # same names and shapes, no longer sharing memory
    assert build_manifest(untied, 4, fingerprint, 10_000 / MIB).aliases == {}
    grown = {**state, "small_after_big": torch.randn(6)}
    assert build_manifest(grown, 5, fingerprint, 10_000 / MIB).spec_of("small_after_big").shape == (6,)


def test_staging_flags_damaged_bytes_and_missing_buckets(fingerprint, new_state):
    manifest = build_manifest(new_state, 1, fingerprint, SMALL_BUCKET_MB)
    staged = StagedUpdate(manifest)
    buf = flatten_bucket(manifest.buckets[0], new_state)
    buf[manifest.buckets[0].tensors[0].nbytes // 2] ^= 1  # one flipped bit inside the first tensor
    staged.add_flat(0, buf)
    assert any("checksum mismatch" in p for p in staged.problems)
    assert staged.missing_buckets() == list(range(1, len(manifest.buckets)))

    engine = _engine()
    before = _greedy(engine)
    with pytest.raises(WeightUpdateError, match="bucket 1 never arrived") as err:
        WeightReceiver(engine, fingerprint).commit(staged)
    assert "keeps serving version 0" in str(err.value) and "checksum mismatch" in str(err.value)
    assert engine.policy_version == 0 and _greedy(engine) == before


# ---------------------------------------------------------------------------- in-process


def test_in_process_push_applies_and_rejects_mismatches_whole(fingerprint, new_state, expected_greedy):
    engine = _engine()
    transport = InProcessTransport([WeightReceiver(engine, fingerprint)], fingerprint)
    transport.push(new_state, 1)
    assert engine.policy_version == 1 and _greedy(engine) == expected_greedy

    bad_dtype = {**new_state, "model.norm.weight": new_state["model.norm.weight"].to(torch.bfloat16)}
    missing = {n: t for n, t in new_state.items() if n != "model.layers.1.self_attn.o_proj.weight"}
    extra = {**new_state, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}
    cases = [
        (bad_dtype, transport, "model.norm.weight: dtype bfloat16 != the engine's float32"),
        (missing, transport, "missing weight 'model.layers.1.self_attn.o_proj.weight'"),
        (extra, transport, "unexpected weight 'model.layers.9.mlp.up_proj.weight'"),
        (_wrong_shape(new_state), transport, f"{WRONG_SHAPE}: shape (129, 64) != the engine's (128, 64)"),
        (new_state, InProcessTransport(transport.receivers, "f" * 64), "tokenizer fingerprint"),
    ]
    for state, sender, message in cases:
        with pytest.raises(WeightUpdateError, match="keeps serving version 1") as err:
            sender.push(state, 2)
        assert message in str(err.value)
        assert engine.policy_version == 1 and _greedy(engine) == expected_greedy

    with pytest.raises(WeightUpdateError, match="already at version 1"):
        transport.push(new_state, 0)  # versions only move forward
    transport.push(new_state, 1)  # a retry of the current version is fine


def test_a_bfloat16_engine_takes_the_trainer_s_float32_push(fingerprint, new_state):
    """engine.dtype=bfloat16: the checked path accepts float32 tensors for it (cast as copied in) and
    serves what a bfloat16 engine started from those weights serves; a bfloat16 push into a float32
    engine stays refused (above)."""
    model, _ = load_model("tiny:0")
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=64, seed=0, dtype=torch.bfloat16)
    InProcessTransport([WeightReceiver(engine, fingerprint)], fingerprint).push(new_state, 1)
    fresh = ReferenceEngine(tiny_llama(seed=1), max_num_seqs=4, max_model_len=64, seed=0, dtype=torch.bfloat16)
    assert engine.policy_version == 1 and _greedy(engine) == _greedy(fresh)


def test_in_process_push_through_an_engine_worker(fingerprint, new_state, expected_greedy):
    engine = _engine()
    worker = EngineWorker(engine)
    try:
        InProcessTransport([WeightReceiver(worker, fingerprint)], fingerprint).push(new_state, 4)
    finally:
        worker.close()
    assert engine.policy_version == 4 and _greedy(engine) == expected_greedy


# ---------------------------------------------------------------------------- safetensors files


def test_file_transport_applies_complete_versions_and_rejects_damaged_ones(tmp_path, fingerprint, new_state,
                                                                          expected_greedy):
    engine = _engine()
    receiver = FileReceiver(WeightReceiver(engine, fingerprint))
    transport = FileTransport(tmp_path, fingerprint, bucket_mb=SMALL_BUCKET_MB)

    # A directory without a manifest is a push still in progress: invisible to readers.
    version_dir(tmp_path, 7).mkdir()
    (version_dir(tmp_path, 7) / "bucket_0.safetensors").write_bytes(b"half")
    assert latest_version(tmp_path) is None
    with pytest.raises(WeightUpdateError, match="no manifest.json"):
        receiver.load(version_dir(tmp_path, 7))

    directory = transport.push(new_state, 1)
    assert (directory / MANIFEST).is_file()
    assert not list(directory.glob("*.tmp"))
    assert latest_version(tmp_path) == 1
    assert receiver.load_latest(tmp_path).version == 1
    assert receiver.load_latest(tmp_path) is None  # nothing newer
    assert engine.policy_version == 1 and _greedy(engine) == expected_greedy
    with pytest.raises(FileExistsError, match="immutable"):
        transport.push(new_state, 1)

    def truncate(d: Path) -> None:
        file = bucket_file(d, 1)
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])

    def flip_a_byte(d: Path) -> None:
        file = bucket_file(d, 2)
        data = bytearray(file.read_bytes())
        data[-5] ^= 0xFF  # inside the tensor data, past the safetensors header
        file.write_bytes(bytes(data))

    cases = [
        (transport, new_state, truncate, "cannot read bucket_1.safetensors"),
        (transport, new_state, flip_a_byte, "bucket_2.safetensors: checksum mismatch"),
        (FileTransport(tmp_path, "0" * 64, bucket_mb=SMALL_BUCKET_MB), new_state, None, "tokenizer fingerprint"),
        (transport, _wrong_shape(new_state), None, f"{WRONG_SHAPE}: shape (129, 64) != the engine's (128, 64)"),
    ]
    for version, (sender, state, damage, message) in enumerate(cases, start=2):
        directory = sender.push(state, version)
        if damage is not None:
            damage(directory)
        with pytest.raises(WeightUpdateError, match="keeps serving version 1") as err:
            receiver.load(directory)
        assert message in str(err.value)
        assert engine.policy_version == 1 and _greedy(engine) == expected_greedy


# ---------------------------------------------------------------------------- torch.distributed (gloo)


def _engine_rank(index: int, init_method: str, world_size: int, device: str) -> None:
    """An engine process: a ReferenceEngine on tiny:0 serving broadcasts from rank 0 until closed,
    then reporting its version and greedy output to rank 0."""
    torch.set_num_threads(1)
    rank = index + 1
    buffers = f"cuda:{rank}" if device == "cuda" else "cpu"
    group = init_weight_group(rank, world_size, init_method, device=buffers, timeout_s=60)
    try:
        model, tokenizer = load_model("tiny:0")
        engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=64, seed=0)
        DistributedReceiver(group, WeightReceiver(engine, tokenizer_fingerprint(tokenizer))).serve()
        group.gather_object({"version": engine.policy_version, "greedy": _greedy(engine)}, dst=0)
    finally:
        group.close()


def _broadcast_round(fingerprint, new_state, engines: int, device: str) -> tuple[list, list]:
    """Rank 0 (this process) pushes a good version, then a bad one, then closes; returns the push
    results and what each engine process reported at the end."""
    init_method = loopback_init_method()
    world = engines + 1
    ctx = mp.spawn(_engine_rank, args=(init_method, world, device), nprocs=engines, join=False)
    ok = False
    group = None
    try:
        # A private group: the default process group may already exist in this process (an
        # in-process vLLM engine creates one), and the transport must not need it.
        group = init_weight_group(0, world, init_method, device="cuda:0" if device == "cuda" else "cpu", timeout_s=60)
        sender = DistributedSender(group, fingerprint, bucket_mb=SMALL_BUCKET_MB)
        results = sender.push(new_state, 1)
        with pytest.raises(WeightUpdateError, match=f"rejected by {engines} of {engines} engines") as err:
            sender.push(_wrong_shape(new_state), 2)
        assert f"{WRONG_SHAPE}: shape (129, 64) != the engine's (128, 64)" in str(err.value)
        assert "keeps serving version 1" in str(err.value)
        sender.close()
        reports = group.gather_object(None, dst=0)
        ok = True
    finally:
        if group is not None:
            group.close()
        if not ok:
            for process in ctx.processes:
                process.terminate()
    while not ctx.join(timeout=60):
        pass
    return results, reports[1:]


def test_gloo_broadcast_to_two_engine_processes(fingerprint, new_state, expected_greedy):
    results, reports = _broadcast_round(fingerprint, new_state, engines=2, device="cpu")
    assert [(r.rank, r.version, r.ok) for r in results] == [(1, 1, True), (2, 1, True)]
    # Each engine generates exactly what a local engine with the new weights generates, at version 1
    # (the bad version 2 that followed was refused whole).
    assert [r["version"] for r in reports] == [1, 1]
    for report in reports:
        _assert_same_greedy(report["greedy"], expected_greedy)


def _adapter(seed: int) -> tuple[dict[str, torch.Tensor], object]:
    """A rank-4 adapter on tiny:0 large enough to move its logprobs."""
    from rollwise.bench.adapters import random_adapter

    state, spec = random_adapter(tiny_llama(seed=0), 4, seed=seed)
    return {name: t * 30 for name, t in state.items()}, spec


def _adapter_engine_rank(index: int, init_method: str) -> None:
    """An engine process taking LoRA adapter broadcasts, then reporting what it serves."""
    torch.set_num_threads(1)
    group = init_weight_group(1, 2, init_method, timeout_s=60)
    try:
        model, tokenizer = load_model("tiny:0")
        engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=64, seed=0)
        receiver = DistributedReceiver(group, WeightReceiver(engine, tokenizer_fingerprint(tokenizer), adapters=engine))
        kept = []
        while (result := receiver.receive()) is not None:
            kept.append([b.data_ptr() for b in receiver._kept])
        group.gather_object({"adapters": engine.loaded_adapters(), "greedy": _greedy(engine),
                             "reused": kept[0] == kept[1] and bool(kept[0])}, dst=0)
    finally:
        group.close()


def test_gloo_broadcast_of_an_adapter_loads_it_beside_the_base_and_reuses_the_buffers(fingerprint):
    """train.lora's update over the collective transport: the engine process serves the latest adapter exactly
    as a local engine that loaded it, and its second receive lands in the first one's buffers."""
    (first, spec), (second, _) = _adapter(1), _adapter(2)
    local = _engine()
    base_greedy = _greedy(local)
    local.load_adapter(spec, second, 2)
    expected = _greedy(local)
    assert expected != base_greedy
    init_method = loopback_init_method()
    ctx = mp.spawn(_adapter_engine_rank, args=(init_method,), nprocs=1, join=False)
    group = None
    try:
        group = init_weight_group(0, 2, init_method, timeout_s=60)
        sender = DistributedSender(group, fingerprint, bucket_mb=SMALL_BUCKET_MB)
        for version, state in ((1, first), (2, second)):
            [result] = sender.push(state, version, adapter=spec)
            assert result.ok and result.version == version
        sender.close()
        report = group.gather_object(None, dst=0)[1]
    finally:
        if group is not None:
            group.close()
    while not ctx.join(timeout=60):
        pass
    assert report["adapters"] == {"policy": 2} and report["reused"]
    _assert_same_greedy(report["greedy"], expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL broadcast needs two GPUs (trainer + engine)")
def test_nccl_broadcast_to_an_engine_process(fingerprint, new_state, expected_greedy):
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    results, reports = _broadcast_round(fingerprint, new_state, engines=1, device="cuda")
    assert [r.ok for r in results] == [True]
    assert [r["version"] for r in reports] == [1]
    _assert_same_greedy(reports[0]["greedy"], expected_greedy)


def _waiting_rank(init_method: str, world_size: int, timeout_s: float, report) -> None:
    """Engine rank 1: receives the next broadcast (into an engine whose check refuses it, so it only joins the
    broadcasts) and reports how long it waited before the transfer failed."""
    torch.set_num_threads(1)
    group = init_weight_group(1, world_size, init_method, timeout_s=timeout_s)
    engine = ReferenceEngine(tiny_llama(), max_num_seqs=1, max_model_len=16, seed=0)
    receiver = DistributedReceiver(group, WeightReceiver(engine, None))
    report.put("joined")
    start = time.monotonic()
    try:
        receiver.receive()
        report.put(("finished", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - the point: how it ends, and when
        report.put(("failed", time.monotonic() - start, str(exc)[:200]))


def _dying_rank(init_method: str, world_size: int, timeout_s: float, report) -> None:
    """Engine rank 2: joins, then dies (a killed engine) before the push."""
    init_weight_group(2, world_size, init_method, timeout_s=timeout_s)
    report.put("joined")
    report.close()
    report.join_thread()  # the message is out before the process dies
    os._exit(0)


def test_a_push_that_breaks_on_a_dead_rank_does_not_leave_the_others_waiting_out_the_timeout():
    """A push whose broadcast fails on a dead engine (the trainer's send raises) is abandoned; the engines still
    waiting in the broadcast must fail at once, not at the group's timeout (CI once waited 300 s here: the
    failed send's pending broadcasts kept the group's connections open through the exception's traceback)."""
    timeout_s = 90.0
    init_method = loopback_init_method()
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    procs = [ctx.Process(target=target, args=(init_method, 3, timeout_s, report)) for target in (_waiting_rank, _dying_rank)]
    for p in procs:
        p.start()
    try:
        group = init_weight_group(0, 3, init_method, timeout_s=timeout_s)
        assert [report.get(timeout=60), report.get(timeout=60)] == ["joined", "joined"]
        procs[1].join(30)  # rank 2 is gone
        # 64 MiB in 1 MiB buckets: far more than the sockets buffer, so the send to the dead rank fails.
        state = {f"t{i}": torch.randn(1 << 18) for i in range(64)}
        sender = DistributedSender(group, "", bucket_mb=1)
        with pytest.raises(RuntimeError) as broken:
            sender.send(state, 1)
        group.abandon()  # what the fleet does; `broken` (its traceback) stays alive, as in the fleet's retry loop
        outcome = report.get(timeout=timeout_s + 30)
        assert outcome[0] == "failed", outcome
        assert outcome[1] < 20, f"the live engine waited {outcome[1]:.0f} s for an abandoned push: {outcome}"
        assert broken.value is not None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
