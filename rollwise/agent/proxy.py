"""The black-box proxy: an OpenAI-compatible endpoint per session, so any agent framework can be trained.

Point the framework's OpenAI client at `http://HOST:PORT/sessions/<session id>/v1` and run it as is.
Every chat completion becomes one engine turn of that session: the proxy renders the conversation
through the chat template itself, sends *token ids* to the engine (or router) over `POST /generate`,
and records the exact sampled ids, logprobs and policy versions (rollwise.agent.trajectory).

    POST   /sessions/{id}/v1/chat/completions   OpenAI chat completions (tools, tool_calls); the session is
                                                created on first use. Responses also carry token_ids and
                                                policy_versions; stream, n > 1 and stop strings are refused
    GET    /sessions/{id}/v1/models, /v1/models the served model
    GET    /sessions/{id}/trajectory            the trajectory so far (segments: ids, mask, logprobs, versions)
    POST   /sessions/{id}/finish {reward?}      close the session: no more turns; returns the trajectory
    DELETE /sessions/{id}                       forget it (returns the trajectory one last time)
    GET    /sessions                            ids, turns and state of the sessions held

Errors are OpenAI's error JSON naming the field: 400 for a bad request, 404 for an unknown session,
409 for a finished session, 413 for a body over --max-request-bytes (refused before it is read), 429 with
code max_turns / max_tokens / context when a session limit is reached (a conversation that cannot fit the
engine's context is refused before it is tokenized), 502 when the engine fails. A failed turn leaves the
trajectory as it was (nothing recorded twice: the retried request generates the turn once).

Run it: `python -m rollwise.agent.proxy --upstream http://127.0.0.1:8000 --model tiny:0 --port 8100`
(upstream: `rollwise serve engine` or `rollwise serve router`; the tokenizer fingerprints must match).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from pydantic import ConfigDict, Field, field_validator

from rollwise.agent.client import chat_completion_dict, sampling_args
from rollwise.agent.episode import end_session, intercept
from rollwise.agent.generator import Generator, UpstreamError
from rollwise.agent.messages import MessageError
from rollwise.agent.session import AgentSession, LimitReached, SessionLimits
from rollwise.engine.retention_policy import ToolLatencies
from rollwise.serve.errors import APIError, error_responses
from rollwise.serve.front import Front, install_front
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES, check_max_request_bytes
from rollwise.serve.settings import FrontSettings
from rollwise.serve.openai_schemas import MAX_TOKEN_COUNT, ChatMessage, CheckedJSON, RequestBody, report_ignored

SESSION_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class ProxyError(APIError):
    """A refusal, as every rollwise server answers it (rollwise.serve.errors)."""


class ChatRequest(CheckedJSON):
    """The OpenAI fields an agent session serves. Unknown fields are ignored, as vLLM does (agent
    frameworks send many), and named in the x-rollwise-ignored-fields response header; known fields
    the session cannot honour are refused by name. Messages are the engine server's (shared checks: roles,
    text content, tool calls in OpenAI's layout); the body is checked whole first (nesting, Unicode)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_COUNT)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    logprobs: bool | None = None  # accepted: the sampled tokens' logprobs are always returned
    top_logprobs: int | None = Field(None, ge=0, le=0)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value not in (None, "auto", "none"):
            raise ValueError("only 'auto' and 'none' are supported (the model decides)")
        return value


class FinishRequest(RequestBody):  # strict: a misspelt field is refused, and so is a non-finite reward
    reward: float | None = None


class SessionStore:
    """Sessions by id; created on first use with the proxy's defaults."""

    def __init__(self, generator: Generator, tokenizer: Any, limits: SessionLimits, parser: str,
                 temperature: float, max_sessions: int) -> None:
        self.generator, self.tokenizer, self.limits, self.parser = generator, tokenizer, limits, parser
        self.temperature, self.max_sessions = temperature, max_sessions
        self.describe_tools = True
        self.info = generator.info()
        self.sessions: dict[str, AgentSession] = {}
        self.finished: dict[str, float | None] = {}  # session id -> reward given at finish
        # Session KV retention (issue 21): a turn that asks for tools is reported to the engine; the time
        # until the agent's next call is that tool's latency, learned per tool.
        self.latencies = ToolLatencies()
        self.tool_out: dict[str, tuple[str, float]] = {}  # session id -> (tool, when its call was returned)
        self._lock = threading.Lock()

    def get(self, session_id: str, create: bool = False) -> AgentSession:
        if not SESSION_ID.match(session_id):
            raise ProxyError(400, f"session id {session_id!r} must be 1-128 characters of A-Z a-z 0-9 _ . : -",
                             "session_id")
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                if not create:
                    raise ProxyError(404, f"no session {session_id!r}", "session_id", kind="not_found_error")
                if len(self.sessions) >= self.max_sessions:
                    raise ProxyError(429, f"the proxy holds max_sessions={self.max_sessions} sessions: finish and "
                                     "DELETE old ones", kind="rate_limit_error")
                session = AgentSession(self.generator, self.tokenizer, session_id=session_id, limits=self.limits,
                                       parser=self.parser, temperature=self.temperature, info=self.info)
                self.sessions[session_id] = session
            return session


def _turn(store: SessionStore, session: AgentSession, body: ChatRequest, model: str) -> dict[str, Any]:
    """Runs on a worker thread: one session turn, holding the session's lock."""
    fields = body.model_dump(exclude={"messages", "tools", "tool_choice", "model", "parallel_tool_calls", "logprobs",
                                      "top_logprobs", "user", "metadata", "store", "stream_options",
                                      *(body.model_extra or {})})
    try:
        args = sampling_args(**fields)
    except ValueError as exc:
        raise ProxyError(400, str(exc), str(exc).split(":")[0]) from exc
    with session.lock:
        if session.id in store.finished:
            raise ProxyError(409, f"session {session.id!r} is finished", "session_id", kind="conflict")
        # describe_tools=False: the tools' specs stay out of the prompt (the caller's own prompt shows the call
        # format, as agent.describe_tools does); the model's calls are parsed and returned all the same.
        tools = body.tools if body.tool_choice != "none" and store.describe_tools else None
        if session.id in store.tool_out:  # the agent is back from its tool
            tool, since = store.tool_out.pop(session.id)
            store.latencies.observe(tool, time.monotonic() - since)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            turn = session.chat(messages, tools=tools, **args)
        except MessageError as exc:
            raise ProxyError(400, str(exc), "messages") from exc
        except LimitReached as exc:
            raise ProxyError(429, str(exc), None, kind="session_limit", code=exc.reason) from exc
        except UpstreamError as exc:
            raise ProxyError(502, f"the engine failed: {exc.message}", kind="server_error") from exc
        except ValueError as exc:  # refused by the engine (e.g. a prompt past max_model_len)
            raise ProxyError(400, f"the engine refused the turn: {exc}") from exc
        if turn.parsed.wants_tools:
            _intercept(store, session, turn)
        return chat_completion_dict(session, turn, model)


def _intercept(store: SessionStore, session: AgentSession, turn: Any) -> None:
    """Tell the engine this turn ended in a tool call. Best effort: an engine that cannot keep the KV
    costs only recomputation, so an upstream failure here is not the agent's problem."""
    calls = [*turn.parsed.calls, *turn.parsed.errors]
    tool = getattr(calls[0], "name", None) or "tool"
    store.tool_out[session.id] = (tool, time.monotonic())
    try:
        intercept(session, turn, tool, store.latencies.expected(tool))
    except UpstreamError:
        pass


def _end(store: SessionStore, session: AgentSession) -> None:
    store.tool_out.pop(session.id, None)
    try:
        end_session(session)
    except UpstreamError:
        pass


def create_proxy_app(generator: Generator, tokenizer: Any, *, model_name: str = "rollwise-policy",
                     limits: SessionLimits | None = None, parser: str = "hermes", temperature: float = 1.0,
                     max_sessions: int = 10_000, max_concurrent_turns: int = 256,
                     fingerprint: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                     front: Front | None = None, describe_tools: bool = True) -> FastAPI:
    """The proxy over `generator` (an HTTPGenerator to an engine/router, or a LocalGenerator).
    `fingerprint`: this tokenizer's; refused when the engine reports a different one (invariant 1).
    `front`: the serving front (rollwise.serve.front; default: loopback, no keys, bodies over `max_request_bytes`
    refused with 413 before they are read), as on every rollwise server."""
    check_max_request_bytes(max_request_bytes)
    front = front or Front(FrontSettings(max_request_bytes=max_request_bytes))
    store = SessionStore(generator, tokenizer, limits or SessionLimits(), parser, temperature, max_sessions)
    store.describe_tools = describe_tools
    engine_fp = store.info.tokenizer_fingerprint
    if fingerprint and engine_fp and fingerprint != engine_fp:
        raise ValueError(f"the engine's tokenizer (fingerprint {engine_fp[:12]}…) differs from the proxy's "
                         f"({fingerprint[:12]}…): token ids would mean different text; use the engine's model spec")
    app = FastAPI(title="rollwise agent proxy", summary="OpenAI-compatible endpoint per session, exact trajectories")
    app.state.store = store
    created = int(time.time())
    executor = ThreadPoolExecutor(max_workers=max_concurrent_turns, thread_name_prefix="proxy-turn")

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "rollwise"}]}

    @app.post("/sessions/{session_id}/v1/chat/completions", responses=error_responses(400, 404, 409, 413, 429, 502))
    async def chat_completions(session_id: str, body: ChatRequest) -> dict[str, Any]:
        if body.model is not None and body.model != model_name:
            raise ProxyError(404, f"model {body.model!r} is not served here; this proxy serves {model_name!r}",
                             "model", kind="not_found_error")
        session = store.get(session_id, create=True)
        # A turn blocks its thread for the whole generation: a pool sized for many sessions at once
        # (asyncio's default pool has only cores + 4 threads).
        result = await asyncio.get_running_loop().run_in_executor(executor, _turn, store, session, body, model_name)
        return report_ignored(body, result)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        return models()

    @app.get("/v1/models")
    async def all_models() -> dict[str, Any]:
        return models()

    def _trajectory(session: AgentSession) -> dict[str, Any]:
        with session.lock:
            traj = session.trajectory()
        out = traj.to_dict()
        out["finished"] = session.id in store.finished
        if out["finished"]:
            out["reward"] = store.finished[session.id]
        return out

    async def _off_loop(fn, *args):  # noqa: ANN001, ANN202 - waits for a running turn without blocking the loop
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    @app.get("/sessions/{session_id}/trajectory", responses=error_responses(400, 404))
    async def trajectory(session_id: str) -> dict[str, Any]:
        return await _off_loop(_trajectory, store.get(session_id))

    @app.post("/sessions/{session_id}/finish", responses=error_responses(400, 404, 409, 413))
    async def finish(session_id: str, body: FinishRequest | None = None) -> dict[str, Any]:
        session = store.get(session_id)
        reward = body.reward if body else None
        # A retried finish (the client lost the first answer) is answered again; a second, different reward is
        # refused, so the reward a trainer reads is the one given first.
        if session_id in store.finished and store.finished[session_id] != reward:
            raise ProxyError(409, f"session {session_id!r} was finished with reward {store.finished[session_id]!r}; "
                             "a session's reward is set once", "reward", kind="conflict")
        store.finished[session_id] = reward
        if session.finish_reason is None:
            session.finish_reason = "done"
        await _off_loop(_end, store, session)  # the engine may drop what it holds for the session
        return await _off_loop(_trajectory, session)

    @app.delete("/sessions/{session_id}", responses=error_responses(400, 404))
    async def delete(session_id: str) -> dict[str, Any]:
        session = store.get(session_id)
        out = await _off_loop(_trajectory, session)
        with store._lock:
            store.sessions.pop(session_id, None)
            store.finished.pop(session_id, None)
        return out

    @app.get("/sessions")
    async def sessions() -> dict[str, Any]:
        return {"sessions": [{"id": sid, "turns": s.builder.turns, "finished": sid in store.finished,
                              "finish_reason": s.finish_reason} for sid, s in list(store.sessions.items())]}

    install_front(app, front)  # keys, limits, error envelope, /health, /ready, request metrics, drain
    return app


def main(argv: list[str] | None = None) -> None:
    import argparse

    import os

    from rollwise.agent.generator import HTTPGenerator
    from rollwise.model.loading import tokenizer_fingerprint
    from rollwise.serve.drain import serve_app
    from rollwise.serve.settings import CLIENT_KEY_ENV, add_front_arguments

    parser = argparse.ArgumentParser(prog="python -m rollwise.agent.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="engine or router URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the engine's model spec (for the tokenizer)")
    parser.add_argument("--upstream-api-key", default=os.environ.get(CLIENT_KEY_ENV), metavar="KEY",
                        help=f"the API key sent to the upstream when it has keys (default: ${CLIENT_KEY_ENV}, if set)")
    parser.add_argument("--max-turns", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4096, help="sampled tokens per session")
    add_front_arguments(parser, port=8100)
    args = parser.parse_args(argv)
    try:
        front = Front.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = load_tokenizer(args.model)
    upstream_auth = {"Authorization": f"Bearer {args.upstream_api_key}"} if args.upstream_api_key else None
    app = create_proxy_app(HTTPGenerator(args.upstream, headers=upstream_auth), tokenizer, model_name=args.model,
                           limits=SessionLimits(max_turns=args.max_turns, max_tokens=args.max_tokens),
                           fingerprint=tokenizer_fingerprint(tokenizer), front=front)
    serve_app(app, front)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model spec, without loading weights."""
    if spec.startswith(("tiny:", "tiny-moe:")):
        from rollwise.model.tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from rollwise.model.loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


if __name__ == "__main__":
    main()
