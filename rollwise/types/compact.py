"""Compact per-token storage for samples: what a Sample keeps for every token, in as few bytes as exact.

A rollout controller at cluster scale holds hundreds of thousands of finished samples waiting for an
update (the flexible batch at eta = 2 lets up to (eta + 1) x 2 batches of groups wait): as Python
lists, token ids, log-probs and versions cost 8 bytes a token each (more where every int or float is
its own object), ~24 KB a sample, ~26 GB at 4096 GPUs (docs/benchmarks.md, issue 26). Here:

- token ids: `array('i')`, int32, 4 bytes a token (every vocabulary fits; exact);
- log-probs: `array('f')`, float32, 4 bytes a token. Exact for what engines return: the reference
  engine and vLLM compute log-probs in float32 and hand them out as Python floats, which float32 holds
  bit for bit; the trainer turns them into a float32 tensor in any case;
- versions: `VersionRuns`, run-length (one (version, count) pair per policy version that sampled a
  span of the response: a sample has at most eta + 1 runs), ~0 bytes a token;
- the simulator's synthetic ids and log-probs (one token repeated, then EOS; a constant log-prob):
  `TokenRuns` / `LogprobRuns`, kept as they come (the simulator holds ~800k samples at 4096 GPUs).

All three read like lists (len, index, slice, iterate, compare equal to a list of the same values);
they are not lists: concatenate with `[*a, *b]` or `list(a) + list(b)`, serialise with `tolist()`.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload


def token_array(values: Iterable[int], field: str = "token ids") -> array | TokenRuns:
    """int32 token ids; an array('i') or TokenRuns is kept as is (shared, never copied: do not mutate it)."""
    if (isinstance(values, array) and values.typecode == "i") or isinstance(values, TokenRuns):
        return values  # type: ignore[return-value]
    try:
        return array("i", values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{field} must be integer token ids in int32 range ({e}); pass the engine's ids as given") from None


def logprob_array(values: Iterable[float], field: str = "behaviour_logprobs") -> array | LogprobRuns:
    """float32 log-probs (exact for the float32 values engines return)."""
    if (isinstance(values, array) and values.typecode == "f") or isinstance(values, LogprobRuns):
        return values  # type: ignore[return-value]
    try:
        return array("f", values)
    except TypeError as e:
        raise ValueError(f"{field} must be numbers, one per response token ({e})") from None


class Runs(Sequence[Any]):
    """A run-length sequence: (value, count) pairs in order, read like a list. Versions are always
    stored so (VersionRuns); the simulator's synthetic tokens and log-probs too (a constant token then
    EOS, a constant log-prob: two runs, not a per-token array). Engines' real ids and log-probs are
    arrays: runs would not shrink them."""

    __slots__ = ("_values", "_ends")
    typecode = "d"  # of the values array: "i" (int32) for ids and versions, "f" (float32) for log-probs

    def __init__(self, values: Iterable[Any] = ()) -> None:
        if isinstance(values, Runs):
            self._values, self._ends = array(self.typecode, values._values), values._ends
            return
        self._values, self._ends = array(self.typecode), array("q")
        seq = values if isinstance(values, (list, tuple, array)) else list(values)
        if seq and seq.count(seq[0]) == len(seq):  # one value (the common case): a C-speed check
            self._append(seq[0], len(seq))
        else:
            for value, run in itertools.groupby(seq):
                self._append(value, sum(1 for _ in run))

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[Any, int]]) -> Runs:
        """From (value, count) pairs, without a per-token list."""
        out = cls()
        for value, count in runs:
            out._append(value, count)
        return out

    def _append(self, value: Any, count: int) -> None:
        if count <= 0:
            return
        value = self._check(value)
        if self._values and self._values[-1] == value:
            self._ends[-1] += count
        else:
            self._values.append(value)
            self._ends.append(len(self) + count)

    def _check(self, value: Any) -> Any:
        return value

    def runs(self) -> Iterator[tuple[Any, int]]:
        start = 0
        for value, end in zip(self._values, self._ends):
            yield value, end - start
            start = end

    def lowest(self, default: Any) -> Any:
        return min(self._values, default=default)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Runs: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return type(self)(list(self)[i])
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._values[bisect_right(self._ends, i)]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(itertools.repeat(v, c) for v, c in self.runs())

    def count(self, value: Any) -> int:
        return sum(c for v, c in self.runs() if v == value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Runs):
            return list(self.runs()) == list(other.runs())
        if isinstance(other, (list, tuple, array)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares like a list, so unhashable like one

    def tolist(self) -> list[Any]:
        return list(self)

    # Concatenation gives a plain list, as list + list does (multi-turn prompts: prompt + ids + result).
    def __add__(self, other: Iterable[Any]) -> list[Any]:
        return [*self, *other]

    def __radd__(self, other: Iterable[Any]) -> list[Any]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.runs())})"


class VersionRuns(Runs):
    """Per-token policy versions (int32), run-length: a sample has at most eta + 1 runs."""

    __slots__ = ()
    typecode = "i"

    def _check(self, value: Any) -> int:
        return _as_version(value)


class TokenRuns(Runs):
    """Token ids as runs (the simulator's synthetic responses: one token repeated, then EOS)."""

    __slots__ = ()
    typecode = "i"


class LogprobRuns(Runs):
    """Log-probs as runs, float32 (the simulator's constant log-prob)."""

    __slots__ = ()
    typecode = "f"


def _as_version(value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError("a bool")
        return operator.index(value)  # ints and numpy integers
    except TypeError:
        raise ValueError(f"versions must be integers (one policy version per response token), got {value!r}") from None


def lowest_version(versions: Sequence[int], default: int) -> int:
    """The oldest version of a sample's tokens, fast for VersionRuns, correct for any sequence."""
    return versions.lowest(default) if isinstance(versions, Runs) else min(versions, default=default)


def as_versions(values: Iterable[int]) -> VersionRuns:
    """A sample's versions as VersionRuns (kept as is when they already are)."""
    return values if isinstance(values, VersionRuns) else VersionRuns(values)


def version_runs(versions: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(version, token count) pairs of any sequence of versions."""
    return (versions if isinstance(versions, VersionRuns) else VersionRuns(versions)).runs()
