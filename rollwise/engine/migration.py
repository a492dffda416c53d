"""Live migration of in-flight requests between two engines (issue 42 item 3, ServerlessLLM's token-based
migration): nothing lost, nothing generated twice.

A running request's state is its tokens, not its KV: the prompt, the tokens sampled so far with their
logprobs, policy versions (and top logprobs), and each sample's RNG state. The destination B recomputes
the KV from those tokens (a prefill, through its prefix cache) while the source A keeps decoding; the
tokens A sampled meanwhile (the delta) are prefilled on B in further rounds (at most max_rounds); when the
delta is small, B takes the request over at a step boundary of A (prefilling the last delta) and A forgets
its copy without emitting a sample. The request then continues on B exactly where it stopped on A: greedy decoding gives
the tokens one engine would have produced, and a seeded sample keeps its stream (its RNG state moves with
it; the vLLM backend's cannot move: rollwise.engine.vllm_migration). Tokens keep the versions that sampled them;
B's tokens carry B's version (partial-rollout semantics).

    round 0: s = A.export(r); B.stage(s)                     B prefills prompt + tokens[:-1]
             (a request still waiting for admission on A moves at once: nothing to catch up)
    round k: A steps; s = A.export(r); |delta| <= max_delta?  no: B.stage(s) (the delta only), again
    handover: s = A.suspend(r); B.commit(s); A.release_migrated(r)   A stops r between two steps, keeping its
             slot and KV until B confirms; B refused: A.resume(r), it decodes on from the same step

Every request named is accounted for exactly once in the result: moved (`migrated`), finished on A during the
catch-up (`finished_on_source`), kept on A (`stayed`, with the reason: B refused to stage or take it, or A could not
export it; A runs it on, as if nothing had been tried), or, only when A could not take back a request B refused at
the handover, on neither engine (`failed`, with both reasons: its caller must answer its client with the error).
One request's refusal never undoes the others' moves: a migration that moved some requests returns them; one that
moved none and kept some raises ValueError (nothing changed). Should B refuse the handover, A takes the request
back: A kept the request suspended (its slots and KV held, out of its batch: no other request can take its
slot meanwhile) until B's commit was confirmed, and resumes it where it stopped. `migrate` drives two engines
from this thread (A decodes `source_steps` steps during B's first prefill; the samples A finishes meanwhile
come back in `MigrationResult.source_finished` for the caller to deliver as usual); `migrate_between` drives
two EngineWorkers, each stepping on its own thread, so A really decodes while B prefills and A's finished
samples come out of A's worker as always. Either way a request that finished on A is not migrated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from rollwise.types.generation import Completion, GenerationRequest, ModelInfo

T = TypeVar("T")

log = logging.getLogger("rollwise.engine")


@dataclass(frozen=True)
class MigratingSample:
    """One running sample of a request: everything its continuation depends on."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    rng_state: bytes  # the sample's generator state: a seeded sample continues its own stream
    cached_prompt_tokens: int


@dataclass(frozen=True)
class MigrationState:
    """A request in flight on an engine, as exported between two of its steps. No samples: it was still
    waiting for admission (the destination just queues it). session_id: the retained session it resumed."""

    request: GenerationRequest
    samples: list[MigratingSample]
    session_id: str | None = None
    # The source's max_model_len: a target with less room would cut the request off earlier than the source (None:
    # unknown, e.g. an older peer's state; check_context_limit then goes by the request's own budget).
    max_model_len: int | None = None

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@runtime_checkable
class Migratable(Protocol):
    """What an engine offers to migration (the reference engine: rollwise.engine.reference.migration; the vLLM
    backend: rollwise.engine.vllm_migration)."""

    def model_info(self) -> ModelInfo: ...
    def step(self) -> list[Completion]: ...
    def migratable_requests(self) -> list[str]:
        """The ids of the requests in flight (running or waiting), in submission order."""
    def export_running(self, request_id: str) -> MigrationState | None:
        """The request's state now, changing nothing; None when it is not in flight."""
    def stage_migration(self, state: MigrationState) -> int:
        """Prefill what of `state` is not in this engine's KV yet (a slot per sample); returns the tokens
        prefilled. Raises ValueError (nothing staged) when there is no room or the state does not fit."""
    def commit_migration(self, state: MigrationState) -> None:
        """Take the request over: stage the rest of `state`, then it decodes here from where it stopped."""
    def cancel_migration(self, request_id: str) -> None:
        """Free what was staged for the request (it finished on the source)."""
    def suspend_migrating(self, request_id: str) -> MigrationState | None:
        """The handover's first half on the source: the request's final state, and it stops here (no token sampled,
        no sample emitted) while keeping what it needs to go on (its slots and KV, or at least its place: nothing
        admitted meanwhile can take them) until release_migrated or resume_migrating; None: not in flight."""
    def resume_migrating(self, request_id: str) -> None:
        """The target refused the handover: the suspended request goes on here from where it stopped (a request
        not suspended here, e.g. aborted by its client meanwhile: nothing to do)."""
    def release_migrated(self, request_id: str) -> int:
        """Forget the request without emitting a sample (it continues elsewhere; a suspended one's slots are freed);
        returns its samples dropped."""


@dataclass
class MigrationResult:
    """What a migration did; each request named is in exactly one of migrated, finished_on_source, stayed, failed.
    migrated: request id -> tokens it had when B took it over; finished_on_source: requests that finished on A during
    the catch-up (their samples are in source_finished); stayed: request id -> why it still runs on A; failed:
    request id -> why it runs on neither engine (its client must be answered with that error)."""

    migrated: dict[str, int] = field(default_factory=dict)
    finished_on_source: list[str] = field(default_factory=list)
    stayed: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    source_finished: list[Completion] = field(default_factory=list)
    rounds: int = 0
    tokens_prefilled: int = 0  # on B, over all rounds: what the handover cost instead of regenerating


# The handover's last delta is prefilled while the request waits (it is on neither engine's batch then): a few
# tokens cost about one decode step. More rounds rarely help: when B prefills a delta about as fast as A
# samples it (a small model, both busy) the delta stops shrinking, so the catch-up is bounded.
DELTA_TOKENS = 8
CATCH_UP_ROUNDS = 4

# ModelInfo fields two engines must share for a request to continue from one on the other.
_SAME = ("model", "vocab_size", "tokenizer_fingerprint", "eos_token_ids")


def check_compatible(source: ModelInfo, target: ModelInfo) -> None:
    """Refuse a migration between engines that would not continue a sample the same way, naming the field."""
    for name in _SAME:
        if getattr(source, name) != getattr(target, name):
            raise ValueError(f"cannot migrate: model_info.{name} differs between the engines "
                             f"({getattr(source, name)!r} vs {getattr(target, name)!r}); migrate to an engine "
                             "serving the same model and tokenizer")


def check_context_limit(state: MigrationState, max_model_len: int) -> None:
    """Refuse (ValueError, nothing staged) a request that could run further on its source than on this engine, whose
    `max_model_len` is given: it would stop early here (finish reason "length") with tokens one engine would not
    have produced. How far it can run: its prompt + max_tokens, capped by the source's limit when known. A sample
    whose tokens already fill this engine's context is refused too (whatever the source's limit says)."""
    request = state.request
    budget = len(request.prompt_ids) + request.params.max_tokens
    reach = budget if state.max_model_len is None else min(budget, state.max_model_len)
    if reach > max_model_len:
        source = "unknown" if state.max_model_len is None else str(state.max_model_len)
        raise ValueError(f"cannot migrate request {request.request_id!r} here: its prompt_ids has "
                         f"{len(request.prompt_ids)} tokens and max_tokens={request.params.max_tokens}, so it may run "
                         f"to {reach} tokens on its source (max_model_len={source}), but this engine's max_model_len="
                         f"{max_model_len} would cut it off earlier; migrate it to an engine with max_model_len >= "
                         f"{reach} or let it finish where it runs")
    for sample in state.samples:  # a sample that already filled this engine's context has nothing left to run here
        total = len(request.prompt_ids) + len(sample.token_ids)
        if total >= max_model_len:
            raise ValueError(f"cannot migrate request {request.request_id!r}: its {total} tokens leave no room to "
                             f"generate within this engine's max_model_len={max_model_len}")


class CommandRunner(Protocol):
    """Runs a command on an engine between two of its steps: EngineWorker.call (the engine on its own thread)."""

    def call(self, fn: Callable[[Migratable], T]) -> T: ...


@dataclass(frozen=True)
class _Ends:
    """Where the coordinator's commands run, and how the source moves on between two rounds."""

    source: Callable[[Callable[[Migratable], T]], T]
    target: Callable[[Callable[[Migratable], T]], T]
    advance: Callable[[], list[Completion]]  # the source's samples finished meanwhile that come back here


def migrate(
    source: Migratable, target: Migratable, request_ids: list[str] | None = None, *,
    source_steps: int = 1, max_delta: int = DELTA_TOKENS, max_rounds: int = CATCH_UP_ROUNDS,
) -> MigrationResult:
    """Move `request_ids` (default: all in flight on `source`) from `source` to `target`, two engines this thread
    steps. On return every request is either running on `target` (its copy on `source` dropped, no sample
    emitted) or finished on `source` during the catch-up (in `source_finished`). source_steps: the source's steps
    during the target's first prefill; max_delta: the most tokens any one sample may have left to prefill at the
    handover; max_rounds bounds the catch-up whatever the delta."""
    steps = [source_steps]

    def advance() -> list[Completion]:
        finished = [c for _ in range(steps[0]) for c in source.step()]
        steps[0] = 1
        return finished

    return _migrate(_Ends(lambda fn: fn(source), lambda fn: fn(target), advance), request_ids, max_delta, max_rounds)


def migrate_between(
    source: CommandRunner, target: CommandRunner, request_ids: list[str] | None = None, *,
    max_delta: int = DELTA_TOKENS, max_rounds: int = CATCH_UP_ROUNDS,
) -> MigrationResult:
    """`migrate` for engines on their own threads (EngineWorkers): the source keeps stepping on its thread while
    the target prefills on its own, and the samples the source finishes meanwhile come out of the source as
    usual (never in the result). Use it to drain an engine before it sleeps or is removed."""
    return _migrate(_Ends(source.call, target.call, list), request_ids, max_delta, max_rounds)


class MigrationRefused(ValueError):
    """No request moved and some were refused (each kept running on the source): the reasons, by request."""

    def __init__(self, stayed: dict[str, str]) -> None:
        self.stayed = dict(stayed)
        super().__init__("; ".join(stayed.values()))


def _migrate(ends: _Ends, request_ids: list[str] | None, max_delta: int, max_rounds: int) -> MigrationResult:
    for side, run in (("source", ends.source), ("target", ends.target)):
        if not run(lambda e: isinstance(e, Migratable)):
            raise ValueError(f"cannot migrate: the {side} engine does not support live migration (the reference "
                             "engine and the vLLM backend do): abort and resubmit its requests instead")
    check_compatible(ends.source(lambda e: e.model_info()), ends.target(lambda e: e.model_info()))
    ids = list(ends.source(lambda e: e.migratable_requests()) if request_ids is None else request_ids)
    result = MigrationResult()
    staged: dict[str, MigrationState] = {}
    try:
        for rid in ids:
            with _per_request(ends, rid, result, staged):
                state = ends.source(lambda e, rid=rid: e.export_running(rid))
                if state is None:  # it finished on the source since it was named (the source keeps stepping): its
                    result.finished_on_source.append(rid)  # samples come out there; nothing to move
                elif not state.samples:  # still waiting for admission: it moves at once, nothing to catch up
                    _hand_over(ends, rid, state, result)
                else:
                    result.tokens_prefilled += ends.target(lambda e, state=state: e.stage_migration(state))
                    staged[rid] = state
        while staged:
            result.rounds += 1
            result.source_finished += ends.advance()
            current = _current(ends, staged, result)
            delta = max((_delta(staged[rid], state) for rid, state in current.items()), default=0)
            last = delta <= max_delta or result.rounds >= max_rounds
            for rid, state in current.items():
                with _per_request(ends, rid, result, staged):
                    if last:
                        _hand_over(ends, rid, staged.pop(rid), result)
                    else:
                        result.tokens_prefilled += ends.target(lambda e, state=state: e.stage_migration(state))
                        staged[rid] = state
            if last:
                break
    except BaseException:
        for rid in staged:  # nothing half-moved: the source still runs every request not yet handed over
            ends.target(lambda e, rid=rid: e.cancel_migration(rid))
        raise
    if result.stayed and not result.migrated and not result.failed:
        raise MigrationRefused(result.stayed)  # refused whole: nothing changed
    return result


@contextmanager
def _per_request(ends: _Ends, rid: str, result: MigrationResult, staged: dict[str, MigrationState]) -> Iterator[None]:
    """One request's step of the migration: should it fail (the target refused it, or could not be reached), that
    request stays on the source, its staging on the target freed, and the others go on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - recorded against the request, which runs on where it was
        staged.pop(rid, None)
        _cancel_quietly(ends, rid)
        if rid not in result.failed:
            result.stayed[rid] = _reason(exc)


def _cancel_quietly(ends: _Ends, rid: str) -> None:
    """Free what the target staged (or took over, should its answer have been lost) for the request; a target
    that cannot be reached holds nothing it will act on, so its error is not the request's."""
    _best_effort(rid, "the target's cancel_migration", lambda: ends.target(lambda e: e.cancel_migration(rid)))


def _best_effort(rid: str, what: str, command: Callable[[], object]) -> None:
    """Run a clean-up whose failure does not change the request's outcome (each caller says why): a failure is
    logged, naming the request, the command and the error, and goes no further."""
    try:
        command()
    except Exception as exc:  # noqa: BLE001 - best effort, see above
        log.warning("migration of request %r: %s failed, ignored (%s)", rid, what, _reason(exc))


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _hand_over(ends: _Ends, rid: str, staged: MigrationState, result: MigrationResult) -> None:
    """The switch: the source suspends the request between two of its steps (its final state read in the same
    command, so no token falls in between; its slots and KV stay held, so nothing the source admits meanwhile can
    take them), the target takes it on from that state, and only then does the source free it. Should the target
    refuse it, the source resumes it where it stopped (and it raises, for `_per_request` to record it as stayed);
    only a source that cannot resume it (it failed) records it as failed: a request is never silently lost."""
    final = ends.source(lambda e: e.suspend_migrating(rid))
    if final is None:  # it finished on the source just before (its samples come out there)
        _cancel_quietly(ends, rid)
        result.finished_on_source.append(rid)
        return
    try:
        ends.target(lambda e: e.commit_migration(final))
    except Exception as refused:
        _cancel_quietly(ends, rid)
        try:
            ends.source(lambda e: e.resume_migrating(rid))
        except Exception as back:  # noqa: BLE001 - the request's client is answered with it
            result.failed[rid] = (f"{_reason(refused)}; and the source could not take request {rid!r} back "
                                  f"({_reason(back)})")
        raise
    result.migrated[rid] = final.tokens
    result.tokens_prefilled += final.tokens - staged.tokens
    # The target runs it now: what the source held for it goes. (Should that fail, the source's engine failed:
    # the request still moved, and is recorded so.)
    _best_effort(rid, "the source's release_migrated", lambda: ends.source(lambda e: e.release_migrated(rid)))


def _delta(staged: MigrationState, now: MigrationState) -> int:
    """The most tokens one sample sampled on the source since `staged` (a sample new since then: all of them)."""
    before = {s.index: len(s.token_ids) for s in staged.samples}
    return max((len(s.token_ids) - before.get(s.index, 0) for s in now.samples), default=0)


def _current(ends: _Ends, staged: dict[str, MigrationState], result: MigrationResult) -> dict[str, MigrationState]:
    """The staged requests' states now; those that finished on the source are cancelled on the target."""
    current = {}
    for rid in list(staged):
        with _per_request(ends, rid, result, staged):
            state = ends.source(lambda e, rid=rid: e.export_running(rid))
        if rid not in staged:  # the source could not export it: it stays there
            continue
        if state is None:
            _cancel_quietly(ends, rid)
            result.finished_on_source.append(rid)
            del staged[rid]
            continue
        current[rid] = state
    return current


def fresh_stream_seed(request: GenerationRequest, sample: MigratingSample) -> int | None:
    """The seed a sample continues with when its RNG state could not move (`rng_state` empty: the vLLM backend's
    generators stay inside its worker): a fresh stream, so every token is still drawn from the policy's
    distribution, but a seeded sample's tokens after the handover differ from an unmigrated run's. Derived from
    (seed, sample index, tokens so far) when the request is seeded; None (the engine's own seed source) if not."""
    if request.params.seed is None:
        return None
    return (request.params.seed * 1_000_003 + sample.index * 100_003 + len(sample.token_ids)) % 2**31
