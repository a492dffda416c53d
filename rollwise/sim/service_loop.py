"""`rollwise bench service`'s own workload on a virtual clock (issue 39): N tenants, each running the arithmetic RL
loop through `rollwise serve tinker`, on ONE worker (one engine device + one trainer device), as the worker runs
them (rollwise/service/worker.py).

Per tenant and step, as rollwise/bench/service_tenant.py calls the SDK (each call a request row and a result):
save_weights_for_sampler (an adapter push), create_sampling_session, `groups` asample requests at once (each
`group_size` samples), the client's own work (rewards, datums), then forward_backward and optim_step sent
together; the step ends when optim_step's result is back.

The worker, as built (`worker="two_lane"`): two threads, each polling the store (5 ms, backing off x1.5 to 50 ms
while idle) for its own rows. The sampling lane's pass takes the sampling-session creations, then every queued
sample of every tenant in one engine batch; the training lane's pass takes the training rows per model in seq
order, in rounds (each round: the models' next rows; single ops one at a time, every forward_backward of the
round in one batched call). A tenant's own calls stay in sequence (its client waits on each result), so the
lanes overlap across tenants: one tenant samples while another trains. `worker="serial"`: the one-thread worker
before it (one pass: creations, training rounds, then samples), kept for comparison. On a GPU host the lanes
have their own devices; on the CPU they share its cores (`LaneSharing`).

Costs (`ServiceCosts`) say what each call takes on the device; `rpc_s` and `client_s` are what a request and a
step cost off the device (HTTP, the store, the SDK, the client's Python), which tenants overlap with each other.
Where the numbers come from: rollwise.sim.service_costs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollwise.sim.cores import crowded_cores
from rollwise.sim.cost import CostModel
from rollwise.sim.mux import Host

WORKER_POLL_S = 0.005  # rollwise/service/worker.py: Worker.run's idle wait, x1.5 per empty pass up to the cap
WORKER_POLL_MAX_S = 0.05


class ServiceWorkload(BaseModel):
    """One tenant's step (docs/bench/service.json "workload"); token counts of the arithmetic prompts."""

    model_config = ConfigDict(extra="forbid")

    groups: int = Field(4, ge=1, description="asample requests per step (one problem each)")
    group_size: int = Field(4, ge=1, description="samples per asample request")
    max_tokens: int = Field(8, ge=1, description="decode steps of a sampling batch (its longest sample)")
    # bundled SmolLM2's tokenizer on rollwise/bench/service_tenant.py's few-shot prompt: 42-44 tokens, mean 43.6
    prompt_tokens: int = Field(44, ge=1)
    # docs/bench/service.json: 46.6 trained tokens a sample = prompt + completion - 1 -> completions of ~4 tokens
    completion_tokens: int = Field(4, ge=1, description="mean sampled tokens (the stop string ends most early)")
    lora_rank: int = Field(8, ge=1)

    @property
    def samples_per_step(self) -> int:
        return self.groups * self.group_size

    @property
    def train_tokens_per_step(self) -> int:
        return self.samples_per_step * (self.prompt_tokens + self.completion_tokens - 1)


class ServiceCosts(BaseModel):
    """Seconds per worker call, and off-device latencies. Sampling follows `engine` (rollwise.sim.cost)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    engine: CostModel
    sample_call_s: float = Field(0.0, ge=0, description="per sample_many call, beside the engine steps")
    fb_call_s: float = Field(0.0, ge=0, description="per forward_backward_many call (the base's kernels, Python)")
    fb_per_tenant_s: float = Field(0.0, ge=0, description="per tenant in a call (its adapter's kernels, its loss)")
    fb_s_per_token: float = Field(0.0, ge=0, description="compute per trained token (compute-bound regime)")
    fb_memory_s: float = Field(0.0, ge=0, description="floor of a call: reading the base weights (memory-bound)")
    optim_s: float = Field(0.0, ge=0, description="AdamW over one tenant's adapter")
    push_s: float = Field(0.0, ge=0, description="save_weights_for_sampler: one adapter to the sampler")
    session_s: float = Field(0.0, ge=0, description="create_sampling_session")
    store_s_per_row: float = Field(0.0, ge=0, description="the worker's store writes per row (claim, result)")
    rpc_s: float = Field(0.0, ge=0, description="a request's round trip off the worker: HTTP, row insert, future")
    client_s: float = Field(0.0, ge=0, description="the client's own work per step: rewards, datums")
    sources: list[str] = Field(default_factory=list)
    assumptions: list[str] = Field(default_factory=list)

    def sample_s(self, requests: int, workload: ServiceWorkload) -> float:
        seqs = requests * workload.group_size
        return self.sample_call_s + self.engine.steps_duration(
            workload.max_tokens, seqs, seqs * workload.prompt_tokens, seqs * workload.prompt_tokens)

    def forward_backward_s(self, tenants: int, tokens: int) -> float:
        return self.fb_call_s + self.fb_per_tenant_s * tenants + max(self.fb_memory_s, self.fb_s_per_token * tokens)


TRAINING = ("push", "optim", "fb")
SAMPLING = ("session", "sample")
Worker = Literal["two_lane", "serial"]
WORKERS: tuple[Worker, ...] = ("two_lane", "serial")


@dataclass(frozen=True)
class LaneSharing:
    """The two lanes on one CPU's cores (the CPU service: both threads run torch on all the cores), as the pool
    simulator shares them (rollwise.sim.mux.Host, measured by rollwise.sim.host.measure_cpu_host): the OS shares
    the cores per thread, so with k lanes computing at once each of their k x `threads` threads runs at
    min(1, cores / threads running), `cores` the measured effective cores at that crowding. A lane's rate is
    that over its rate alone, since the costs are levelled on calls that ran alone. Absent (None): the lanes
    are on devices of their own (an engine GPU, a trainer GPU) and never slow each other."""

    host: Host
    threads: int  # torch intra-op threads per lane (torch's default: the machine's cores)

    def rate(self, busy: int) -> float:
        if busy <= 1 or not self.host.shared:
            return 1.0

        def per_thread(n: int) -> float:
            return min(1.0, crowded_cores(self.host.cores, self.host.crowding, n) / n)

        return per_thread(busy * self.threads) / per_thread(self.threads)


@dataclass
class _Row:
    tenant: int
    kind: str
    arrive: float
    seq: int


@dataclass
class _Tenant:
    step: int = 0
    seq: int = 0
    step_started: float = 0.0
    samples_left: int = 0
    step_s: list[float] = field(default_factory=list)


@dataclass
class _Call:
    rows: list[_Row]
    device_s: float  # on the device (or, on the CPU, the cores), alone
    left_s: float  # work left, in seconds alone: the call plus its rows' store writes


@dataclass
class _Lane:
    kinds: tuple[str, ...]
    next_poll: float = 0.0
    idle: float = WORKER_POLL_S
    busy_s: float = 0.0
    calls: list[_Call] = field(default_factory=list)  # the pass in progress, in order


def simulate_service(tenants: int, workload: ServiceWorkload, costs: ServiceCosts, *, steps: int = 8,
                     worker: Worker = "two_lane", sharing: LaneSharing | None = None) -> dict[str, float]:
    """`tenants` clients at once, `steps` steps each. Aggregate samples/s in steady state: tenants x samples a step
    / the mean step time, first step left out (as `rollwise bench service` reports mean_step_s). `worker`:
    "two_lane" as built (a sampling lane beside the training lane), "serial" the one-thread worker before it.
    `sharing`: the lanes share CPU cores (None: each lane on its own device)."""
    rows: list[_Row] = []
    state = [_Tenant() for _ in range(tenants)]
    lanes = [_Lane(TRAINING), _Lane(SAMPLING)] if worker == "two_lane" else [_Lane(TRAINING + SAMPLING)]
    half = costs.rpc_s / 2

    def submit(t: int, kind: str, at: float) -> None:
        tenant = state[t]
        tenant.seq += 1
        rows.append(_Row(t, kind, at + half, tenant.seq))

    def begin_step(t: int, at: float) -> None:
        state[t].step_started = at
        submit(t, "push", at)

    def done(row: _Row, at: float) -> None:  # the client's reaction to a result
        t, back = row.tenant, at + half
        tenant = state[t]
        if row.kind == "push":
            submit(t, "session", back)
        elif row.kind == "session":
            tenant.samples_left = workload.groups
            for _ in range(workload.groups):
                submit(t, "sample", back)
        elif row.kind == "sample":
            tenant.samples_left -= 1
            if tenant.samples_left == 0:
                submit(t, "fb", back + costs.client_s)
                submit(t, "optim", back + costs.client_s)
        elif row.kind == "optim":
            tenant.step_s.append(back - tenant.step_started)
            tenant.step += 1
            if tenant.step < steps:
                begin_step(t, back)

    def plan_pass(lane: _Lane, now: float) -> list[_Call]:
        """One pass (Worker.run_once, run_training_once or run_sampling_once) over the rows that have arrived
        for this lane: its calls in the order the worker makes them."""
        claimed = [r for r in rows if r.arrive <= now and r.kind in lane.kinds]
        for r in claimed:
            rows.remove(r)
        calls: list[_Call] = []

        def call(rs: list[_Row], seconds: float) -> None:
            calls.append(_Call(rs, seconds, seconds + costs.store_s_per_row * len(rs)))

        for r in [r for r in claimed if r.kind == "session"]:
            call([r], costs.session_s)
        training = sorted((r for r in claimed if r.kind in TRAINING), key=lambda r: (r.tenant, r.seq))
        while training:
            heads = list({r.tenant: r for r in reversed(training)}.values())  # each model's next row
            for r in heads:
                training.remove(r)
            for r in heads:
                if r.kind != "fb":
                    call([r], costs.push_s if r.kind == "push" else costs.optim_s)
            batch = [r for r in heads if r.kind == "fb"]
            if batch:
                call(batch, costs.forward_backward_s(len(batch), len(batch) * workload.train_tokens_per_step))
        samples = [r for r in claimed if r.kind == "sample"]
        if samples:
            call(samples, costs.sample_s(len(samples), workload))
        return calls

    for t in range(tenants):
        begin_step(t, 0.0)
    now = 0.0
    while any(s.step < steps for s in state):
        # lanes whose poll is due: a pass over their arrived rows, or an idle wait (x1.5 up to the cap)
        for lane in lanes:
            if not lane.calls and lane.next_poll <= now:
                lane.calls = plan_pass(lane, now)
                if lane.calls:
                    lane.idle = WORKER_POLL_S
                else:
                    lane.next_poll, lane.idle = now + lane.idle, min(lane.idle * 1.5, WORKER_POLL_MAX_S)
        busy = [lane for lane in lanes if lane.calls]
        rate = sharing.rate(len(busy)) if sharing else 1.0
        ends = [now + lane.calls[0].left_s / rate for lane in busy]
        polls = [lane.next_poll for lane in lanes if not lane.calls]
        later = min(ends + polls)
        for lane in busy:
            lane.calls[0].left_s -= (later - now) * rate
        now = later
        for lane in busy:
            head = lane.calls[0]
            if head.left_s <= 1e-12:
                lane.calls.pop(0)
                lane.busy_s += head.device_s
                for r in head.rows:
                    done(r, now)
                if not lane.calls:
                    lane.next_poll = now  # a pass that ran rows polls again at once
    steady = [s for tenant in state for s in (tenant.step_s[1:] or tenant.step_s)]
    step_s = statistics.fmean(steady)
    makespan = max(sum(tenant.step_s) for tenant in state)
    return {"tenants": tenants, "step_s": step_s,
            "aggregate_samples_per_s": tenants * workload.samples_per_step / step_s,
            "aggregate_train_tokens_per_s": tenants * workload.train_tokens_per_step / step_s,
            "device_busy": sum(ln.busy_s for ln in lanes) / (len(lanes) * makespan)}


def device_bound_samples_per_s(tenants: int, workload: ServiceWorkload, costs: ServiceCosts, *,
                               worker: Worker = "two_lane") -> float:
    """The most samples/s the devices allow whatever the latencies: one step of every tenant with every call batched
    as far as the worker batches (all samples in one call, all forward_backwards in one), back to back; two
    lanes on their own devices: the busier of the two."""
    sampling_s = costs.sample_s(tenants * workload.groups, workload) + tenants * costs.session_s
    training_s = (costs.forward_backward_s(tenants, tenants * workload.train_tokens_per_step)
                  + tenants * (costs.push_s + costs.optim_s))
    device_s = max(sampling_s, training_s) if worker == "two_lane" else sampling_s + training_s
    return tenants * workload.samples_per_step / device_s
