"""Test helper: gather n completions from any RolloutBackend, failing clearly when they stop coming.
Imported by the test modules; not a test module itself."""

from __future__ import annotations

import time

from rollwise.types.contracts import RolloutBackend


def collect(backend: RolloutBackend, n: int, timeout: float = 60.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} samples arrived"
        c = backend.next_completion(0.05)
        if c is not None:
            out.append(c)
    return out
