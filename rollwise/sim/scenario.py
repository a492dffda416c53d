"""A simulation scenario (YAML): cluster, cost model, workload, rollout policy. Validated by pydantic,
so a typo names the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollwise.types.generation import GenerationRequest
from rollwise.sim.cost import CostModel, TrainerModel, load_cost_file
from rollwise.sim.speculation import SpeculationModel


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterSpec(_Section):
    gpus: int = Field(8, ge=1, description="rollout GPUs; engines = gpus // cost.gpus_per_engine")
    cost: str = Field("h100-7b", description="cost file: a path, or a bundled name under rollwise/sim/configs/")
    routing: str = Field("least_load", description="production routing policy (rollwise.router.policies)")
    shard_size: int = Field(64, ge=1, description="engines per router shard (one routing decision's scope)")
    max_num_seqs: int | None = Field(None, ge=1, description="override the cost file's per-engine concurrency")
    trainer_gpus_ratio: float = Field(0.5, gt=0, description="trainer GPUs per rollout GPU (disaggregated; an assumption)")
    trainer_gpus: int | None = Field(None, ge=1, description="trainer GPUs (overrides trainer_gpus_ratio; "
                                     "`rollwise sim plan` chooses it)")


class OutputLengths(_Section):
    kind: Literal["lognormal", "trace"] = "lognormal"
    median: float = Field(512, gt=0)
    sigma: float = Field(1.0, ge=0)
    trace: str | None = Field(None, description="kind=trace: a file with one output length per line")
    max_tokens: int = Field(4096, ge=1, description="the generation budget (rollout.max_tokens)")

    @model_validator(mode="after")
    def _trace_needs_path(self) -> OutputLengths:
        if self.kind == "trace" and not self.trace:
            raise ValueError("workload.output.kind=trace needs workload.output.trace (a file of lengths)")
        return self


class WorkloadSpec(_Section):
    updates: int = Field(4, ge=1, description="trainer updates to simulate")
    prompts_per_step: int = Field(64, ge=1, description="GRPO groups per update (scaled by gpus in a sweep)")
    group_size: int = Field(16, ge=2)
    prompt_tokens: int = Field(256, ge=1, description="tokens per prompt, shared prefix included")
    shared_prefix_tokens: int = Field(0, ge=0, description="system/few-shot prefix every prompt starts with")
    output: OutputLengths = OutputLengths()
    force_lengths: bool = Field(False, description="benchmark style: every sample its own request, lengths forced")
    # An RL recipe's trainer work per update, relative to one policy update over every token of the batch: GRPO's
    # skip of zero-variance groups makes it < 1, a reference model's forward (REINFORCE++'s KL in the reward) or a
    # critic adds to it. `rollwise bench algorithms` measures each recipe's on the default task and projects
    # its step time here (rollwise.bench.algorithms_projection).
    trainer_work: float = Field(1.0, gt=0, description="trainer seconds per update relative to a policy update "
                                "over the whole batch (a recipe's; measured by `rollwise bench algorithms`)")


class RolloutSpec(_Section):
    mode: Literal["sync", "sorted", "async"] = "sorted"
    max_staleness: int = Field(1, ge=0)
    oversubscription: float | None = Field(None, ge=1.0, description="default: max_staleness + 1")
    partial_rollout: Literal["continue", "abort"] = "continue"
    update_batch: Literal["fixed", "flexible"] = Field("fixed", description="rollout.update_batch (issue 26)")
    max_batch_factor: float = Field(2.0, ge=1.0, description="update_batch=flexible: most groups per update "
                                    "= this x prompts_per_step")


class SessionsSpec(_Section):
    """Multi-turn agent sessions (no trainer): generate, call a tool, append its result, repeat."""

    count: int = Field(0, ge=0)
    turns: int = Field(4, ge=1)
    tool_latency_median_s: float = Field(2.0, ge=0)
    tool_latency_sigma: float = Field(0.5, ge=0)
    tool_result_tokens: int = Field(64, ge=1)


class Scenario(_Section):
    name: str = "scenario"
    seed: int = 0
    cluster: ClusterSpec = ClusterSpec()
    workload: WorkloadSpec = WorkloadSpec()
    rollout: RolloutSpec = RolloutSpec()
    sessions: SessionsSpec = SessionsSpec()
    # engine.speculation=history on every engine (None: off), e.g. --set speculation.acceptance=0.8
    speculation: SpeculationModel | None = None
    base_dir: Path | None = Field(None, exclude=True)

    def cost(self) -> tuple[CostModel, TrainerModel]:
        engine, trainer = load_cost_file(self.cluster.cost, self.base_dir)
        if self.cluster.max_num_seqs is not None:
            engine = engine.model_copy(update={"max_num_seqs": self.cluster.max_num_seqs})
        if self.speculation is not None:
            engine = engine.model_copy(update={"speculation": self.speculation})
        return engine, trainer or TrainerModel()

    def engines(self, cost: CostModel) -> int:
        n = self.cluster.gpus // cost.gpus_per_engine
        if n < 1:
            raise ValueError(f"cluster.gpus={self.cluster.gpus} is less than one engine "
                             f"({cost.gpus_per_engine} GPUs per engine in {cost.name})")
        return n

    def trainer_gpus(self) -> int:
        if self.cluster.trainer_gpus is not None:
            return self.cluster.trainer_gpus
        return max(1, round(self.cluster.gpus * self.cluster.trainer_gpus_ratio))


def load_scenario(path: str | Path, overrides: dict | None = None) -> Scenario:
    path = Path(path)
    raw = yaml.safe_load(path.read_text()) or {}
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    scenario = Scenario.model_validate(raw)
    scenario.base_dir = path.parent
    return scenario


class LengthModel:
    """A sample's natural output length, a pure function of (seed, sample seed): same seed, same run."""

    def __init__(self, spec: OutputLengths, seed: int, base_dir: Path | None = None) -> None:
        self.spec, self.seed = spec, seed
        self.trace: list[int] | None = None
        if spec.kind == "trace":
            p = Path(spec.trace)  # type: ignore[arg-type]
            if not p.is_absolute() and base_dir is not None and not p.exists():
                p = base_dir / p
            self.trace = [int(float(x)) for x in p.read_text().split() if x.strip()]
            if not self.trace:
                raise ValueError(f"trace file {p} holds no lengths")

    def draw(self, key: int) -> int:
        u1, u2 = uniform_draw(self.seed, key, 1), uniform_draw(self.seed, key, 2)
        if self.trace is not None:
            return max(1, self.trace[int(u1 * len(self.trace))])
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)  # Box-Muller
        return max(1, round(math.exp(math.log(self.spec.median) + self.spec.sigma * z)))

    def for_request(self, req: GenerationRequest, index: int) -> int:
        seed = req.params.seed if req.params.seed is not None else hash(req.request_id) & 0x7FFFFFFF
        return self.draw(seed + index)


_MASK = (1 << 64) - 1


def uniform_draw(seed: int, key: int, stream: int) -> float:
    """A uniform in (0, 1) from (seed, key, stream) by splitmix64: cheap, and the same on every run."""
    z = (seed * 0x9E3779B97F4A7C15 + key * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return ((z >> 11) + 0.5) / float(1 << 53)
