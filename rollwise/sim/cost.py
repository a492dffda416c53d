"""The simulated engine's cost model: how long one scheduler iteration takes, and what fits.

One engine step (continuous batching, as the reference engine and vLLM run it) prefills the newly
admitted prompts and decodes one token for every running sequence:

    step_s = step_overhead_s
           + prefill_s_per_token * uncached prompt tokens prefilled in this step
           + decode_s_per_seq    * running sequences
           + decode_s_per_ctx_token * context tokens of the running sequences (KV read)

Why this shape: decode is memory-bound on GPUs (every step reads the weights once: the overhead
term, and every sequence's KV cache: the context term) and compute-bound per sequence on CPUs (the
per-sequence term); prefill is compute-bound per token. `rollwise sim calibrate` fits the four
numbers by least squares from timed steps of a real engine; the GPU-class files under
rollwise/sim/configs/ derive them from published hardware and model figures (cited there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from rollwise.sim.cores import overlap_slowdowns
from rollwise.sim.speculation import SpeculationModel
from rollwise.types.microbatch import computed_tokens


class CostModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "unnamed"
    step_overhead_s: float = Field(0.0, ge=0, description="fixed time per engine step (weights read, launch)")
    prefill_s_per_token: float = Field(0.0, ge=0, description="per uncached prompt token prefilled")
    decode_s_per_seq: float = Field(0.0, ge=0, description="per running sequence per step")
    decode_s_per_ctx_token: float = Field(0.0, ge=0, description="per context token of running sequences per step")
    # Measured step time by running batch, context excluded (linear between the sizes, flat beyond): where
    # set, it replaces overhead + per-sequence. Small CPU batches are not linear: the reference engine
    # here steps a batch of 2 about 1.7x slower than a batch of 1 and barely slower than a batch of 8
    # (matrix-vector vs matrix-matrix kernels), and a rollout's long tail runs at exactly those sizes.
    decode_s_by_batch: dict[int, float] = Field(default_factory=dict)
    max_num_seqs: int = Field(64, ge=1, description="concurrent sequences per engine (bubble-ratio capacity)")
    max_model_len: int = Field(4096, ge=2, description="prompt + generated tokens per sequence")
    kv_capacity_tokens: int = Field(1 << 30, ge=1, description="KV-cache tokens per engine; gates admission")
    prefix_cache_tokens: int = Field(0, ge=0, description="cross-request prefix cache per engine (0: off)")
    block_size: int = Field(16, ge=1, description="prefix-cache granularity in tokens")
    # Reference engine: a newly admitted sequence samples its first token from the prefill and is decoded
    # in the same step (2 tokens in its first step); vLLM's first step yields 1 token.
    decode_after_prefill: bool = False
    weight_update_s: float = Field(0.0, ge=0, description="engine blocked while loading new weights")
    # vLLM resets its prefix cache with the running requests at a weight update: they re-prefill their
    # whole context (prompt + tokens so far) under the new weights in the next step.
    update_reprefill: bool = False
    gpus_per_engine: int = Field(1, ge=1, description="tensor parallel degree: GPUs one engine occupies")
    # Where generation and training share cores (this CPU machine), engine steps run slower while
    # the trainer trains; 1.0 on disaggregated GPUs.
    train_contention: float = Field(1.0, ge=1.0, description="engine step slowdown while the trainer trains")
    # Measured at a few running batch sizes (small batches are mostly Python and contend less); empty:
    # train_contention at every batch size. Linear between the measured sizes, flat beyond them.
    train_contention_by_batch: dict[int, float] = Field(default_factory=dict)
    # Derived contention instead of the measured tables above (issue 26): the engine and the trainer share
    # `shared_cores` cores, each on `torch_threads` threads, and slow each other as the OS shares the cores
    # per thread (rollwise.sim.cores.overlap_slowdowns, from this model's own step times). 0: not modelled.
    shared_cores: float = Field(0.0, ge=0, description="cores engine and trainer share (0: the tables above)")
    torch_threads: int = Field(1, ge=1, description="torch threads the engine and the trainer each run")
    # Speculative decoding (engine.speculation=history): the scenario's `speculation` section (sim.speculation).
    speculation: SpeculationModel | None = None
    sources: list[str] = Field(default_factory=list, description="where the numbers come from")
    assumptions: list[str] = Field(default_factory=list)

    def engine_contention(self, batch: int) -> float:
        if self.shared_cores > 0:
            return self.overlap_slowdowns(batch)[0]
        return interpolate(self.train_contention_by_batch, batch, self.train_contention)

    @property
    def shares_cores(self) -> bool:
        """Engine and trainer slow each other by the derived model: fewer shared cores than their threads."""
        return 0 < self.shared_cores < 2 * self.torch_threads

    def overlap_slowdowns(self, batch: int) -> tuple[float, float]:
        """(engine step, train step) slowdowns while the engine runs `batch` sequences and the trainer
        trains on the shared cores. The engine's serial (Python) part is its step at batch 1."""
        return overlap_slowdowns(self.decode_s(batch, 0.0), self.decode_s(1, 0.0), self.torch_threads,
                                 self.shared_cores)

    def decode_s(self, batch: int, context_tokens: float) -> float:
        if self.decode_s_by_batch:
            return interpolate(self.decode_s_by_batch, batch, 0.0) + self.decode_s_per_ctx_token * context_tokens
        return self.step_overhead_s + self.decode_s_per_seq * batch + self.decode_s_per_ctx_token * context_tokens

    def steps_duration(self, k: int, batch: int, context0: float, prefill_tokens: int) -> float:
        """k consecutive steps with a fixed batch whose context grows by `batch` tokens per step; the
        first step also prefills. Closed form, so the simulator can jump over k steps at once."""
        if k <= 0:
            return 0.0
        per, growth = self.decode_s(batch, context0), 1.0
        if self.speculation is not None:  # a step here is one emitted token per sequence
            per, growth = self.speculation.token_step(self.decode_s, batch, context0)
        return (self.prefill_s_per_token * prefill_tokens + k * per
                + self.decode_s_per_ctx_token * batch * k * (k - 1) / 2 * growth)


class CollectiveModel(BaseModel):
    """What a sharded (FSDP2) trainer step and push cost in collectives: all-gathers of parameters
    and reduce-scatters of gradients, ring-style, at the link bandwidth a rank sees. Each rank sends
    `passes_per_micro_batch` x model bytes x (N-1)/N per micro-batch (measured by `rollwise bench
    trainer` over loopback: its "collective model-bytes/micro-batch/rank" at N=2, divided by 1/2),
    and a weight push gathers the model once more. Compute hides up to `overlap` of it."""

    model_config = ConfigDict(extra="forbid")

    model_bytes: float = Field(..., gt=0, description="bytes of the parameters as the collectives move them")
    passes_per_micro_batch: float = Field(3.0, gt=0, description="model-sized ring passes per micro-batch "
                                          "(FSDP2: forward gather + backward gather + gradient reduce-scatter)")
    micro_batches_per_step: int = Field(1, ge=1, description="gradient-accumulation micro-batches per update")
    gpus_per_node: int = Field(8, ge=1)
    intra_node_gbps: float = Field(..., gt=0, description="GB/s per rank inside a node (NVLink)")
    inter_node_gbps: float = Field(..., gt=0, description="GB/s per rank across nodes (InfiniBand)")
    overlap: float = Field(0.0, ge=0, le=1, description="share of the compute time that can hide collectives")

    def bandwidth(self, ranks: int) -> float:
        return (self.intra_node_gbps if ranks <= self.gpus_per_node else self.inter_node_gbps) * 1e9

    def ring_s(self, passes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return passes * self.model_bytes * (ranks - 1) / ranks / self.bandwidth(ranks)

    def step_s(self, ranks: int, compute_s: float) -> float:
        """Collective time a step adds beyond its compute (what overlap does not hide), plus the push gather."""
        comm = self.ring_s(self.passes_per_micro_batch * self.micro_batches_per_step, ranks)
        return max(comm - self.overlap * compute_s, 0.0) + self.ring_s(1.0, ranks)


class TrainerModel(BaseModel):
    """The modelled trainer: one update = overhead + trained tokens x time per token, spread over the
    trainer's GPUs (assumes data-parallel scaling; state otherwise in the cost file). What a trained
    token is: `packed` counts prompt + response of every sample (sequence packing, as GPU trainers do);
    `micro_batches` counts what rollwise's own trainer computes, padding included
    (rollwise.types.microbatch.computed_tokens: a group's prompt once + rows x its longest response)."""

    model_config = ConfigDict(extra="forbid")

    step_overhead_s: float = Field(0.0, ge=0, description="per update: optimizer step, gradient sync")
    s_per_token_gpu: float = Field(0.0, ge=0, description="seconds per trained token on one GPU (or this CPU)")
    tokens: Literal["packed", "micro_batches"] = Field("packed", description="what counts as a trained token")
    contention: float = Field(1.0, ge=1.0, description="train step slowdown while engines generate on shared cores")
    contention_by_batch: dict[int, float] = Field(default_factory=dict, description="by the engine's running batch")
    collectives: CollectiveModel | None = Field(None, description="sharded-trainer collectives; None: free")
    sources: list[str] = Field(default_factory=list)
    assumptions: list[str] = Field(default_factory=list)

    def contention_at(self, engine_batch: int) -> float:
        return interpolate(self.contention_by_batch, engine_batch, self.contention)

    def step_s(self, tokens: int, gpus: int = 1) -> float:
        compute = self.s_per_token_gpu * tokens / max(gpus, 1)
        comm = self.collectives.step_s(gpus, compute) if self.collectives is not None else 0.0
        return self.step_overhead_s + compute + comm

    def batch_tokens(self, samples: list[Any], train: Any) -> int:
        """Trained tokens of one update's samples, as `tokens` counts them (train: the run's TrainConfig)."""
        if self.tokens == "micro_batches":
            return computed_tokens(samples, train)
        return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def interpolate(points: dict[int, float], x: int, default: float) -> float:
    """Piecewise linear through `points` (x -> y), flat outside them; `default` when there are none."""
    if not points:
        return default
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return points[xs[-1]]


CONFIG_DIR = Path(__file__).parent / "configs"


def resolve_config_path(path: str | Path, base: Path | None = None) -> Path:
    """A path as given, relative to a scenario file, or a bundled config by name (e.g. 'h100-7b')."""
    p = Path(path)
    candidates = [p]
    if base is not None:
        candidates.append(base / p)
    candidates += [CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"no config file {path!r} (looked in {', '.join(str(c) for c in candidates)})")


def load_cost_file(path: str | Path, base: Path | None = None) -> tuple[CostModel, TrainerModel | None]:
    """A cost file holds `engine:` (a CostModel) and optionally `trainer:` (a TrainerModel)."""
    raw: dict[str, Any] = yaml.safe_load(resolve_config_path(path, base).read_text()) or {}
    trainer = raw.get("trainer")
    return CostModel.model_validate(raw.get("engine", {})), (TrainerModel.model_validate(trainer) if trainer else None)
