"""vLLM's token-in route on the engine server: `POST /inference/v1/generate`.

vLLM 0.32 serves it (vllm/entrypoints/scale_out/token_in_token_out), and vLLM's own router
(`vllm-router`) forwards token-in requests to it, adding `"stream": false`. Serving the same request
and response shape lets that router, and other vLLM tooling, sit in front of rollwise engines unchanged.

Request (vLLM's GenerateRequest):

    {"token_ids": [...], "sampling_params": {max_tokens, temperature, top_p, top_k, n, seed,
     stop_token_ids, ignore_eos, min_tokens, repetition_penalty, frequency_penalty, presence_penalty,
     logprobs}, "request_id"?, "model"?, "stream"?: false, "return_token_ids"?, "output_mode"?: "tokens",
     "cache_salt"?}

verifiers 0.4.0 / prime-rl's train client (the `renderers` package) posts exactly this, with `logprobs: 1`,
`skip_special_tokens: false`, a `cache_salt` and the header X-Session-ID (the router's session key), and reads
each logprob entry's `token` ("token_id:<id>", as vLLM writes it with return_tokens_as_token_ids) and `logprob`.
`cache_salt` is honoured: prefix-cache entries are shared only among requests with the same salt.

Response (vLLM's GenerateTokensResponse): {request_id, model, created, output_mode: "tokens", usage
{prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details {cached_tokens}}, prompt_token_ids
(with return_token_ids), choices [{index, finish_reason, stop_reason, token_ids, logprobs {content
[{token: "token_id:<id>", token_id, logprob, rank, top_logprobs}]} (when sampling_params.logprobs is set),
weight_versions [{version, start, end}] (the policy version of every output token, as spans)}]}. `rank` is the sampled
token's place among the returned alternatives (None when it is not among them), not its vocabulary rank.

Unknown fields (top level and in sampling_params) are accepted and ignored as vLLM ignores them, and
named in the x-rollwise-ignored-fields header; so is `priority` (the engine schedules first come, first
served). What rollwise cannot do as asked is refused with a 400 naming the field: stream=true,
output_mode="text", multimodal inputs.
Like vLLM without a max_tokens, a request generates until max_model_len.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from rollwise.engine.service import EngineService
from rollwise.serve.errors import APIError, error_responses
from rollwise.serve.responses import FiniteJSONResponse
from rollwise.serve.openai_schemas import (
    MAX_TOP_LOGPROBS,
    CheckedJSON,
    GenerateRequest,
    LenientBody,
    SamplingFields,
    report_ignored,
)

ROUTE = "/inference/v1/generate"


# vLLM's request fields that rollwise serves one way only: field -> (is this value served?, why another is
# refused). A refused value is a 400 naming the field.
SERVED_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda value: not value, "must be false: streaming is not served on /inference/v1/generate "
                                        "(use /v1/completions with stream: true)"),
    "output_mode": (lambda value: value == "tokens",
                    "only 'tokens' is served; detokenize the token_ids, or use /v1/completions for text"),
    **dict.fromkeys(("features", "content_parts"), (
        lambda value: value is None, "is not supported: the engine has no multimodal inputs; leave it out")),
}


# vLLM SamplingParams fields that change what is sampled and that the engine cannot honour: accepted when off
# (unset, empty), refused otherwise with a 400 naming the field, never ignored (the tokens and logprobs would come
# from another distribution than the client asked for). min_p is refused by SamplingFields, on every route.
UNSERVED_SAMPLING = {
    "stop": "stop strings are not served on the token route: pass their ids in stop_token_ids",
    "logit_bias": "the engine samples without logit biases",
    "allowed_token_ids": "the engine samples from the whole vocabulary",
    "bad_words": "the engine samples without banned words",
    "structured_outputs": "the engine has no structured (guided) decoding",
    "guided_decoding": "the engine has no structured (guided) decoding",
    "logits_processors": "the engine runs no custom logits processors",
}


class VLLMSamplingParams(SamplingFields):
    """The vLLM SamplingParams fields the engine serves; vLLM's other fields are accepted and ignored, but those
    that would change the sampled distribution (UNSERVED_SAMPLING) are refused unless off."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # None: no logprobs; k: sampled + k best
    stop: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    logits_processors: Any = None

    @field_validator(*UNSERVED_SAMPLING)
    @classmethod
    def _off(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"is not supported ({UNSERVED_SAMPLING[info.field_name]}): leave it out")
        return value

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


class VLLMGenerateRequest(CheckedJSON, LenientBody):  # checked whole first, as every request body
    """vLLM 0.32's GenerateRequest, the fields rollwise can honour (see the module docstring)."""

    request_id: str | None = Field(None, min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: VLLMSamplingParams
    model: str | None = None
    stream: bool | None = False
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated serving: nothing to transfer here
    features: Any = None
    content_parts: Any = None

    @field_validator(*SERVED_ONLY)
    @classmethod
    def _as_served(cls, value: Any, info: ValidationInfo) -> Any:
        served, why = SERVED_ONLY[info.field_name]
        if not served(value):
            raise ValueError(why)
        return value


def as_rollwise(body: VLLMGenerateRequest) -> GenerateRequest:
    """The same request in /generate's terms (its checks and sampling run unchanged)."""
    sampling = body.sampling_params
    fields = {name: getattr(sampling, name) for name in SamplingFields.model_fields if name != "request_id"}
    if body.cache_salt is not None:  # vLLM's place for it is the top level (sampling_params' is honoured too)
        fields["cache_salt"] = body.cache_salt
    return GenerateRequest(prompt_ids=body.token_ids, top_logprobs=sampling.logprobs or 0,
                           request_id=body.request_id, **fields)


def _logprobs(choice: dict[str, Any]) -> dict[str, Any]:
    """vLLM's generate-shaped logprobs: the sampled token, then its top alternatives in rank order."""
    tops = choice.get("top_logprobs") or [[] for _ in choice["token_ids"]]
    content = []
    for token, logprob, top in zip(choice["token_ids"], choice["logprobs"], tops):
        alternatives = [{"token": f"token_id:{int(t)}", "token_id": int(t), "logprob": float(lp), "rank": rank}
                        for rank, (t, lp) in enumerate(top, start=1)]
        rank = next((a["rank"] for a in alternatives if a["token_id"] == token), None)
        content.append({"token": f"token_id:{token}", "token_id": token, "logprob": logprob, "rank": rank,
                        "top_logprobs": alternatives})
    return {"content": content}


def weight_versions(versions: list[int]) -> list[dict[str, Any]]:
    """vLLM's WeightVersionSpan list: output tokens [start, end) sampled by weights labelled `version`
    (rollwise's per-token policy versions, run-length encoded; a weight update mid-sample makes two)."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans


def as_vllm(result: dict[str, Any], body: VLLMGenerateRequest, model: str) -> dict[str, Any]:
    """/generate's answer in vLLM's GenerateTokensResponse shape."""
    choices = result["choices"]
    with_logprobs = body.sampling_params.logprobs is not None
    completion = sum(len(c["token_ids"]) for c in choices)
    prompt = len(result["prompt_ids"])
    cached = min((c["cached_prompt_tokens"] for c in choices), default=0)
    return {
        "request_id": result["request_id"],
        "model": model,
        "created": int(time.time()),
        "output_mode": "tokens",
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}},
        "prompt_token_ids": result["prompt_ids"] if body.return_token_ids else None,
        "kv_transfer_params": None,
        "choices": [{"index": c["index"], "finish_reason": c["finish_reason"] or "abort", "stop_reason": None,
                     "token_ids": c["token_ids"], "logprobs": _logprobs(c) if with_logprobs else None,
                     "weight_versions": weight_versions(c["versions"])}
                    for c in choices],
    }


def add_vllm_generate_route(app: FastAPI, server: EngineService) -> None:
    """Register POST /inference/v1/generate on the engine server's app."""

    @app.post(ROUTE, responses=error_responses(400, 404, 409, 413, 503))
    async def inference_generate(request: Request, body: VLLMGenerateRequest):  # noqa: ANN202
        server.check_model(body.model)
        server.check_prompt(body.token_ids, "token_ids")  # named as this route's field, before /generate's check
        try:
            result = await server.generate(request, as_rollwise(body))
        except ValueError as exc:  # a field of GenerateRequest's own checks (e.g. top_logprobs range)
            raise APIError(400, f"sampling_params: {exc}", "sampling_params") from exc
        return report_ignored(body, FiniteJSONResponse(as_vllm(result, body, server.model_name)))
