"""Where the run's parts run: `placement: local`, `placement: ray` or a shared pool (`pool.url`).

`place(request)` returns a Placement (rollwise.control.placement.base): trainer, rollout backend,
weight sender, scorer and engine view. Each placement lives in its own module and imports only
`base`; this dispatcher imports the one the configuration picks (Ray is imported only for ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollwise.control.placement.base import Placement, PlaceRequest


def place(req: PlaceRequest) -> Placement:
    """The placement where the run's engines are. Each carries weights with one sender (local: in
    process, ray: the object store, pool: HTTP); `sync.sender` may name it or say auto, and a sender
    that cannot reach these engines was refused when the config was read (RunConfig)."""
    cfg = req.cfg
    if cfg.engines_at == "pool":
        from rollwise.control.placement.pool import place_pool

        return place_pool(req)
    if cfg.engines_at == "ray":
        from rollwise.control.placement.ray import place_ray

        return place_ray(req)
    from rollwise.control.placement.local import place_local

    return place_local(req)

