"""The only way the router names a replica URL: a replica's base URL plus one of a fixed set of paths.

No byte of a client request may choose the host or the path of an upstream call (issue 24, item 1):
handler parameters are query parameters in FastAPI, and a client-chosen suffix appended to replica.url
could name another host ("@evil/...") or another endpoint ("/pause" -> "/sleep").
"""

from __future__ import annotations

from rollwise.router.replicas import Replica
from rollwise.router.requests import RouterError

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate")
CONTROL_ENDPOINTS = ("/pause", "/resume", "/flush_cache")
UPSTREAM_PATHS = frozenset(GENERATION_ENDPOINTS + CONTROL_ENDPOINTS
                           + ("/abort", "/update_weights_from_disk", "/v1/models", "/model_info",
                              "/retain", "/release_session",  # session KV retention (issue 21)
                              "/migrate"))  # a planned removal's live migration (issue 42, rollwise.router.removal)


def upstream_url(replica: Replica, path: str) -> str:
    if path not in UPSTREAM_PATHS:
        raise RouterError(500, f"internal error: refusing to call replica path {path!r} (not an upstream path)",
                          kind="internal_error")
    return replica.url + path
