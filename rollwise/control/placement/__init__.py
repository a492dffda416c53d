"""Where the run's parts run: `placement: local`, `placement: ray` or a shared pool (`pool.url`).

`place(request)` returns a Placement (rollwise.control.placement.base): trainer, rollout backend,
weight sender, scorer and engine view. Each placement lives in its own module and imports only
`base`; this dispatcher imports the one the configuration picks (Ray is imported only for ray).
"""

from __future__ import annotations

from rollwise.control.placement.base import EngineView, Placement, PlaceRequest, ScoreFn


def place(req: PlaceRequest) -> Placement:
    cfg = req.cfg
    if cfg.pool.url:
        from rollwise.control.placement.pool import place_pool

        return place_pool(req)
    if cfg.placement == "ray":
        from rollwise.control.placement.ray import place_ray

        return place_ray(req)
    from rollwise.control.placement.local import place_local

    return place_local(req)


__all__ = ["EngineView", "PlaceRequest", "Placement", "ScoreFn", "place"]
