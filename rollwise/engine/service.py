"""The engine server's core: what each endpoint does, over one EngineFrontend (rollwise.engine.frontend).

Checks that name the field (model, prompt length and vocabulary, sampling limits), submitting a request
and following its samples to the end (or streaming them), the endpoint bodies; the routes that call these
are in rollwise.engine.server, the response shapes in rollwise.engine.openai_responses.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rollwise.engine.contract import Engine
from rollwise.engine.disk_weights import read_weights, refusal, weight_files
from rollwise.engine.frontend import EngineFrontend, Generation
from rollwise.engine.metrics import EngineCollector
from rollwise.engine.openai_responses import OpenAIResponses, sse
from rollwise.engine.samples import Detokenizer, Sample, longest_token_chars
from rollwise.engine.speculation.counters import counters_of
from rollwise.types.generation import Completion, SamplingParams
from rollwise.model.loading import tokenizer_fingerprint
from rollwise.serve.disconnect import unless_disconnected
from rollwise.serve.errors import APIError
from rollwise.serve.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAISampling,
    SamplingFields,
    UpdateWeightsRequest,
)
from rollwise.tasks.prompts import encode_prompt


class EngineService:
    """The HTTP handlers' logic over one EngineFrontend."""

    def __init__(self, engine: Engine, tokenizer: Any, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = int(engine.model_info().vocab_size)
        self.frontend = EngineFrontend(engine)
        self.detok = Detokenizer(tokenizer)
        self.shape = OpenAIResponses(self.detok)
        self.longest_token_chars = longest_token_chars(tokenizer)
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = EngineCollector(self.frontend)
        self.registry.register(self.collector)
        self.created = int(time.time())

    # ------------------------------------------------------------ checks shared by the endpoints

    def adapters(self) -> dict[str, int]:
        """The LoRA adapters the engine serves (name -> version); requests name one as their `model`."""
        return dict(self.engine.loaded_adapters())

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model / default policy)."""
        return None if model is None or model == self.model_name else model

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters():
            served = ", ".join([repr(self.model_name), *map(repr, sorted(self.adapters()))])
            raise APIError(404, f"model {model!r} is not served here; this server serves {served} "
                                "(a LoRA adapter is named after its push)", "model", kind="not_found_error")

    def check_prompt(self, ids: list[int], name: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{name} must not be empty", name)
        if len(ids) >= self.engine.max_model_len:  # first: a huge list is refused without walking it
            raise APIError(400, f"{name} has {len(ids)} tokens, which leaves no room to generate within "
                                f"max_model_len={self.engine.max_model_len}", name)
        for j, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"{name}[{j}] = {token} is outside the vocabulary [0, {self.vocab_size})", name)
        return ids

    def check_text_length(self, chars: int, name: str) -> None:
        """Refuse, without tokenizing, text that cannot fit: no token covers more than `longest_token_chars`
        characters, so text of chars >= longest * max_model_len has at least max_model_len tokens."""
        limit = self.longest_token_chars * self.engine.max_model_len
        if chars >= limit:
            raise APIError(400, f"{name} has {chars} characters, more than max_model_len="
                                f"{self.engine.max_model_len} tokens can hold (no token of this tokenizer is longer "
                                f"than {self.longest_token_chars} characters); shorten it", name)

    def params(self, body: SamplingFields, max_tokens: int | None) -> SamplingParams:
        longest = self.engine.max_model_len  # no sample is longer: the engine stops there
        if max_tokens is not None and max_tokens > longest:
            raise APIError(400, f"max_tokens ({max_tokens}) must be <= max_model_len ({longest}): no sample can be "
                                "longer than the engine's context", "max_tokens")
        if body.min_tokens > (max_tokens or longest):
            default = "" if max_tokens else ", the default: max_model_len"
            raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens or longest}"
                                f"{default})", "min_tokens")
        if body.n > self.engine.max_num_seqs:
            raise APIError(400, f"n must be <= max_num_seqs ({self.engine.max_num_seqs}): a request's samples share "
                                "one prefill and run together", "n")
        for j, token in enumerate(body.stop_token_ids):
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"stop_token_ids[{j}] = {token} is outside the vocabulary "
                                    f"[0, {self.vocab_size})", "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens or self.engine.max_model_len,  # the engine stops at max_model_len anyway
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            n=body.n,
            stop_token_ids=list(body.stop_token_ids),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            top_logprobs=body.num_top_logprobs(),
        )

    # ------------------------------------------------------------ running a request

    async def _pump(self, gen: Generation, samples: dict[tuple[str, int], Sample]) -> list[Sample]:
        """Wait for events (a list per engine step), apply every one queued; return the samples that changed."""
        events = await gen.queue.get()
        while not gen.queue.empty():
            events = events + gen.queue.get_nowait()
        changed: dict[int, Sample] = {}
        for event in events:
            if event[0] == "error":
                raise APIError(503, f"the engine failed: {event[1]}", kind="server_error")
            if event[0] == "token":
                _, rid, index, token, logprob, version = event
                sample = samples[(rid, index)]
                sample.add(token, logprob, version)
            else:
                completion: Completion = event[1]
                key = (completion.request_id, completion.index)
                sample = samples.get(key)
                if sample is None or sample.engine_done:
                    continue
                sample.finish(completion)
                gen.pending.discard(key)
            changed[id(sample)] = sample
        # Every sample of an engine request past a stop string: stop spending steps on it.
        for rid, size in zip(gen.engine_ids, gen.sizes):
            group = [samples[(rid, i)] for i in range(size)]
            if rid not in gen.aborting and all(s.finished for s in group) and not all(s.engine_done for s in group):
                gen.aborting.add(rid)
                await self.frontend.abort_engine([rid])
        return list(changed.values())

    async def _start(
        self, prefix: str, body: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
        stops: list[str], stream: bool, decode: bool = True, split: bool = False,
    ) -> tuple[Generation, list[Sample], dict[tuple[str, int], Sample]]:
        """Submit; choice p * n + i is sample i of prompt p. With `split`, every choice is its own
        engine request (n=1, seed + i: the same samples as one n-sample request, and the engine still
        shares the prefill of requests admitted together), so a stop string can end just that one."""
        params = self.params(body, max_tokens)
        n = params.n
        if split:
            units = [(ids, replace(params, n=1, seed=None if params.seed is None else params.seed + i))
                     for ids in prompts for i in range(n)]
        else:
            units = [(ids, params) for ids in prompts]
        public_id = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        gen = await self.frontend.submit(public_id, units, stream_tokens=stream or bool(stops),
                                         adapter=self.adapter_of(getattr(body, "model", None)),
                                         cache_salt=body.cache_salt)
        detok = self.detok if decode else None
        ordered = [Sample(p * n + i, ids, detok, stops) for p, ids in enumerate(prompts) for i in range(n)]
        if split:
            by_key = {(rid, 0): s for rid, s in zip(gen.engine_ids, ordered)}
        else:
            by_key = {(gen.engine_ids[s.index // n], s.index % n): s for s in ordered}
        return gen, ordered, by_key

    async def _run_to_end(self, gen: Generation, by_key: dict[tuple[str, int], Sample]) -> None:
        try:
            while gen.pending:
                await self._pump(gen, by_key)
        finally:
            self.frontend.release(gen)
        self._count(by_key.values())

    def _count(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.frontend.finished_samples[s.finish_reason or "abort"] += 1

    # ------------------------------------------------------------ OpenAI layout

    async def _stream(
        self, chat: bool, gen: Generation, samples: list[Sample], by_key: dict[tuple[str, int], Sample],
        prompts: list[list[int]], include_usage: bool,
    ) -> AsyncIterator[str]:
        head = {"id": gen.public_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        try:
            if chat:  # OpenAI opens each choice with the assistant role
                yield sse({**head, "choices": [
                    {"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None, "prompt_token_ids": s.prompt_ids} for s in samples
                ]})
                for s in samples:
                    s.announced = True
            while not all(s.closed for s in samples):
                changed = await self._pump(gen, by_key)
                choices = [c for s in sorted(changed, key=lambda s: s.index) if (c := self.shape.delta(chat, s))]
                if choices:
                    yield sse({**head, "choices": choices})
            self._count(samples)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.shape.usage(prompts, samples)})
            yield sse("[DONE]")
        except APIError as exc:
            yield sse(exc.body())
        finally:
            self.frontend.release(gen)

    async def openai(self, request: Request, chat: bool, body: OpenAISampling, prompts: list[list[int]],
                     max_tokens: int | None):
        gen, samples, by_key = await self._start(
            "chatcmpl" if chat else "cmpl", body, prompts, max_tokens, body.stop, body.stream, split=True
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(chat, gen, samples, by_key, prompts, include_usage),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        await unless_disconnected(request, self._run_to_end(gen, by_key))
        return {
            "id": gen.public_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self.shape.choice(chat, s) for s in samples],
            "usage": self.shape.usage(prompts, samples),
        }

    # ------------------------------------------------------------ endpoint bodies

    async def chat_completions(self, request: Request, body: ChatCompletionRequest):
        self.check_model(body.model)
        if body.max_tokens and body.max_completion_tokens and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them", "max_tokens")
        messages = [m.for_template() for m in body.messages]
        # The template adds text, so the messages' own text bounds the rendered prompt from below.
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        try:  # off the event loop: rendering and tokenizing a long conversation must not stall /health
            prompt = await asyncio.to_thread(encode_prompt, self.tokenizer, messages, body.tools)
        except Exception as exc:  # noqa: BLE001 - no template, or the template rejects the conversation
            raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages") from exc
        self.check_prompt(prompt, "messages")
        return await self.openai(request, True, body, [prompt], body.max_tokens or body.max_completion_tokens)

    async def completions(self, request: Request, body: CompletionRequest):
        self.check_model(body.model)
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of is not supported (it must equal n)", "best_of")
        names = ["prompt" if len(body.prompt) == 1 else f"prompt[{i}]" for i in range(len(body.prompt))]
        for name, prompt in zip(names, body.prompt):
            if isinstance(prompt, str):
                self.check_text_length(len(prompt), name)
        texts = [p for p in body.prompt if isinstance(p, str)]
        encoded = iter(await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts]) if texts else [])
        prompts = [self.check_prompt(next(encoded) if isinstance(p, str) else p, name)
                   for name, p in zip(names, body.prompt)]
        result = await self.openai(request, False, body, prompts, body.max_tokens)
        if body.echo:  # never streamed (the request model refuses echo with stream)
            self.shape.echo(result, body, prompts)
        return result

    async def generate(self, request: Request, body: GenerateRequest) -> dict[str, Any]:
        prompt = self.check_prompt(body.prompt_ids, "prompt_ids")
        gen, samples, by_key = await self._start("gen", body, [prompt], body.max_tokens, [], False, decode=False)
        await unless_disconnected(request, self._run_to_end(gen, by_key))
        return {
            "request_id": gen.public_id,
            "prompt_ids": prompt,
            "choices": [
                {"index": s.index, "token_ids": s.token_ids, "logprobs": s.logprobs, "versions": s.versions,
                 **({"top_logprobs": s.top_logprobs} if s.top_logprobs else {}),
                 **({"routed_experts": s.routed_experts.to_wire()} if s.routed_experts is not None else {}),
                 **({"migrations": s.migrations} if s.migrations else {}),  # live migrations (migration_http.py)
                 "finish_reason": s.finish_reason, "cached_prompt_tokens": s.cached_prompt_tokens}
                for s in samples
            ],
        }

    async def update_weights_from_disk(self, body: UpdateWeightsRequest) -> dict[str, Any]:
        """Load a model's files as `body.version`, checked whole first (rollwise.engine.disk_weights)."""
        files = weight_files(Path(body.path).expanduser())
        old = self.engine.policy_version
        weights = await asyncio.to_thread(read_weights, files)
        refused = await asyncio.to_thread(refusal, weights, self.engine.expected_weights, body.version, old)
        if refused is not None:
            raise refused
        try:  # (the engine checks the version again, on its thread: another update may have landed meanwhile)
            await self.frontend.call(lambda engine: engine.apply_weights(weights.state, body.version))
        except ValueError as exc:
            raise APIError(400, f"weights rejected, still serving policy version {old}: {exc}", "path") from exc
        return {"policy_version": body.version, "previous_version": old, "tensors": len(weights.state),
                "files": [str(f) for f in files]}

    def model_info(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "engine": self.engine.name,
            "vocab_size": self.vocab_size,
            "tokenizer_vocab_size": len(self.tokenizer),
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.engine.max_num_seqs,
            "eos_token_ids": sorted(self.engine.eos_token_ids),
            "tokenizer_fingerprint": self.fingerprint,
            "policy_version": self.engine.policy_version,
            "paused": self.engine.paused,
        }

    async def metrics(self) -> Response:
        def snapshot(engine: Engine) -> dict[str, Any]:
            return {"running": engine.num_running, "waiting": engine.num_waiting, "paused": engine.paused,
                    "policy_version": engine.policy_version, **engine.stats,
                    "prefix_cache_tokens": engine.prefix_cache_tokens,
                    "speculation": counters_of(engine)}  # None: the engine keeps no draft counters (vLLM)

        snap = await self.frontend.call(snapshot)
        snap["step_seconds"] = self.frontend.worker.step_seconds if self.frontend.worker is not None else 0.0
        self.collector.snapshot = snap
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

