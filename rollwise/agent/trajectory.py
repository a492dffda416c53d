"""Exact multi-turn trajectories: token ids + loss mask + behaviour logprobs + policy versions.

Token-in/token-out (DESIGN.md invariant 1), built turn by turn:

1. The first prompt is the chat template's rendering of the opening messages (mask 0).
2. Each engine turn appends the engine's sampled ids *as they are* (mask 1, with their logprobs and
   policy versions). Its text is decoded only to show the agent; it is never encoded again.
3. The messages that follow (tool results, user or system turns) add only their *template tokens*
   (mask 0). They are found by rendering canonical conversations and comparing token ids:

       base      = render(msgs[:k], generation prompt)        what turn k's prompt looks like
       with_asst = render(msgs[:k] + [assistant])             the assistant turn closed by the template
       full      = render(msgs[:k] + [assistant] + new, generation prompt)

   `base` must be a prefix of `with_asst` and `with_asst` of `full` (the prefix-extension property).
   The template's own tokens after the assistant's end-of-turn token (e.g. ChatML's "\n" after the
   sampled <|im_end|>) and then full[len(with_asst):] are appended with mask 0. The sampled
   end-of-turn token stays as sampled (mask 1); a turn cut at max_tokens gets the template's
   end-of-turn tokens with mask 0 (the model did not sample them).
4. A template that rewrites earlier turns (strips reasoning, changes the system prompt) breaks the
   property: the trajectory is *split*, and a new segment starts from the canonical rendering of the
   whole conversation (mask 0). Nothing is ever re-tokenized into a span the trainer trains on.

The engine's next prompt is always the current segment's ids, so the engine continues from exactly
the tokens it sampled (and its prefix cache hits every earlier turn).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rollwise.agent.template import ChatRenderer, Message
from rollwise.types.generation import Completion
from rollwise.types.routing import RoutedExperts

NO_VERSION = -1  # policy version of tokens no policy sampled (prompt, template, tool results)


@dataclass
class SampledSpan:
    """One engine turn inside a segment: ids [start, end) are exactly the engine's sampled ids."""

    turn: int  # 0-based engine call number in the session
    start: int
    end: int
    prompt_len: int  # the prompt the engine was given = segment ids [0, prompt_len)
    finish_reason: str
    request_id: str
    # True when re-encoding the decoded text would NOT give back the sampled ids (BPE is not a
    # bijection): the tokens a naive, text-based trajectory would have trained on instead.
    retokenization_drift: bool = False


@dataclass
class TrajectorySegment:
    """One trainable sample: a token sequence whose every prompt was a prefix of the next."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the engine; 0: prompt/template/tools
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob where mask is 1, else 0.0
    versions: list[int] = field(default_factory=list)  # policy version where mask is 1, else NO_VERSION
    spans: list[SampledSpan] = field(default_factory=list)
    split_reason: str | None = None  # why this segment started a new sample (None: the first)
    # MoE: the engine's experts of token_ids[:n] (n = up to the last sampled token, exclusive), for replay.
    routed_experts: RoutedExperts | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_len(self) -> int:
        """Tokens before the first sampled token (the whole segment if nothing was sampled)."""
        return self.spans[0].start if self.spans else len(self.token_ids)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def append(self, ids: list[int], *, mask: int, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.token_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [NO_VERSION] * len(ids)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (only ever used to take back template tokens, never sampled ones)."""
        if any(self.loss_mask[n:]):
            raise ValueError("refusing to take back sampled tokens")
        del self.token_ids[n:], self.loss_mask[n:], self.logprobs[n:], self.versions[n:]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts.head(n - 1)

    def check(self) -> None:
        """Internal consistency; raises AssertionError naming the first problem."""
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            assert len(getattr(self, name)) == n, f"{name} has {len(getattr(self, name))} entries for {n} tokens"
        sampled = [0] * n
        for span in self.spans:
            for i in range(span.start, span.end):
                sampled[i] = 1
        assert sampled == self.loss_mask, "loss mask is not exactly the sampled spans"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["routed_experts"] = self.routed_experts.to_wire() if self.routed_experts is not None else None
        return out


@dataclass
class Trajectory:
    """A session's trajectory: one segment, or several where the template broke the prefix property."""

    session_id: str
    segments: list[TrajectorySegment]
    messages: list[Message]  # the conversation as the template saw it (assistant turns as decoded text)
    turns: int
    sampled_tokens: int
    finish_reason: str | None = None  # why the episode ended, when it has
    reward: float | None = None

    @property
    def splits(self) -> list[str]:
        return [s.split_reason for s in self.segments[1:] if s.split_reason]

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "turns": self.turns, "sampled_tokens": self.sampled_tokens,
                "finish_reason": self.finish_reason, "reward": self.reward, "messages": self.messages,
                "splits": self.splits, "segments": [s.to_dict() for s in self.segments]}


class PrefixBreak(Exception):
    """The chat template does not extend the previous rendering: the trajectory must split."""


def _first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class TrajectoryBuilder:
    """Builds one session's trajectory. Not thread-safe: a session's turns are sequential."""

    def __init__(self, renderer: ChatRenderer, eos_token_ids: set[int] | list[int], session_id: str = "session",
                 tools: list[dict] | None = None) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.session_id = session_id
        self.tools = tools
        self.messages: list[Message] = []
        self.segments: list[TrajectorySegment] = []
        self.turns = 0
        self._base: list[int] = []  # canonical rendering of self.messages + generation prompt
        self._pending: SampledSpan | None = None  # the last sampled turn, not yet closed by new messages
        self._pending_ids: list[int] = []
        self._with_asst: list[int] = []  # canonical rendering of self.messages once the pending turn is in

    # ------------------------------------------------------------------ the engine's view

    @property
    def segment(self) -> TrajectorySegment:
        return self.segments[-1]

    def prompt_ids(self) -> list[int]:
        """The next engine prompt: exactly the current segment's ids."""
        if not self.segments:
            raise RuntimeError("no conversation yet: call start(messages) first")
        if self._pending is not None:
            raise RuntimeError("the last assistant turn has no following message yet: call extend() first")
        return list(self.segment.token_ids)

    # ------------------------------------------------------------------ building

    def _render(self, messages: list[Message], gen: bool) -> list[int]:
        return self.renderer.render(messages, add_generation_prompt=gen, tools=self.tools)

    def start(self, messages: list[Message], split_reason: str | None = None) -> None:
        """Begin a segment from the canonical rendering of `messages` (all mask 0)."""
        if not messages:
            raise ValueError("a conversation needs at least one message")
        self.messages = [dict(m) for m in messages]
        self._base = self._render(self.messages, gen=True)
        segment = TrajectorySegment(split_reason=split_reason)
        segment.append(self._base, mask=0)
        self.segments.append(segment)
        self._pending = None

    def add_completion(self, completion: Completion) -> str:
        """Append one engine turn's sampled ids (mask 1); returns its text for the agent."""
        if self._pending is not None:
            raise RuntimeError("two engine turns in a row without a message between them")
        segment = self.segment
        if list(completion.prompt_ids) != segment.token_ids:
            # The engine must have been prompted with exactly what the trainer will see.
            raise ValueError(f"completion {completion.request_id} was not generated from this trajectory's prompt")
        ids = list(completion.token_ids)
        if len(completion.logprobs) != len(ids) or len(completion.versions) != len(ids):
            raise ValueError(f"completion {completion.request_id}: logprobs/versions do not match its token ids")
        start = len(segment)
        segment.append(ids, mask=1, logprobs=list(completion.logprobs), versions=list(completion.versions))
        if completion.routed_experts is not None:
            old = segment.routed_experts
            segment.routed_experts = completion.routed_experts if old is None else old.followed_by(completion.routed_experts)
        span = SampledSpan(self.turns, start, len(segment), start, completion.finish_reason, completion.request_id)
        segment.spans.append(span)
        self.turns += 1
        text = self.decode(ids)
        self.messages.append({"role": "assistant", "content": text})
        self._pending, self._pending_ids = span, ids
        # Drift is measured here, when the turn is sampled, so that every turn is counted: also the
        # session's last (nothing follows it) and one whose next message makes the trajectory split.
        self._with_asst = self._render(self.messages, gen=False)
        span.retokenization_drift = self._drifts(text)
        return text

    def decode(self, ids: list[int]) -> str:
        """The text of sampled ids for the agent (special tokens such as the end of turn dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def extend(self, new_messages: list[Message]) -> None:
        """Messages after the last assistant turn (tool results, user/system turns): append their
        template tokens with mask 0, or split where the template breaks the prefix property."""
        if not new_messages:
            raise ValueError("extend() needs at least one message")
        if self._pending is None:
            # Messages straight after other messages (no engine turn between): same prefix rule.
            self._extend_plain(new_messages)
            return
        full_messages = self.messages + [dict(m) for m in new_messages]
        try:
            tail = self._template_tokens(full_messages)
        except PrefixBreak as exc:
            self._pending = None
            self.start(full_messages, split_reason=str(exc))
            return
        self.segment.append(tail, mask=0)
        self.messages = full_messages
        self._pending = None

    def _extend_plain(self, new_messages: list[Message]) -> None:
        """New messages with no engine turn since the last ones (e.g. a tool result, then a system
        note): take back the generation prompt the segment ends with (template tokens, mask 0) and
        append the new messages' template tokens, if the template extends its rendering."""
        full_messages = self.messages + [dict(m) for m in new_messages]
        full = self._render(full_messages, gen=True)
        plain = self._render(self.messages, gen=False)
        gen_prompt = self._base[len(plain):]
        segment = self.segment
        held_tail = segment.token_ids[len(segment) - len(gen_prompt):] if gen_prompt else []
        ok = (self._base[: len(plain)] == plain and full[: len(plain)] == plain and held_tail == gen_prompt
              and not any(segment.loss_mask[len(segment) - len(gen_prompt):]))
        if not ok:
            self.start(full_messages, split_reason="the template rewrites the conversation when a "
                       f"{new_messages[0]['role']} message follows another message")
            return
        segment.truncate(len(segment) - len(gen_prompt))
        segment.append(full[len(plain):], mask=0)
        self.messages, self._base = full_messages, full

    def _close_turn(self) -> tuple[list[int], list[int]]:
        """The pending turn as the template renders it after the generation prompt: (its canonical
        content ids, the template tokens that follow what was sampled). PrefixBreak where the
        template does not continue its generation prompt or has no matching end of turn."""
        base, span, sampled = self._base, self._pending, self._pending_ids
        with_asst = self._with_asst
        if with_asst[: len(base)] != base:
            at = _first_mismatch(with_asst, base)
            raise PrefixBreak(f"turn {span.turn}: the template renders the assistant turn differently "
                              f"from its generation prompt (token {at} differs)")
        closing = with_asst[len(base):]  # canonical assistant content + end of turn + template tail
        if self._stopped_on_eos():
            eot = sampled[-1]
            positions = [i for i, t in enumerate(closing) if t == eot]
            if not positions:
                raise PrefixBreak(f"turn {span.turn}: the template does not close the assistant turn with the "
                                  f"sampled end-of-turn token {eot}")
            at = positions[-1]
            return closing[:at], closing[at + 1:]  # e.g. ChatML's "\n" after <|im_end|>: template tokens
        # Cut at max_tokens (or stopped on a non-EOS stop id): the template closes the turn; those
        # end-of-turn tokens were not sampled, so they go in with mask 0.
        positions = [i for i, t in enumerate(closing) if t in self.eos_token_ids]
        if not positions:
            raise PrefixBreak(f"turn {span.turn}: the template's assistant turn has no end-of-turn token")
        at = positions[-1]
        return closing[:at], closing[at:]

    def _stopped_on_eos(self) -> bool:
        sampled = self._pending_ids
        return bool(sampled) and sampled[-1] in self.eos_token_ids and self._pending.finish_reason == "stop"

    def _drifts(self, text: str) -> bool:
        """Would a text-based pipeline (decode, then encode the conversation) train on other ids than
        the sampled ones for the pending turn?"""
        sampled = self._pending_ids
        content = sampled[:-1] if self._stopped_on_eos() else [t for t in sampled if t not in self.eos_token_ids]
        try:
            canonical, _ = self._close_turn()
        except PrefixBreak:
            # The template does not show the turn after its own prompt: compare with encoding the text.
            canonical = list(self.tokenizer.encode(text, add_special_tokens=False))
        return canonical != content

    def _template_tokens(self, full_messages: list[Message]) -> list[int]:
        """The template tokens after the pending turn's sampled ids, up to the next generation prompt."""
        _, tail = self._close_turn()
        with_asst = self._with_asst
        full = self._render(full_messages, gen=True)
        if full[: len(with_asst)] != with_asst:
            at = _first_mismatch(full, with_asst)
            raise PrefixBreak(f"turn {self._pending.turn}: the template rewrites earlier turns once a "
                              f"{full_messages[len(self.messages)]['role']} message follows (token {at} of "
                              f"{len(with_asst)} differs)")
        self._base = full
        return tail + full[len(with_asst):]

    # ------------------------------------------------------------------ results

    def trajectory(self, finish_reason: str | None = None, reward: float | None = None) -> Trajectory:
        for segment in self.segments:
            segment.check()
        return Trajectory(
            session_id=self.session_id, segments=self.segments, messages=list(self.messages), turns=self.turns,
            sampled_tokens=sum(s.sampled_tokens for s in self.segments), finish_reason=finish_reason, reward=reward,
        )
