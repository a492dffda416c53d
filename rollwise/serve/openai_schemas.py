"""The request bodies of the engine server's OpenAI-compatible and token-level endpoints (pydantic).

Shared by the engine server and the pool; kept apart from the server so the wire format reads in one place.

What clients send to vLLM works here: on the OpenAI endpoints, unknown fields are accepted and
ignored, as vLLM does (agent frameworks send many), and reported back in the response header
`x-rollwise-ignored-fields` (and logged once per field name). Known fields are checked: a bad value
is a 400 naming it. Non-finite numbers (JSON `Infinity`/`NaN`, which Python's json parser accepts)
are refused everywhere, and so are, anywhere in a body, nesting past 64 levels and lone surrogates
(`CheckedJSON`, before any field is read) and token counts past int32. The token-level and control bodies (/generate, /abort, weights, the pool's)
stay strict: a misspelt field there is a bug in our own caller.
"""

from __future__ import annotations

import json
import logging
import re
from urllib.parse import quote
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollwise.serve.errors import ProblemAt
from rollwise.serve.json_bounds import json_problem, loads_bounded

log = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-rollwise-ignored-fields"
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# Token counts past int32 fit no context window, and overflow engines' integer types on the way (vLLM's
# serialisation to its engine core): refused at the schema instead of hanging a request.
MAX_TOKEN_COUNT = 2**31 - 1
# Logits are divided (or multiplied) by the penalty: 5e-324 overflowed them to inf and the logprobs to NaN (found by
# fuzzing). vLLM and HF take any value > 0; useful ones lie well inside this range.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# Below this a temperature divides the logits into inf and the sampled logprobs into NaN (5e-324 sampled token 0
# with logprob NaN); vLLM treats such temperatures as greedy, and so do we.
GREEDY_TEMPERATURE_EPS = 1e-5


def greedy_below_epsilon(temperature: float | None) -> float | None:
    return 0.0 if temperature is not None and 0 < temperature < GREEDY_TEMPERATURE_EPS else temperature


class CheckedJSON(BaseModel):
    """A request body checked whole before its fields are read: nesting at most MAX_JSON_DEPTH levels and text
    that is valid Unicode, anywhere in it, unknown fields included (rollwise.serve.json_bounds). A 400 names the
    place, e.g. `messages[2].content`."""

    @model_validator(mode="before")
    @classmethod
    def _sound_json(cls, value: Any) -> Any:
        problem = json_problem(value)
        if problem is not None:
            raise ProblemAt(*problem)
        return value


class RequestBody(CheckedJSON):
    # a misspelt field is an error, not silently ignored; inf/nan are never a valid sampling value
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LenientBody(BaseModel):
    """An OpenAI body: unknown fields are kept aside (model_extra) and reported, never used."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def _not_supported(value: Any, what: str) -> Any:
    if value:
        raise ValueError(f"is not supported ({what})")
    return value


class SamplingChecks(RequestBody):
    """The checks between sampling fields that every server's sampling body applies (engine server, router,
    pool): a temperature below 1e-5 is greedy, and min_tokens fits within max_tokens. The fields themselves are
    redeclared by each body with its own defaults and bounds (the pool's are concrete, the OpenAI endpoints' None)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, value: float | None) -> float | None:
        return greedy_below_epsilon(value)

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingChecks:
        # (against the engine's default max_tokens, max_model_len, the engine service checks it)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ProblemAt("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self


class SamplingFields(SamplingChecks):
    """Sampling fields shared by every generation endpoint (engine SamplingParams)."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)  # None: until max_model_len
    temperature: float | None = Field(None, ge=0)  # None: 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)  # 0: off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, le=2**62)
    stop_token_ids: list[int] = []  # finish with "stop" on these ids (kept in token_ids, like EOS)
    ignore_eos: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=256)  # public id for /abort
    # vLLM's cache_salt: prefix-cache entries are shared only among requests with the same salt (None: unsalted)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_COUNT)  # no EOS / stop token before this many tokens
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)  # None: 1.0 (off)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)  # None: 0; vLLM's range
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM's min_p changes what is sampled and the engine cannot honour it: 0 (off) is accepted, anything else is
    # refused rather than ignored (ignored, the tokens and logprobs would come from another distribution than asked).
    min_p: float | None = None

    @field_validator("min_p")
    @classmethod
    def _min_p_off(cls, value: float | None) -> float | None:
        return _not_supported(value, "the engine samples without min_p: leave it out or 0")

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, value: Any) -> Any:
        return 0 if value == -1 else value  # vLLM's (and older OpenAI clients') spelling of "off"

    def num_top_logprobs(self) -> int:
        """How many alternatives per token the response shows (the endpoints that can show them override)."""
        return 0


class StreamOptions(LenientBody):
    include_usage: bool = False


class OpenAISampling(SamplingFields):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # unknown fields: ignored, reported

    model: str | None = None
    stop: Any = []  # str | list[str]: OpenAI stop strings, cut from the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if not all(value):
            raise ValueError("must not contain empty strings")
        return value

    @model_validator(mode="after")
    def _no_streamed_alternatives(self) -> OpenAISampling:
        if self.stream and self.num_top_logprobs():
            raise ValueError("is refused: top alternatives (top_logprobs, or completions logprobs > 0) are only "
                             "returned with stream: false")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: Any) -> Any:
        return _not_supported(value, "the reference engine samples without logit biases")


class FunctionCall(LenientBody):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a mapping is taken too

    @field_validator("arguments")
    @classmethod
    def _bounded(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        """A JSON string that nests too deeply is refused here (templates and json.dumps would recurse on it
        later); a string that is not JSON is kept as written, as a model may have written it."""
        if isinstance(value, str):
            _, problem = loads_bounded(value)
            if problem is not None:
                raise ValueError(problem)
        return value


class ToolCallMessage(LenientBody):
    """A call in an assistant message's tool_calls (OpenAI layout)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(LenientBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _calls_without_text(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("content") is None and value.get("tool_calls"):
            return {**value, "content": ""}  # OpenAI sends content: null next to tool_calls
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):  # OpenAI content parts: only text ones can be served
            texts = []
            for i, part in enumerate(value):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"part {i} must be {{'type': 'text', 'text': <string>}} (only text is supported)")
                texts.append(part["text"])
            return "".join(texts)
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it. Tool-call arguments arrive as a JSON string; templates
        (Qwen, Llama 3, Hermes) expect a mapping, so valid JSON is parsed, as vLLM does."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_parsed_arguments(call.model_dump(exclude_none=True)) for call in self.tool_calls]
        return message


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass  # not JSON: the template gets the string as sent
    return call


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # the sampled tokens' logprobs are always returned
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (logprobs: true)
    tools: list[dict[str, Any]] | None = None  # OpenAI function specs, passed to the chat template
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "auto", "none"):
            raise ValueError("is not supported: only 'auto' and 'none' (no constrained decoding here: "
                             "the model decides whether to call a tool)")
        return value

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("is refused: top_logprobs needs logprobs: true (as in OpenAI's API and vLLM)")
        return self

    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0


class CompletionRequest(OpenAISampling):
    prompt: Any = Field(...)  # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: bool = False  # the prompt's text (and tokens, with null logprobs) before the completion
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        """Normalised to a list of prompts, each text or token ids."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if ids(value):
                return [value]
            if all(isinstance(x, str) for x in value) or all(ids(x) for x in value):
                return value
        if value == []:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of token ids, or a list of either")

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @model_validator(mode="after")
    def _no_streamed_echo(self) -> CompletionRequest:
        if self.echo and self.stream:
            raise ValueError("is refused: echo is only supported with stream: false")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _not_supported(value, "no insertion mode")


class GenerateRequest(SamplingFields):
    prompt_ids: list[int] = Field(min_length=1)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # per token: the best (token id, logprob) pairs

    def num_top_logprobs(self) -> int:
        return self.top_logprobs


class AbortRequest(RequestBody):
    request_id: str = Field(min_length=1)


class UpdateWeightsRequest(RequestBody):
    path: str = Field(min_length=1)  # a .safetensors file, or a HF model directory holding them
    version: int = Field(ge=0)


# ==================================================================== unknown fields: ignored, reported


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Paths of the unknown fields a lenient body (and the bodies inside it) set aside, e.g. 'messages[0].x'."""
    found = [prefix + name for name in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                found += ignored_fields(item, f"{prefix}{name}{'' if i is None else f'[{i}]'}.")
    return found


_logged: set[str] = set()
MAX_LOGGED_NAMES = 1000
MAX_HEADER_CHARS = 2000


def report_ignored(body: BaseModel, result: Any) -> Any:
    """`result` (a handler's dict or Response) with the ignored fields in a header; each field name
    is logged once per process, so a framework sending the same extras on every call logs them once."""
    names = ignored_fields(body)
    if not names:
        return result
    for generic in dict.fromkeys(re.sub(r"\[\d+\]", "[]", n) for n in names):
        if generic not in _logged and len(_logged) < MAX_LOGGED_NAMES:  # client-chosen names: bounded memory
            _logged.add(generic)
            log.warning("ignoring unknown request field %r (as vLLM does); reported in the %s header",
                        generic, IGNORED_FIELDS_HEADER)
    response = result if isinstance(result, Response) else JSONResponse(result)
    # Field names are client text: percent-encoded (headers are Latin-1; a raw "é" made a 500) and capped.
    value = ",".join(quote(n, safe="[]._-") for n in names)
    if len(value) > MAX_HEADER_CHARS:
        value = value[:MAX_HEADER_CHARS].rsplit(",", 1)[0] + ",..."
    response.headers[IGNORED_FIELDS_HEADER] = value
    return response

