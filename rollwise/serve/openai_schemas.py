"""The request bodies of the engine server's OpenAI-compatible and token-level endpoints (pydantic).

Shared by the engine server and the pool; kept apart from the server so the wire format reads in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored


def _not_supported(value: Any, what: str) -> Any:
    if value:
        raise ValueError(f"is not supported ({what})")
    return value


class SamplingFields(RequestBody):
    """Sampling fields shared by every generation endpoint (engine SamplingParams)."""

    max_tokens: int | None = Field(None, ge=1)  # None: until max_model_len
    temperature: float | None = Field(None, ge=0)  # None: 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, le=2**62)
    stop_token_ids: list[int] = []  # finish with "stop" on these ids (kept in token_ids, like EOS)
    ignore_eos: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=256)  # public id for /abort


class StreamOptions(RequestBody):
    include_usage: bool = False


class OpenAISampling(SamplingFields):
    model: str | None = None
    stop: Any = []  # str | list[str]: OpenAI stop strings, cut from the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
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

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        return _not_supported(value, "the reference engine samples without penalties; send 0 or leave it out")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: Any) -> Any:
        return _not_supported(value, "the reference engine samples without logit biases")


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None

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


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # accepted; the sampled tokens' logprobs are always returned
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top(cls, value: int | None) -> int | None:
        return _not_supported(value, "only the sampled tokens' logprobs are returned")


class CompletionRequest(OpenAISampling):
    prompt: Any = Field(...)  # str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
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

    @field_validator("logprobs")
    @classmethod
    def _no_top(cls, value: int | None) -> int | None:
        return _not_supported(value, "top alternatives are not returned; the sampled tokens' logprobs always are")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return _not_supported(value, "prompt_token_ids carries the prompt")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _not_supported(value, "no insertion mode")


class GenerateRequest(SamplingFields):
    prompt_ids: list[int] = Field(min_length=1)


class AbortRequest(RequestBody):
    request_id: str = Field(min_length=1)


class UpdateWeightsRequest(RequestBody):
    path: str = Field(min_length=1)  # a .safetensors file, or a HF model directory holding them
    version: int = Field(ge=0)
