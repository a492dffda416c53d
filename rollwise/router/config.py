"""The router's settings (`rollwise serve router` flags map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollwise.router.policies import LoadCost
from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "prefix"
    model: str | None = None  # tokenizer spec; None: ask a replica's /model_info
    # The API key the router sends its replicas (`Authorization: Bearer KEY`), when they have keys
    # (--upstream-api-key, default $ROLLWISE_API_KEY); its own callers' keys are the front's (--api-keys).
    upstream_api_key: str | None = None
    max_in_flight: int | None = None  # per replica; None: 2 x the replica's max_num_seqs
    queue_timeout_s: float = 30.0  # how long a request waits for a replica with room
    max_queue: int = 4096  # requests waiting beyond this are refused at once (429)
    max_attempts: int = 3  # replicas one request may be tried on
    health_interval_s: float = 1.0
    # A replica whose /health is slow or failing (busy, e.g. tokenizing a huge prompt) is written off only
    # after this long without a good answer; a refused connection (the process is gone) writes it off at once.
    health_grace_s: float = 30.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    default_max_tokens: int = 256  # decode-work estimate for requests that set no max_tokens
    drain_timeout_s: float = 60.0  # rolling update: how long to wait for a replica's requests to finish
    upstream_timeout_s: float = 600.0
    state_file: Path | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before anything reads them
    # Routing needs a prompt's start, not all of it: only this many characters are tokenized (the engine
    # still gets, tokenizes and length-checks the whole prompt).
    max_route_chars: int = 65536
    load_cost: LoadCost = field(default_factory=LoadCost)
