"""SimEngine: the engine contract (rollwise.engine.contract.Engine) on a virtual clock.

It schedules like the reference engine (FIFO admission of whole requests into free slots, identical
prompts admitted together share one prefill, a block-granular prefix cache, continuous batching) but
computes nothing: each scheduler iteration takes the time the cost model says, token ids are
synthetic, logprobs constant. What it keeps exact is what the policies above it see: which samples
finish when, how many tokens each has, which policy version sampled each token, aborts, pauses.

Two ways to drive it:
- `step()`, the contract: one iteration, advancing the clock by its duration (tests, `generate`).
- `start_op()` / `finish_op()`, the simulator's fast path: the batch only changes when a sequence
  finishes or a request arrives, so the engine plans k identical decode steps at once (k = steps until
  the next sequence finishes) and a command arriving mid-way `_cut`s the plan at the next step
  boundary, where the real engine would have run it. This is what lets 4096 engines run in minutes.

Token bookkeeping is lazy: a global decode-iteration counter D, and each sequence's token count is
D - base (capped by its length), so a step costs O(log batch), not O(batch).

Why this file runs past ~400 lines: the contract's `step`, the planned-op fast path and the lazy token
bookkeeping all read and cut the same private batch state (the finish heap, the counter D, the op in
flight); split apart, that state would have to be shared across modules.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollwise.engine.contract import check_replacement, check_request, run_to_completion
from rollwise.engine.retention import RetentionDecision, RetentionRequest
from rollwise.engine.state import EngineState
from rollwise.types.generation import Completion, EngineLoad, FinishReason, GenerationRequest, ModelInfo
from rollwise.sim.routing import BlockLRU
from rollwise.sim.cost import CostModel
from rollwise.types.compact import LogprobRuns, TokenRuns, VersionRuns
from rollwise.types.score import ScoreSequence
from rollwise.types.weights import ExpectedWeights

# (request, sample index) -> the length the sample would have if nothing capped it (EOS after it).
LengthSampler = Callable[[GenerationRequest, int], int]


class VirtualClock:
    """Simulated seconds; shared by every engine of a cluster."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    index: int
    length: int  # tokens it will have when done
    reason: FinishReason
    join_d: int  # D before the step that admitted it
    base: int  # tokens after iteration D (> join_d) = min(length, D - base)
    finish_d: int
    prompt_len: int
    cached: int
    token: int  # the synthetic token id it repeats

    def tokens_at(self, d: int) -> int:
        return 0 if d <= self.join_d else min(self.length, d - self.base)


@dataclass
class _Op:
    """k planned steps (or a weight-update stall, k = 0) from t0 with a fixed batch."""

    t0: float
    d0: int
    k: int
    batch: int
    ctx0: float
    prefill: int
    slowdown: float
    end: float
    stall: bool = False


class SimEngine(EngineState):
    name = "sim"
    device = "cpu"
    expected_weights = ExpectedWeights({})  # it holds no tensors: apply_weights versions its tokens only

    def describe(self) -> str:
        return f"sim (cost model {self.cost.name}, virtual clock)"

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        raise ValueError("score: the simulator's engine holds no model, so it has no log-probs to score tokens with")

    def __init__(self, cost: CostModel, *, clock: VirtualClock | None = None, policy_version: int = 0,
                 vocab_size: int = 32000, eos_token_id: int = 2, length_sampler: LengthSampler | None = None,
                 seed: int = 0, engine_id: str = "sim-0", cache_history: bool = True) -> None:
        self.cost = cost
        self.clock = clock or VirtualClock()
        super().__init__(self.clock)  # paused/sleeping flags, unfinished requests, timeline on the virtual clock
        self.engine_id = engine_id
        self.max_num_seqs = cost.max_num_seqs
        self.max_model_len = cost.max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = {eos_token_id}
        self.length_sampler = length_sampler
        # Finished prompt + output into the prefix cache (the next turn of a session starts with it), as
        # the reference engine does; costs O(tokens) per sample, so single-turn GRPO scenarios skip it.
        self.cache_history = cache_history
        self._n_of: dict[str, int] = {}  # request id -> n (its samples' keys are (id, 0..n-1))
        self._rng = random.Random(seed)
        self._version = policy_version
        self._changes: list[tuple[int, int]] = [(0, policy_version)]  # (D from which, version)
        self._pending_version: int | None = None
        self._reprefill = 0  # context tokens to prefill again in the next step (update_reprefill)
        self.waiting: deque[GenerationRequest] = deque()
        self.running: dict[tuple[str, int], _Seq] = {}
        self._heap: list[tuple[int, int, tuple[str, int]]] = []  # (finish_d, tiebreak, key)
        self._tiebreak = 0
        self._d = 0  # decode iterations done
        self._prompt_sum = 0  # Σ prompt_len over running
        self._base_sum = 0  # Σ base over running
        self.op: _Op | None = None
        self.op_serial = 0  # bumped whenever the current op's end changes (the cluster's heap key)
        self.slowdown = 1.0
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "prefix_cache_hit_tokens": 0, "prefill_tokens": 0}
        self.prefix_cache = BlockLRU(cost.prefix_cache_tokens, cost.block_size) if cost.prefix_cache_tokens else None
        self.on_tokens: Callable[[str, int, int, float, int], None] | None = None  # not streamed: no per-token work

    # ------------------------------------------------------------ state

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(r.params.n for r in self.waiting)

    @property
    def unfinished_samples(self) -> int:
        """Samples submitted and not finished yet (running or waiting)."""
        return sum(self._unfinished.values())

    def busy(self) -> bool:
        return self.op is not None

    def context_tokens(self, d: int | None = None) -> int:
        d = self._d if d is None else d
        return self._prompt_sum + len(self.running) * d - self._base_sum

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=self.num_running, waiting=self.num_waiting, max_num_seqs=self.max_num_seqs,
            kv_cache_usage=min(1.0, self.context_tokens() / self.cost.kv_capacity_tokens),
            prompt_tokens=self.stats["prompt_tokens"], cached_prompt_tokens=self.stats["cached_prompt_tokens"],
            generated_tokens=self.stats["generated_tokens"], paused=self.paused, sleeping=self.sleeping,
            policy_version=self._version,
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(engine=self.name, model=self.cost.name, vocab_size=self.vocab_size,
                         max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                         eos_token_ids=sorted(self.eos_token_ids), tokenizer_fingerprint=None,
                         policy_version=self._version)

    # ------------------------------------------------------------ commands (between steps)

    def add_request(self, req: GenerationRequest) -> None:
        check_request(req, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      in_flight=req.request_id in self._unfinished, sleeping=self.sleeping,
                      max_num_seqs=self.max_num_seqs)
        self.waiting.append(req)
        self._unfinished[req.request_id] = req.params.n
        self._n_of[req.request_id] = req.params.n
        self._cut()  # admitted at the next step boundary, as the real engine would

    def abort(self, request_id: str) -> list[Completion]:
        if self._unfinished.pop(request_id, None) is None:
            return []
        n = self._n_of.pop(request_id)
        self._cut()
        d_end = self.op.d0 + self.op.k if self.op is not None else self._d  # tokens as of the next boundary
        aborted: list[Completion] = []
        for req in [r for r in self.waiting if r.request_id == request_id]:
            self.waiting.remove(req)
            aborted += [Completion(req.request_id, i, list(req.prompt_ids), [], [], [], "abort")
                        for i in range(req.params.n)]
        for key in [(request_id, i) for i in range(n) if (request_id, i) in self.running]:
            seq = self._remove(key)
            aborted.append(self._completion(seq, seq.tokens_at(d_end), "abort"))
        self.mark_timeline()
        return sorted(aborted, key=lambda c: c.index)

    def apply_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        """No weights to load: validate, then version the tokens sampled after the next step boundary and
        block the engine for cost.weight_update_s (the time a real load takes)."""
        if state_dict is not None and not isinstance(state_dict, Mapping):
            raise ValueError("apply_weights needs a mapping of weight names to tensors (or None in simulation)")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int, got {version!r}")
        self._cut()
        if self.op is None:
            self._apply_version(version)
            self._start_stall()
        else:
            self._pending_version = version

    def replace_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        """Engine.replace_weights: on an idle engine, apply_weights (which drops the prefix cache with the old version
        and checks no order of versions; this engine keeps no session KV or drafter). No tensors are checked: it holds none."""
        check_replacement({}, self.expected_weights, busy=self.has_unfinished())
        self.apply_weights(state_dict, version)

    def retain(self, req: RetentionRequest) -> RetentionDecision:
        """This engine holds no session KV; retention is simulated by rollwise.sim.intercept."""
        return RetentionDecision(req.session_id, "discard", 0, 0.0, "the simulated engine keeps no session KV")

    def release_session(self, session_id: str) -> bool:
        return False

    def pause(self) -> None:
        if not self.paused:
            self._cut()  # the op in progress stops at the next step boundary, as the real engine would
        super().pause()

    def _free_memory(self) -> bool:
        """sleep(): no memory to free; the prefix cache is emptied, as a real engine's would be."""
        if self.prefix_cache is not None:
            self.prefix_cache = BlockLRU(self.cost.prefix_cache_tokens, self.cost.block_size)
        return True

    def _restore_memory(self) -> None:
        pass  # nothing was freed

    def set_slowdown(self, factor: float) -> None:
        """Engine steps run `factor` times slower from the next step boundary (e.g. the trainer shares cores)."""
        if factor != self.slowdown:
            self.slowdown = factor
            self._cut()

    # ------------------------------------------------------------ the contract's loop

    def step(self) -> list[Completion]:
        """One scheduler iteration; the clock moves to its end. Paused: does nothing."""
        if self.paused:
            return []
        finished: list[Completion] = []
        if self.op is not None:  # a weight-update stall (or a plan the cluster started): finish it first
            self.clock.now = max(self.clock.now, self.op.end)
            finished += self.finish_op()
        if self.start_op(max_steps=1) is not None:
            self.clock.now = max(self.clock.now, self.op.end)
            finished += self.finish_op()
        return finished

    def generate(self, requests: list[GenerationRequest],
                 progress: Callable[[int], None] | None = None) -> list[Completion]:
        return run_to_completion(self, requests, progress)

    # ------------------------------------------------------------ the simulator's fast path

    def start_op(self, max_steps: int | None = None) -> float | None:
        """At clock.now, with no op in progress: admit, plan steps until the next finish; returns the
        op's end time, or None when there is nothing to do (idle, paused)."""
        assert self.op is None, "an op is already in progress"
        if self.paused or self.sleeping:
            return None
        now = self.clock.now
        prefill = self._admit() + self._reprefill
        self._reprefill = 0
        batch = len(self.running)
        if batch == 0:
            return None
        k = max(1, self._heap[0][0] - self._d)
        if max_steps is not None:
            k = min(k, max_steps)
        ctx0 = self.context_tokens()
        duration = self.cost.steps_duration(k, batch, ctx0, prefill) * self.slowdown
        self.op = _Op(now, self._d, k, batch, ctx0, prefill, self.slowdown, now + duration)
        self.op_serial += 1
        self.mark_timeline()
        return self.op.end

    def finish_op(self) -> list[Completion]:
        """At the op's end: advance D, retire finished sequences, apply a pending weight update."""
        op, self.op = self.op, None
        assert op is not None
        if op.stall:
            self.mark_timeline()
            return []
        self._d = op.d0 + op.k
        self.stats["steps"] += op.k
        finished: list[Completion] = []
        while self._heap and self._heap[0][0] <= self._d:
            _, _, key = heapq.heappop(self._heap)
            seq = self.running.get(key)
            if seq is None or seq.finish_d > self._d:
                continue  # aborted (lazy deletion)
            self._remove(key)
            self._retire(seq.request.request_id)
            c = self._completion(seq, seq.length, seq.reason)
            if self.cache_history and self.prefix_cache is not None and c.versions[0] == self._version:
                self.prefix_cache.insert([*seq.request.prompt_ids, *c.token_ids[:-1]])
            finished.append(c)
        if self._pending_version is not None:
            self._apply_version(self._pending_version)
            self._pending_version = None
            self._start_stall()
        self.mark_timeline()
        return finished

    # ------------------------------------------------------------ internals

    def _cut(self) -> None:
        """A command arrived at clock.now mid-op: the op now ends at the next step boundary."""
        op = self.op
        if op is None or op.stall or op.k <= 1:
            return
        now = self.clock.now
        lo, hi = 1, op.k  # smallest j with end of step j >= now
        while lo < hi:
            mid = (lo + hi) // 2
            if op.t0 + self.cost.steps_duration(mid, op.batch, op.ctx0, op.prefill) * op.slowdown >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo < op.k:
            op.k = lo
            op.end = op.t0 + self.cost.steps_duration(lo, op.batch, op.ctx0, op.prefill) * op.slowdown
            self.op_serial += 1

    def _start_stall(self) -> None:
        if self.cost.weight_update_s > 0:
            now = self.clock.now
            self.op = _Op(now, self._d, 0, 0, 0.0, 0, 1.0, now + self.cost.weight_update_s, stall=True)
            self.op_serial += 1

    def _apply_version(self, version: int) -> None:
        self._version = version
        if self.cost.update_reprefill:
            self._reprefill += self.context_tokens()
        self._changes.append((self._d, version))
        if self.prefix_cache is not None:  # cached KV was computed by the old weights
            self.prefix_cache = BlockLRU(self.cost.prefix_cache_tokens, self.cost.block_size)

    def _admit(self) -> int:
        """FIFO admission of whole requests into free slots while the KV cache holds their prompts.
        Returns the prompt tokens to prefill (identical prompts in one step share one prefill)."""
        prefill = 0
        shared: dict[tuple[int, ...], None] = {}
        dap = 1 if self.cost.decode_after_prefill else 0
        while self.waiting:
            req = self.waiting[0]
            n, plen = req.params.n, len(req.prompt_ids)
            if n > self.max_num_seqs - len(self.running):
                break
            if self.running and self.context_tokens() + n * plen > self.cost.kv_capacity_tokens:
                break
            self.waiting.popleft()
            key = tuple(req.prompt_ids)
            if key in shared:
                reused = plen
            else:
                reused = self.prefix_cache.match(req.prompt_ids) if self.prefix_cache is not None else 0
                shared[key] = None
                prefill += plen - reused
                self.stats["prefill_tokens"] += plen - reused
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(req.prompt_ids)
            self.stats["prompt_tokens"] += plen * n
            self.stats["cached_prompt_tokens"] += plen * (n - 1) + reused
            self.stats["prefix_cache_hit_tokens"] += reused
            for i in range(n):
                length, reason = self._length(req, i)
                base = self._d - dap
                seq = _Seq(req, i, length, reason, self._d, base, max(base + length, self._d + 1), plen,
                           reused if i == 0 else plen, self._token(req, i))
                self._add(seq)
        return prefill

    def _length(self, req: GenerationRequest, i: int) -> tuple[int, FinishReason]:
        cap = min(req.params.max_tokens, self.max_model_len - len(req.prompt_ids))
        if req.params.ignore_eos or self.length_sampler is None:
            natural = req.params.max_tokens
        else:
            natural = max(1, int(self.length_sampler(req, i)))
        if natural <= cap and not req.params.ignore_eos and self.length_sampler is not None:
            return natural, "stop"
        return min(natural, cap), "length"

    def _token(self, req: GenerationRequest, i: int) -> int:
        seed = req.params.seed + i if req.params.seed is not None else self._rng.randrange(2**31)
        token = 3 + (seed * 2654435761) % (self.vocab_size - 3)
        return token if token not in self.eos_token_ids else 3

    def _add(self, seq: _Seq) -> None:
        key = (seq.request.request_id, seq.index)
        self.running[key] = seq
        self._prompt_sum += seq.prompt_len
        self._base_sum += seq.base
        self._tiebreak += 1
        heapq.heappush(self._heap, (seq.finish_d, self._tiebreak, key))

    def _remove(self, key: tuple[str, int]) -> _Seq:
        seq = self.running.pop(key)
        self._prompt_sum -= seq.prompt_len
        self._base_sum -= seq.base
        if not self.running:
            self._heap.clear()
        return seq

    def _retire(self, request_id: str) -> None:
        if self._sample_returned(request_id):
            del self._n_of[request_id]

    def _versions(self, seq: _Seq, n: int) -> VersionRuns:
        """Version of each of the first n tokens: token t (1-based) is sampled in iteration
        max(join_d + 1, base + t), under the version in force when that iteration started."""
        out: list[tuple[int, int]] = []  # (version, tokens): run-length, no per-token list
        t = 1
        changes = self._changes
        while t <= n:
            d = max(seq.join_d + 1, seq.base + t)  # iteration that sampled token t
            # version in force: the last change with from_d <= d - 1
            j = len(changes) - 1
            while changes[j][0] > d - 1:
                j -= 1
            version = changes[j][1]
            # tokens up to (but excluding) the iteration after the next change use this version
            if j + 1 < len(changes):
                last_d = changes[j + 1][0]  # iterations <= last_d still use `version`
                last_t = min(n, max(t, last_d - seq.base))
            else:
                last_t = n
            out.append((version, last_t - t + 1))
            t = last_t + 1
        return VersionRuns.from_runs(out)

    def _completion(self, seq: _Seq, n: int, reason: FinishReason) -> Completion:
        self.stats["generated_tokens"] += n
        # Synthetic ids (one token, then EOS on a stop) and a constant log-prob, as runs: the controller
        # keeps them as they are, ~0 bytes a token (a 4096-GPU run holds ~800k samples; docs/benchmarks.md).
        stop = 1 if reason == "stop" and n else 0
        tokens = TokenRuns.from_runs([(seq.token, n - stop), (min(self.eos_token_ids), stop)])
        return Completion(seq.request.request_id, seq.index, list(seq.request.prompt_ids), tokens,  # type: ignore[arg-type]
                          LogprobRuns.from_runs([(-1.0, n)]), self._versions(seq, n), reason, seq.cached)  # type: ignore[arg-type]
