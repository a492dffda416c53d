"""An agent session: one multi-turn episode against an engine, recorded as an exact trajectory.

    session = AgentSession(generator, tokenizer, tools=registry.specs())
    turn = session.chat(messages)               # OpenAI semantics: the whole conversation each call
    ... or session.start(messages); turn = session.generate(); session.add_messages([...])
    session.trajectory()                        # token ids, loss mask, logprobs, versions

Limits: engine turns, sampled tokens over the session, and the engine's context length. A turn's
max_tokens is cut to what the session and the context still allow; past a limit, generate() raises
LimitReached (the trajectory so far stays intact and retrievable).
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollwise.agent.generator import Generator
from rollwise.agent.messages import MessageError, client_key, content_text, template_view, validate
from rollwise.agent.template import ChatRenderer
from rollwise.agent.toolcalls import (
    MAX_CALLS_PER_TURN,
    ParsedReply,
    ToolCallParser,
    format_hermes_call,
    get_parser,
    parse_reply,
)
from rollwise.agent.trajectory import Trajectory, TrajectoryBuilder
from rollwise.engine.samples import longest_token_chars
from rollwise.types.generation import Completion, SamplingParams

_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for, read once per tokenizer: reading a large
    vocabulary takes tens of milliseconds, and a rollout or the proxy opens a session per episode."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be weakly referenced (then not cached)
        pass
    value = longest_token_chars(tokenizer)
    with contextlib.suppress(TypeError):
        _LONGEST[tokenizer] = value
    return value


class SessionLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(16, ge=1, description="engine turns (assistant replies) per session")
    max_tokens: int = Field(4096, ge=1, description="sampled tokens over the whole session")
    max_tokens_per_turn: int = Field(512, ge=1, description="default max_tokens of one turn")
    max_tool_calls_per_turn: int = Field(MAX_CALLS_PER_TURN, ge=1, description="tool calls run per assistant "
                                         "turn; the rest get one error result naming this cap")


class LimitReached(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "max_turns" | "max_tokens" | "context"


@dataclass
class TurnResult:
    """One engine turn: the sampled completion, its text, and the tool calls parsed from it."""

    completion: Completion
    text: str
    parsed: ParsedReply
    finish_reason: str  # stop | length | abort | tool_calls
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI layout

    def message(self) -> dict[str, Any]:
        """The assistant message in OpenAI's layout (content outside tool calls, tool_calls)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.parsed.content if self.tool_calls else self.text}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class AgentSession:
    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        *,
        session_id: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        parser: str | ToolCallParser = "hermes",
        limits: SessionLimits | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat_template: str | None = None,
        info: Any = None,
    ) -> None:
        self.id = session_id or f"session-{uuid.uuid4().hex[:12]}"
        self.generator = generator
        self.renderer = ChatRenderer(tokenizer, chat_template)
        self.parser = get_parser(parser)
        self.limits = limits or SessionLimits()
        self.defaults = {"temperature": temperature, "top_p": top_p, "seed": seed}
        self.info = info or generator.info()
        self.longest_token_chars = _longest_token_chars(tokenizer)
        self.tools = list(tools or [])
        self.builder = TrajectoryBuilder(self.renderer, self.info.eos_token_ids, self.id, self.tools)
        self.client_view: list[dict[str, Any]] = []
        self.turns: list[TurnResult] = []
        self.finish_reason: str | None = None
        self.lock = threading.Lock()  # a session's turns are sequential (the proxy may get concurrent calls)

    # ------------------------------------------------------------------ conversation

    def _format_call(self, name: str, arguments: dict[str, Any]) -> str:
        fmt = getattr(self.parser, "format_call", None)
        return fmt(name, arguments) if fmt else format_hermes_call(name, arguments)

    def _template_messages(self, messages: list[dict[str, Any]], opening: bool) -> list[dict[str, Any]]:
        out = [template_view(m, self._format_call) for m in messages]
        if opening and self.tools and not self.renderer.template_handles_tools:
            # The template cannot show tools: describe them (and the call format) in the system message.
            prompt = self.parser.tools_prompt(self.tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def start(self, messages: list[Any], split_reason: str | None = None) -> None:
        """Open (or, with split_reason, re-open as a new segment) the conversation."""
        messages = validate(messages)
        self.builder.start(self._template_messages(messages, opening=True), split_reason=split_reason)
        self.client_view = list(messages)

    def add_messages(self, messages: list[Any]) -> None:
        """Tool results and user/system turns after the last reply (template tokens, mask 0)."""
        if not self.builder.segments:
            raise RuntimeError("add_messages() before start()")
        messages = validate(messages)
        self.builder.extend(self._template_messages(messages, opening=False))
        self.client_view += messages

    def check_fits(self, messages: list[dict[str, Any]]) -> None:
        """Refuse, before rendering or tokenizing anything, a conversation that cannot fit the engine's context
        (LimitReached "context"; nothing about the session changes). The template renders every message, its
        text verbatim, so it takes at least one token per message and at least chars / longest_token_chars
        tokens: a flood of messages or text is refused at once instead of costing seconds and memory."""
        limit = self.info.max_model_len
        chars = sum(len(content_text(m.get("content"), "message")) for m in messages)
        if len(messages) >= limit or chars >= self.longest_token_chars * limit:
            raise LimitReached("context", f"session {self.id}: the conversation ({len(messages)} messages, {chars} "
                               f"characters) cannot fit the engine's max_model_len={limit} tokens (each message "
                               f"takes at least one token, and no token is longer than {self.longest_token_chars} "
                               "characters); shorten it")

    def chat(self, messages: list[Any], tools: list[dict[str, Any]] | None = None, **sampling: Any) -> TurnResult:
        """OpenAI semantics: `messages` is the whole conversation; only what is new is appended."""
        messages = validate(messages)
        self.check_fits(messages)
        if tools is not None and list(tools) != self.tools:
            if self.builder.segments:
                self.tools = list(tools)
                self.builder.tools = self.tools
                self.start(messages, split_reason="the tools changed")
                return self.generate(**sampling)
            self.tools = list(tools)
            self.builder.tools = self.tools
        if not self.builder.segments:
            self.start(messages)
        else:
            known = [client_key(m) for m in self.client_view]
            sent = [client_key(m) for m in messages]
            if sent[: len(known)] == known and len(sent) > len(known):
                self.add_messages(messages[len(known):])
            elif self.turns and sent == known[:-1] and self.client_view[-1]["role"] == "assistant":
                # The client repeats the request whose reply it never got (a timeout and a retry):
                # answer with that reply again; generating anew would put a turn the client never
                # saw into the trajectory (and the engine would sample twice for one turn).
                return self.turns[-1]
            elif sent == known and self.client_view[-1]["role"] != "assistant":
                pass  # a retry of the same request (e.g. after a failure): generate again from here
            elif sent == known:
                raise MessageError("messages end with the last assistant reply: add a user or tool message "
                                   "before asking for the next reply")
            else:
                at = next((i for i, (a, b) in enumerate(zip(sent, known)) if a != b), min(len(sent), len(known)))
                self.start(messages, split_reason=f"the client changed the conversation at message {at}")
        return self.generate(**sampling)

    # ------------------------------------------------------------------ generation

    def _check_limits(self, prompt_len: int) -> int:
        """Tokens this turn may sample; raises LimitReached when none."""
        if self.builder.turns >= self.limits.max_turns:
            raise LimitReached("max_turns", f"session {self.id} reached max_turns={self.limits.max_turns}")
        used = sum(s.sampled_tokens for s in self.builder.segments)
        left = self.limits.max_tokens - used
        if left <= 0:
            raise LimitReached("max_tokens", f"session {self.id} sampled its max_tokens={self.limits.max_tokens}")
        room = self.info.max_model_len - prompt_len
        if room < 1:
            raise LimitReached("context", f"session {self.id}: the conversation ({prompt_len} tokens) fills the "
                               f"engine's max_model_len={self.info.max_model_len}")
        return min(left, room)

    def generate(self, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop_token_ids: list[int] | None = None) -> TurnResult:
        prompt = self.builder.prompt_ids()
        try:
            budget = self._check_limits(len(prompt))
        except LimitReached as exc:
            self.finish_reason = exc.reason
            raise
        params = SamplingParams(
            max_tokens=min(max_tokens or self.limits.max_tokens_per_turn, budget),
            temperature=self.defaults["temperature"] if temperature is None else temperature,
            top_p=self.defaults["top_p"] if top_p is None else top_p,
            seed=self.defaults["seed"] if seed is None else seed,
            stop_token_ids=list(stop_token_ids or []),
        )
        if params.seed is not None:
            params.seed += self.builder.turns  # a different draw each turn, still reproducible
        completion = self.generator.generate(prompt, params, self.id)
        text = self.builder.add_completion(completion)
        parsed = parse_reply(self.parser, text, self.limits.max_tool_calls_per_turn)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for c in parsed.calls]
        finish = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
        turn = TurnResult(completion, text, parsed, finish, calls)
        self.turns.append(turn)
        self.client_view.append(turn.message())
        return turn

    def trajectory(self) -> Trajectory:
        return self.builder.trajectory(finish_reason=self.finish_reason)
