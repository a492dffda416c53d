"""SimCluster: many SimEngines behind the RolloutBackend protocol (rollwise.types.contracts), on one virtual clock.

The RolloutController talks to a RolloutBackend (submit, next_completion, abort, pause, resume,
load_weights). The real one steps an engine on a thread while wall time passes; this one steps
SimEngines in event order while *virtual* time passes, and only when the controller would wait:

- `next_completion(timeout)`: run engine steps in time order until one returns a finished sample
  (the controller then does exactly what it does on a real engine: admit, regenerate, batch);
- `advance_to(t)`: the trainer trains until t; engines keep generating, completions queue up;
- `load_version(v)`: every engine loads version v (no weights move); returns the time the last one
  is done (the trainer blocks until then, as a real weight push does). `load_weights(update)` is
  the same through the protocol; the time is left in `weights_loaded_at`.

Requests are placed by a production routing policy (rollwise.router.policies, called exactly as the
router's gateway calls it). At thousands of engines one policy decision over every replica costs
O(replicas) per request, which real deployments avoid with several routers: the cluster is split
into router shards of `shard_size` engines, a request goes to the shard with the fewest sequences in
flight, and the policy chooses among that shard's engines. With <= shard_size engines: one router.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from rollwise.types.generation import ModelInfo
from rollwise.types.generation import Completion, GenerationRequest
from rollwise.router.policies import Policy, ReplicaLoad, RouteRequest
from rollwise.sim.engine import SimEngine, VirtualClock

if TYPE_CHECKING:
    from rollwise.types.weight_update import WeightUpdate


class SimulationStuck(RuntimeError):
    """The controller waits for completions but no engine has work: a scheduling deadlock."""


class _Account:
    __slots__ = ("in_flight", "prefill", "decode")

    def __init__(self) -> None:
        self.in_flight = self.prefill = self.decode = 0


class SimCluster:
    def __init__(self, engines: list[SimEngine], clock: VirtualClock, policy: Policy | None = None,
                 shard_size: int = 64) -> None:
        if not engines:
            raise ValueError("a cluster needs at least one engine")
        self.engines = engines
        self.clock = clock
        self.policy = policy
        self.completions: deque[Completion] = deque()
        self._heap: list[tuple[float, int, int, int]] = []  # (op end, tiebreak, engine index, op serial)
        self._tiebreak = 0
        self._pushed: dict[int, int] = {}  # engine index -> op serial in the heap
        self._index = {e.engine_id: i for i, e in enumerate(engines)}
        self._where: dict[str, int] = {}  # request id -> engine index
        self._pending: dict[str, tuple[int, int, int, RouteRequest]] = {}  # rid -> (samples left, prefill, decode, route)
        self._acct = [_Account() for _ in engines]
        self._shards = [list(range(i, min(i + shard_size, len(engines)))) for i in range(0, len(engines), shard_size)]
        self._shard_of = [s for s, members in enumerate(self._shards) for _ in members]
        self._shard_load = [0] * len(self._shards)
        self.affinity: dict[str, int] = {}  # session/group key -> engine (the router's affinity table)
        self._idle_polls = 0
        self.weights_loaded_at = clock.now  # when the last engine finished loading the latest version
        # While the trainer trains, the controller's pump may only take what has finished by now: the
        # simulator's loop moves time (run.train_through_contention), a poll must not.
        self.queued_only = False

    # ------------------------------------------------------------ the EngineWorker interface

    def submit(self, requests: list[GenerationRequest]) -> None:
        touched: dict[int, None] = {}
        for req in requests:
            i = self._route(req)
            self.engines[i].add_request(req)
            self._where[req.request_id] = i
            touched[i] = None
        for i in touched:  # one call, like EngineWorker.submit: all admitted at the same step boundary
            self._sync(i)

    def next_completion(self, timeout: float) -> Completion | None:
        if not self.completions and not self.queued_only:
            self._advance(until=None, stop_on_completion=True)
        if self.completions:
            self._idle_polls = 0
            return self.completions.popleft()
        if self.queued_only:
            return None
        # Nothing running anywhere: the controller's poll times out (virtual time passes). A real
        # controller would spin forever; the simulator says so.
        self.clock.now += timeout
        self._idle_polls += 1
        if self._idle_polls > 100_000:
            raise SimulationStuck("the controller waits for completions but no engine has work")
        return None

    def abort(self, request_ids: list[str]) -> list[Completion]:
        out: list[Completion] = []
        for rid in request_ids:
            i = self._where.get(rid)
            if i is None:
                continue
            aborted = self.engines[i].abort(rid)
            for c in aborted:
                self._retire(c)
            out += aborted
            self._sync(i)
        return out

    def load_weights(self, update: WeightUpdate) -> None:
        """Every engine loads the update's version at its next step boundary (a simulated engine holds
        no weights: only the version moves); `weights_loaded_at` is when the last one is done."""
        self.load_version(update.version)

    def load_version(self, version: int) -> float:
        """Every engine loads `version` at its next step boundary; returns when the last one is done."""
        done = self.clock.now
        for i, e in enumerate(self.engines):
            e.apply_weights(None, version)
            self._sync(i)
            if e.op is not None:  # a stall now, or a step whose end applies the update and then stalls
                done = max(done, e.op.end + (e.cost.weight_update_s if not e.op.stall else 0.0))
        self.weights_loaded_at = done
        return done

    def model_info(self) -> ModelInfo:
        return self.engines[0].model_info()

    def metrics(self) -> dict[str, float]:
        return {}

    def pause(self) -> None:
        for i, e in enumerate(self.engines):
            e.pause()
            self._sync(i)

    def resume(self) -> None:
        for i, e in enumerate(self.engines):
            e.resume()
            self._sync(i)

    def close(self) -> None:
        pass

    # ------------------------------------------------------------ simulator controls

    def advance_to(self, t: float, stop_on_completion: bool = False) -> None:
        """Let virtual time pass until t (the trainer is busy); completions queue up. With
        stop_on_completion: stop early, at the first engine event that finishes a sample."""
        self._advance(until=t, stop_on_completion=stop_on_completion)
        if not (stop_on_completion and self.completions):
            self.clock.now = max(self.clock.now, t)

    def next_event_time(self) -> float | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def set_slowdown(self, factor: float) -> None:
        for i, e in enumerate(self.engines):
            e.set_slowdown(factor)
            self._sync(i)

    def set_engine_slowdown(self, i: int, factor: float) -> None:
        if self.engines[i].slowdown != factor:
            self.engines[i].set_slowdown(factor)
            self._sync(i)

    # ------------------------------------------------------------ internals

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap:
            _, _, i, serial = heap[0]
            e = self.engines[i]
            if e.op is not None and e.op_serial == serial:
                return
            heapq.heappop(heap)

    def _advance(self, until: float | None, stop_on_completion: bool) -> None:
        heap = self._heap
        while True:
            self._drop_stale()
            if not heap or (until is not None and heap[0][0] > until):
                return
            end, _, i, _ = heapq.heappop(heap)
            self._pushed.pop(i, None)
            self.clock.now = max(self.clock.now, end)
            for c in self.engines[i].finish_op():
                self._retire(c)
                self.completions.append(c)
            self._sync(i)
            if stop_on_completion and self.completions:
                return

    def _sync(self, i: int) -> None:
        """After anything happened to engine i: start its next op if idle, (re)schedule its end."""
        e = self.engines[i]
        if e.op is None and e.has_unfinished():
            e.start_op()
        if e.op is not None and self._pushed.get(i) != e.op_serial:
            self._tiebreak += 1
            heapq.heappush(self._heap, (e.op.end, self._tiebreak, i, e.op_serial))
            self._pushed[i] = e.op_serial

    def _route(self, req: GenerationRequest) -> int:
        n = req.params.n
        # Controller ids are g<k> or g<k>/<i>#<attempt> (a GRPO group); session turns are s<k>/t<turn>.
        group_key = req.request_id.split("/")[0]
        session = group_key if group_key.startswith("s") else None
        route = RouteRequest(tokens=req.prompt_ids, session_key=session, group_key=None if session else group_key,
                             samples=n, max_tokens=req.params.max_tokens)
        if len(self.engines) == 1:
            i, matched = 0, 0
        elif self.policy is None:  # no router: fewest sequences in flight
            i, matched = min(range(len(self.engines)), key=lambda j: self._acct[j].in_flight), 0
        else:
            shard = min(range(len(self._shards)), key=lambda s: self._shard_load[s]) if len(self._shards) > 1 else 0
            members = self._shards[shard]
            pinned = self.affinity.get(group_key)
            if pinned is not None:
                route = replace(route, pinned=self.engines[pinned].engine_id)
            loads = [ReplicaLoad(self.engines[j].engine_id, self._acct[j].in_flight, self._acct[j].prefill,
                                 self._acct[j].decode) for j in members]
            if pinned is not None and pinned not in members:
                a = self._acct[pinned]
                loads.append(ReplicaLoad(self.engines[pinned].engine_id, a.in_flight, a.prefill, a.decode))
            decision = self.policy.choose(route, loads)
            self.policy.on_routed(route, decision, self.clock.now)
            i, matched = self._index[decision.replica], decision.matched_tokens
            self.affinity[group_key] = i
        prefill, decode = max(len(req.prompt_ids) - matched, 0), n * req.params.max_tokens
        a = self._acct[i]
        a.in_flight += n
        a.prefill += prefill
        a.decode += decode
        self._shard_load[self._shard_of[i]] += n
        self._pending[req.request_id] = (n, prefill, decode, route)
        return i

    def _retire(self, c: Completion) -> None:
        entry = self._pending.get(c.request_id)
        if entry is None:
            return
        left, prefill, decode, route = entry
        i = self._where[c.request_id]
        a = self._acct[i]
        a.in_flight -= 1
        self._shard_load[self._shard_of[i]] -= 1
        if self.policy is not None and self.policy.learns_outputs and c.finish_reason != "abort":
            self.policy.on_finished(route, self.engines[i].engine_id, [c.token_ids], self.clock.now)
        if left > 1:
            self._pending[c.request_id] = (left - 1, prefill, decode, route)
            return
        a.prefill -= prefill
        a.decode -= decode
        del self._pending[c.request_id]
        del self._where[c.request_id]
