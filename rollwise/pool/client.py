"""A training job's side of the pool, by its user-facing name. The code lives in
rollwise.control.pool_backend: the training loop's placement (control) builds it, and the pool's
server side sits a layer above control (.importlinter), so the client cannot live in this package."""

from rollwise.control.pool_backend import (  # noqa: F401 - re-exported
    PoolAttachment,
    PoolClient,
    PoolServerError,
    PoolWorker,
    attach_to_pool,
)
