"""The Tinker service's samplers: what a `sampling_session_id` serves, and `asample` on rollwise's reference engine.

One ReferenceEngine per base model serves the base and every LoRA sampler on it (each a named adapter,
`GenerationRequest.adapter`), so one engine batch decodes many tenants' samples together. Full-parameter
samplers are jobs of one in-process EnginePool (rollwise.service.full_samplers): their weights are pushed into
the pool, and the pool switches its slots between them (sleep / wake / load from its tiered model cache) — one
switching mechanism for the whole project, with its accounting, instead of a second engine set kept here.
Publishing is a weight push (`load_adapter` / the pool's `push_weights`), never a disk write. `sample_many`
submits every job's samples before stepping the engines, so jobs of many tenants share batches; a job that is
wrong fails alone, as a ServiceUserError naming the field.
"""

from __future__ import annotations

import hashlib
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from rollwise.engine.contract import Engine
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.jobs import Job, PoolError, QueuedRequest
from rollwise.service.base_models import BaseModel, BaseModels, SamplerWeights
from rollwise.service.full_samplers import FullSamplers
from rollwise.service.errors import ServiceUserError
from rollwise.service.sample_stops import Stops, parse_stop, stop_cut, tail_matches
from rollwise.service.wire_proto import SampledSequenceOut, encode_sample_response
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams

UINT64 = 2**64  # the wire's seed is a uint64


@dataclass
class SampleJob:
    """One `asample` request as the sampler runs it (build it with `from_request`)."""

    sampler_id: str
    prompt: list[int]
    num_samples: int
    params: types.SamplingParams
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: torch.Tensor | None = None  # int64 [len(prompt) - 1, K] token ids, -1: none
    record_stability_info: bool = False

    @classmethod
    def from_request(cls, body: types.SampleRequest) -> SampleJob:
        if body.sampling_session_id is None:
            raise ServiceUserError("sampling_session_id: missing; create a sampling session and sample from it")
        try:
            prompt = body.prompt.to_ints()
        except ValueError as exc:
            raise ServiceUserError(f"prompt: only encoded_text chunks can be sampled here ({exc})") from None
        return cls(sampler_id=body.sampling_session_id, prompt=prompt, num_samples=body.num_samples,
                   params=body.sampling_params, prompt_logprobs=bool(body.prompt_logprobs),
                   prompt_logprobs_last_n=body.prompt_logprobs_last_n,
                   topk_prompt_logprobs=body.topk_prompt_logprobs, topk_sample_logprobs=body.topk_sample_logprobs,
                   prompt_alt_tokens_k=body.prompt_alt_tokens_k,
                   target_prompt_logprobs=dense_targets(body.target_prompt_logprobs),
                   record_stability_info=bool(body.record_stability_info))


@dataclass
class Served:
    """What one sampler serves: an engine and the adapter it names there (None: the engine's own weights), or
    (full-parameter weights) its job in the samplers' engine pool."""

    base: BaseModel
    engine: ReferenceEngine | None  # None: a full-parameter sampler (`job`)
    adapter: str | None
    job: Job | None = None

    @property
    def full(self) -> bool:
        return self.job is not None

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.shape.vocab_size if self.engine is not None else self.base.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len if self.engine is not None else self.job.max_model_len


@dataclass
class _Run:
    """One job in flight: its samples' engine requests, and what came back."""

    job: SampleJob
    served: Served
    stops: Stops
    request_ids: list[str]
    prompt_logprobs: list[float | None] | None
    topk_prompt: list[list[tuple[int, float]] | None] | None  # per prompt position (None: not scored)
    targets: torch.Tensor | None  # float32 [len(prompt) - 1, K]: target_prompt_logprobs
    done: dict[str, Completion] = field(default_factory=dict)
    queued: list[QueuedRequest] = field(default_factory=list)  # a full-parameter sampler's requests in the pool
    error: ServiceUserError | None = None  # the pool ended its requests with an error (its weights broke an engine)

    def result(self) -> bytes | ServiceUserError:
        if self.error is not None:
            return self.error
        decode = self.served.base.tokenizer.decode
        sequences, tops = [], []
        for rid in self.request_ids:
            c = self.done[rid]
            cut = stop_cut(c.token_ids, self.stops, decode)
            keep = len(c.token_ids) if cut is None else cut
            reason = "stop" if cut is not None or c.finish_reason == "stop" else "length"
            sequences.append(SampledSequenceOut(c.token_ids[:keep], c.logprobs[:keep], reason))
            tops.append(c.top_logprobs[:keep])
        payload = encode_sample_response(sequences, self.prompt_logprobs)
        if not self.job.topk_sample_logprobs and self.topk_prompt is None and self.targets is None:
            return payload
        msg = pb.SampleResponse.FromString(payload)
        if self.job.topk_sample_logprobs:
            for seq, per_token in zip(msg.sequences, tops):
                fill_topk(seq.topk_sampled_logprobs, per_token, self.job.topk_sample_logprobs)
        if self.topk_prompt is not None:
            fill_topk(msg.topk_prompt_logprobs, self.topk_prompt, self.job.topk_prompt_logprobs)
        if self.targets is not None:  # dense float32, the request's shape (to_torch() reads it as a sparse reply)
            out = msg.target_prompt_logprobs
            out.dense, out.dtype = self.targets.numpy().astype("<f4").tobytes(), pb.DTYPE_FLOAT32
            out.shape.extend(self.targets.shape)
        return msg.SerializeToString()


class Samplers:
    """The worker's samplers by sampler id (sampling_session_id). Every public method holds one lock, so publishes
    and sample batches run one at a time.

    max_num_seqs x max_model_len: each engine's KV-cache slots (allocated up front; a prompt plus its sample must fit
    in max_model_len, longer samples stop with "length"). max_adapters: LoRA samplers kept per base engine;
    max_full_samplers: full-parameter samplers kept (jobs of the pool). Past them the least recently used sampler is
    dropped (sampling it again is a user error that says to publish again). full_slots / full_sleeping /
    full_cache: the full-parameter pool's engines, sleeping engines kept per slot, tiered cache (FullSamplers)."""

    def __init__(self, bases: BaseModels, *, max_num_seqs: int = 32, max_model_len: int = 1024,
                 max_adapters: int = 32, max_full_samplers: int = 16, full_slots: int = 1, full_sleeping: int = 1,
                 full_cache: CacheSettings | None = None, seed: int | None = None) -> None:
        self.bases = bases
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_adapters = max_adapters
        self.seed = seed
        self.full = FullSamplers(slots=full_slots, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                 max_sleeping=full_sleeping, max_samplers=max_full_samplers, seed=seed,
                                 cache=full_cache)
        self._served: OrderedDict[str, Served] = OrderedDict()  # least recently used first
        self._engines: dict[str, ReferenceEngine] = {}  # base model name -> its shared engine
        self._watched: dict[str, list[int]] = {}  # request id -> tokens so far, for requests with stop strings
        self._pool_done = threading.Event()  # set by the pool's threads as a full-parameter request ends
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- publishing

    def publish(self, sampler_id: str, weights: SamplerWeights | None, base_model: str) -> None:
        """Serve `weights` (None: the base model itself) as `sampler_id`, replacing what it served before."""
        with self._lock:
            base = self.bases.get(weights.base_model if weights is not None else base_model)
            old = self._served.pop(sampler_id, None)
            if weights is not None and weights.adapter is None and weights.full_state is not None:
                self._release(old)  # (a full sampler's job stays attached: the push is its next version)
                job = self.full.publish(sampler_id, base, weights.full_state)
                self._served[sampler_id] = Served(base, None, None, job=job)
                self._evict_full()
                return
            self._release(old)
            self.full.drop(sampler_id)
            if weights is None or weights.adapter is None:
                self._served[sampler_id] = Served(base, self._shared(base), None)
            else:
                engine = self._shared(base)
                spec, state = weights.adapter
                name = adapter_name(sampler_id)
                engine.load_adapter(spec.model_copy(update={"name": name, "default": False}), state, weights.version)
                self._served[sampler_id] = Served(base, engine, name)
                self._evict_adapters(engine)

    def served(self, sampler_id: str) -> Served:
        served = self._served.get(sampler_id)
        if served is None:
            raise ServiceUserError(f"sampling_session_id {sampler_id!r}: not served here (never published, dropped "
                                   "for newer samplers, or the server restarted); save_weights_for_sampler or "
                                   "create_sampling_session again")
        return served

    def _shared(self, base: BaseModel) -> ReferenceEngine:
        engine = self._engines.get(base.name)
        if engine is None:
            engine = self._engines[base.name] = self._new_engine(base)
        return engine

    def _new_engine(self, base: BaseModel) -> ReferenceEngine:
        engine = ReferenceEngine(base.model, max_num_seqs=self.max_num_seqs,
                                 max_model_len=min(self.max_model_len, base.max_context_length),
                                 dtype=next(base.model.parameters()).dtype, seed=self.seed, model_name=base.name)
        engine.on_tokens = self._on_token
        return engine

    def _evict_full(self) -> None:
        """The full samplers the pool detached for newer ones (past max_full_samplers) are no longer served."""
        for sid in [sid for sid, s in self._served.items() if s.job is not None and s.job.detached]:
            del self._served[sid]

    def _release(self, old: Served | None) -> None:
        if old is not None and old.adapter is not None and old.engine is not None:
            old.engine.unload_adapter(old.adapter)

    def close(self) -> None:
        """Stop the full-parameter pool's threads (the LoRA engines are stepped by sample_many only)."""
        self.full.close()

    def _evict_adapters(self, engine: ReferenceEngine) -> None:
        on_engine = [sid for sid, s in self._served.items() if s.engine is engine and s.adapter is not None]
        for sid in on_engine[: max(0, len(on_engine) - self.max_adapters)]:
            self._release(self._served.pop(sid))

    # ---------------------------------------------------------------- sampling

    def sample_many(self, jobs: Sequence[SampleJob]) -> list[bytes | ServiceUserError]:
        """Run every job (all submitted before any engine steps: one batch across tenants); per job, in order, the
        serialized pb.SampleResponse or the ServiceUserError that refused it (nothing of it ran)."""
        with self._lock:
            slots: list[_Run | ServiceUserError] = []
            for job in jobs:
                try:
                    slots.append(self._submit(job))
                except ServiceUserError as exc:
                    slots.append(exc)
            runs = [s for s in slots if isinstance(s, _Run)]
            try:
                self._drive(runs)
            except BaseException:
                self._abort_all(runs)
                raise
            return [s.result() if isinstance(s, _Run) else s for s in slots]

    def _submit(self, job: SampleJob) -> _Run:
        served = self.served(job.sampler_id)
        self._served.move_to_end(job.sampler_id)
        check_supported(job)
        vocab = served.vocab_size
        stops = parse_stop(job.params.stop, vocab)
        max_len = served.max_model_len
        if not job.prompt:
            raise ServiceUserError("prompt: empty; give at least one token")
        if len(job.prompt) >= max_len:
            raise ServiceUserError(f"prompt: {len(job.prompt)} tokens leave no room to sample within this server's "
                                   f"max_model_len={max_len}")
        if min(job.prompt) < 0 or max(job.prompt) >= vocab:
            raise ServiceUserError(f"prompt: token ids must lie in [0, {vocab})")
        for name in ("topk_sample_logprobs", "topk_prompt_logprobs"):
            if not 0 <= getattr(job, name) <= vocab:
                raise ServiceUserError(f"{name}: must be in [0, the vocabulary size {vocab}], got {getattr(job, name)}")
        if job.num_samples < 1:
            raise ServiceUserError(f"num_samples: must be >= 1, got {job.num_samples}")
        requests = [GenerationRequest(f"tinker-{uuid.uuid4().hex}-{i}", list(job.prompt),
                                      engine_params(job, i, stops, max_len - len(job.prompt)), adapter=served.adapter)
                    for i in range(job.num_samples)]
        targets = job.target_prompt_logprobs
        if targets is not None and (targets.dim() != 2 or targets.shape[0] != len(job.prompt) - 1
                                    or bool(((targets < -1) | (targets >= vocab)).any())):
            raise ServiceUserError(f"target_prompt_logprobs: int64 [len(prompt) - 1 = {len(job.prompt) - 1}, K] "
                                   f"token ids in [0, {vocab}) or -1 expected, got shape {list(targets.shape)}")
        prompt_lps, topk_prompt, target_lps = self._prompt_logprobs(served, job)
        run = _Run(job, served, stops, [r.request_id for r in requests], prompt_lps, topk_prompt, target_lps)
        if served.job is not None:  # the pool runs it (stop strings are cut when it is back: run.result)
            try:
                run.queued = self.full.submit(served.job, requests, self._pool_done)
            except PoolError as exc:
                raise ServiceUserError(f"sampling_session_id {job.sampler_id!r}: {exc.message}") from None
            return run
        engine = served.engine
        assert engine is not None
        added: list[str] = []
        try:
            for req in requests:
                engine.add_request(req)
                added.append(req.request_id)
        except ValueError as exc:
            for rid in added:
                engine.abort(rid)
            raise ServiceUserError(f"prompt: {exc}") from None
        if stops.strings:
            for req in requests:
                self._watched[req.request_id] = []
        return run

    def _prompt_logprobs(
        self, served: Served, job: SampleJob
    ) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None, torch.Tensor | None]:
        """What the job asked of its prompt, under exactly the weights this sampler serves (its adapter on the same
        engine model): log p(prompt[i] | prompt[:i]) and/or the top-k tokens at each position i; None at position 0
        and before the last `prompt_logprobs_last_n` positions."""
        if not job.prompt_logprobs and not job.topk_prompt_logprobs and job.target_prompt_logprobs is None:
            return None, None, None

        def score(engine: Engine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            assert isinstance(engine, ReferenceEngine), "the samplers' engines are reference engines"
            with engine.adapters.rows([engine.adapters.resolve(served.adapter)]):
                return tuple(engine.model.prompt_logprobs(job.prompt, job.topk_prompt_logprobs,
                                                          job.target_prompt_logprobs))

        if served.job is not None:
            try:
                chosen, top_ids, top_lps, targets = self.full.on_engine(served.job, score)
            except PoolError as exc:
                raise ServiceUserError(f"sampling_session_id {job.sampler_id!r}: {exc.message}") from None
        else:
            assert served.engine is not None
            chosen, top_ids, top_lps, targets = score(served.engine)
        skip = 1 if job.prompt_logprobs_last_n is None else len(job.prompt) - job.prompt_logprobs_last_n
        values = [None] * skip + chosen.tolist()[skip - 1:]
        tops = [None] * skip + [list(zip(ids, lps))
                                for ids, lps in zip(top_ids.tolist()[skip - 1:], top_lps.tolist()[skip - 1:])]
        return ((values if job.prompt_logprobs else None), (tops if job.topk_prompt_logprobs else None),
                (targets if job.target_prompt_logprobs is not None else None))

    def _drive(self, runs: list[_Run]) -> None:
        """Step the engines until every run's samples are back (the pool's come back on its own threads);
        stop-string matches on the LoRA engines are aborted as they happen."""
        owner = {rid: run for run in runs for rid in run.request_ids}
        engines = list({id(run.served.engine): run.served.engine for run in runs
                        if run.served.engine is not None}.values())
        pooled = [run for run in runs if run.queued]
        while owner:
            self._pool_done.clear()  # (before collecting: a request ending meanwhile sets it again)
            for run in pooled:
                self._collect(owner, run)
            busy = [engine for engine in engines if engine.has_unfinished()]
            if not busy:
                local = [rid for rid, run in owner.items() if run.served.engine is not None]
                if local:
                    raise RuntimeError(f"{len(local)} samples never came back from their engines")
                if owner:
                    self._pool_done.wait(1.0)
                continue
            for engine in busy:
                for c in engine.step():
                    self._deliver(owner, c)
            for rid in [rid for rid, tokens in self._watched.items() if tokens and rid in owner]:
                run = owner[rid]
                if tail_matches(self._watched[rid], run.stops, run.served.base.tokenizer.decode):
                    for c in run.served.engine.abort(rid):
                        self._deliver(owner, c)

    def _collect(self, owner: dict[str, _Run], run: _Run) -> None:
        """A full-parameter run's requests the pool has ended: their sample, or the error that ended them."""
        for req in run.queued:
            if req.public_id not in owner or req.remaining > 0:
                continue
            owner.pop(req.public_id)
            if req.error is not None:
                run.error = ServiceUserError(f"sampling_session_id {run.job.sampler_id!r}: {req.error.message}")
            elif req.done:
                run.done[req.public_id] = req.done[0]
            else:  # its job was detached meanwhile (dropped for newer samplers)
                run.error = ServiceUserError(f"sampling_session_id {run.job.sampler_id!r}: dropped for newer "
                                             "samplers while sampling; save_weights_for_sampler again")

    def _deliver(self, owner: dict[str, _Run], c: Completion) -> None:
        run = owner.pop(c.request_id, None)
        self._watched.pop(c.request_id, None)
        if run is not None:
            run.done[c.request_id] = c

    def _on_token(self, request_id: str, index: int, token: int, logprob: float, version: int) -> None:
        tokens = self._watched.get(request_id)
        if tokens is not None:
            tokens.append(token)

    def _abort_all(self, runs: list[_Run]) -> None:
        """After a server error mid-batch: leave every engine idle for the next batch."""
        for run in runs:
            if run.served.job is not None:
                self.full.abort(run.served.job, [rid for rid in run.request_ids if rid not in run.done])
                continue
            assert run.served.engine is not None
            for rid in run.request_ids:
                self._watched.pop(rid, None)
                if rid not in run.done:
                    run.served.engine.abort(rid)


def check_supported(job: SampleJob) -> None:
    """Options this server does not compute -> ServiceUserError naming the field (the SDK would otherwise get
    a reply without them)."""
    refused = {
        "prompt_alt_tokens_k": job.prompt_alt_tokens_k > 0,
        "record_stability_info": job.record_stability_info,
    }
    for name, asked in refused.items():
        if asked:
            raise ServiceUserError(f"{name}: not supported by this server; send the request without it")
    last_n = job.prompt_logprobs_last_n
    scored = job.prompt_logprobs or job.topk_prompt_logprobs > 0
    if last_n is not None and (not scored or not 1 <= last_n <= len(job.prompt) - 1):
        raise ServiceUserError(f"prompt_logprobs_last_n: must be in [1, {len(job.prompt) - 1}] (the prompt's length "
                               f"- 1) and needs prompt_logprobs or topk_prompt_logprobs, got {last_n}")


def engine_params(job: SampleJob, index: int, stops: Stops, room: int) -> SamplingParams:
    """The engine's SamplingParams for sample `index` of `job` (one engine request per sample, n=1, seed + index:
    the seeds the engine gives a request's n samples, so results do not depend on how samples are batched)."""
    p = job.params
    max_tokens = room if p.max_tokens is None else p.max_tokens
    if max_tokens < 1:
        raise ServiceUserError(f"sampling_params.max_tokens: must be >= 1, got {max_tokens}")
    seed = p.seed
    if seed is not None and not 0 <= seed <= UINT64 - job.num_samples:
        raise ServiceUserError(f"sampling_params.seed: must be in [0, 2^64 - num_samples], got {seed}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise ServiceUserError(f"sampling_params.temperature: must be a finite number >= 0, got {p.temperature}")
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise ServiceUserError(f"sampling_params.top_p: must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise ServiceUserError(f"sampling_params.top_k: must be -1 (no limit) or >= 1, got {p.top_k}")
    return SamplingParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=max(p.top_k, 0), n=1, stop_token_ids=list(stops.token_ids),
                          seed=None if seed is None else seed + index, ignore_eos=stops.ignore_eos,
                          top_logprobs=job.topk_sample_logprobs)


def dense_targets(data: types.TensorData | None) -> torch.Tensor | None:
    """target_prompt_logprobs as sent (dense or sparse CSR) -> int64 token ids, -1 where nothing is asked."""
    if data is None:
        return None
    try:
        return data.to_torch(pad_value=-1).to(torch.int64)
    except (AssertionError, ValueError, RuntimeError, TypeError) as exc:
        raise ServiceUserError(f"target_prompt_logprobs: not a valid tensor ({exc})") from None


def fill_topk(out: pb.TopkLogprobs, rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> None:
    """A pb.TopkLogprobs [len(rows), k] of (token id, logprob) rows, best first; a None row (not scored) and a
    short row's tail get the SDK's sentinel (id 0, logprob MASK_LOGPROB)."""
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j], lps[i, j] = token, logprob
    out.token_ids, out.logprobs, out.k, out.length = ids.tobytes(), lps.tobytes(), k, len(rows)


def adapter_name(sampler_id: str) -> str:
    """The engine adapter name of a sampler (sampler ids carry ':', which adapter names may not)."""
    return "sampler-" + hashlib.sha256(sampler_id.encode()).hexdigest()[:24]
