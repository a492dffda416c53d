"""A trajectory as the trainer receives it: exact token ids, behaviour logprobs, policy versions."""

from __future__ import annotations

import base64
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rollwise.types.compact import as_versions, logprob_array, token_array

if TYPE_CHECKING:  # annotations only: the types layer imports no other rollwise package
    from rollwise.engine.types import Completion


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


@dataclass
class Sample:
    """Per-token fields are stored compactly (rollwise.types.compact), whatever sequence is passed in:
    prompt_ids and response_ids as array('i') (int32, exact), behaviour_logprobs as array('f') (float32:
    exact for the float32 log-probs engines return), versions as VersionRuns (run-length). They read like
    lists; they are not lists (concatenate with [*a, *b], serialise with .tolist()). A controller holds
    100,000s of waiting samples at cluster scale: ~9 bytes a token here against ~24 as lists."""

    sample_id: str  # unique: "<request id>/<sample index>"
    group_id: str  # the GRPO group (one prompt's n samples)
    problem_id: str
    prompt_ids: Sequence[int]  # array('i'); may be shared by a group's samples: never mutate in place
    response_ids: Sequence[int]  # array('i'): exactly the engine's sampled ids, never re-tokenized
    behaviour_logprobs: Sequence[float]  # array('f'): engine log-probs of response_ids
    versions: Sequence[int]  # VersionRuns: policy version that sampled each response token
    finish_reason: str
    response_text: str = ""  # decoded for scoring and logs only; training never reads it
    reward: float = 0.0
    outcome: str = ""
    strict_correct: bool = False
    lenient_correct: bool = False
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)
    # Multi-turn (rollwise.agent): 1 on tokens the engine sampled, 0 on template / tool-result tokens
    # between turns, which are in response_ids only as context. None: every response token is sampled.
    loss_mask: list[int] | None = None
    # MoE: the experts the engine routed every token to (prompt + response[:-1]); the trainer replays them.
    routed_experts: RoutedExperts | None = None

    def __post_init__(self) -> None:
        where = f"sample {self.sample_id}"
        self.prompt_ids = token_array(self.prompt_ids, f"{where}: prompt_ids")
        self.response_ids = token_array(self.response_ids, f"{where}: response_ids")
        self.behaviour_logprobs = logprob_array(self.behaviour_logprobs, f"{where}: behaviour_logprobs")
        self.versions = as_versions(self.versions)

    @property
    def trained_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else len(self.response_ids)

    @classmethod
    def from_completion(cls, c: Completion, *, problem_id: str, response_text: str = "",
                        sample_id: str | None = None, group_id: str | None = None,
                        prompt_ids: array | None = None, **extra) -> Sample:
        """The engine's exact ids, logprobs and versions; ids default to the completion's own.
        `prompt_ids`: the request's prompt as an array('i') the group's samples share (one copy a group,
        not one a sample); it must be the prompt the completion was generated from."""
        if prompt_ids is not None and len(prompt_ids) != len(c.prompt_ids):
            raise ValueError(f"completion {c.request_id}/{c.index}: shared prompt_ids has {len(prompt_ids)} "
                             f"tokens, the completion's prompt {len(c.prompt_ids)}")
        return cls(
            sample_id=sample_id or c.sample_id,
            group_id=group_id or c.request_id,
            problem_id=problem_id,
            prompt_ids=c.prompt_ids if prompt_ids is None else prompt_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            versions=c.versions,
            finish_reason=c.finish_reason,
            response_text=response_text,
            extra={"cached_prompt_tokens": c.cached_prompt_tokens, **extra},
            routed_experts=c.routed_experts,
        )

    def staleness(self, trainer_version: int) -> list[int]:
        """Per trained token (tokens with loss mask 0 were sampled by no policy)."""
        return [trainer_version - v for v, m in zip(self.versions, self.trained_mask) if m]


def group_samples(samples: list[Sample]) -> dict[str, list[Sample]]:
    """Samples by GRPO group, each group's in the order given."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return groups
