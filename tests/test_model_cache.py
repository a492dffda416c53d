"""The pool's tiered model cache and start-up-aware placement (issue 42 items 2 and 4).

- the memory and disk tiers never hold more than their budgets under a storm of puts and gets from several
  threads, and every get returns the weights stored under its key;
- get() serves from the fastest tier holding the weights (memory, then disk, then remote), bit for bit equal to
  the source (fp32, bf16, tied weights; a LoRA adapter alike), and the remote loader runs once;
- a real pool on loopback switching between two jobs reloads them from the cache, and /state says which tier
  (a LoRA job's adapter alike: its greedy samples from the cached adapter equal those from the pushed one);
- the pure scheduler puts a starving job on the free slot where it starts soonest (sleeping < memory < disk <
  remote), with the same estimate the simulator uses.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import pytest
import torch

from adapters import random_adapter
from completions import collect

from rollwise.control.pool_backend import PoolClient, PoolWorker
from rollwise.local_server import serve_in_thread
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.pool import cli as pool_cli
from rollwise.pool.app import create_app
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.model_cache import ModelCache, weights_bytes
from rollwise.pool.scheduler import JobView, Policy, SlotView, plan
from rollwise.pool.startup_cost import StartupCost, calibrate, estimate_migration, estimate_start
from rollwise.sim.mux import Transitions
from rollwise.sync.adapters import adapter_update
from rollwise.train.lora import adapter_spec
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.types.train_config import LoraConfig
from rollwise.types.weight_update import WeightUpdate

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _weights(seed: int, kb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(kb * 256, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_budgets_hold_under_a_storm_of_switches(tmp_path: Path):
    one = weights_bytes(_weights(0, 4))
    cache = ModelCache(CacheSettings(memory_bytes=3 * one, disk_dir=tmp_path, disk_bytes=5 * one))
    sources = {f"job{i}": _weights(i, 4 * (1 + i % 3)) for i in range(10)}  # 1x..3x `one`: some evict several
    errors: list[BaseException] = []
    tiers_seen: set[str] = set()

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                key = rng.choice(list(sources))
                if rng.random() < 0.2:
                    cache.put(key, sources[key], priority=rng.choice([0.0, 1.0]))
                else:
                    got = cache.get(key, lambda k=key: sources[k], priority=rng.choice([0.0, 1.0, 2.0]))
                    tiers_seen.add(got.tier)
                    assert _equal(got.weights, sources[key]), key
                cache.check()
                assert cache.used("memory") <= 3 * one and cache.used("disk") <= 5 * one
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=storm, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert tiers_seen == {"memory", "disk", "remote"}
    report = cache.report()
    assert report["memory"]["evictions"] > 0 and report["disk"]["evictions"] > 0  # the budgets were pressed
    # the disk tier holds exactly the flat checkpoints of its entries: evicted ones are gone from disk too
    assert len(list(tmp_path.iterdir())) == len(report["disk"]["entries"])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_get_serves_the_fastest_tier_bit_for_bit(tmp_path: Path, kind: str):
    if kind == "full":
        emb = torch.randn(32, 8)
        source = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.randn(8).to(torch.bfloat16),
                  "experts.w": torch.randn(4, 8, 16)}  # tied weights (one storage), bf16, an MoE-shaped tensor
    else:
        source = {"layers.0.q_proj.lora_A": torch.randn(4, 8), "layers.0.q_proj.lora_B": torch.zeros(8, 4)}
    calls = []

    def remote() -> dict[str, torch.Tensor]:
        calls.append(1)
        return source

    size = weights_bytes(source)
    cache = ModelCache(CacheSettings(memory_bytes=size, disk_dir=tmp_path, disk_bytes=10 * size))
    assert cache.tier_of("a") == "remote"
    first = cache.get("a", remote)
    assert first.tier == "remote" and _equal(first.weights, source)
    assert cache.tier_of("a") == "memory"
    second = cache.get("a", remote)
    assert second.tier == "memory" and _equal(second.weights, source)
    shifted: dict[int, torch.Tensor] = {}  # another model of the same size (ties kept)
    other = {k: shifted.setdefault(v.data_ptr(), v + 1) for k, v in source.items()}
    cache.get("b", lambda: other)  # fills memory: "a" is left on disk only
    assert cache.tier_of("a") == "disk"
    third = cache.get("a", remote)
    assert third.tier == "disk" and _equal(third.weights, source)
    if kind == "full":  # tied weights come back tied
        assert third.weights["embed.weight"].data_ptr() == third.weights["lm_head.weight"].data_ptr()
    assert cache.get("a", remote).tier == "memory"  # promoted by the disk hit
    assert calls == [1]  # the remote tier was read once


def test_priority_keeps_an_entry_a_lower_priority_one_cannot_evict(tmp_path: Path):
    w = _weights(1, 4)
    cache = ModelCache(CacheSettings(memory_bytes=weights_bytes(w)))
    cache.put("important", w, priority=2.0)
    cache.put("other", _weights(2, 4), priority=1.0)  # would need to evict a higher priority: not cached
    assert cache.tier_of("important") == "memory" and cache.tier_of("other") == "remote"
    cache.put("urgent", _weights(3, 4), priority=3.0)
    assert cache.tier_of("urgent") == "memory" and cache.tier_of("important") == "remote"


# ==================================================================== the pool's switch path, over HTTP


def _attach(url: str, job: str, spec: str, version: int) -> PoolWorker:
    model, tok = load_model(spec)
    fp = tokenizer_fingerprint(tok)
    client = PoolClient(url)
    client.attach(job, spec, 1.0, fp)
    worker = PoolWorker(client, fp, poll_s=0.2)
    worker.load_weights(WeightUpdate.of_state(model.state_dict(), version, fp))
    return worker


def _generate(worker: PoolWorker, tag: str) -> None:
    reqs = [GenerationRequest(f"{tag}-{i}", [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, seed=i))
            for i in range(2)]
    worker.submit(reqs)
    collect(worker, len(reqs), timeout=30)


def test_pool_switches_load_from_the_cache_and_say_which_tier(tmp_path: Path):
    one_model = weights_bytes(load_model("tiny:0")[0].state_dict())
    # memory holds one job's weights, disk both: a job switched back in comes from disk, then memory
    cache = CacheSettings(memory_bytes=int(one_model * 1.5), disk_dir=tmp_path, disk_bytes=4 * one_model)
    pool = EnginePool(1, max_num_seqs=4, max_model_len=64, policy=Policy(min_slice_s=0.0), max_sleeping=0,
                      cache=cache)  # nothing sleeps: every switch back is a load
    with serve_in_thread(create_app(pool)) as (url, _):
        a = _attach(url, "a", "tiny:0", 0)
        b = _attach(url, "b", "tiny:1", 100)
        try:
            for rnd, worker in enumerate([a, b, a, b, a]):
                _generate(worker, f"r{rnd}")
            state = httpx.get(f"{url}/state", timeout=30).json()
        finally:
            for w in (a, b):
                w.close()
                w.client.detach()
    loads = [(t["job"], t["reason"]) for t in state["transitions"] if t["kind"] == "load"]
    assert [job for job, _ in loads] == ["a", "b", "a", "b", "a"], loads
    tiers = [reason.split(" for ")[0] for _, reason in loads]
    assert tiers == ["load (remote tier)", "load (remote tier)", "load (disk tier)", "load (disk tier)",
                     "load (disk tier)"], tiers
    assert state["model_cache"]["memory"]["used_bytes"] <= cache.memory_bytes
    assert state["model_cache"]["disk"]["hits"] == 3 and state["model_cache"]["remote"]["hits"] == 2
    assert state["isolation"]["violations"] == []


def test_a_lora_jobs_adapter_is_cached_alike():
    """A LoRA job's adapter and a full job alternate on one slot: the second load of each comes from the memory
    tier, and the LoRA job's greedy samples from the cached adapter equal those from the pushed one."""
    cfg = LoraConfig(rank=4, alpha=8.0)
    pool = EnginePool(1, max_num_seqs=4, max_model_len=64, policy=Policy(min_slice_s=0.0), max_sleeping=0,
                      cache=CacheSettings(memory_bytes=2**30))
    with serve_in_thread(create_app(pool)) as (url, _):
        full = _attach(url, "f", "tiny:1", 0)
        _, tok = load_model("tiny:0")
        fp = tokenizer_fingerprint(tok)
        client = PoolClient(url)
        client.attach("l", "tiny:0", 1.0, fp, lora=True)
        lora = PoolWorker(client, fp, poll_s=0.2)
        update = adapter_update(random_adapter(load_model("tiny:0")[0], cfg, 3), adapter_spec(cfg, "policy", default=True), 1, fp)
        client.push_weights(update.tensors(), 1, fp, adapter=update.manifest.adapter)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        samples = []
        try:
            for rnd in range(2):
                _generate(full, f"f{rnd}")
                lora.submit([GenerationRequest(f"l{rnd}", [5, 6, 7, 8], greedy)])
                samples.append(collect(lora, 1, timeout=30)[0].token_ids)
            state = httpx.get(f"{url}/state", timeout=30).json()
        finally:
            for w in (full, lora):
                w.close()
                w.client.detach()
    loads = [(t["job"], t["reason"].split(" for ")[0]) for t in state["transitions"] if t["kind"] == "load"]
    assert loads == [("f", "load (remote tier)"), ("lora:tiny:0", "load (remote tier)"),
                     ("f", "load (memory tier)"), ("lora:tiny:0", "load (memory tier)")], loads
    assert samples[0] == samples[1]


def test_serve_pool_refuses_a_bad_cache_size(capsys):
    assert pool_cli.main(["--cache-memory-gib", "-1"]) == 2
    assert "--cache-memory-gib" in capsys.readouterr().out
    assert pool_cli.main(["--cache-dir", "/proc/no-such-dir", "--port", "0"]) == 2
    assert "--cache-dir /proc/no-such-dir" in capsys.readouterr().out


# ==================================================================== start-up-aware placement (pure)


def test_scheduler_places_a_job_where_it_starts_soonest():
    cost = StartupCost()
    nbytes = 2 * 10**9
    starts = {w: estimate_start(cost, w, nbytes) for w in ("sleeping", "memory", "disk", "remote")}
    assert starts["sleeping"] < starts["memory"] < starts["disk"] < starts["remote"]
    job = JobView("x", 1.0, queued=4, engine_seconds=0.0)
    for order in (["remote", "disk", "memory", "sleeping"], ["memory", "remote", "disk", "sleeping"],
                  ["disk", "memory", "remote", "disk"]):
        slots = [SlotView(i, None, 0.0, 0, 4, {"x": starts[w]}) for i, w in enumerate(order)]
        chosen = [d.slot for d in plan(slots, [job], now=0.0) if d.action == "switch"]
        best = min(range(len(order)), key=lambda i: (starts[order[i]], i))
        assert chosen[:1] == [best], (order, chosen)
    # a slot held by a job with no work (training) is free too: the waiting job returns where it sleeps
    idle_b = JobView("b", 1.0, queued=0, engine_seconds=0.0)
    slots = [SlotView(0, None, 0.0, 0, 4, {"x": starts["remote"]}),
             SlotView(1, "b", 0.0, 0, 4, {"x": starts["sleeping"]})]
    decisions = plan(slots, [job, idle_b], now=0.0)
    assert [(d.action, d.job) for d in decisions] == [("idle", None), ("switch", "x")], decisions
    # without estimates: slot order, as before
    plain = plan([SlotView(i, None, 0.0, 0, 4) for i in range(3)], [job], now=0.0)
    assert [d.action for d in plain][:1] == ["switch"]
    # the simulator estimates a switch with the same function
    t = Transitions(startup=cost, model_bytes=nbytes, load_tier="disk")
    assert t.start_s(sleeping=False) == starts["disk"] and t.start_s(sleeping=True) == starts["sleeping"]


def test_calibration_measures_this_machine():
    cost = calibrate(4 * 2**20, model=load_model("tiny:0")[0], tokens=16)
    assert cost.memory_gbps >= cost.disk_gbps >= cost.remote_gbps > 0  # measured, never inverted
    assert cost.migrate_s_per_token > 0 and cost.migrate_s_per_token != StartupCost().migrate_s_per_token
    assert estimate_migration(cost, 100) == pytest.approx(100 * cost.migrate_s_per_token)
