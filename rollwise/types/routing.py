"""The experts an MoE engine routed each token to (`RoutedExperts`, for routing replay: R3), stored compactly.
Engines fill it into a Completion (rollwise.types.generation), the trainer reads it from a Sample (rollwise.types.sample).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np


ROUTING_DTYPES = ("int8", "int16")


@dataclass(frozen=True)
class RoutedExperts:
    """The experts an MoE engine routed each token to (for routing replay, R3), stored compactly.

    An array [num_tokens, num_layers, top_k] of expert ids as little-endian int8 (models with at most
    127 experts) or int16 bytes, row-major. Rows are the tokens a forward ran on: the prompt, then every
    generated token but the last (nothing ran on it), so num_tokens = len(prompt) + len(response) - 1.
    On the wire it is {"data": base64, "shape": [tokens, layers, top_k], "dtype": "int8" | "int16"}.
    """

    data: bytes
    num_tokens: int
    num_layers: int
    top_k: int
    dtype: str = "int8"

    def __post_init__(self) -> None:
        if self.dtype not in ROUTING_DTYPES:
            raise ValueError(f"routed_experts dtype must be one of {ROUTING_DTYPES}, got {self.dtype!r}")
        expected = self.num_tokens * self.bytes_per_token
        if min(self.num_tokens, self.num_layers, self.top_k) < 0 or len(self.data) != expected:
            raise ValueError(f"routed_experts holds {len(self.data)} bytes, but shape "
                             f"{[self.num_tokens, self.num_layers, self.top_k]} of {self.dtype} needs {expected}")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.top_k * np.dtype(self.dtype).itemsize

    @classmethod
    def from_array(cls, experts: Any, num_experts: int) -> RoutedExperts:
        """From an integer array-like [tokens, layers, top_k] (numpy or torch) of a model with `num_experts`."""
        dtype = "int8" if num_experts <= 127 else "int16"
        array = np.asarray(experts, dtype=np.dtype(dtype).newbyteorder("<"))
        if array.ndim != 3:
            raise ValueError(f"routed experts must be [tokens, layers, top_k], got shape {list(array.shape)}")
        return cls(array.tobytes(), *array.shape, dtype=dtype)

    def array(self) -> np.ndarray:
        flat = np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<"))
        return flat.reshape(self.num_tokens, self.num_layers, self.top_k)

    def head(self, num_tokens: int) -> RoutedExperts:
        """The first `num_tokens` rows (a sample cut short by a stop string keeps its tokens' routing)."""
        n = max(0, min(num_tokens, self.num_tokens))
        return RoutedExperts(self.data[: n * self.bytes_per_token], n, self.num_layers, self.top_k, self.dtype)

    def followed_by(self, later: RoutedExperts) -> RoutedExperts:
        """These rows, then `later`'s rows past them: a multi-turn trajectory keeps the routing each token
        had when it was sampled, and takes the routing of tokens added since (template, tool results)
        from the later turn's prefill."""
        if (later.num_layers, later.top_k, later.dtype) != (self.num_layers, self.top_k, self.dtype):
            raise ValueError("routed_experts of one trajectory come from differently shaped models")
        tail = later.data[self.num_tokens * self.bytes_per_token:]
        return RoutedExperts(self.data + tail, max(self.num_tokens, later.num_tokens), self.num_layers, self.top_k,
                             self.dtype)

    def to_wire(self) -> dict[str, Any]:
        return {"data": base64.b64encode(self.data).decode("ascii"),
                "shape": [self.num_tokens, self.num_layers, self.top_k], "dtype": self.dtype}

    @classmethod
    def from_choice(cls, choice: dict[str, Any], where: str = "choice") -> RoutedExperts | None:
        """A response choice's `routed_experts` (None when the engine returned none: a dense model)."""
        obj = choice.get("routed_experts")
        return None if obj is None else cls.from_wire(obj, where)

    @classmethod
    def from_wire(cls, obj: Any, where: str = "routed_experts") -> RoutedExperts:
        """Parse the wire form; a malformed one raises ValueError naming `where` (e.g. the sample)."""
        try:
            shape = [int(n) for n in obj["shape"]]
            if len(shape) != 3:
                raise ValueError(f"shape must be [tokens, layers, top_k], got {obj['shape']}")
            return cls(base64.b64decode(obj["data"], validate=True), *shape, dtype=obj.get("dtype", "int8"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: malformed routed_experts ({e}); expected "
                             '{"data": base64, "shape": [tokens, layers, top_k], "dtype": "int8"|"int16"}') from None
