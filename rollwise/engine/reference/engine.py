"""The reference engine: exact, readable continuous batching over LlamaFamilyModel.

Structured like vLLM v1: a Scheduler (rollwise.engine.reference.scheduler) decides which sequences
occupy the fixed KV-cache slots, the model executes prefill/decode for them, and the engine loop
(`step`) stitches the two together and turns finished sequences into Completions. Sequences join and leave the running batch every step.
Components it holds: the LoRA AdapterSet (rollwise.engine.reference.lora), SessionRetention (.session_retention:
KV kept across tool calls), Migration (.migration: live migration's staging and handover) and, with a drafter,
Speculation (.speculative: drafts verified exactly in one forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from rollwise.engine.reference.lora import AdapterSet
from rollwise.engine.reference.migration import Migration, MigrationMethods
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.reference.session_retention import SessionRetention
from rollwise.engine.reference.prefix_cache import PrefixCache, prefill_suffix, prefill_with_prefix
from rollwise.engine.reference.scoring import ReferenceScoring
from rollwise.engine.reference.sampling import (
    needs_processing, process_logits, sample, scaled_logprobs, top_logprobs,
)
from rollwise.engine.reference.scheduler import Scheduler, Sequence
from rollwise.engine.reference.speculative import Speculation, speculation_metrics
from rollwise.engine.speculation.counters import new_counters
from rollwise.engine.speculation.drafter import Drafter
from rollwise.engine.contract import check_replacement, check_request, check_update, check_version, run_to_completion
from rollwise.engine.retention import RetentionDecision, RetentionLimits, RetentionRequest
from rollwise.engine.retention_policy import PolicyName
from rollwise.engine.state import EngineState
from rollwise.types.generation import Completion, EngineLoad, FinishReason, GenerationRequest, ModelInfo
from rollwise.types.weights import AdapterSpec, ExpectedWeights, dtype_name


# Prefills of at least this many new tokens measure the recompute cost the retention policy weighs
# (recomputing a context is a long prefill; a resumed turn's few new tokens would overstate it).
RECOMPUTE_SAMPLE_MIN = 64


class ReferenceEngine(ReferenceScoring, MigrationMethods, EngineState):
    """Continuous-batching generation with exact fp32 logprobs and per-token policy versions."""

    name = "reference"

    def __init__(
        self,
        hf_model: nn.Module,
        *,
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        eos_token_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        policy_version: int = 0,
        seed: int | None = None,
        prefix_cache_tokens: int = 0,
        model_name: str = "model",
        tokenizer_fingerprint: str | None = None,
        drafter: Drafter | None = None,
        retention: RetentionLimits | None = None,
        retention_policy: PolicyName = "min_waste",
        capture_routing: bool = True,
    ) -> None:
        super().__init__()  # paused/sleeping flags, unfinished requests, timeline on time.monotonic
        # from_hf copies the weights: the trainer keeps training hf_model, the engine samples from its copy.
        self.model = LlamaFamilyModel.from_hf(hf_model, dtype=dtype)
        # What a weight update must match (names, shapes, dtypes, ties): fixed for the engine's life, so it is
        # read once here rather than walked from the module on every push (~3 ms for SmolLM2-135M).
        self.expected_weights = ExpectedWeights.of_module(self.model)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.cache = self.model.new_cache(max_num_seqs, max_model_len)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else _default_eos(hf_model))
        self._version = policy_version
        # Seeds the per-sequence generators of requests that bring no seed of their own.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.scheduler = Scheduler(max_num_seqs)
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "prefix_cache_hit_tokens": 0}
        # Cross-request prefix cache (0 tokens: off). It holds KV of prompts and of finished sequences,
        # so GRPO groups and multi-turn sessions skip recomputing the prefix they share.
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        # Optional streaming hook, called on the stepping thread for every sampled token as
        # on_tokens(request_id, index, token, logprob, version); the HTTP server streams through it.
        self.on_tokens: Callable[[str, int, int, float, int], None] | None = None
        # Speculative decoding from rollout history (engine.speculation: history): drafts are verified
        # exactly against the current weights (see .speculative). None: plain decoding, one token per step.
        if drafter is not None and self.model.is_moe:
            raise ValueError("engine.speculation with a mixture-of-experts model is not supported by the reference "
                             "engine (verified drafts would need their routing kept); set engine.speculation: none")
        self.drafter = drafter
        self.spec_stats = new_counters()  # read by speculation.counters_of, even with no drafter
        self.speculation = None if drafter is None else Speculation(
            self.model, drafter, max_model_len, self.spec_stats, self._processed_logits, self._record)
        self.adapters = AdapterSet.for_model(self.model)  # LoRA adapters, unmerged, per sequence (.lora)
        self.retention = SessionRetention.for_model(self.model, retention, retention_policy, self.scheduler,
                                                    max_model_len, max_num_seqs, self.prefix_cache is not None)
        self.kv_tiers = self.retention.kv_tiers  # None: retention off
        self.stats["recomputed_prompt_tokens"] = 0  # prompt tokens whose KV the engine had and let go
        self.capture_routing = capture_routing
        self.migration = Migration(self.model, self.scheduler, self.adapters, self.prefix_cache, self.kv_tiers,
                                   max_model_len, self._unfinished, self.retention.resuming, self.add_request)

    # ---------------------------------------------------------------- public state

    @property
    def capture_routing(self) -> bool:
        """MoE: return the experts every token went to with its sample (R3); always False for a dense model."""
        return self.model.capture_routing

    @capture_routing.setter
    def capture_routing(self, on: bool) -> None:
        # Off only to time what capture costs (`rollwise bench r3`): samples then carry no routing, and a
        # replaying trainer refuses them. The prefix cache is emptied, so no later hit mixes entries kept with
        # and without routing.
        self.model.capture_routing = self.model.is_moe and on
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return sum(r.params.n for r in self.scheduler.waiting)

    def speculation_metrics(self) -> dict[str, float]:
        """Speculative decoding's counters and rates so far (rollwise.engine.reference.speculative)."""
        return speculation_metrics(self.spec_stats, self.drafter)

    def _free_memory(self) -> bool:
        """sleep(): free the KV cache (weights stay: they are the only copy); wake() allocates it again."""
        self.retention.release("sleep")
        self.cache = None
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    def _restore_memory(self) -> None:
        self.cache = self.model.new_cache(self.max_num_seqs, self.max_model_len)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=self.num_running, waiting=self.num_waiting, max_num_seqs=self.max_num_seqs,
            # one fixed-size slot per sequence or pinned session
            kv_cache_usage=(self.num_running + (self.kv_tiers.pinned_slots() if self.kv_tiers else 0)) / self.max_num_seqs,
            prompt_tokens=self.stats["prompt_tokens"], cached_prompt_tokens=self.stats["cached_prompt_tokens"],
            generated_tokens=self.stats["generated_tokens"], paused=self.paused, sleeping=self.sleeping,
            policy_version=self._version,
        )

    @property
    def prefix_cache_tokens(self) -> int:
        return self.prefix_cache.num_tokens if self.prefix_cache is not None else 0

    def flush_prefix_cache(self) -> int:
        held = self.prefix_cache_tokens
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return held

    @property
    def device(self) -> str:
        param = next(self.model.parameters(), None)
        return str(param.device) if param is not None else "cpu"

    def describe(self) -> str:
        return f"reference (pure PyTorch, {dtype_name(self.model.dtype)})"

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            engine=self.name, model=self.model_name, vocab_size=self.model.config.shape.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            eos_token_ids=sorted(self.eos_token_ids), tokenizer_fingerprint=self.fingerprint,
            policy_version=self._version,
        )

    # ---------------------------------------------------------------- requests

    def add_request(self, req: GenerationRequest) -> None:
        check_request(req, max_model_len=self.max_model_len, vocab_size=self.model.config.shape.vocab_size,
                      in_flight=req.request_id in self._unfinished, sleeping=self.sleeping,
                      max_num_seqs=self.max_num_seqs)
        self.adapters.resolve(req.adapter)  # an adapter that is not loaded is refused here, named
        self.scheduler.waiting.append(req)
        self._unfinished[req.request_id] = req.params.n

    def abort(self, request_id: str) -> list[Completion]:
        """Stop a request now; its samples come back with finish_reason 'abort' and the tokens so far.
        A finished turn's request: whatever KV is held for it is released."""
        self.retention.release("abort", request_id)
        self.migration.resume(request_id)  # handed over, not yet confirmed: aborted here from where it stopped
        if self._unfinished.pop(request_id, None) is None:
            return []
        aborted: list[Completion] = []
        for req in [r for r in self.scheduler.waiting if r.request_id == request_id]:
            self.scheduler.waiting.remove(req)
            aborted += [_empty_completion(req, i) for i in range(req.params.n)]
        for seq in [s for s in self.scheduler.running.values() if s.request.request_id == request_id]:
            self.scheduler.release(seq.slot)
            aborted.append(seq.completion("abort"))
        self.mark_timeline()
        return sorted(aborted, key=lambda c: c.index)

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[Completion]:
        """One scheduler iteration: prefill newly admitted requests (sampling their first tokens),
        then one decode step for every running sequence. Returns the samples that finished.
        A paused engine does nothing and returns []."""
        if self.paused:
            return []
        finished: list[Completion] = []
        # Requests admitted together with the same prompt (e.g. GRPO samples submitted one request
        # each) share a single prefill, exactly like the n samples of one request.
        groups: dict[tuple, list[tuple[GenerationRequest, list[int]]]] = {}
        for request, slots in self.retention.admit_pinned():  # resumed pinned sessions: each in its own slot
            groups[("pinned", request.request_id)] = [(request, slots)]
        self.retention.expire()  # after: a session already back is not made to recompute by its TTL
        for request, slots in self.scheduler.admit(lambda needed: self.retention.reclaim(needed, self.cache)):
            groups.setdefault((request.adapter, request.cache_salt, *request.prompt_ids), []).append((request, slots))
        if groups:
            # The admitted sequences are busy from here, through their prefill: counted from its start, as
            # the simulated engine counts them from the op's start (they were counted idle through their
            # own prefill before, which read as bubble).
            self.mark_timeline(starting=sum(len(slots) for group in groups.values() for _, slots in group))
        for group in groups.values():
            finished += self._prefill(group)
        self.mark_timeline()
        if self.scheduler.running:
            started = time.perf_counter()
            finished += self._decode()
            self.retention.decode_step_cost.observe(1, time.perf_counter() - started)
        self.stats["steps"] += 1
        self.mark_timeline()
        return finished

    def generate(
        self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        """Run `requests` to completion; returns completions ordered by (request order, sample index).
        `progress`, if given, is called after each step with the number of samples that finished in it."""
        return run_to_completion(self, requests, progress)

    # ---------------------------------------------------------------- weights

    def apply_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy new weights in by HF name (a subset is fine, e.g. streamed buckets). The version (never
        backwards), names, shapes, dtypes and values (no NaN or inf) are all validated before anything is
        copied; on a problem this raises ValueError and the old weights stay. Partial-rollout semantics:
        in-flight sequences keep their KV cache (computed by the old weights) and continue with the new
        ones; each token records the version sampling it."""
        check_update(state_dict, version, self._version, self.expected_weights)
        self._load_weights(state_dict, version)
        if self.drafter is not None:  # old versions' rollouts age out; the rest stay (they are verified)
            self.drafter.on_policy_version(version)

    def replace_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Engine.replace_weights: another owner's complete weights (check_replacement first), its version as given
        (it may be lower); the prefix cache, held session KV and the drafter's history were the old weights'."""
        check_replacement(state_dict, self.expected_weights, busy=self.has_unfinished())
        self._load_weights(state_dict, version)
        if self.drafter is not None:
            self.drafter.clear()

    def _load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Checked weights copied in at `version`; what the old weights computed and is kept goes."""
        self.model.load_weights(state_dict)
        self._version = version
        if self.prefix_cache is not None:  # cached KV was computed by the old weights
            self.prefix_cache.clear()
        self.retention.release("weight_update")  # so was held session KV: the promise is released, explicitly

    # ---------------------------------------------------------------- session KV retention (self.retention)

    def retain(self, req: RetentionRequest) -> RetentionDecision:
        """A turn ended in a tool call: preserve, swap or discard its KV (rollwise.engine.reference.session_retention)."""
        return self.retention.retain(req, self.cache)

    def release_session(self, session_id: str) -> bool:
        return self.retention.release_session(session_id)

    def retention_stats(self) -> dict[str, int]:
        return self.retention.retention_stats()

    # ------------------------------------------------------- live migration (self.migration, MigrationMethods)

    def migratable_requests(self) -> list[str]:
        return list(self._unfinished)

    # ---------------------------------------------------------------- LoRA adapters (self.adapters)

    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        """Load (or replace) adapter `spec.name` at `version`; ValueError and nothing changed if it does
        not fit the base. A default adapter is the run's policy: its version is the engine's (never backwards)."""
        if spec.default:
            check_version(version, self._version)
        self.adapters.load(spec, state, version, self.model.dtype)
        if spec.default:
            self._version = version
            if self.prefix_cache is not None:  # cached KV was computed by the old adapter
                self.prefix_cache.clear()

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (requests naming it are refused from now on). Refused while
        requests of it are queued or running: they would lose their adapter mid-sequence."""
        pending = [*(r.request_id for r in self.scheduler.waiting if r.adapter == name),
                   *(s.request.request_id for s in self.scheduler.running.values() if s.request.adapter == name)]
        if pending:
            raise ValueError(f"adapter {name!r} still serves requests {pending[:4]}: abort them or let them finish")
        self.adapters.remove(name)

    def loaded_adapters(self) -> dict[str, int]:
        """Served adapter name -> its version."""
        return self.adapters.versions()

    # ---------------------------------------------------------------- internals

    def _generator_for(self, request: GenerationRequest, index: int) -> torch.Generator:
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        return torch.Generator().manual_seed(seed + index)

    def _prefill(self, group: list[tuple[GenerationRequest, list[int]]]) -> list[Completion]:
        """Prefill a prompt once, share its KV with every slot of the group (all samples of all
        requests with this prompt), and sample each sample's first token from the shared logits."""
        prompt = group[0][0].prompt_ids
        all_slots = [slot for _, slots in group for slot in slots]
        resumed = self.retention.resume_start(group, self.cache)  # a retained session's context, already in its slot
        started = time.perf_counter()
        # The prefix cache holds the default policy's KV: a named LoRA adapter's prompt neither reads nor feeds it.
        shared_cache = self.prefix_cache if group[0][0].adapter is None else None
        salt = group[0][0].cache_salt  # one salt per group (the group key holds it)
        hit = shared_cache.match(prompt, salt) if shared_cache is not None and not resumed else None
        with self.adapters.rows([self.adapters.resolve(group[0][0].adapter)]):  # one adapter per group
            if resumed:
                logits = prefill_suffix(self.model, self.cache, prompt, all_slots, resumed)
            elif hit is None:
                logits = self.model.prefill(self.cache, prompt, all_slots)
            else:
                logits = prefill_with_prefix(self.model, self.cache, prompt, all_slots, hit)
        reused = resumed or (hit.num_tokens if hit is not None else 0)
        if len(prompt) - reused >= RECOMPUTE_SAMPLE_MIN:  # a short suffix's time per token is mostly overhead
            self.retention.recompute_cost.observe(len(prompt) - reused, time.perf_counter() - started)
        self.stats["recomputed_prompt_tokens"] += self.retention.recomputed(group[0][0].request_id, prompt, reused)
        routing = self._prompt_routing(hit)
        seqs = [
            Sequence(request, i, slot, self._generator_for(request, i), cached_prompt_tokens=len(prompt),
                     prompt_routing=routing, num_experts=self.model.config.num_experts)
            for request, slots in group
            for i, slot in enumerate(slots)
        ]
        seqs[0].cached_prompt_tokens = reused  # the one sample whose prompt was actually computed
        self.stats["prompt_tokens"] += len(prompt) * len(seqs)
        self.stats["cached_prompt_tokens"] += len(prompt) * (len(seqs) - 1) + reused
        self.stats["prefix_cache_hit_tokens"] += reused - resumed
        if shared_cache is not None:
            shared_cache.insert(prompt, self.cache.k[:, all_slots[0]], self.cache.v[:, all_slots[0]], routing, salt)
        for seq in seqs:
            self.scheduler.start(seq)
        return self._append_tokens(seqs, logits.expand(len(seqs), -1))

    def _decode(self) -> list[Completion]:
        seqs = [self.scheduler.running[slot] for slot in sorted(self.scheduler.running)]
        if self.speculation is not None and not self.adapters.adapters:  # no drafting while serving LoRA adapters
            verified = self.speculation.decode(self.cache, seqs)
            if verified is not None:  # some sequence had a draft: this step was the verification
                return verified
        last_tokens = torch.tensor([seq.token_ids[-1] for seq in seqs])
        with self.adapters.rows([self.adapters.resolve(s.request.adapter) for s in seqs]):  # each row its own
            logits = self.model.decode(self.cache, last_tokens, [seq.slot for seq in seqs])
        if self.model.capture_routing:
            for seq, row in zip(seqs, self.model.last_routing):
                seq.routing.append(row[None])
        return self._append_tokens(seqs, logits)

    def _prompt_routing(self, hit) -> Tensor | None:
        """MoE: the experts of every prompt token of the prefill just run. Tokens served from the prefix
        cache skipped the MoE layers; their routing was cached with their KV (never silently missing)."""
        if not self.model.capture_routing:
            return None
        computed = self.model.last_routing
        return computed if hit is None else torch.cat([hit.routing(), computed])

    def _append_tokens(self, seqs: list[Sequence], logits: Tensor) -> list[Completion]:
        """Sample a token for each sequence, record it, and retire the ones that are done."""
        params = [s.request.params for s in seqs]
        logits = self._processed_logits(seqs, logits)
        tokens, logprobs = sample(logits, params, [s.generator for s in seqs])
        tops = self._top_logprobs(logits, params)
        finished = []
        for seq, token, logprob, top in zip(seqs, tokens, logprobs, tops):
            done = self._record(seq, token, logprob, top)
            if done is not None:
                finished.append(done)
        return finished

    def _record(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]]) -> Completion | None:
        """Append one sampled token to `seq`; if that finishes it, retire it and return its Completion."""
        self.stats["generated_tokens"] += 1
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.request.params.top_logprobs:
            seq.top_logprobs.append(top)
        version = self.adapters.version_of(seq.request.adapter, self._version)  # a named adapter's own version
        seq.versions.append(version)
        if self.on_tokens is not None:
            self.on_tokens(seq.request.request_id, seq.index, token, logprob, version)
        reason = self._finish_reason(seq, token)
        if reason is None:
            return None
        self._cache_history(seq)
        fresh = all(v == self._version for v in seq.versions)
        if not self.retention.park(seq.request.request_id, list(seq.request.prompt_ids) + seq.token_ids, seq.slot,
                                   fresh and seq.request.params.n == 1, self.cache):  # parked: a retain() may keep its KV
            self.scheduler.release(seq.slot)
        self._sample_returned(seq.request.request_id)
        if self.drafter is not None:  # siblings still running draft from this sample at once
            self.drafter.observe(seq.request.prompt_ids, seq.token_ids, self._version,
                                 key=f"{seq.request.request_id}/{seq.index}")
        return seq.completion(reason)

    def _processed_logits(self, seqs: list[Sequence], logits: Tensor) -> Tensor:
        """min_tokens and penalties, for the rows that ask for them (a new tensor: prefill logits are one
        row expanded over the group)."""
        if not any(needs_processing(s.request.params) for s in seqs):
            return logits
        rows = []
        for seq, row in zip(seqs, logits):
            params = seq.request.params
            if needs_processing(params):
                stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                row = process_logits(row, params, seq.request.prompt_ids, seq.token_ids, stops)
            rows.append(row)
        return torch.stack(rows)

    @staticmethod
    def _top_logprobs(logits: Tensor, params: list) -> list[list[tuple[int, float]]]:
        """The asked-for alternatives per row, from the same distribution `sample` reports logprobs of."""
        if not any(p.top_logprobs for p in params):
            return [[] for _ in params]
        logprobs = scaled_logprobs(logits, params)
        return [top_logprobs(row, p.top_logprobs) for row, p in zip(logprobs, params)]

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"  # the stop token stays in token_ids so the trainer trains on it
        if len(seq.token_ids) >= params.max_tokens:
            return "length"
        # The last sampled token needs no cache position, so a sequence may reach max_model_len tokens.
        if len(seq.request.prompt_ids) + len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _cache_history(self, seq: Sequence) -> None:
        """A finished sequence's prompt + tokens (all but the last, which never got KV) into the prefix
        cache: the next turn of a conversation starts with them. Only if the current weights made all of it."""
        if (self.prefix_cache is not None and seq.request.adapter is None
                and all(v == self._version for v in seq.versions)):
            tokens = list(seq.request.prompt_ids) + seq.token_ids[:-1]
            routing = torch.cat([seq.prompt_routing, *seq.routing]) if seq.prompt_routing is not None else None
            self.prefix_cache.insert(tokens, self.cache.k[:, seq.slot], self.cache.v[:, seq.slot], routing,
                                     seq.request.cache_salt)



def _default_eos(hf_model: nn.Module) -> list[int]:
    """EOS ids from the model config and its generation config (each may be an int, a list or None)."""
    ids: list[int] = []
    for cfg in (hf_model.config, getattr(hf_model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            ids += [eos] if isinstance(eos, int) else list(eos)
    return ids


def _empty_completion(req: GenerationRequest, index: int) -> Completion:
    return Completion(req.request_id, index, list(req.prompt_ids), [], [], [], "abort")
