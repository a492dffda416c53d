"""The vLLM backend's side of live migration (rollwise.engine.migration: the protocol and its coordinator), token
based as ServerlessLLM does it: a request's state is its tokens, never its KV.

- export: each sample's tokens, logprobs, versions (and top logprobs) as this engine recorded them
  (VllmSample.sampled), changing nothing.
- stage (on the target): a one-token greedy vLLM request over prompt + the sample's tokens but its last, whose
  output is discarded: vLLM's prefix cache keeps the KV it computes (whole blocks), so the handover's prefill
  finds it. It runs in the engine's next step, while the source keeps decoding; each catch-up round stages the
  longer context, and the prefix cache serves what an earlier round computed.
- commit: each sample continues as a vLLM request whose prompt is the original prompt + the sample's tokens,
  with max_tokens / min_tokens less the tokens it has, and its VllmSample starts from the source's tokens,
  logprobs and versions: the tokens sampled here carry this engine's version, and the Completion has the
  original prompt and every token, as if one engine had run it. vLLM has no way to admit a request that already
  has output tokens (its own preemption resumes keep the request inside the engine core and its worker), so the
  continuation is a new request over the longer prompt, as ServerlessLLM's.
- suspend (the handover, until the target confirms it): the source aborts its vLLM requests (vLLM cannot pause one)
  but keeps the request's place: its id stays in flight here with its samples' tokens (`_samples`), so nothing can
  take it, and should the target refuse it, resume re-adds each sample as a continuation (as commit does: greedy
  samples go on exactly, a seeded one with a fresh stream; a waiting one is queued anew, behind what vLLM queued
  meanwhile: vLLM has no slots to hold, only its queue).
- release: the source aborts its vLLM requests without emitting a sample (a session pin the request resumed from
  is released with it: VllmSessionPins.request_aborted; the session's KV moves as tokens, never as blocks).
- a session's retained KV (InferCept, `MigrationState.session_id`): this backend binds no request to a session
  until retain() (rollwise.engine.vllm_retention pins a finished turn by its request id and tokens), so commit
  needs no session, by design: the continuation's prompt is the turn's whole context, whose blocks the staging
  already computed into vLLM's prefix cache, and its finished turn is recorded under the request id like any
  other, so the agent's retain(session, request id) on this engine pins it and the session's next turn reuses it.

What a continuation changes, and what is therefore refused (ValueError naming the request, nothing changed):
- frequency/presence penalties count the *output* tokens, which the continuation sees as prompt: a request with
  either penalty on is not migratable (it stays and finishes where it runs). Repetition penalty counts prompt and
  output alike, so it continues exactly.
- the RNG stream: vLLM keeps each seeded request's torch generator inside its worker, and its sampler is not the
  reference engine's, so no RNG state leaves or enters a vLLM engine (rng_state is exported empty, and ignored).
  A non-greedy sample continues with a fresh stream: seeded from (params.seed, sample index, tokens so far) when
  the request is seeded, from the engine's seed source otherwise. Each token is still drawn from the policy's
  distribution (the distribution is exact), but a seeded sample's tokens after the handover differ from those
  of an unmigrated run. Greedy samples continue exactly.
- a request some of whose samples finished while others still wait for admission (vLLM admits each sample on its
  own) cannot be described as a MigrationState: it is not migratable. One none of whose samples finished and
  some of which wait moves as a waiting request: the target starts it anew (nothing was emitted yet).
- MoE routing capture (GPU) would only cover the continuation: refused.
- a request that could run further on its source than this engine's max_model_len allows (it would be cut off
  early here): refused, as on every target (rollwise.engine.migration.check_context_limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from rollwise.engine.migration import MigratingSample, MigrationState, check_context_limit, fresh_stream_seed
from rollwise.engine.sampled_tokens import SampledTokens
from rollwise.engine.vllm_requests import VllmSample, vllm_sampling_params
from rollwise.types.generation import GenerationRequest, ModelInfo, SamplingParams

if TYPE_CHECKING:  # annotations only: importing vLLM, or the engine's other halves, is the engine's business
    from vllm.v1.engine.llm_engine import LLMEngine

    from rollwise.engine.vllm_adapters import VllmAdapters
    from rollwise.engine.vllm_retention import VllmSessionPins


@dataclass
class _Staged:
    """What the target staged for one request: per sample index, the context its KV was computed for (the
    vLLM prefix cache holds it once the staging request ran) and the staging requests still queued."""

    contexts: dict[int, list[int]] = field(default_factory=dict)
    vids: list[str] = field(default_factory=list)


def migration_refusal(request: GenerationRequest) -> str | None:
    """Why a vLLM continuation would not sample `request` as one engine would (None: it migrates)."""
    p = request.params
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        return (f"cannot migrate request {request.request_id!r}: its frequency/presence penalties count the "
                "sampled tokens, which a vLLM continuation would see as prompt; let it finish where it runs")
    return None


def continuation_params(params: SamplingParams, done: int) -> SamplingParams:
    """The sampling params of a sample that has `done` tokens, continued as a request of its own."""
    return replace(params, n=1, max_tokens=params.max_tokens - done, min_tokens=max(0, params.min_tokens - done))


class VllmMigration:
    """Mixed into VLLMEngine (which holds these attributes and methods): its Migratable half."""

    _llm: LLMEngine
    _samples: dict[str, VllmSample]
    _children: dict[str, list[str]]
    _adapters: VllmAdapters
    _seed_source: torch.Generator
    eos_token_ids: set[int]
    max_model_len: int
    num_experts: int
    device: str
    sleeping: bool
    session_pins: VllmSessionPins | None
    model_info: Callable[[], ModelInfo]
    add_request: Callable[[GenerationRequest], None]
    _scheduler: Callable[[], Any]

    _staged_migrations: dict[str, _Staged]
    _suspended_migrations: dict[str, MigrationState]  # handed over, the target's commit not confirmed yet

    # ---------------------------------------------------------------- on the source

    def migratable_requests(self) -> list[str]:
        """The requests in flight, in submission order, those this engine will not move included: their
        export_running raises, naming why (migration_refusal, or partly finished while others of their samples
        wait: see the module docstring), so a migration accounts for each (`MigrationResult.stayed`)."""
        return list(self._children)

    def export_running(self, request_id: str) -> MigrationState | None:
        vids = self._children.get(request_id)
        if vids is None:
            return None
        why = self._why_not(request_id)
        if why is not None:
            raise ValueError(why)
        samples = [self._samples[vid] for vid in vids]
        request = samples[0].request
        if any(not s.sampled.token_ids for s in samples):  # none finished (else refused): it starts anew there
            return MigrationState(request, [], max_model_len=self.max_model_len)
        return MigrationState(request, [
            MigratingSample(s.index, list(s.sampled.token_ids), list(s.sampled.logprobs), list(s.sampled.versions),
                            [list(t) for t in s.sampled.top_logprobs], b"", s.cached_prompt_tokens or 0)
            for s in sorted(samples, key=lambda s: s.index)], max_model_len=self.max_model_len)

    def suspend_migrating(self, request_id: str) -> MigrationState | None:
        """Export the request and stop its vLLM requests; its id and samples stay here until release or resume."""
        state = self.export_running(request_id)
        if state is not None and request_id not in self._suspended_migrations:
            self._llm.abort_request(self._children[request_id])
            self._suspended_migrations[request_id] = state
        return state

    def resume_migrating(self, request_id: str) -> None:
        """The target refused it: each sample goes on here as a continuation of its tokens (module docstring)."""
        state = self._suspended_migrations.pop(request_id, None)
        if state is None or request_id not in self._children:  # aborted by its client meanwhile
            return
        for vid in self._children.pop(request_id):
            self._samples.pop(vid, None)
        self._continue(state)

    def release_migrated(self, request_id: str) -> int:
        """Forget the request (it continues on another engine): its vLLM requests are aborted, no sample emitted."""
        self._suspended_migrations.pop(request_id, None)
        vids = self._children.pop(request_id, None)
        if vids is None:
            return 0
        self._llm.abort_request(vids)
        for vid in vids:
            self._samples.pop(vid, None)
            if self.session_pins is not None:
                self.session_pins.request_aborted(vid)
        return len(vids)

    def _why_not(self, request_id: str) -> str | None:
        samples = [self._samples[vid] for vid in self._children[request_id]]
        request = samples[0].request
        if self._captures_routing():
            return (f"cannot migrate request {request_id!r}: its mixture-of-experts routing is captured for replay "
                    "and would cover only the continuation; let it finish or abort it")
        waiting = any(not s.sampled.token_ids for s in samples)
        if waiting and len(samples) < request.params.n:
            return (f"cannot migrate request {request_id!r} now: some of its samples finished while others still "
                    "wait for admission; let it finish where it runs")
        return migration_refusal(request)

    def _captures_routing(self) -> bool:
        return bool(self.num_experts) and self.device != "cpu"

    # ---------------------------------------------------------------- on the target

    def stage_migration(self, state: MigrationState) -> int:
        """Queue a one-token staging request per sample over what of its context is not staged yet; returns the
        tokens that are new to this engine's staging (the prefix cache may already hold some of them)."""
        request = self._check_incoming(state)
        staged = self._staged_migrations.setdefault(request.request_id, _Staged())
        lora, _ = self._adapters.request(request.adapter)
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        params = VLLMSamplingParams(n=1, max_tokens=1, temperature=0.0, detokenize=False, skip_special_tokens=False)
        new = 0
        for sample in state.samples:
            context = list(request.prompt_ids) + sample.token_ids[:-1]
            before = staged.contexts.get(sample.index, [])
            if context[: len(before)] != before:
                self.cancel_migration(request.request_id)
                raise ValueError(f"cannot migrate request {request.request_id!r}: sample {sample.index}'s tokens "
                                 "changed under the migration (the source's export is not a continuation of the "
                                 "staged one)")
            if len(context) == len(before):
                continue
            vid = f"{request.request_id}#{sample.index}@stage{len(context)}"
            prompt = TokensPrompt(prompt_token_ids=context)
            if request.cache_salt is not None:  # the continuation's blocks hash with the same salt
                prompt["cache_salt"] = request.cache_salt
            self._llm.add_request(vid, prompt, params, lora_request=lora)
            staged.vids.append(vid)
            staged.contexts[sample.index] = context
            new += len(context) - len(before)
        return new

    def commit_migration(self, state: MigrationState) -> None:
        """Take the request over: each sample continues from its tokens (a waiting request is queued anew).
        state.session_id is not needed here: a session is bound at retain() (module docstring)."""
        self._check_incoming(state)
        self.cancel_migration(state.request.request_id)  # a staging request not run yet: the continuation prefills it
        self._continue(state)

    def _continue(self, state: MigrationState) -> None:
        """Run the request here from `state`: each sample a continuation of its tokens (a waiting one anew)."""
        request = state.request
        if not state.samples:
            self.add_request(request)
            return
        from vllm.inputs import TokensPrompt

        lora, lora_version = self._adapters.request(request.adapter)
        vids = []
        for sample in sorted(state.samples, key=lambda s: s.index):
            vid = f"{request.request_id}#{sample.index}"
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids) + list(sample.token_ids))
            if request.cache_salt is not None:
                prompt["cache_salt"] = request.cache_salt
            params = continuation_params(request.params, len(sample.token_ids))
            self._llm.add_request(vid, prompt, vllm_sampling_params(params, self._fresh_seed(request, sample),
                                                                    self.eos_token_ids), lora_request=lora)
            sampled = SampledTokens(list(sample.token_ids), list(sample.logprobs), list(sample.versions),
                                    [list(t) for t in sample.top_logprobs])
            self._samples[vid] = VllmSample(request, sample.index, adapter_version=lora_version, sampled=sampled,
                                            cached_prompt_tokens=sample.cached_prompt_tokens)
            vids.append(vid)
        self._children[request.request_id] = vids

    def cancel_migration(self, request_id: str) -> None:
        staged = self._staged_migrations.pop(request_id, None)
        if staged is not None and staged.vids:  # those that ran are finished: vLLM ignores their ids
            self._llm.abort_request(staged.vids)

    def has_staging(self) -> bool:
        """Staging requests not run yet: the engine has work (its worker steps for them even with no sample of its
        own running; a staged context stays staged, in the prefix cache, once its request ran)."""
        if not self._staged_migrations or self._llm is None:  # (the common case: checked at every step)
            return False
        queued = self._scheduler().requests  # vLLM drops a request from it when it finishes or is aborted
        for staged in self._staged_migrations.values():
            staged.vids = [vid for vid in staged.vids if vid in queued]
        return any(staged.vids for staged in self._staged_migrations.values())

    def _check_incoming(self, state: MigrationState) -> GenerationRequest:
        request = state.request
        rid = request.request_id
        if rid in self._children:
            raise ValueError(f"cannot migrate request {rid!r} here: that id is already in flight")
        if self.sleeping:
            raise ValueError(f"cannot migrate request {rid!r} here: the engine is sleeping; wake() it")
        if self._captures_routing():
            raise ValueError(f"cannot migrate request {rid!r} here: this engine captures mixture-of-experts routing, "
                             "which would cover only the continuation")
        why = migration_refusal(request)
        if why is not None:
            raise ValueError(why)
        check_context_limit(state, self.max_model_len)
        for sample in state.samples:
            if len(sample.token_ids) >= request.params.max_tokens:
                raise ValueError(f"cannot migrate request {rid!r}: sample {sample.index} already has "
                                 f"max_tokens={request.params.max_tokens} tokens (it finished)")
        self._adapters.request(request.adapter)  # an adapter this engine does not serve is refused, named
        return request

    def _fresh_seed(self, request: GenerationRequest, sample: MigratingSample) -> int:
        """The continuation's seed: vLLM's RNG state does not move (module docstring), so a fresh stream."""
        seed = fresh_stream_seed(request, sample)
        return seed if seed is not None else int(torch.randint(0, 2**31, (1,), generator=self._seed_source))
