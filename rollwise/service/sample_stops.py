"""Tinker's `SamplingParams.stop` on rollwise's engines, which know stop *tokens* only.

- `None`: stop at the model's EOS (the engine's default);
- `[]`: no stop at all, not even EOS (ignore_eos): generation runs to max_tokens;
- token ids: the engine's stop_token_ids (EOS still stops, as in vLLM);
- strings (or one string): the engine generates and the sampler watches the decoded completion; a sequence
  ends at the first token whose decoded prefix contains a stop string, that token included (the cookbook's
  parsers look for the stop text), and is aborted in the engine as soon as it matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollwise.service.errors import ServiceUserError

Decode = Callable[[Sequence[int]], str]
# Tokens decoded when watching a running sequence: enough for the longest stop string however the tokenizer
# splits it (a character is at most 4 byte-level tokens), plus a margin for the token before it.
TOKENS_PER_CHAR = 4


@dataclass(frozen=True)
class Stops:
    """How one request stops: the engine's part (token ids, ignore_eos) and the sampler's (strings)."""

    token_ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def window(self) -> int:
        """Tail tokens to decode when watching for the strings."""
        return TOKENS_PER_CHAR * max(len(s) for s in self.strings) + TOKENS_PER_CHAR


def parse_stop(stop: str | Sequence[str] | Sequence[int] | None, vocab_size: int) -> Stops:
    """`sampling_params.stop` as sent -> Stops; a wrong value -> ServiceUserError naming the field."""
    if stop is None:
        return Stops()
    if isinstance(stop, str):
        stop = [stop]
    items = list(stop)
    if not items:
        return Stops(ignore_eos=True)
    if all(isinstance(s, str) for s in items):
        if any(s == "" for s in items):
            raise ServiceUserError("sampling_params.stop: an empty stop string would stop at once; remove it")
        return Stops(strings=tuple(items))
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        bad = [t for t in items if not 0 <= t < vocab_size]
        if bad:
            raise ServiceUserError(f"sampling_params.stop: token ids {bad[:5]} are not in the vocabulary "
                                   f"[0, {vocab_size})")
        return Stops(token_ids=tuple(items))
    raise ServiceUserError("sampling_params.stop: give stop strings or stop token ids, not a mix")


def tail_matches(tokens: Sequence[int], stops: Stops, decode: Decode) -> bool:
    """Whether the decoded last tokens of a running sequence contain a stop string (checked after every
    token, so a new match always lies in the tail)."""
    text = decode(tokens[-stops.window:])
    return any(s in text for s in stops.strings)


def stop_cut(tokens: Sequence[int], stops: Stops, decode: Decode) -> int | None:
    """How many tokens to keep: up to and including the first token whose decoded prefix contains a stop
    string; None when the completion contains none."""
    if not stops.strings or not any(s in decode(tokens) for s in stops.strings):
        return None
    # The match was caught right after the token that completed it, so it is near the end: walk back to the
    # shortest prefix that still contains a stop string.
    keep = len(tokens)
    while keep > 1 and any(s in decode(tokens[: keep - 1]) for s in stops.strings):
        keep -= 1
    return keep
