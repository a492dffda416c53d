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
  span of the response: a sample has at most eta + 1 runs), ~0 bytes a token.

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


def token_array(values: Iterable[int], field: str = "token ids") -> array:
    """int32 token ids; an array('i') is kept as is (shared, never copied: do not mutate it)."""
    if isinstance(values, array) and values.typecode == "i":
        return values
    try:
        return array("i", values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{field} must be integer token ids in int32 range ({e}); pass the engine's ids as given") from None


def logprob_array(values: Iterable[float], field: str = "behaviour_logprobs") -> array:
    """float32 log-probs (exact for the float32 values engines return)."""
    if isinstance(values, array) and values.typecode == "f":
        return values
    try:
        return array("f", values)
    except TypeError as e:
        raise ValueError(f"{field} must be numbers, one per response token ({e})") from None


class VersionRuns(Sequence[int]):
    """Per-token policy versions, run-length encoded: `runs()` gives (version, count) pairs in token order."""

    __slots__ = ("_values", "_ends")

    def __init__(self, versions: Iterable[int] = ()) -> None:
        if isinstance(versions, VersionRuns):
            self._values, self._ends = versions._values, versions._ends
            return
        values, ends, n = array("i"), array("q"), 0
        seq = versions if isinstance(versions, (list, tuple, array)) else list(versions)
        if seq and seq.count(seq[0]) == len(seq):  # one version (the common case): a C-speed check
            values.append(_as_version(seq[0]))
            ends.append(len(seq))
        else:
            for version, run in itertools.groupby(seq):
                n += sum(1 for _ in run)
                values.append(_as_version(version))
                ends.append(n)
        self._values, self._ends = values, ends

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[int, int]]) -> VersionRuns:
        """From (version, count) pairs (the simulator builds versions this way, no per-token list)."""
        out = cls()
        n = 0
        for version, count in runs:
            if count <= 0:
                continue
            if out._values and out._values[-1] == version:
                out._ends[-1] += count
            else:
                out._values.append(_as_version(version))
                out._ends.append(n + count)
            n += count
        return out

    def runs(self) -> Iterator[tuple[int, int]]:
        start = 0
        for version, end in zip(self._values, self._ends):
            yield version, end - start
            start = end

    def lowest(self, default: int) -> int:
        """The oldest version (the one staleness is measured by); `default` for no tokens."""
        return min(self._values, default=default)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> VersionRuns: ...
    def __getitem__(self, i: int | slice) -> int | VersionRuns:
        if isinstance(i, slice):
            return VersionRuns(list(self)[i])
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("version index out of range")
        return self._values[bisect_right(self._ends, i)]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(itertools.repeat(v, c) for v, c in self.runs())

    def count(self, value: Any) -> int:
        return sum(c for v, c in self.runs() if v == value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VersionRuns):
            return self._values == other._values and self._ends == other._ends
        if isinstance(other, (list, tuple, array)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares like a list, so unhashable like one

    def tolist(self) -> list[int]:
        return list(self)

    def __repr__(self) -> str:
        return f"VersionRuns({list(self.runs())})"


def _as_version(value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError("a bool")
        return operator.index(value)  # ints and numpy integers
    except TypeError:
        raise ValueError(f"versions must be integers (one policy version per response token), got {value!r}") from None


def lowest_version(versions: Sequence[int], default: int) -> int:
    """The oldest version of a sample's tokens, fast for VersionRuns, correct for any sequence."""
    return versions.lowest(default) if isinstance(versions, VersionRuns) else min(versions, default=default)


def version_runs(versions: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(version, token count) pairs of any sequence of versions."""
    return (versions if isinstance(versions, VersionRuns) else VersionRuns(versions)).runs()
