"""ReferenceEngine's side of live migration (rollwise.engine.migration, the protocol and its coordinator):
export a running request's tokens and RNG state, stage its KV on this engine by prefilling them (the
prefix cache serves what it holds), and take it over at the handover, so it decodes on from where it
stopped on the source. `Migration` is a component ReferenceEngine holds, built with the engine's scheduler,
model, adapters, prefix cache and request book-keeping; the engine's contract methods delegate to it. The KV
cache is an argument (None while the engine sleeps): the engine frees and re-allocates it on sleep/wake."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollwise.engine.migration import MigratingSample, MigrationState, check_context_limit, fresh_stream_seed
from rollwise.engine.reference.prefix_cache import prefill_suffix, prefill_with_prefix
from rollwise.engine.reference.scheduler import Sequence
from rollwise.types.generation import GenerationRequest

if TYPE_CHECKING:
    from rollwise.engine.reference.kv_tiers import Held, KVTiers
    from rollwise.engine.reference.lora import AdapterSet
    from rollwise.engine.reference.model import KVCache, LlamaFamilyModel
    from rollwise.engine.reference.prefix_cache import PrefixCache
    from rollwise.engine.reference.scheduler import Scheduler


@dataclass
class _Suspended:
    """A request handed over but not yet confirmed by the target: out of the batch and the waiting queue, its
    samples' slots (with their KV) and generators kept, so the source resumes it as if nothing had been tried."""

    seqs: list[Sequence]  # its running samples (their slots are held: neither running nor free)
    waiting: GenerationRequest | None  # a request still waiting for admission
    ahead: list[str]  # the requests queued ahead of a waiting one: it goes back behind those still waiting


@dataclass
class _Staged:
    slot: int
    context: list[int]  # the tokens whose KV the slot holds: prompt + the sample's tokens but its last


class Migration:
    """export / stage / commit / cancel / release: the engine's export_running, stage_migration,
    commit_migration, cancel_migration and release_migrated."""

    def __init__(self, model: LlamaFamilyModel, scheduler: Scheduler, adapters: AdapterSet,
                 prefix_cache: PrefixCache | None, kv_tiers: KVTiers | None, max_model_len: int,
                 unfinished: dict[str, int], resuming: dict[str, Held],
                 add_request: Callable[[GenerationRequest], None]) -> None:
        self.model, self.scheduler, self.adapters = model, scheduler, adapters
        self.prefix_cache, self.kv_tiers, self.max_model_len = prefix_cache, kv_tiers, max_model_len
        self.unfinished = unfinished  # the engine's request id -> samples still to return (shared, not copied)
        self.resuming = resuming  # the engine's resumed pinned sessions (shared, not copied)
        self.add_request = add_request  # the engine's: a request still waiting on the source is queued anew
        self.staged: dict[str, dict[int, _Staged]] = {}  # request id -> sample index -> its slot
        self.suspended: dict[str, _Suspended] = {}  # request id -> handed over, the target's commit not confirmed

    # ------------------------------------------------------------ on the source

    def export(self, request_id: str) -> MigrationState | None:
        if request_id not in self.unfinished:
            return None
        if self.model.capture_routing:
            raise ValueError(f"cannot migrate request {request_id!r}: a mixture-of-experts request's routing would "
                             "have to be recomputed with its KV (not supported); let it finish or abort it")
        held = self.suspended.get(request_id)
        waiting = [r for r in self.scheduler.waiting if r.request_id == request_id] if held is None else \
            [held.waiting] if held.waiting is not None else []
        if waiting:
            return MigrationState(waiting[0], [], max_model_len=self.max_model_len)
        seqs = sorted(held.seqs if held is not None else
                      (s for s in self.scheduler.running.values() if s.request.request_id == request_id),
                      key=lambda s: s.index)
        samples = [MigratingSample(s.index, list(s.token_ids), list(s.logprobs), list(s.versions),
                                   [list(t) for t in s.top_logprobs], s.generator.get_state().numpy().tobytes(),
                                   s.cached_prompt_tokens) for s in seqs]
        session = self.kv_tiers.owners.get(request_id) if self.kv_tiers is not None else None
        return MigrationState(seqs[0].request, samples, session, self.max_model_len)

    def suspend(self, request_id: str) -> MigrationState | None:
        """The handover (rollwise.engine.migration._hand_over): the request's final state; it leaves the batch (or
        the waiting queue) but keeps its slots, KV and generators until release() or resume()."""
        state = self.export(request_id)
        if state is None or request_id in self.suspended:
            return state
        waiting = next((r for r in self.scheduler.waiting if r.request_id == request_id), None)
        ahead: list[str] = []
        if waiting is not None:
            ahead = [r.request_id for r in self.scheduler.waiting]
            ahead = ahead[: ahead.index(request_id)]
            self.scheduler.waiting.remove(waiting)
        seqs = [s for s in self.scheduler.running.values() if s.request.request_id == request_id]
        for seq in seqs:
            self.scheduler.hold(seq.slot)  # out of the batch; the slot is neither running nor free
        self.suspended[request_id] = _Suspended(seqs, waiting, ahead)
        return state

    def resume(self, request_id: str) -> None:
        """The target refused it: it goes on here from the step it stopped at (its slots and KV were held), a
        waiting one back in the queue behind the requests that were ahead of it."""
        held = self.suspended.pop(request_id, None)
        if held is None:  # not suspended (aborted by its client meanwhile): nothing to resume
            return
        for seq in held.seqs:
            self.scheduler.start(seq)
        if held.waiting is not None:
            ahead = set(held.ahead)
            queue = self.scheduler.waiting
            at = max((i + 1 for i, r in enumerate(queue) if r.request_id in ahead), default=0)
            queue.insert(at, held.waiting)

    def release(self, request_id: str) -> int:
        """Forget the request (it continues on another engine): its slots are freed, no sample is emitted."""
        self.resume(request_id)  # a suspended one: back where the rest finds it (in one command: no step between)
        if self.unfinished.pop(request_id, None) is None:
            return 0
        dropped = 0
        for req in [r for r in self.scheduler.waiting if r.request_id == request_id]:
            self.scheduler.waiting.remove(req)
            dropped += req.params.n
        for seq in [s for s in self.scheduler.running.values() if s.request.request_id == request_id]:
            self.scheduler.release(seq.slot)
            dropped += 1
        if self.kv_tiers is not None:  # the session's next KV is the destination's to keep
            self.kv_tiers.owners.pop(request_id, None)
        self.resuming.pop(request_id, None)
        return dropped

    # ------------------------------------------------------------ on the destination

    def stage(self, state: MigrationState, cache: KVCache | None) -> int:
        request = state.request
        if request.request_id in self.unfinished:
            raise ValueError(f"cannot migrate request {request.request_id!r} here: that id is already in flight")
        if cache is None:  # the engine sleeps: its KV cache is freed
            raise ValueError(f"cannot migrate request {request.request_id!r} here: the engine is sleeping; wake() it")
        check_context_limit(state, self.max_model_len)
        self.adapters.resolve(request.adapter)  # an adapter this engine does not serve is refused, named
        first = request.request_id not in self.staged
        staged = self.staged.setdefault(request.request_id, {})
        prefilled = 0
        try:
            for sample in state.samples:
                context = list(request.prompt_ids) + sample.token_ids[:-1]
                prefilled += self._stage_sample(cache, request.request_id, request.adapter, staged, sample.index,
                                                context)
        except ValueError:
            if first:  # refused on its first staging: no slot stays taken for it
                self.cancel(request.request_id)
            raise
        return prefilled

    def commit(self, state: MigrationState, cache: KVCache | None) -> None:
        request = state.request
        if not state.samples:  # still waiting on the source: queued here like any new request
            check_context_limit(state, self.max_model_len)  # (stage, which checks it, is skipped)
            self.cancel(request.request_id)
            self.add_request(request)
            return
        self.stage(state, cache)
        staged = self.staged.pop(request.request_id)
        for index in set(staged) - {s.index for s in state.samples}:  # finished on the source meanwhile
            self.scheduler.free(staged.pop(index).slot)
        for sample in state.samples:
            generator = torch.Generator()
            if sample.rng_state:  # its own stream goes on
                generator.set_state(torch.frombuffer(bytearray(sample.rng_state), dtype=torch.uint8))
            else:  # from an engine whose RNG state cannot move (vLLM): a fresh stream (migration.fresh_stream_seed)
                seed = fresh_stream_seed(request, sample)
                if seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(seed)
            seq = Sequence(request, sample.index, staged[sample.index].slot, generator, sample.cached_prompt_tokens,
                           token_ids=list(sample.token_ids), logprobs=list(sample.logprobs),
                           versions=list(sample.versions), top_logprobs=[list(t) for t in sample.top_logprobs])
            self.scheduler.start(seq)
        self.unfinished[request.request_id] = len(state.samples)
        if self.kv_tiers is not None:  # its finished turn may be retained here for the session
            self.kv_tiers.own(request.request_id, state.session_id)

    def cancel(self, request_id: str) -> None:
        for staged in self.staged.pop(request_id, {}).values():
            self.scheduler.free(staged.slot)

    def _stage_sample(self, cache: KVCache, request_id: str, adapter: str | None, staged: dict[int, _Staged], index: int,
                      context: list[int]) -> int:
        """Prefill what of `context` the sample's staged slot lacks; returns the tokens computed."""
        entry = staged.get(index)
        if entry is None:
            slot = self.scheduler.reserve()
            if slot is None:
                raise ValueError(f"cannot migrate request {request_id!r} here: no free KV slot "
                                 f"(max_num_seqs={len(cache.lengths)}); migrate when one frees or to another engine")
            entry = staged[index] = _Staged(slot, [])
        if context[: len(entry.context)] != entry.context:
            raise ValueError(f"cannot migrate request {request_id!r}: sample {index}'s tokens changed under the "
                             "migration (the source's export is not a continuation of the staged one)")
        start = len(entry.context)
        if start == len(context):
            return 0
        # The prefix cache holds the default policy's KV only (as in ReferenceEngine._prefill).
        hit = self.prefix_cache.match(context) if self.prefix_cache is not None and adapter is None and start == 0 \
            else None
        with torch.inference_mode(), self.adapters.rows([self.adapters.resolve(adapter)]):
            if start > 0:
                prefill_suffix(self.model, cache, context, [entry.slot], start)
            elif hit is not None:
                prefill_with_prefix(self.model, cache, context, [entry.slot], hit)
                start = hit.num_tokens
            else:
                self.model.prefill(cache, context, [entry.slot])
        entry.context = context
        return len(context) - start


class MigrationMethods:
    """ReferenceEngine's Migratable methods (rollwise.engine.migration), over its Migration component and KV cache
    (None while it sleeps)."""

    migration: Migration
    cache: KVCache | None

    def export_running(self, request_id: str) -> MigrationState | None:
        return self.migration.export(request_id)

    def suspend_migrating(self, request_id: str) -> MigrationState | None:
        return self.migration.suspend(request_id)

    def resume_migrating(self, request_id: str) -> None:
        self.migration.resume(request_id)

    def release_migrated(self, request_id: str) -> int:
        return self.migration.release(request_id)

    def stage_migration(self, state: MigrationState) -> int:
        return self.migration.stage(state, self.cache)

    def commit_migration(self, state: MigrationState) -> None:
        self.migration.commit(state, self.cache)

    def cancel_migration(self, request_id: str) -> None:
        self.migration.cancel(request_id)
