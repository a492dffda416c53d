"""Many simulated replicas: a small cost-model engine to see how routing policies behave at scale
(64 replicas) without 64 engines. It calls the same pure policies as the HTTP router.

Each replica is a continuous-batching engine in simulated time: every step admits waiting requests
into free slots (up to max_num_seqs), prefills their uncached prompt tokens (a block-granular LRU
prefix cache, like the reference engine's; identical prompts admitted in one step share one
prefill), and decodes one token for every running sequence. A step takes

    step_s + prefill_s_per_token * prefill tokens + decode_s_per_seq * running sequences
           + decode_s_per_ctx_token * context tokens of the running sequences
           + cached_s_per_token * prompt tokens reused from the prefix cache

of its own device, plus `request_s` of serving work per request (the client's and router's HTTP, JSON,
routing) done by a serving process of `serving_cores` cores (requests in it share them), and
`replica_request_s` in the replica's own process (its HTTP side) before the engine sees it, and
`router_s` in the router's own process (one core; the measured router cost, ROUTER_S_PER_REQUEST). With
`cores` set, the replicas are single-threaded processes sharing that many CPU cores with the serving
process (bench router: 4 replicas and the router on 2 cores): processor sharing, every task advances
at min(1, cores / demand) of its own speed.

The defaults are an illustrative cost model; `rollwise sim validate-router` fills one in from a
calibration of the benchmark's replica engine (rollwise/bench/validate_router.py).
The router side mirrors app.py: in-flight caps, the same load accounting, a FIFO queue when full.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from rollwise.router.policies import Policy, ReplicaLoad, RouteRequest
from rollwise.sim.cores import SharedCores


# The router process's own CPU seconds per request (parse, choose, relay both ways, its share of the health
# probes), as `rollwise bench router` measures it: `real.policies.prefix.router_cpu_s_per_request` of the full
# run on an idle machine (docs/bench/router.json: 4 rounds x 68 requests, 4 reference-engine replicas, every
# router in its own process, read from the kernel's per-process CPU clock): 0.98 ms per request, against
# vllm-router cache_aware's 0.53 ms in the same run (docs/benchmarks/router.md, "Routers as peers").
ROUTER_S_PER_REQUEST = 0.00098


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 64
    max_num_seqs: int = 16
    cache_tokens: int = 16384  # per replica
    block_size: int = 16
    step_s: float = 0.004
    prefill_s_per_token: float = 0.00005
    decode_s_per_seq: float = 0.0004
    decode_s_per_ctx_token: float = 0.0
    cached_s_per_token: float = 0.0  # a prefix-cache hit is not free: its KV is copied into the slot
    cores: float = 0.0  # 0: every replica has its own device; > 0: replicas share this many cores
    padded_context: bool = False  # decode attends over batch x longest context (the reference engine)
    # Per request, outside the engine step: the client's and router's HTTP handling, JSON, routing (CPU
    # time, in the serving process).
    request_s: float = 0.0
    replica_request_s: float = 0.0  # per request in the replica's process, beside its engine (HTTP, asyncio)
    # Spread of request_s (coefficient of variation; lognormal, mean kept). Identical clients started
    # together otherwise stay in lockstep forever: round robin then sends every turn of a session to
    # the same replica, an affinity no real router run has.
    request_cv: float = 0.0
    # Cores the serving work can use at once: bench router's client and router are one Python process,
    # whose threads take turns under one interpreter lock.
    serving_cores: float = 1.0
    # The router's own work per request, in its own single-threaded process (one event loop: one core at
    # most), after request_s and before the request can be queued at a replica. 0: a router that costs nothing.
    router_s: float = ROUTER_S_PER_REQUEST


class BlockLRU:
    """Which token-block prefixes a replica caches (no tensors: the sim only counts)."""

    def __init__(self, max_tokens: int, block_size: int) -> None:
        self.max_blocks, self.block_size = max(1, max_tokens // block_size), block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, tokens: Sequence[int], limit: int) -> list[int]:
        keys, h = [], 0
        for start in range(0, limit - self.block_size + 1, self.block_size):
            h = hash((h, tuple(tokens[start : start + self.block_size])))
            keys.append(h)
        return keys

    def match(self, tokens: Sequence[int]) -> int:
        hit = 0
        for key in self._keys(tokens, len(tokens) - 1):  # the last prompt token is always computed
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hit += self.block_size
        return hit

    def insert(self, tokens: Sequence[int]) -> None:
        for key in self._keys(tokens, len(tokens)):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


@dataclass(eq=False)
class SimRequest:
    route: RouteRequest
    output: list[int]  # the tokens this request will "generate"
    on_done: Callable[[SimRequest, float], None]
    sent_at: float = 0.0
    replica: str | None = None
    account: tuple[int, int] = (0, 0)
    cached: int = 0
    done_at: float = 0.0


@dataclass(eq=False)
class _Replica:
    name: str
    cache: BlockLRU
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # [request, tokens still to generate]
    stepping: bool = False
    step_started: float = 0.0
    busy_s: float = 0.0  # wall time inside steps (stretched where cores are shared)
    in_flight: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    computed_prefill: int = 0
    generated: int = 0

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.name, self.in_flight, self.prefill_tokens, self.decode_tokens)


class Simulation:
    def __init__(self, policy: Policy, config: SimConfig, seed: int = 0) -> None:
        self.policy, self.cfg = policy, config
        self.replicas = {f"sim{i:02d}": _Replica(f"sim{i:02d}", BlockLRU(config.cache_tokens, config.block_size))
                         for i in range(config.replicas)}
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._queue: deque[SimRequest] = deque()  # router queue: every replica at its cap
        self.affinity: dict[str, str] = {}  # session/group key -> last replica (the router's AffinityTable)
        self.done: list[SimRequest] = []
        # Engine steps (when replicas share `cores`) and requests' serving work (always: the serving process
        # runs one request's work at a time per `serving_cores`) share the machine (rollwise.sim.cores).
        self._cores = SharedCores(config.cores, self.at, lambda: self.now,
                                  caps={"serving": config.serving_cores, "router": 1.0})
        self._jitter = random.Random(seed * 7919 + 1)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()

    # ------------------------------------------------------------ the router

    def submit(self, request: SimRequest) -> None:
        request.sent_at = self.now
        if self.cfg.request_s > 0:  # the client's and router's work (HTTP, JSON, routing) comes first
            work = self.cfg.request_s
            if self.cfg.request_cv > 0:  # real serving times vary; without it, lockstep clients never reorder
                work *= self._jitter.lognormvariate(-self.cfg.request_cv ** 2 / 2, self.cfg.request_cv)
            self._share(work, lambda: self._route(request), serving=True)
        else:
            self._route(request)

    def _route(self, request: SimRequest) -> None:
        """The router process's own work (router_s), then the queue; requests in it share its one core."""
        if self.cfg.router_s > 0:
            self._cores.run(self.cfg.router_s, lambda: self._enqueue(request), "router")
        else:
            self._enqueue(request)

    def _enqueue(self, request: SimRequest) -> None:
        self._queue.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        cap = 2 * self.cfg.max_num_seqs
        while self._queue:
            room = [r.load() for r in self.replicas.values() if r.in_flight < cap]
            if not room:
                return
            request = self._queue.popleft()
            key = request.route.affinity_key
            if key is not None:
                request.route = replace(request.route, pinned=self.affinity.get(key))
            decision = self.policy.choose(request.route, room)
            if key is not None:
                self.affinity[key] = decision.replica
            replica = self.replicas[decision.replica]
            request.replica = decision.replica
            prefill = max(len(request.route.tokens) - decision.matched_tokens, 0)
            request.account = (prefill, request.route.max_tokens)
            replica.in_flight += 1
            replica.prefill_tokens += prefill
            replica.decode_tokens += request.route.max_tokens
            self.policy.on_routed(request.route, decision, self.now)
            if self.cfg.replica_request_s > 0:  # the replica's HTTP work before its engine sees it
                if self.cfg.cores > 0:
                    self._share(self.cfg.replica_request_s, lambda r=replica, q=request: self._arrive(r, q))
                else:
                    self.at(self.now + self.cfg.replica_request_s, lambda r=replica, q=request: self._arrive(r, q))
            else:
                self._arrive(replica, request)

    def _arrive(self, replica: _Replica, request: SimRequest) -> None:
        replica.waiting.append(request)
        if not replica.stepping:
            replica.stepping = True
            self.at(self.now, lambda: self._step(replica))

    # ------------------------------------------------------------ the engines

    def _step(self, replica: _Replica) -> None:
        cfg = self.cfg
        prefilled: set[tuple[int, ...]] = set()
        prefill = reused = 0
        while replica.waiting and len(replica.running) < cfg.max_num_seqs:
            request = replica.waiting.popleft()
            tokens = request.route.tokens
            key = tuple(tokens)
            if key in prefilled:  # admitted with an identical prompt: shares its prefill outright
                request.cached = len(tokens)
            else:
                request.cached = replica.cache.match(tokens)
                reused += request.cached  # cached KV copied into the sequence's slot
            prefilled.add(key)
            prefill += len(tokens) - request.cached
            replica.cache.insert(tokens)
            replica.running.append([request, len(request.output)])
        replica.computed_prefill += prefill
        replica.step_started = self.now
        replica.generated += len(replica.running)
        lengths = [len(request.route.tokens) + len(request.output) - left for request, left in replica.running]
        # padded: every running sequence attends over the longest one's context (the reference engine's
        # batched decode); otherwise each over its own (paged attention, as vLLM).
        context = len(lengths) * max(lengths, default=0) if cfg.padded_context else sum(lengths)
        duration = (cfg.step_s + cfg.prefill_s_per_token * prefill + cfg.decode_s_per_seq * len(replica.running)
                    + cfg.decode_s_per_ctx_token * context + cfg.cached_s_per_token * reused)
        if cfg.cores > 0:
            self._share(duration, lambda: self._end_step(replica))
        else:
            self.at(self.now + duration, lambda: self._end_step(replica))

    def _share(self, work_s: float, on_done: Callable[[], None], serving: bool = False) -> None:
        self._cores.run(work_s, on_done, "serving" if serving else None)

    def _end_step(self, replica: _Replica) -> None:
        replica.busy_s += self.now - replica.step_started
        still = []
        for entry in replica.running:
            entry[1] -= 1
            if entry[1] > 0:
                still.append(entry)
                continue
            request = entry[0]
            replica.cache.insert(list(request.route.tokens) + request.output[:-1])
            replica.in_flight -= 1
            replica.prefill_tokens -= request.account[0]
            replica.decode_tokens -= request.account[1]
            request.done_at = self.now
            self.done.append(request)
            self.policy.on_finished(request.route, replica.name, [request.output], self.now)
            request.on_done(request, self.now)
        replica.running = still
        if replica.running or replica.waiting:
            self.at(self.now, lambda: self._step(replica))
        else:
            replica.stepping = False
        self._dispatch()


def simulate(policy: Policy, workload: Workload, config: SimConfig) -> dict:
    """Run the closed-loop workload (GRPO group workers + multi-turn sessions) on simulated replicas."""
    sim = Simulation(policy, config, seed=workload.seed)
    rng = random.Random(workload.seed)

    def output(n: int) -> list[int]:
        return [rng.randrange(5, 95) for _ in range(n)]

    groups = deque(enumerate(workload.group_prompts))

    def next_group() -> None:
        if not groups:
            return
        g, prompt = groups.popleft()
        pending = [workload.group_size]

        def done(_: SimRequest, t: float) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                next_group()

        for _ in range(workload.group_size):
            route = RouteRequest(tokens=prompt, group_key=f"g{g}", max_tokens=workload.max_tokens)
            sim.submit(SimRequest(route, output(workload.max_tokens), done))

    def run_session(s: int, history: list[int], turn: int) -> None:
        if turn == len(workload.session_turns[s]):
            return
        prompt = history + workload.session_turns[s][turn]

        def done(request: SimRequest, t: float) -> None:
            run_session(s, prompt + request.output, turn + 1)

        route = RouteRequest(tokens=prompt, session_key=f"s{s}", max_tokens=workload.max_tokens)
        sim.submit(SimRequest(route, output(workload.max_tokens), done))

    for _ in range(workload.group_workers):
        sim.at(0.0, next_group)
    for s in range(len(workload.session_turns)):
        sim.at(0.0, lambda s=s: run_session(s, [], 0))
    sim.run()
    prompt = sum(len(r.route.tokens) for r in sim.done)
    cached = sum(r.cached for r in sim.done)
    work = [r.computed_prefill + r.generated for r in sim.replicas.values()]  # tokens computed per replica
    return {
        "requests": len(sim.done),
        "latencies": [r.done_at - r.sent_at for r in sim.done],
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefill_tokens": sum(r.computed_prefill for r in sim.replicas.values()),
        "replica_work": work,
        "makespan_s": sim.now,
        "engine_busy_s": sum(r.busy_s for r in sim.replicas.values()),
    }


@dataclass
class Workload:
    """Token-level GRPO groups (group_size samples of one prompt, sent as separate requests, as rollout
    workers do) and multi-turn sessions (each turn: history + previous answer + a new user message)."""

    group_prompts: list[list[int]]
    group_size: int
    group_workers: int  # groups in flight at once (closed loop)
    session_turns: list[list[list[int]]]  # session -> turn -> new user tokens (the first holds the opening prompt)
    max_tokens: int
    seed: int = 0


def make_workload(seed: int, groups: int, group_size: int, group_workers: int, sessions: int, turns: int,
                  shared_tokens: int, question_tokens: int, opening_tokens: int, user_tokens: int,
                  max_tokens: int) -> Workload:
    """Group prompts share a system/few-shot prefix of `shared_tokens` and differ in their question."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 95) for _ in range(n)]

    shared = tokens(shared_tokens)
    group_prompts = [shared + tokens(question_tokens) for _ in range(groups)]
    session_turns = [[tokens(opening_tokens)] + [tokens(user_tokens) for _ in range(turns - 1)]
                     for _ in range(sessions)]
    return Workload(group_prompts, group_size, group_workers, session_turns, max_tokens, seed)
