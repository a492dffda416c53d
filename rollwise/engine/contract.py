"""The engine contract: what every backend (reference, vLLM) does, so nothing above it cares which.

Token ids in, token ids + per-token logprobs + per-token policy versions out. The caller drives the
engine step by step (`step()` is one scheduler iteration), which is what lets the rollout worker put
every other call — submit, abort, weight update, pause — *between* two steps: a weight update can
never land in the middle of a forward pass, and `pause()` freezes in-flight requests with their state.
The HTTP server (`rollwise serve engine`) exposes the same operations over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rollwise.engine.retention import RetentionDecision, RetentionRequest
from rollwise.types.generation import Completion, EngineLoad, GenerationRequest, ModelInfo
from rollwise.types.score import ScoreSequence
from rollwise.types.weight_checks import nonfinite, state_problems, version_problem
from rollwise.types.weights import AdapterSpec, ExpectedWeights


@runtime_checkable
class Engine(Protocol):
    """The contract. Every method is called from one thread (the engine's), between steps."""

    name: str  # "reference" | "vllm"
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: set[int]
    timeline: list[tuple[float, int]]  # (monotonic time, running sequences), appended every step
    stats: dict[str, int]  # prompt_tokens, cached_prompt_tokens, generated_tokens, steps
    # Called for every sampled token as on_tokens(request_id, index, token, logprob, version).
    on_tokens: Callable[[str, int, int, float, int], None] | None
    # What a weight update must match (names, shapes, dtypes, ties), read once when the engine starts.
    expected_weights: ExpectedWeights
    # Where its weights live ("cpu", "cuda", "cuda:0", ...): a Ray engine rank joins a weight broadcast over
    # NCCL when they are on a GPU, gloo otherwise.
    device: str

    @property
    def policy_version(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def paused(self) -> bool: ...
    @property
    def sleeping(self) -> bool: ...

    def has_unfinished(self) -> bool: ...
    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request (n samples). Raises ValueError naming the problem for bad input."""
    def abort(self, request_id: str) -> list[Completion]:
        """Stop a request now; its samples come back with finish_reason 'abort' and the tokens so far."""
    def step(self) -> list[Completion]:
        """One scheduler iteration; returns the samples that finished in it. Paused: does nothing."""
    def generate(
        self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        """Run requests to completion on an idle engine; ordered by (request order, sample index)."""
    def pause(self) -> None:
        """Stop generating; in-flight requests keep their state and continue on resume()."""
    def resume(self) -> None: ...
    def apply_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Load new weights by HF name, versioned. Everything is validated before anything is applied:
        a bad update raises ValueError and the engine keeps serving its previous version. Tokens
        sampled afterwards carry `version`, so a request that spans an update says so token by token."""
    def replace_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Take another owner's weights of the same model (a pool slot recycling an engine for another job:
        rollwise.pool.slots): the complete state, checked by check_replacement before anything is copied, on an idle
        engine. Everything computed with the old weights is dropped (prefix cache, retained session KV, the
        drafter's history) and the version becomes `version`, which may be lower than the one it served (another
        owner's numbering). On a problem: ValueError, nothing changed."""
    def sleep(self) -> bool:
        """Release what memory the backend can (engine must be idle); returns whether memory was freed."""
    def wake(self) -> None: ...
    def retain(self, req: RetentionRequest) -> RetentionDecision:
        """The turn `req.request_id` ended in a tool call: preserve, swap or discard its KV until the
        session's next turn, and report which (rollwise.engine.retention). Never blocks the engine: held KV
        is bounded by budgets and released on its TTL, abort, a weight update or release_session."""
    def release_session(self, session_id: str) -> bool:
        """The session ended: release what the engine holds for it; returns whether it held anything."""
    def load(self) -> EngineLoad: ...
    def model_info(self) -> ModelInfo: ...
    def reset_timeline(self) -> None: ...
    def describe(self) -> str:
        """One line for the console: which engine, and how it was set up."""
    def loaded_adapters(self) -> dict[str, int]:
        """The LoRA adapters it serves beside its base: name -> version ({}: none)."""
    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        """Serve adapter `spec.name` at `version` without touching the base (or raise ValueError, nothing changed)."""
    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (or raise ValueError: requests of it in flight, or no unloading here)."""
    @property
    def prefix_cache_tokens(self) -> int:
        """Tokens of KV its own cross-request prefix cache holds (0: it keeps none of its own)."""
    def flush_prefix_cache(self) -> int:
        """Empty that prefix cache; returns how many tokens it held."""
    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        """Per sequence (in order), log p(token_ids[i] | token_ids[:i]) at `temperature` for i in start..len-1, under
        the weights it serves: a prefill, nothing sampled, the batch's sequences together (a teacher engine scoring
        a student's responses: rollwise.engine.scoring)."""
    def close(self) -> None:
        """Release what the engine holds beyond its memory (vLLM: its engine core and weight directory)."""


def run_to_completion(
    engine: Engine, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
) -> list[Completion]:
    """`Engine.generate` for any backend: submit everything, step until done, keep request order.
    If a request is refused, the ones already queued are withdrawn so the engine is left idle."""
    if engine.paused:
        raise RuntimeError("generate() on a paused engine would never finish: resume() it first")
    if engine.sleeping:
        raise RuntimeError("generate() on a sleeping engine: wake() it first")
    if engine.has_unfinished():
        raise RuntimeError("generate() needs an idle engine; drain or abort the streaming requests first")
    add_all(engine, requests)
    done: list[Completion] = []
    while engine.has_unfinished():
        finished = engine.step()
        done += finished
        if progress is not None and finished:
            progress(len(finished))
    order = {req.request_id: i for i, req in enumerate(requests)}
    return sorted(done, key=lambda c: (order[c.request_id], c.index))


def seed_source(seed: int | None) -> torch.Generator:
    """Where an engine draws the seeds of requests that bring none: from `seed` (a reproducible run), or
    from the operating system's entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def add_all(engine: Engine, requests: list[GenerationRequest]) -> None:
    """Queue every request or none: if the engine refuses one (ValueError), the ones queued before it
    are withdrawn and the error is raised."""
    queued: list[str] = []
    try:
        for req in requests:
            engine.add_request(req)
            queued.append(req.request_id)
    except ValueError:
        for request_id in queued:
            engine.abort(request_id)
        raise


def check_request(req: GenerationRequest, *, max_model_len: int, vocab_size: int, in_flight: bool, sleeping: bool,
                  max_num_seqs: int | None = None) -> None:
    """What every engine refuses in add_request, with a ValueError naming the request and the problem.
    max_num_seqs: for engines that run a request's n samples together (one shared prefill)."""
    prompt = req.prompt_ids
    if not prompt:
        raise ValueError(f"request {req.request_id!r}: empty prompt")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"request {req.request_id!r}: prompt has {len(prompt)} tokens, which leaves no room to "
            f"generate within max_model_len={max_model_len}"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"request {req.request_id!r}: prompt token ids must lie in [0, {vocab_size})")
    if max_num_seqs is not None and req.params.n > max_num_seqs:
        raise ValueError(
            f"request {req.request_id!r}: n={req.params.n} samples exceed max_num_seqs={max_num_seqs} "
            "(a request's samples run together because they share one prefill)"
        )
    if in_flight:
        raise ValueError(f"request id {req.request_id!r} is already in flight")
    if sleeping:
        raise ValueError("the engine is sleeping: wake() it before submitting requests")


def check_weights(
    state_dict: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], *, require_all: bool
) -> None:
    """Validate names, shapes and values of a weight update against the model's own. Raises ValueError
    naming the first problems; called before any weight is touched, so a bad update changes nothing."""
    unknown = sorted(set(state_dict) - set(expected))
    if unknown:
        raise ValueError(f"unknown weight names (not in this model): {unknown[:5]}")
    if require_all:
        missing = sorted(set(expected) - set(state_dict))
        if missing:
            raise ValueError(f"incomplete update: {len(missing)} weights missing, e.g. {missing[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(expected[name])}")
    bad = nonfinite(state_dict)
    if bad:
        raise ValueError(f"{bad[0]}: contains NaN or inf" + (f" (and {len(bad) - 1} more tensors)" if bad[1:] else ""))


def check_version(version: int, current: int) -> None:
    """Versions never go backwards in an engine: every token carries the version that sampled it, and the
    staleness bound counts on them (re-pushing the current version is a retry, allowed)."""
    backwards = version_problem(version, current)
    if backwards is not None:
        raise ValueError(backwards)


def check_update(state_dict: Mapping[str, Tensor], version: int, current: int, expected: ExpectedWeights) -> None:
    """What an engine's apply_weights refuses before it touches a weight (the reference engine's; vLLM's checks
    its own names and shapes): a version older than the one it serves, and tensors whose names, shapes, dtypes
    or values (NaN, inf) do not fit its model, by the rules every path shares (rollwise.types.weight_checks).
    A subset of the weights is fine here (buckets streamed in)."""
    check_version(version, current)
    _refuse(state_problems(state_dict, expected, complete=False))


def check_replacement(state_dict: Mapping[str, Tensor], expected: ExpectedWeights, *, busy: bool) -> None:
    """What every engine's replace_weights refuses before it touches a weight: an engine with requests in flight
    (they would continue under another owner's weights), and a state that is not the whole model (a name left out
    would keep the previous owner's tensor) or whose names, shapes, dtypes or values do not fit it (the rules every
    path shares: rollwise.types.weight_checks). No version check: the new owner numbers its own versions."""
    if busy:
        raise ValueError("replace_weights needs an idle engine: finish or abort its requests first")
    _refuse(state_problems(state_dict, expected, complete=True), "replace_weights: ")


def _refuse(problems: list[str], prefix: str = "") -> None:
    """A state's problems as one ValueError (the first five, and how many in all); nothing when there are none."""
    if problems:
        more = f"; ... ({len(problems)} problems in all)" if len(problems) > 5 else ""
        raise ValueError(prefix + "; ".join(problems[:5]) + more)
