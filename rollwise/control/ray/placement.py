"""`placement: ray`: engines, the trainer and reward workers as Ray actors, in one placement group.

The training loop (rollwise.control.train_loop) runs unchanged; what it holds are stand-ins:

- the engines: a `RayEngineFleet` (rollwise.control.ray.fleet), the RolloutBackend over `ray.num_engines` engine actors; a dead engine actor is restarted by Ray, re-synced to the
  current weights and policy version, and its outstanding requests are generated again;
- the trainer: `RayTrainer`, the Trainer (rollwise.types.contracts) proxying a `TrainerActor` that holds the
  model, the optimizer and the GRPOTrainer, and runs train steps and checkpoint save/load; weights go
  from the trainer actor to the engine actors through Ray's object store, never through the driver
  (rollwise.sync.senders.ObjectStoreSender), or with `sync.sender: collective` as one gloo/NCCL
  broadcast from the driver to every engine actor (rollwise.control.ray.fleet_collective);
- the reward: `RayScorer` (rollwise.control.ray.reward), which scores each finished group on one of
  `ray.reward_workers` actors (round robin; Ray retries a call on a restarted actor: scoring is idempotent).
  Held-out evaluation is still scored in the driver.
- an environment task's workers (task.kind verifiers / openenv): one actor each, owning the environment's
  process (rollwise.control.ray.env_workers); the driver's EnvService health-checks and replaces them.

`ray.address`: 'auto' joins the cluster `ray start` runs on this machine, or starts a local one for
the run (shut down at the end); HOST:PORT joins that cluster. If this process is already connected
(ray.init called before), that connection is used. Every actor runs in `rollwise`'s own Python
environment: install rollwise on every node (and keep model files and the task's files at the same
paths: actors load the model and the task themselves).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollwise.config import ConfigError, RunConfig, dump_config
from rollwise.control.ray.calls import get_all, log
from rollwise.control.ray.engine_actor import engine_actor_class
from rollwise.control.ray.fleet import RayEngineFleet
from rollwise.control.ray.fleet_collective import FleetWeightGroup
from rollwise.control.ray.trainer_ranks import RayRankGroup, TrainerRankActor, kill_actors
from rollwise.tasks import ENVIRONMENT_KINDS
from rollwise.types.sample import Sample
from rollwise.types.weight_update import WeightUpdate
from rollwise.train.sharded import ShardedTrainer

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from rollwise.control.ray.reward import RayScorer  # (reward.py imports this module's session)

# Called with every fleet place_on_ray creates (tests use it to kill actors mid-rollout).
FLEET_HOOKS: list[Callable[[RayEngineFleet], None]] = []

_SESSION: RaySession | None = None


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _check_reachable(address: str) -> None:
    """Fail fast with the fix named (ray.init would retry for a minute on a wrong address)."""
    host, _, port = address.rpartition(":")
    if address.startswith(("ray://", "http")) or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(
            f"ray.address={address!r}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
            f"`ray start --head --port {port}`, or set ray.address=auto (joins a local cluster or starts one)"
        ) from None


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    return bundle or {"CPU": 0.001}  # Ray refuses empty bundles


class RaySession:
    """The run's connection to the cluster, its placement group and its actors (one per process)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        rc = cfg.ray
        self.owns_ray = False
        # Bundles: engines first (index i = engine i), then the trainer ranks, then the reward workers, then an
        # environment task's workers (rollwise.control.ray.env_workers).
        self.engine_bundles = list(range(rc.num_engines))
        self.trainer_bundles = [rc.num_engines + i for i in range(rc.trainer_ranks)]
        self.reward_bundles = [rc.num_engines + rc.trainer_ranks + i for i in range(rc.reward_workers)]
        env_workers = cfg.task.workers if cfg.task.kind in ENVIRONMENT_KINDS else 0
        first_env = rc.num_engines + rc.trainer_ranks + rc.reward_workers
        self.env_bundles = [first_env + i for i in range(env_workers)]
        # last, train.teacher.model's actor (rollwise.control.ray.teacher_actor); a train.teacher.url teacher has none
        teachers = int(cfg.train.teacher is not None and cfg.train.teacher.model is not None)
        self.teacher_bundles = [first_env + env_workers + i for i in range(teachers)]
        bundles = ([_bundle(rc.engine_cpus, rc.engine_gpus)] * rc.num_engines
                   + [_bundle(rc.trainer_cpus, rc.trainer_gpus)] * rc.trainer_ranks
                   + [_bundle(rc.reward_cpus, 0)] * rc.reward_workers
                   + [_bundle(rc.env_cpus, 0)] * env_workers
                   + [_bundle(rc.teacher_cpus, rc.teacher_gpus)] * teachers)
        demand = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
        if not ray.is_initialized():
            env = {k: v for k, v in os.environ.items() if k.startswith("ROLLWISE_")}
            kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "configure_logging": True}
            if env:
                kwargs["runtime_env"] = {"env_vars": env}
            if rc.address == "auto":
                try:
                    ray.init(address="auto", **kwargs)
                except ConnectionError:
                    # One machine: logical CPUs enough for every bundle (local placement shares the cores too).
                    cpus = max(os.cpu_count() or 1, math.ceil(demand["CPU"]))
                    log(f"no running Ray cluster found (ray.address=auto): starting a local one ({cpus} CPUs) for this run")
                    ray.init(include_dashboard=False, num_cpus=cpus, **kwargs)
            else:
                _check_reachable(rc.address)
                ray.init(address=rc.address, **kwargs)
            self.owns_ray = True
        total = ray.cluster_resources()
        short = {k: (v, total.get(k, 0.0)) for k, v in demand.items() if v > total.get(k, 0.0) + 1e-9}
        if short:
            self.close_ray()
            raise ConfigError(
                "the Ray cluster is too small for this run: it needs " + ", ".join(
                    f"{need:g} {k} (the cluster has {have:g})" for k, (need, have) in short.items())
                + f" for {rc.num_engines} engines x ({rc.engine_cpus:g} CPU, {rc.engine_gpus:g} GPU), {rc.trainer_ranks} "
                f"trainer rank(s) x ({rc.trainer_cpus:g} CPU, {rc.trainer_gpus:g} GPU) and {rc.reward_workers} reward workers x "
                f"{rc.reward_cpus:g} CPU"
                + (f" and {env_workers} environment workers x {rc.env_cpus:g} CPU" if env_workers else "")
                + (f" and a teacher actor ({rc.teacher_cpus:g} CPU, {rc.teacher_gpus:g} GPU)" if teachers else "")
                + ": lower ray.engine_cpus / ray.trainer_cpus / ray.reward_cpus / ray.env_cpus / ray.teacher_cpus / "
                "ray.num_engines "
                "/ ray.trainer_ranks (fractions are fine), or add nodes"
            )
        self.pg = placement_group(bundles, strategy=rc.placement_strategy, name="")
        try:
            ray.get(self.pg.ready(), timeout=rc.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            self.close_ray()
            raise ConfigError(
                f"the Ray cluster cannot hold this run's placement group ({rc.placement_strategy}: {bundles}) within "
                f"{rc.start_timeout_s:.0f}s; available: {ray.available_resources()}. Lower ray.engine_cpus / "
                "ray.trainer_cpus / ray.reward_cpus / ray.num_engines, or add nodes"
            ) from None
        self.actors: list[ActorHandle] = []
        self.trainer: RayTrainer | ShardedTrainer | None = None
        self.trainer_ready: Callable[[], list[dict]] | None = None  # waits for the trainer's actors
        self.scorer: RayScorer | None = None
        self.closed = False

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)

    def close(self) -> None:
        global _SESSION
        if self.closed:
            return
        self.closed = True
        kill_actors(self.actors)
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
        self.close_ray()
        if _SESSION is self:
            _SESSION = None

    def close_ray(self) -> None:
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def session(cfg: RunConfig) -> RaySession:
    """This process's Ray session for the run, started on first use."""
    global _SESSION
    if _SESSION is None or _SESSION.closed:
        _SESSION = RaySession(cfg)
    return _SESSION


def _where(info: dict) -> str:
    return f"{info['node_ip']} pid {info['pid']}"


# ---------------------------------------------------------------- trainer


class TrainerActor:
    """GRPOTrainer in its own process: train steps, the weights to push, checkpoints."""

    def __init__(self, cfg_data: dict, fingerprint: str) -> None:
        from rollwise.model.loading import load_model, tokenizer_fingerprint
        from rollwise.train.trainer import GRPOTrainer

        cfg = RunConfig.model_validate(cfg_data)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        _seed(cfg.seed)
        model, self.tokenizer = load_model(cfg.model)
        mine = tokenizer_fingerprint(self.tokenizer)
        self.error = None if mine == fingerprint else (
            f"tokenizer fingerprint mismatch: the trainer actor's tokenizer for {cfg.model!r} hashes to {mine[:16]}…, "
            f"the driver's to {fingerprint[:16]}…; every node must load the same model files")
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.trainer = GRPOTrainer(model, cfg.train, pad_token_id=pad_id, temperature=cfg.rollout.temperature or 1.0)

    def info(self) -> dict[str, Any]:
        if self.error:
            raise RuntimeError(self.error)
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "version": self.trainer.version,
                "n_params": sum(p.numel() for p in self.trainer.model.parameters())}

    def train_step(self, samples: list[Sample]) -> tuple[dict[str, float], int]:
        return self.trainer.train_step(samples), self.trainer.version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach() for name, t in self.trainer.model.state_dict().items()}

    def save_checkpoint(self, run_dir: str, step: int, extra: dict[str, Any], keep_last: int) -> str:
        from rollwise.train.checkpoint import save_checkpoint

        return str(save_checkpoint(Path(run_dir), self.trainer, self.tokenizer, step, extra, keep_last))

    def load_checkpoint(self, ckpt: str) -> tuple[dict[str, Any], int]:
        from rollwise.train.checkpoint import load_checkpoint

        return load_checkpoint(Path(ckpt), self.trainer), self.trainer.version


class RayTrainer:
    """The Trainer protocol (rollwise.types.contracts), run by the trainer actor."""

    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor
        self.info_ref = actor.info.remote()  # answered once it started (awaited with the engines)
        self.version = 0  # a fresh trainer; load_checkpoint sets a resumed one's

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        metrics, self.version = ray.get(self.actor.train_step.remote(samples))
        return metrics

    def weights(self) -> ObjectRef:
        """An ObjectRef to the current weights, for the engines to fetch from the object store."""
        return self.actor.state_dict.remote()

    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any], keep_last: int) -> Path:
        return Path(ray.get(self.actor.save_checkpoint.remote(str(run_dir), step, extra, keep_last)))

    def load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        state, self.version = ray.get(self.actor.load_checkpoint.remote(str(ckpt)))
        return state


def start_trainer(cfg: RunConfig, *, fingerprint: str, tokenizer: Any = None) -> RayTrainer | ShardedTrainer:
    """The trainer actor(s) (in the run's placement group), behind a Trainer the loop drives like
    GRPOTrainer: one TrainerActor, or with ray.trainer_ranks=N a ShardedTrainer over N rank actors
    (rollwise.control.ray.trainer_ranks; `tokenizer` is saved with its checkpoints). A single actor
    is not awaited here: it starts while the reward and engine actors start (place_on_ray waits for
    all); rank actors must join their process group before the trainer can answer, so they are."""
    s = session(cfg)
    if cfg.ray.trainer_ranks > 1:
        return _start_rank_actors(s, cfg, fingerprint, tokenizer)
    actor = ray.remote(TrainerActor).options(
        num_cpus=cfg.ray.trainer_cpus, num_gpus=cfg.ray.trainer_gpus, max_restarts=0,
        scheduling_strategy=s.strategy(s.trainer_bundles[0]),
    ).remote(dump_config(cfg), fingerprint)
    s.actors.append(actor)
    trainer = RayTrainer(actor)
    s.trainer = trainer
    s.trainer_ready = lambda: get_all([trainer.info_ref], cfg.ray.start_timeout_s, "the trainer actor to start")
    return trainer


def _start_rank_actors(s: RaySession, cfg: RunConfig, fingerprint: str, tokenizer: Any) -> ShardedTrainer:
    n = cfg.ray.trainer_ranks
    actors = [ray.remote(TrainerRankActor).options(
        num_cpus=cfg.ray.trainer_cpus, num_gpus=cfg.ray.trainer_gpus, max_restarts=0, max_task_retries=0,
        scheduling_strategy=s.strategy(bundle),
    ).remote(dump_config(cfg), fingerprint, rank, n) for rank, bundle in enumerate(s.trainer_bundles)]
    s.actors += actors
    group = RayRankGroup(actors, timeout_s=cfg.ray.start_timeout_s)
    infos = group.join()
    s.trainer = ShardedTrainer.over(group, cfg.train, tokenizer=tokenizer)
    s.trainer_ready = lambda: infos
    return s.trainer


# ---------------------------------------------------------------- engines


def place_on_ray(cfg: RunConfig, *, fingerprint: str, eos_ids: list[int] | None,
                 initial: WeightUpdate) -> tuple[RayEngineFleet, str, Callable[[], None]]:
    """Start `ray.num_engines` engine actors holding `initial` (the trainer's current weights, a resumed
    run's included): (the fleet, one line for the console, the session's teardown)."""
    s = session(cfg)
    rc = cfg.ray
    policy_version = initial.version
    cls = engine_actor_class()
    cfg_data = dump_config(cfg)
    actors = [
        cls.options(
            num_cpus=rc.engine_cpus, num_gpus=rc.engine_gpus, max_restarts=rc.max_restarts, max_task_retries=0,
            max_concurrency=8, scheduling_strategy=s.strategy(bundle),
        ).remote(cfg_data, i, fingerprint, eos_ids, policy_version)
        for i, bundle in enumerate(s.engine_bundles)
    ]
    s.actors += actors
    # sync.sender=collective: this process is rank 0 of a weight group every engine actor joins.
    collective = (FleetWeightGroup(fingerprint, timeout_s=rc.start_timeout_s)
                  if cfg.weight_sender == "collective" else None)
    try:
        fleet = RayEngineFleet(actors, s.engine_bundles, initial=initial, max_restarts=rc.max_restarts,
                               restart_timeout_s=rc.restart_timeout_s, start_timeout_s=rc.start_timeout_s,
                               collective=collective)
        if s.trainer_ready is not None:
            infos = s.trainer_ready()
            log(f"{len(infos)} trainer actor(s) ({rc.trainer_cpus:g} CPU, {rc.trainer_gpus:g} GPU each) on "
                 + ", ".join(_where(i) for i in infos))
        if s.scorer is not None:
            infos = get_all(s.scorer.info_refs, rc.start_timeout_s, "the reward actors to start")
            log(f"{len(infos)} reward actor(s) on " + ", ".join(_where(i) for i in infos))
    except ray.exceptions.RayTaskError as exc:  # e.g. a tokenizer fingerprint mismatch, said plainly
        s.close()
        raise RuntimeError(str(exc.cause if getattr(exc, "cause", None) is not None else exc)) from None
    except BaseException:
        s.close()
        raise
    where = ", ".join(f"engine {sl.index}: {_where(sl.info)}" for sl in fleet.slots)
    log(f"{rc.num_engines} engine actor(s) ({fleet.view.name}, {rc.engine_cpus:g} CPU / {rc.engine_gpus:g} GPU each, "
         f"placement group {rc.placement_strategy}, max_restarts={rc.max_restarts}): {where}")
    for hook in FLEET_HOOKS:
        hook(fleet)
    weights = (f", weights by {'NCCL' if collective.device == 'cuda' else 'gloo'} broadcast"
               if collective is not None else "")
    description = (f"ray: {rc.num_engines} x {fleet.view.name} engine actor(s) "
                   f"(cluster {ray.get_runtime_context().gcs_address}{weights})")
    return fleet, description, s.close
