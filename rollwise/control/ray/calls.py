"""What every driver-side Ray module of control/ shares: waiting on actor calls with a timeout that says what
was awaited (`get_all`), and the driver's `[ray]` log line (`log`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError

if TYPE_CHECKING:
    from ray import ObjectRef


def log(message: str) -> None:
    print(f"[ray] {message}", file=sys.stderr, flush=True)


def get_all(refs: list[ObjectRef], timeout: float, what: str) -> list[Any]:
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (is the cluster out of "
                           "resources? see `ray status`)") from None
