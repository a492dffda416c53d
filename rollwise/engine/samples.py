"""One sample's text on the engine server: incremental detokenizing, OpenAI stop strings, stream cursors."""

from __future__ import annotations

from typing import Any

from rollwise.types.generation import Completion
from rollwise.types.routing import RoutedExperts


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` can stand for: its longest vocabulary entry (added
    and special tokens included). Byte-level BPE entries have one character per byte and SentencePiece ones one
    per character (byte-fallback entries like <0x0A> are longer than what they cover), so this is an upper bound."""
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no readable vocabulary: never refuse on length before tokenizing
        return 2**62


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def piece(self, token: int) -> str:
        """The token's own text, for logprob entries."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode([token])
        return text


class Sample:
    """One choice: its tokens so far, its incremental text, OpenAI stop strings, stream cursors."""

    def __init__(self, index: int, prompt_ids: list[int], detok: Detokenizer | None, stops: list[str]) -> None:
        self.index, self.prompt_ids, self.detok, self.stops = index, prompt_ids, detok, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # streamed text waits this many chars
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.full = ""  # decoded token_ids (kept current while tokens stream in)
        self.text: str | None = None  # the final text, once finished
        self.finish_reason: str | None = None
        self.cached_prompt_tokens = 0
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per engine token, when asked (top_logprobs)
        self.routed_experts: RoutedExperts | None = None  # MoE: prompt + token_ids[:-1], from the Completion
        self.engine_done = False  # the engine returned this sample's Completion
        self.migrations: list[tuple[str, str]] = []  # (from engine, to engine): it moved while it ran (live migration)
        self.sent_text, self.sent_tokens, self.announced, self.closed = "", 0, False, False

    @property
    def finished(self) -> bool:
        return self.text is not None

    def add(self, token: int, logprob: float, version: int) -> None:
        if self.finished:  # past a stop string: the rest is not part of the answer
            return
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.detok is None:
            return
        self.full = self.detok.decode(self.token_ids)
        hits = [p for s in self.stops if (p := self.full.find(s)) >= 0]
        if hits:  # OpenAI semantics: the text ends before the stop string; the tokens up to and
            self.text = self.full[: min(hits)]  # including the one that completed it are kept
            self.finish_reason = "stop"

    def finish(self, completion: Completion) -> None:
        self.engine_done = True
        self.cached_prompt_tokens = completion.cached_prompt_tokens
        self.top_logprobs = completion.top_logprobs  # token_ids is a prefix of completion.token_ids
        self.migrations = list(completion.migrations)
        self._finish_tokens(completion)
        if completion.routed_experts is not None:  # cut to the tokens kept (a stop string may end them early)
            self.routed_experts = completion.routed_experts.head(len(self.prompt_ids) + len(self.token_ids) - 1)

    def _finish_tokens(self, completion: Completion) -> None:
        if self.finished:
            return
        if self.stops:  # replay tokens no event carried (none, normally), watching for stop strings
            start = len(self.token_ids)
            for token, logprob, version in zip(
                completion.token_ids[start:], completion.logprobs[start:], completion.versions[start:]
            ):
                self.add(token, logprob, version)
                if self.finished:
                    return
        else:
            self.token_ids = list(completion.token_ids)
            self.logprobs = list(completion.logprobs)
            self.versions = list(completion.versions)
            self.full = self.detok.decode(self.token_ids) if self.detok is not None else ""
        self.text = self.full
        self.finish_reason = completion.finish_reason

    def take_delta(self) -> tuple[str, int, int]:
        """Streaming: (new text, token range) not sent yet. Text that may still turn out to start a
        stop string, or ends in an incomplete character, waits for the next token."""
        if self.finished:
            ready = self.text
        else:
            safe = min(len(self.full) - self.hold, len(self.full.rstrip("\ufffd")))
            ready = self.full[: max(safe, 0)]
        text = ready[len(self.sent_text):] if ready.startswith(self.sent_text) else ""
        self.sent_text += text
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return text, start, self.sent_tokens
