"""The options of `rollwise serve tinker` (rollwise.service.cli): the supervisor and its API child process
(rollwise.service.api) parse the same arguments, so both see one configuration."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rollwise.serve.settings import add_front_arguments
from rollwise.service.api_common import ApiSettings

if TYPE_CHECKING:  # (annotation only: the CLI parses options without loading the HTTP stack)
    from rollwise.serve.auth import ApiKeys

DEFAULT_BASE_MODEL = "bundled:smollm2-135m-instruct"
DEFAULT_DATA_DIR = Path("rollwise-tinker-data")

DESCRIPTION = (
    "A Tinker-compatible training and sampling service: the unmodified `tinker` SDK (0.38) and tinker-cookbook "
    "recipes run against it (base_url=http://HOST:PORT, TINKER_API_KEY=one of --api-keys). Many tenants at once: "
    "each API key sees only its own sessions, models, checkpoints and samplers; LoRA tenants of one base model "
    "share one forward_backward and one sampling batch; full-parameter models are supported too. Every accepted "
    "request is a durable row (SQLite under --data-dir, or --database URL) run by this process's worker in each "
    "model's seq_id order; the HTTP API runs as a child process that is restarted if it dies, losing no accepted "
    "request. Keys for the SDK must start with `tml-` (e.g. `tml-` + "
    "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollwise serve tinker", description=DESCRIPTION,
        epilog="example: rollwise serve tinker --port 8400 --api-keys keys.txt --base-model tiny:0, then "
               "TINKER_API_KEY=$(head -1 keys.txt) python examples/tinker_client.py --base-url http://127.0.0.1:8400")
    p.add_argument("--base-model", action="append", default=None, metavar="NAME",
                   help=f"a base model tenants may train and sample (repeatable): bundled:NAME, a local Hugging Face "
                   f"directory, or tiny:SEED (default: {DEFAULT_BASE_MODEL})")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, metavar="DIR",
                   help="checkpoints ({DIR}/{model_id}/weights/{name}/), tokenizers of code-built models, and the "
                   "SQLite database (default: ./%(default)s)")
    p.add_argument("--database", default=None, metavar="URL",
                   help="SQLAlchemy URL of the request store, e.g. postgresql://user@host/db (needs pip install "
                   "'rollwise[postgres]') (default: SQLite file {DIR}/requests.sqlite)")
    p.add_argument("--max-queued-per-key", type=int, default=1024, metavar="N",
                   help="requests one API key may have queued or running; more get 429 and the SDK backs off "
                   "(default: %(default)s)")
    p.add_argument("--long-poll", type=float, default=25.0, metavar="S",
                   help="seconds retrieve_future holds a pending future before answering try_again (the SDK waits "
                   "45 s per poll) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads for the worker (0: torch's default) (default: %(default)s)")
    add_front_arguments(p, port=8400)  # --host, --port, --api-keys, --insecure-no-auth, limits, drain, log level
    return p


# The SDK's ApiKeyAuthProvider refuses, client-side, an api_key / TINKER_API_KEY that starts with neither (a JWT:
# `eyJ`); only a key printed by TINKER_CREDENTIAL_CMD reaches the server unchecked. So such a key is not refused
# here (the SDK can send it that way), but the operator is told where it is.
SDK_KEY_PREFIXES = ("tml-", "eyJ")


def sdk_key_warnings(keys: ApiKeys | None) -> list[str]:
    """One line per server key the tinker SDK refuses as api_key / TINKER_API_KEY, naming where it was given."""
    if keys is None:
        return []
    return [f"warning: {where}: this key does not start with 'tml-'; the tinker SDK refuses it as api_key or "
            "TINKER_API_KEY ('The api_key must start with the 'tml-' prefix') and sends it only when "
            "TINKER_CREDENTIAL_CMD prints it; prefix it with tml- for SDK clients"
            for where in keys.origins_where(lambda key: not key.startswith(SDK_KEY_PREFIXES))]


def base_models(args: argparse.Namespace) -> list[str]:
    return list(args.base_model or [DEFAULT_BASE_MODEL])


def database_url(args: argparse.Namespace) -> str:
    if args.database:
        return str(args.database)
    return f"sqlite:///{Path(args.data_dir).resolve() / 'requests.sqlite'}"


def api_settings(args: argparse.Namespace) -> ApiSettings:
    if args.max_queued_per_key < 1:
        raise ValueError(f"--max-queued-per-key must be >= 1, got {args.max_queued_per_key}")
    if not 0 < args.long_poll <= 40:
        raise ValueError(f"--long-poll must be in (0, 40] seconds (the SDK waits 45 s per poll), got {args.long_poll}")
    return ApiSettings(max_queued_per_key=args.max_queued_per_key, long_poll_s=args.long_poll)
