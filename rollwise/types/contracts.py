"""The three interfaces the training loop is written against (DESIGN.md, "Shape of the code").

- `RolloutBackend`: where samples are generated. Implemented by the engine core
  (rollwise.engine.core.EngineWorker: one engine on a thread in this process), the Ray fleet
  (rollwise.control.ray.fleet.RayEngineFleet), a shared-pool job (rollwise.control.pool_backend.PoolWorker)
  and the simulator (rollwise.sim.cluster.SimCluster).
- `Trainer`: where gradients are taken; its `weights()` become a WeightUpdate through the sender
  the placement picks (rollwise.sync.senders). GRPOTrainer (rollwise.train.trainer) in this process, or
  the proxy to a trainer actor (rollwise.control.ray.placement.RayTrainer).
- `RolloutControl`: what the loop asks of a rollout controller (rollwise.rollout.controller's
  RolloutController and the agent layer's AgentController).

The smaller contracts the layers below speak through:

- `Scorer`: the reward layer as the rollout controller sees it (rollwise.reward.pool_scorer.PoolScorer: worker
  processes, the default; rollwise.reward.batch.InProcessScorer in this process, `reward.executor: inprocess`;
  reward actors on Ray: rollwise.control.ray.reward.RayScorer); the placement builds it. A `ConcurrentScorer`
  scores in the background, overlapped with generation.
- `WeightEngine` / `AdapterEngine`: what the engine side's WeightReceiver (rollwise.engine.weight_receiver)
  applies a checked update to: an engine, an EngineWorker (between two steps), a pool job's engines; an
  `AdapterEngine` also serves LoRA adapters beside its base (the receiver is given one for adapter updates).

Placement (rollwise.control.placement) returns one of each; the loop never asks which.

This module sits at the bottom of the layers, beside the types its signatures name (rollwise.types:
generation, sample, ledger, task, weight_update): it imports nothing of rollwise at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ray import ObjectRef
    from torch import Tensor

    from rollwise.types.weights import AdapterSpec, ExpectedWeights
    from rollwise.types.weight_update import WeightUpdate
    from rollwise.types.generation import Completion, GenerationRequest, ModelInfo, SamplingParams
    from rollwise.types.ledger import RolloutLedger
    from rollwise.types.sample import Sample
    from rollwise.types.task import Problem

Progress = Callable[[int], None]


@runtime_checkable
class RolloutBackend(Protocol):
    """Engines the rollout controller drives. Semantics every implementation keeps:

    - submit: all requests are admitted at one step boundary, or none (a bad request raises);
    - next_completion: one finished sample, in finishing order, or None after `timeout` seconds;
      each (request id, sample index) is delivered once;
    - abort: the aborted samples come back (finish_reason 'abort'); a sample that finished before
      the abort is already receivable from next_completion when abort returns;
    - load_weights: the whole update is checked, then applied between two engine steps (or
      refused, nothing applied); every token sampled afterwards carries `update.version`;
    - pause/resume: in-flight samples keep their state; close: stop and release the engines.
    """

    def submit(self, requests: list[GenerationRequest]) -> None: ...
    def next_completion(self, timeout: float) -> Completion | None: ...
    def abort(self, request_ids: list[str]) -> list[Completion]: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def load_weights(self, update: WeightUpdate) -> None: ...
    def model_info(self) -> ModelInfo: ...
    def metrics(self) -> dict[str, float]:
        """Placement metrics for the step record (the Ray fleet: engine restarts); {} when none."""
    def close(self) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """The policy being trained, wherever it runs."""

    @property
    def version(self) -> int:
        """The policy version: the number of updates applied (a resumed run's included)."""

    def train_step(self, samples: list[Sample]) -> dict[str, float]: ...
    def weights(self) -> Mapping[str, Tensor] | ObjectRef:
        """The current weights for a transport (rollwise.sync.senders): a mapping of tensors in this
        process (zero-copy views), or a handle the transport resolves (the Ray trainer: an ObjectRef)."""
    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any], keep_last: int) -> Path: ...
    def load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        """Restore the checkpoint (weights, optimizer, version, RNG); returns its state.json."""


@runtime_checkable
class RolloutControl(Protocol):
    """What the training loop calls on a rollout controller, in step order."""

    ledger: RolloutLedger
    score_seconds: float  # time spent scoring inside next_batch
    next_group: int  # the next group index to start (checkpointed)

    def next_batch(self, progress: Progress | None = None) -> list[Sample]: ...
    def assign_advantages(self, samples: list[Sample], mode: str) -> float:
        """Set each sample's advantage; returns the fraction of zero-variance groups."""
    def before_update(self) -> None: ...
    def mark_trained(self, samples: list[Sample]) -> None: ...
    def after_update(self, version: int) -> None: ...
    def evaluate_problems(self, problems: list[Problem], params: SamplingParams, label: str,
                          progress: Progress | None = None) -> list[Sample]:
        """Greedy held-out samples for `problems` (unscored)."""
    def step_metrics(self) -> dict[str, float]: ...
    def in_flight(self) -> int: ...
    def pending_groups(self) -> list[int]: ...
    def close(self, reason: str = "the run ended") -> None: ...


@runtime_checkable
class WeightEngine(Protocol):
    """What a WeightReceiver applies a checked full-weight update to (rollwise.engine.weight_receiver)."""

    @property
    def policy_version(self) -> int | None:
        """The version it serves (None: a pool job that was never pushed)."""
    @property
    def expected_weights(self) -> ExpectedWeights:
        """Every tensor's name, shape and dtype it holds (and which share memory)."""
    def apply_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Apply the whole checked state at once, between two engine steps (or raise ValueError, nothing applied)."""


@runtime_checkable
class AdapterEngine(WeightEngine, Protocol):
    """A WeightEngine that also serves LoRA adapters beside its base (rollwise.sync.adapters)."""

    def loaded_adapters(self) -> dict[str, int]:
        """Adapter name -> the version it holds."""
    def load_adapter(self, spec: AdapterSpec, state: Mapping[str, Tensor], version: int) -> None:
        """Load the adapter without touching the base weights (or raise ValueError, nothing changed)."""


@runtime_checkable
class Scorer(Protocol):
    """Scores a complete group's samples in place: reward, outcome, correctness flags (and `extra["reward_error"]`
    when the reward code failed: reward code is untrusted, so scoring never raises for it)."""

    def score(self, samples: list[Sample]) -> None: ...


@runtime_checkable
class ConcurrentScorer(Scorer, Protocol):
    """A Scorer that also scores in the background (the reward pool, Ray reward actors): `submit` returns at once
    and its future resolves, never with an exception, once every sample is filled in. The rollout controller
    submits each group as it completes and goes on generating; the trainer waits only for the groups it takes."""

    def submit(self, samples: list[Sample]) -> Future[None]: ...
