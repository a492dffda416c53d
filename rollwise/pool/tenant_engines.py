"""The engines a pool slot runs for its tenancies (rollwise.pool.slots): built from a tenancy's model with its
latest weights (a LoRA base: every member's latest adapter), and probed one suspect job at a time when an engine
step failed (issue 43: a tenant's failure stays its own).

A component the pool holds (`EnginePool.engines`): it knows how the pool builds engines (its engine config, seed,
prefix cache), nothing of the pool's jobs, queues or slots.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rollwise.engine.contract import Engine, add_all, run_to_completion
from rollwise.engine.factory import create_engine
from rollwise.pool.jobs import Job, LoraBase
from rollwise.pool.startup_cost import Tier
from rollwise.pool.weight_tiers import WeightTiers, describe
from rollwise.types.engine_config import EngineConfig
from rollwise.types.generation import GenerationRequest, SamplingParams


class TenantEngines:
    """Builds a tenancy's engines, and finds which suspect jobs break one."""

    def __init__(self, config: EngineConfig, *, seed: int | None, prefix_cache_tokens: int,
                 tiers: WeightTiers | None = None) -> None:
        self.config = config
        self.tiers = tiers or WeightTiers()  # jobs' weights through the tiered model cache (issue 42)
        self.seed = seed
        self.prefix_cache_tokens = prefix_cache_tokens

    def new(self, tenancy: Job | LoraBase) -> Engine:
        """An engine for the tenancy's model, holding the weights it attached with (no adapter, no push yet)."""
        lora = isinstance(tenancy, LoraBase)
        return create_engine(self.config, tenancy.template, tenancy.tokenizer,
                             max_model_len=tenancy.max_model_len, eos_token_ids=tenancy.eos_ids,
                             policy_version=0 if lora else tenancy.version, seed=self.seed,
                             model_name=tenancy.model, tokenizer_fingerprint=tenancy.fingerprint,
                             prefix_cache_tokens=self.prefix_cache_tokens)

    def build(self, tenancy: Job | LoraBase) -> tuple[Engine, dict[str, str], str]:
        """The tenancy's engine with its latest weights (a LoRA base: the base as loaded, which LoRA jobs never
        change, and every member's latest adapter); and the LoRA jobs whose adapter failed to load (-> why).
        Its owner is recorded by the slot (Slot.instances: tenancy -> engine), not on the engine. The weights
        come from the fastest cache tier holding them; the third value says which ("memory tier", ...)."""
        engine = self.new(tenancy)
        failed: dict[str, str] = {}
        tiers: list[Tier] = []
        if isinstance(tenancy, LoraBase):
            failed = sync_adapters(engine, tenancy, lambda job: self.tiers.load(job, tiers))
        else:  # the job's latest pushed weights, validated whole
            engine.apply_weights(self.tiers.load(tenancy, tiers), tenancy.version)
        return engine, failed, describe(tiers)

    def recycle(self, engine: Engine, job: Job) -> str:
        """Hand another full job's idle engine of the same model (same_engine) to `job`: its weights replaced whole
        from the fastest cache tier (Engine.replace_weights: every cache of the old weights dropped, the version the
        job's, even if lower), instead of building one (the switch's cost: a model copy and a KV cache). Returns the
        tier, as build() does; ValueError, the engine unchanged, if the job's weights do not replace it whole."""
        tiers: list[Tier] = []
        engine.wake()
        engine.replace_weights(self.tiers.load(job, tiers), job.version)
        engine.resume()  # (its previous owner may have paused it; the slot pauses it again for a paused job)
        return describe(tiers)

    @staticmethod
    def recyclable(engine: Engine | None, owner: Job | LoraBase | None, incoming: Job | LoraBase | None) -> bool:
        """Whether `owner`'s engine, being evicted, can be recycled for `incoming`: it runs nothing (a request
        would continue under another owner's weights) and it is built the same way (same_engine)."""
        return engine is not None and not engine.has_unfinished() and same_engine(owner, incoming)

    def probe(self, tenancy: Job | LoraBase, suspects: list[Job]) -> dict[str, str]:
        """Which of `suspects` break an engine: each runs a short sampled generation alone, on an engine built
        fresh from the tenancy's model holding only that job's current weights (a LoRA job: only its adapter).
        Runs on the slot's thread (the slot serves nothing meanwhile); caller holds tenancy.lock."""
        faults: dict[str, str] = {}
        lora = isinstance(tenancy, LoraBase)
        for job in suspects:
            if job.detached or job.version is None or job.fault is not None:
                continue
            what = f"its {'adapter' if lora else 'weights'} (version {job.version})"
            probe = GenerationRequest(f"probe-{job.name}", [t % job.vocab_size for t in (1, 2, 3)],
                                      SamplingParams(max_tokens=2, temperature=1.0, seed=0),
                                      adapter=job.name if lora else None)
            try:
                engine = self.new(tenancy)
                if lora:
                    engine.load_adapter(job.adapter, job.weights, job.version)
                else:
                    engine.apply_weights(job.weights, job.version)
                run_to_completion(engine, [probe])
            except Exception as exc:  # noqa: BLE001 - what the job's weights do to an engine: its fault
                faults[job.name] = f"{what} breaks the engine ({exc!r})"
        return faults


def same_engine(a: Job | LoraBase | None, b: Job | LoraBase | None) -> bool:
    """Whether one engine can serve both full jobs in turn: what TenantEngines.new builds it from (the model, its
    tensors' names, shapes and dtypes, the tokenizer, eos ids, context length) is the same. Never a LoRA base."""
    if not isinstance(a, Job) or not isinstance(b, Job) or a.lora or b.lora:
        return False
    return (a.model, a.fingerprint, a.max_model_len, a.vocab_size, sorted(a.eos_ids or ())) == \
        (b.model, b.fingerprint, b.max_model_len, b.vocab_size, sorted(b.eos_ids or ())) and a.expected == b.expected


def put_aside(engine: Engine, keep_memory: bool) -> None:
    """A switch's outgoing engine, on the slot's engine thread: idle (or the switch is refused), and asleep (its KV
    cache freed) unless `keep_memory`: it is recycled for the incoming job at once (TenantEngines.recycle), which
    reuses its KV cache instead of freeing it and allocating a zeroed one again on wake (part of a build's cost)."""
    if engine.has_unfinished():
        raise RuntimeError("switching away from an engine with requests in flight")
    if not keep_memory:
        engine.sleep()
    engine.reset_timeline()


def submit_to(current: Engine | None, inst: Engine, requests: list[GenerationRequest]) -> None:
    """On the slot's engine thread: the engine being stepped must be the job's own."""
    if current is not inst:
        raise RuntimeError("the slot is stepping another engine than the job's")
    add_all(inst, requests)


def sync_adapters(inst: Engine, base: LoraBase,
                  load: Callable[[Job], dict[str, Tensor]] | None = None) -> dict[str, str]:
    """A LoRA base's engine serves exactly its jobs' latest adapters (caller holds base.lock; the engine is
    not being stepped): detached and faulted jobs' adapters off, pushed versions on. A job whose adapter fails
    to load is left out (it serves nothing, not even its older version): returns its name -> why. `load`: where a
    job's adapter comes from (TenantEngines.build: the tiered cache); default, the job's store."""
    serving = {name: job for name, job in base.members.items() if job.fault is None}
    loaded = inst.loaded_adapters()
    for name in set(loaded) - set(serving):
        inst.unload_adapter(name)
    failed: dict[str, str] = {}
    for job in serving.values():
        if job.version is not None and job.adapter is not None and loaded.get(job.name) != job.version:
            try:
                inst.load_adapter(job.adapter, job.weights if load is None else load(job), job.version)
            except Exception as exc:  # noqa: BLE001 - this job's adapter; the other jobs are served
                failed[job.name] = f"its adapter (version {job.version}) failed to load on the engine ({exc})"
                if job.name in inst.loaded_adapters():
                    inst.unload_adapter(job.name)
    return failed
