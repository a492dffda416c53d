"""Environment workers as Ray actors (`placement: ray` with an environment task, rollwise.environments).

Each worker of the EnvService is one `EnvWorkerActor`, placed in the run's placement group (`ray.env_cpus` per
actor), that owns one WorkerProcess: the environment's subprocess, spoken to over the same JSON-lines protocol as
a local worker. The driver holds a `RayEnvWorker` per actor, offering EnvService the EnvWorker interface, so the
service's health checks, timeouts, restarts and failure containment are the ones a local run has: a worker the
service replaces is a new actor (Ray does not restart these actors itself: max_restarts=0), and an actor that died
(its node lost) fails its rollouts with the reason and is replaced before it gets more work.

The environment's worker reaches the driver's agent proxy at this node's address (the proxy listens there, not on
loopback); its environment gets the driver's PYTHONPATH (where a config's environment package is found), and
`task.python` and the package must be at the same paths on every node, as rollwise itself is.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray

from rollwise.config import RunConfig
from rollwise.control.ray.calls import log
from rollwise.environments.protocol import Hello, RolloutReply, RolloutRequest
from rollwise.environments.workers import WorkerError, WorkerHosting, WorkerPlace, WorkerProcess, WorkerSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

KILL_TIMEOUT_S = 30.0  # the actor kills its worker's process group first (else the subprocess outlives it)


class EnvWorkerActor:
    """One WorkerProcess in an actor: each method is WorkerProcess's, its values made plain for Ray."""

    def __init__(self, spec_data: dict[str, Any], name: str) -> None:
        self.worker = WorkerProcess(WorkerSpec.model_validate(spec_data), name)

    def start(self, timeout_s: float) -> dict[str, Any]:
        try:
            return {"hello": self.worker.start(timeout_s).model_dump(mode="json")}
        except WorkerError as exc:  # said, not raised: the driver raises it as the local worker would
            return {"error": str(exc)}

    def where(self) -> dict[str, Any]:
        place = self.worker.where()
        return {**place.model_dump(), "node": ray.util.get_node_ip_address()}

    def alive(self) -> bool:
        return self.worker.alive()

    def submit(self, request: dict[str, Any]) -> dict[str, Any] | str:
        value = self.worker.submit(RolloutRequest.model_validate(request)).result()  # the driver times it out
        return value if isinstance(value, str) else value.model_dump(mode="json")

    def ping(self, timeout_s: float) -> bool:
        return self.worker.ping(timeout_s)

    def cancel(self, rollout_id: str) -> None:
        self.worker.cancel(rollout_id)

    def kill(self, reason: str) -> None:
        self.worker.kill(reason)


class RayEnvWorker:
    """The driver's side of one EnvWorkerActor: the EnvWorker interface EnvService drives (calls go to the actor;
    rollouts in flight are counted here, so picking the least busy worker is no round trip)."""

    def __init__(self, spec: WorkerSpec, index: int, options: dict[str, Any]) -> None:
        self.name = f"{spec.label}-{index}"
        self.actor: ActorHandle = ray.remote(EnvWorkerActor).options(**options).remote(spec.model_dump(), self.name)
        self._in_flight = 0
        self._lock = threading.Lock()
        self._place = WorkerPlace(worker_pid=None, host_pid=0, node="(starting)")
        self._killed = False
        self._dead = False  # killed, or seen dead: the service replaces it before its next rollout

    def start(self, timeout_s: float) -> Hello:
        try:
            out = ray.get(self.actor.start.remote(timeout_s), timeout=timeout_s + 60)
            self._place = WorkerPlace.model_validate(ray.get(self.actor.where.remote(), timeout=60))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            self.kill()
            raise WorkerError(f"{self.name}: its Ray actor did not start: {exc}") from None
        if "error" in out:
            self.kill()
            raise WorkerError(out["error"])
        return Hello.model_validate(out["hello"])

    def alive(self) -> bool:
        if self._dead:
            return False
        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=60))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def where(self) -> WorkerPlace:
        return self._place

    def submit(self, request: RolloutRequest) -> Future[RolloutReply | str]:
        done: Future[RolloutReply | str] = Future()
        with self._lock:
            self._in_flight += 1
        call = self.actor.submit.remote(request.model_dump(mode="json")).future()
        call.add_done_callback(lambda f: self._reply(request.id, f, done))
        return done

    def _reply(self, rollout_id: str, call: Future, done: Future[RolloutReply | str]) -> None:
        with self._lock:
            self._in_flight -= 1
        try:
            value = call.result()
        except Exception as exc:  # noqa: BLE001 -- the actor died (or was killed): that rollout fails, said why
            if isinstance(exc, ray.exceptions.RayActorError):
                self._dead = True
            done.set_result(RolloutReply.failure(rollout_id, f"the worker's actor is gone: {type(exc).__name__}"))
            return
        done.set_result(value if isinstance(value, str) else RolloutReply.model_validate(value))

    def ping(self, timeout_s: float) -> bool:
        try:
            return bool(ray.get(self.actor.ping.remote(timeout_s), timeout=timeout_s + 30))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return False

    def cancel(self, rollout_id: str) -> None:
        self.actor.cancel.remote(rollout_id)  # the actor answers the relayed call; nothing to wait for

    def kill(self, reason: str = "the worker was stopped") -> None:
        if self._killed:
            return
        self._killed = self._dead = True
        try:  # the environment's process group first: it is not the actor's child once the actor is gone
            ray.get(self.actor.kill.remote(reason), timeout=KILL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # the actor is gone already (its worker's stdin closed with it)
        ray.kill(self.actor, no_restart=True)


def ray_env_hosting(cfg: RunConfig) -> WorkerHosting:
    """The workers of `cfg`'s environment task as actors in the run's placement group (one bundle per worker)."""
    from rollwise.control.ray.placement import session

    s = session(cfg)
    forwarded = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}

    def make(spec: WorkerSpec, index: int) -> RayEnvWorker:
        spec = spec.model_copy(update={"env": {**forwarded, **spec.env}})
        # Threaded: one call per rollout in flight waits in the actor, health pings answer beside them.
        options = {"num_cpus": cfg.ray.env_cpus, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 1024,
                   "scheduling_strategy": s.strategy(s.env_bundles[index % len(s.env_bundles)])}
        worker = RayEnvWorker(spec, index, options)
        s.actors.append(worker.actor)
        return worker

    return WorkerHosting(make=make, proxy_host=ray.util.get_node_ip_address())


def log_env_workers(places: list[WorkerPlace]) -> None:
    log(f"{len(places)} environment worker actor(s) on "
        + ", ".join(f"{p.node} pid {p.host_pid} (environment pid {p.worker_pid})" for p in places))
