"""The answer format the policy must follow, and a strict parser for it.

Strict on purpose: GRPO finds any slack in the format check. A known failure mode on this setup is
a policy that repeats "<answer>5</answer>" until the token limit; a parser that takes the first or
the last tag pair would reward that. So a response is "ok" only when it contains exactly one
answer tag pair and ends right after the closing tag; everything else is "unparseable".

It lives with the tasks because both sides use it: the prompt states the format (tasks.prompts)
and the reward checks it (rollwise.reward.scoring); reward imports tasks, never the reverse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

ParseStatus = Literal["ok", "unparseable"]

# Finish reasons that mean the model did not end the response itself (engine types: stop/length/abort).
TRUNCATED_FINISH_REASONS = frozenset({"length", "abort"})


@dataclass(frozen=True)
class AnswerFormat:
    """The tags that delimit the final answer."""

    open: str = "<answer>"
    close: str = "</answer>"

    def __post_init__(self) -> None:
        if not self.open.strip() or not self.close.strip():
            raise ValueError(f"answer tags must be non-blank, got open={self.open!r} close={self.close!r}")
        if self.open.lower() == self.close.lower():
            raise ValueError(f"answer open and close tags must differ, got {self.open!r} twice")
        if self.open.lower() in self.close.lower() or self.close.lower() in self.open.lower():
            # Counting occurrences would then double count; e.g. open="<a>" close="<a>/".
            raise ValueError(f"one answer tag contains the other: {self.open!r} / {self.close!r}")

    def wrap(self, answer: str) -> str:
        return f"{self.open}{answer}{self.close}"


@dataclass(frozen=True)
class ParsedResponse:
    """`answer` is set only when status is "ok"; `reason` says why a response was unparseable."""

    status: ParseStatus
    answer: str | None
    reason: str | None = None


def _unparseable(reason: str) -> ParsedResponse:
    return ParsedResponse(status="unparseable", answer=None, reason=reason)


def parse_response(
    text: str, fmt: AnswerFormat | None = None, finish_reason: str | None = None
) -> ParsedResponse:
    """Extract the answer under the strict format.

    "ok" requires all of:
      - the model ended the response itself (finish_reason not "length"/"abort"),
      - exactly one open tag and exactly one close tag, open first (tags are matched
        case-insensitively, so "<ANSWER>" counts as a second tag rather than slipping through),
      - non-blank content between them,
      - nothing but whitespace after the close tag.
    Text before the open tag (the reasoning) is free.
    """
    fmt = fmt or AnswerFormat()
    if finish_reason in TRUNCATED_FINISH_REASONS:
        # A truncated response never finished its answer, even if a tag pair happens to be in it.
        return _unparseable(f"truncated (finish_reason={finish_reason})")
    opens = [m.start() for m in re.finditer(re.escape(fmt.open), text, re.IGNORECASE)]
    closes = [m.start() for m in re.finditer(re.escape(fmt.close), text, re.IGNORECASE)]
    if not opens and not closes:
        return _unparseable("no answer tags")
    if len(opens) > 1 or len(closes) > 1:
        return _unparseable(f"multiple answer tags ({len(opens)} open, {len(closes)} close)")
    if not opens:
        return _unparseable("close tag without open tag")
    if not closes:
        return _unparseable("open tag never closed")
    start, end = opens[0] + len(fmt.open), closes[0]
    if end < start:
        return _unparseable("close tag before open tag")
    if text[end + len(fmt.close) :].strip():
        return _unparseable("text after the close tag")
    answer = text[start:end].strip()
    if not answer:
        return _unparseable("empty answer")
    return ParsedResponse(status="ok", answer=answer)


# A number not glued to a preceding word or digit: in "5-3" the "-" is an operator, so we read "3".
# Thousands separators are allowed only in groups of three ("1,234"), so "1,2" stays two numbers.
_NUMBER_RE = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_FULL_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def last_number(text: str) -> str | None:
    """The last number in `text` (commas removed), or None. Lenient, for diagnostics only:
    it shows how much of the base model's accuracy is hidden by format errors."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number if the whole string is a plain decimal ("5", "-5.0", "1,000", "2e3").

    Fractions like "1/2" are deliberately not numbers here: tasks that ask for a reduced
    fraction must not accept "2/4" because it is numerically equal.
    """
    s = text.strip()
    if not _FULL_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def normalize_text(text: str) -> str:
    """Case- and whitespace-insensitive form used for exact-match verification."""
    return " ".join(text.split()).casefold()


def answers_match(candidate: str, reference: str) -> bool:
    """Normalized exact match: numbers compare by value ("5" == "5.0"), text case-insensitively."""
    a, b = parse_number(candidate), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return normalize_text(candidate) == normalize_text(reference)
