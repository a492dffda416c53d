"""`sync.sender: collective` on `placement: ray`: each weight update is one broadcast from the driver
to every engine actor at once (rollwise.sync.distributed), instead of each actor fetching it from Ray's
object store.

The group: the driver (which holds the full weights: the trainer's, or the ones the sharded trainer's
ranks gathered; a single trainer actor's are fetched from the object store first) is rank 0 of one
private WeightGroup; live engine i is rank i+1. The driver picks a free port on its node's address, and
the backend for everyone: NCCL when every engine's weights live on a GPU and the driver has one,
gloo otherwise (then GPU engines stage on the CPU and load from there). One push:

  1. every live actor is asked to receive (`receive_weights_collective`, one Ray call each, all at once);
  2. the driver broadcasts the header and the buckets (`DistributedSender.send`);
  3. each actor stages, checks and commits through the same WeightReceiver as the object-store path,
     and the driver collects the verdicts: a refusal raises WeightUpdateError naming the engines.

Engines that change (Ray restarted one: a new incarnation token, or gave one up) make the group stale:
it is re-formed, with the engines alive then, before the next push. A push that breaks mid-way (an
engine died in it) abandons the group (the store goes with it, so no rank waits for its timeout), lets
the fleet recover the dead engine (re-synced to the previous version through the object store), and
is tried once more on a re-formed group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError
from torch import Tensor

from rollwise.control.ray.engine_actor import GONE
from rollwise.control.ray.slots import Slot
from rollwise.types.weight_update import WeightUpdate
from rollwise.sync.distributed import DistributedSender, WeightGroup, free_init_method, init_weight_group

if TYPE_CHECKING:
    from ray import ObjectRef

Recover = Callable[[int, BaseException], None]  # the fleet's restart handling, for the slot that died


class CollectivePushError(RuntimeError):
    """The broadcast itself broke twice (not a refusal: that is a WeightUpdateError)."""


def group_device(engine_devices: Sequence[str]) -> str:
    """NCCL (cuda) only when every engine and this process have a GPU; otherwise gloo on the CPU."""
    if engine_devices and all(d == "cuda" for d in engine_devices) and torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass
class FleetWeightGroup:
    """The driver's side of the fleet's weight group: forms it, pushes over it, re-forms it."""

    fingerprint: str
    bucket_mb: float = 64.0
    timeout_s: float = 300.0
    group: WeightGroup | None = None
    sender: DistributedSender | None = None
    members: tuple[tuple[int, str], ...] = ()  # (slot index, incarnation token) of ranks 1..N
    formed: int = 0  # how many times the group was formed (the first at fleet start)
    pushes: int = 0  # updates every live engine received over the group

    @property
    def device(self) -> str:
        return str(self.group.device.type) if self.group is not None else "cpu"

    def form(self, slots: Sequence[Slot]) -> None:
        """A fresh group of this process (rank 0) and `slots` (ranks 1..N), all joining at once. An engine
        that dies while the group forms is noticed only at timeout_s (the rendezvous cannot be
        interrupted): the error then names the engines' join errors."""
        self.abandon()
        device = group_device([s.info.get("weight_device", "cpu") for s in slots])
        init = free_init_method(ray.util.get_node_ip_address())
        world = len(slots) + 1
        joins = [s.actor.join_weight_group.remote(init, rank, world, device, self.timeout_s, s.token)
                 for rank, s in enumerate(slots, start=1)]
        try:
            # Blocks until every engine has joined (the store and the gloo/NCCL rendezvous).
            group = init_weight_group(0, world, init, device=device, timeout_s=self.timeout_s)
        except Exception as exc:
            raise CollectivePushError(f"the engines did not join the weight group at {init} within "
                                      f"{self.timeout_s:.0f}s ({exc}); see the engine actors' errors: "
                                      f"{_errors(joins)}") from None
        ray.get(joins, timeout=self.timeout_s)
        self.group = group
        self.sender = DistributedSender(group, self.fingerprint, bucket_mb=self.bucket_mb,
                                        rank_names=["the trainer"] + [f"engine {s.index}" for s in slots])
        self.members = tuple((s.index, s.token) for s in slots)
        self.formed += 1

    def push_update(self, slots: Sequence[Slot], update: WeightUpdate, recover: Recover) -> WeightUpdate:
        """Broadcast `update` to every live engine; returns it as the fleet keeps it for an engine Ray
        restarts later (re-synced through the object store)."""
        tensors = update.tensors()  # a trainer actor's weights (an ObjectRef) come here from the store first
        self.push(slots, tensors, update.version, recover)
        if isinstance(update.payload, Mapping):
            # The trainer's own tensors change with its next step: keep this version's bytes (one CPU copy).
            # A fetched ObjectRef payload is already such a copy, in the store.
            return update.with_payload({name: t.detach().to("cpu", copy=True) for name, t in tensors.items()})
        return update

    def push(self, slots: Sequence[Slot], tensors: Mapping[str, Tensor], version: int, recover: Recover) -> None:
        """`tensors` as `version` to every live engine; WeightUpdateError if any refused it (named)."""
        broken: BaseException | None = None
        for _attempt in range(2):
            live = [s for s in slots if s.alive]
            if not live:
                raise CollectivePushError(f"no engine is alive to receive version {version}")
            if self.sender is None or self.members != tuple((s.index, s.token) for s in live):
                self.form(live)
            broken = self._push_once(live, tensors, version, recover)
            if broken is None:
                self.pushes += 1
                return
        raise CollectivePushError(f"the collective weight push of version {version} broke twice "
                                  f"(last: {broken!r}); the engines keep their previous version") from broken

    def _push_once(self, live: Sequence[Slot], tensors: Mapping[str, Tensor], version: int,
                   recover: Recover) -> BaseException | None:
        """One attempt; None when every engine answered (WeightUpdateError raised on a refusal), else
        what broke it (the group is abandoned, dead engines are recovered by the fleet)."""
        assert self.sender is not None
        refs = [s.actor.receive_weights_collective.remote(s.token) for s in live]
        broken: BaseException | None = None
        try:
            self.sender.send(tensors, version)
        except Exception as exc:  # a gloo/NCCL error (a peer went away mid-broadcast), or bad tensors
            broken = exc
            self.abandon()  # receivers still waiting on the store fail now, not at their timeout
            if not isinstance(exc, RuntimeError):  # not the transport (e.g. a tensor changed under us):
                _settle(refs)  # the receivers fail with the group; no retry would fix this
                raise
        dead: list[tuple[int, BaseException]] = []
        for slot, ref in zip(live, refs):
            try:
                ray.get(ref, timeout=self.timeout_s)
            except GONE as exc:
                dead.append((slot.index, exc))
            except (RayTaskError, GetTimeoutError) as exc:
                broken = broken or exc
        if broken is None and not dead:
            self.sender.collect(version)  # every verdict is in the store: raises naming refusers
            return None
        self.abandon()
        for index, exc in dead:
            recover(index, exc)
        return broken or dead[0][1]

    def abandon(self) -> None:
        if self.group is not None:
            self.group.abandon()
        self.group, self.sender, self.members = None, None, ()


def _settle(refs: list[ObjectRef]) -> None:
    """Wait (bounded) for calls whose outcome no longer matters, so none is left running."""
    ray.wait(refs, num_returns=len(refs), timeout=30)


def _errors(refs: list[ObjectRef]) -> str:
    """The errors of the join calls that already failed (why an engine did not join)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    errors = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as exc:
            errors.append(str(exc).splitlines()[-1] if str(exc) else repr(exc))
    return "; ".join(errors) or "none reported yet"
