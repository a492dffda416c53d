"""An OpenAI-style client bound to one agent session, in process.

    client = SessionClient(session)
    response = client.chat.completions.create(messages=messages, tools=tools, max_tokens=64)
    response.choices[0].message.tool_calls    # openai's own types

Agent code written against `openai.OpenAI().chat.completions.create` runs unchanged; every call is
one engine turn of the session, recorded exactly. Out of process, the black-box proxy
(rollwise.agent.proxy) serves the same per session over HTTP for the real `openai` client.
"""

from __future__ import annotations

import time
from typing import Any

from rollwise.agent.session import AgentSession, TurnResult


def chat_completion_dict(session: AgentSession, turn: TurnResult, model: str) -> dict[str, Any]:
    """OpenAI's chat.completion layout, plus the exact ids, logprobs and versions of the turn."""
    c = turn.completion
    prompt_tokens = len(c.prompt_ids)
    return {
        "id": f"chatcmpl-{c.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": turn.message(),
            "finish_reason": turn.finish_reason,
            "logprobs": {"content": [
                {"token": session.renderer.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(c.token_ids, c.logprobs)
            ]},
            "token_ids": list(c.token_ids),
            "policy_versions": list(c.versions),
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids),
                  "total_tokens": prompt_tokens + len(c.token_ids)},
        "session_id": session.id,
        # Where vLLM (and so classic verifiers' client, which reads only this spot) puts the prompt's ids with
        # `return_token_ids`: top level, not in the choice. The exact ids the engine continued from.
        "prompt_token_ids": list(c.prompt_ids),
    }


_UNSUPPORTED = {
    "stream": "streaming is not supported in agent sessions",
    "stop": "stop strings would cut sampled tokens (token-in/token-out); use stop_token_ids",
    "logit_bias": "not supported",
    "presence_penalty": "not supported",
    "frequency_penalty": "not supported",
}


def sampling_args(n: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """OpenAI request fields -> AgentSession.generate arguments; unsupported fields are an error."""
    if n not in (None, 1):
        raise ValueError("n must be 1: a session has one trajectory (run one session per sample)")
    for key, why in _UNSUPPORTED.items():
        if kwargs.get(key):
            raise ValueError(f"{key}: {why}")
    if kwargs.get("max_tokens") and kwargs.get("max_completion_tokens") and \
            kwargs["max_tokens"] != kwargs["max_completion_tokens"]:
        raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
    return {
        "max_tokens": kwargs.get("max_tokens") or kwargs.get("max_completion_tokens"),
        "temperature": kwargs.get("temperature"),
        "top_p": kwargs.get("top_p"),
        "seed": kwargs.get("seed"),
        "stop_token_ids": kwargs.get("stop_token_ids"),
    }


class _Completions:
    def __init__(self, client: SessionClient) -> None:
        self._client = client

    def create(self, *, messages: list[Any], tools: list[dict[str, Any]] | None = None, model: str | None = None,
               tool_choice: Any = None, **kwargs: Any) -> Any:
        from openai.types.chat import ChatCompletion

        if tool_choice not in (None, "auto", "none"):
            raise ValueError("tool_choice: only 'auto' and 'none' are supported (the model decides)")
        args = sampling_args(**kwargs)
        session = self._client.session
        with session.lock:
            turn = session.chat(messages, tools=tools, **args)
        return ChatCompletion.model_validate(chat_completion_dict(session, turn, model or self._client.model))


class _Chat:
    def __init__(self, client: SessionClient) -> None:
        self.completions = _Completions(client)


class SessionClient:
    def __init__(self, session: AgentSession, model: str = "rollwise-policy") -> None:
        self.session = session
        self.model = model
        self.chat = _Chat(self)
