"""The serving front's settings and the flags that set them, the same on every rollwise server.

Kept apart from rollwise.serve.front (which needs FastAPI) so that building `rollwise`'s argument parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollwise.serve.limits import DEFAULT_MAX_REQUEST_BYTES

KEYS_ENV = "ROLLWISE_API_KEYS"  # a server's keys, comma-separated
CLIENT_KEY_ENV = "ROLLWISE_API_KEY"  # the one key a client sends


def client_auth_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What rollwise's HTTP clients send a server: `Authorization: Bearer $ROLLWISE_API_KEY` when it is set."""
    key = environ.get(CLIENT_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# FrontSettings field -> the flag a message names
FLAGS = {"host": "--host", "port": "--port", "api_keys": "--api-keys", "insecure_no_auth": "--insecure-no-auth",
         "max_request_bytes": "--max-request-bytes", "max_in_flight_per_key": "--max-in-flight-per-key",
         "drain_timeout_s": "--drain-timeout", "log_level": "--log-level"}


class FrontSettings(BaseModel):
    """The front's settings, one per server (the flags of add_front_arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: Path | None = None  # a file of keys; None: ROLLWISE_API_KEYS if set, else no keys
    insecure_no_auth: bool = False
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1)
    max_in_flight_per_key: int | None = Field(None, ge=1)  # None: no bound beyond the server's own
    drain_timeout_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    log_level: str = Field("info", pattern="^(" + "|".join(LOG_LEVELS) + ")$")

    @classmethod
    def checked(cls, **values: object) -> FrontSettings:
        """The settings, or ValueError naming the flag (`--port must be <= 65535, got 70000`)."""
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                name = str(err["loc"][0]) if err["loc"] else "?"
                problems.append(f"{FLAGS.get(name, name)} {err['msg'].lower()}, got {err.get('input')!r}")
            raise ValueError("; ".join(problems)) from None


def add_front_arguments(parser: argparse.ArgumentParser, port: int) -> None:
    """The flags every rollwise server takes, with the same names, meanings and defaults (but the port)."""
    g = parser.add_argument_group("serving front (the same on every rollwise server)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s; an address other machines reach needs --api-keys "
                   "or --insecure-no-auth)")
    g.add_argument("--port", type=int, default=port, help="TCP port (default: %(default)s)")
    g.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                   help=f"API keys, one per line (`#` comments): every route but /health, /ready and /metrics then "
                   f"needs `Authorization: Bearer KEY` with one of them (default: {KEYS_ENV}, comma-separated, if "
                   f"set; else no keys, allowed only on a loopback --host). rollwise's clients send {CLIENT_KEY_ENV}")
    g.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host without API keys: anyone who reaches the port may call it")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help="refuse request bodies over N bytes with 413, before reading them (default: %(default)s)")
    g.add_argument("--max-in-flight-per-key", type=int, default=None, metavar="N",
                   help="requests one API key (or, without keys, all callers) may have in flight; more get 429 with "
                   "Retry-After (default: no bound)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: /ready turns false, new requests get 503, requests in flight get up to S "
                   "seconds to finish, then the server exits 0 (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, metavar="LEVEL",
                   help="log level: " + ", ".join(LOG_LEVELS) + " (default: %(default)s)")
