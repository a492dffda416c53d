"""`rollwise serve router ...`: its own argument parser (rollwise/cli.py hands the arguments over)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rollwise.router.policies import POLICIES
from rollwise.serve.settings import CLIENT_KEY_ENV, add_front_arguments

DESCRIPTION = (
    "An HTTP gateway in front of N engine replicas (`rollwise serve engine` or any server with the same API). "
    "Serves the same API: POST /v1/completions, /v1/chat/completions (stream=true too), /generate; GET /v1/models, "
    "/model_info; GET /health (router + replica states), /metrics (Prometheus: per-replica load, prefix hits, "
    "latency histograms, retries, failovers); POST /pause, /resume, /abort, /flush_cache (sent to every replica) "
    "and /update_weights_from_disk {path, version} as a rolling update (one replica drained, paused, updated and "
    "resumed at a time while the others serve). Bodies pass through byte for byte: fields the router does not know "
    "survive both ways. Router fields (removed before forwarding): session_id or header X-Session-Id (a multi-turn "
    "session), group_id or X-Group-Id (a GRPO group), min_policy_version or X-Min-Policy-Version (only replicas "
    "serving at least this version); header Idempotency-Key (a retried request never generates twice; the openai "
    "client sends none by default: pass extra_headers={'Idempotency-Key': ...}). A replica that fails gets its requests retried on another; a stream that already sent "
    "bytes ends with an SSE error event instead (never duplicated tokens). A non-streamed request whose client "
    "disconnects is aborted at its replica. Busy -> 429, no healthy replica or version -> 503, with Retry-After; "
    "a body over --max-request-bytes -> 413."
)

POLICY_HELP = (
    "round_robin: each replica in turn; least_load: least pending prefill+decode work; consistent_hash: "
    "rendezvous hash of the session key (else group key, else prompt start); group_affinity: a session/group "
    "stays where its first request was placed (least load); prefix: Preble-style, a radix tree of each "
    "replica's cached prompts: exploit the longest cached prefix, else explore by load, rebalance hot prefixes"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollwise serve router",
        description=DESCRIPTION,
        epilog=(
            "example: rollwise serve engine --model tiny:0 --port 8001 & rollwise serve engine --model tiny:0 "
            "--port 8002 & rollwise serve router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 "
            "--port 8000. Zero-downtime restart: start the new router with --reuse-port on the same port, "
            "then SIGTERM the old one (it finishes its requests); --state-file carries sessions over."
        ),
    )
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="an engine replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    p.add_argument("--policy", default="prefix", choices=list(POLICIES), help=POLICY_HELP + " (default: %(default)s)")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="model spec whose tokenizer the router tokenizes prompts with, to route by token prefix "
                   "(default: the `model` a replica's /model_info reports; without one, prompts route by bytes)")
    p.add_argument("--upstream-api-key", default=os.environ.get(CLIENT_KEY_ENV), metavar="KEY",
                   help="the API key the router sends its replicas when they have keys (default: "
                   f"${CLIENT_KEY_ENV}, if set)")
    p.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="requests in flight per replica before new ones wait (default: 2 x its max_num_seqs)")
    p.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="how long a request waits for a replica with room before 429 (default: %(default)s)")
    p.add_argument("--max-attempts", type=int, default=3, metavar="N",
                   help="replicas one request may be tried on when replicas fail (default: %(default)s)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="seconds between /health probes of each replica (default: %(default)s)")
    p.add_argument("--state-file", type=Path, default=None, metavar="PATH",
                   help="keep session placements, the prefix tree and recent idempotent results in this JSON file "
                   "(written every second and at shutdown, read at start) so a restarted router carries on")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT so a new router can take over the port before the old one stops")
    add_front_arguments(p, port=8080)  # --host, --port, --api-keys, --insecure-no-auth, limits, drain, log level
    return p


def main(argv: list[str]) -> int:
    from rollwise.router.config import RouterConfig
    from rollwise.router.app import serve
    from rollwise.serve.front import Front

    args = build_parser().parse_args(argv)
    problems = []
    if args.max_in_flight is not None and args.max_in_flight < 1:
        problems.append(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if args.queue_timeout < 0:
        problems.append(f"--queue-timeout must be >= 0, got {args.queue_timeout}")
    if args.max_attempts < 1:
        problems.append(f"--max-attempts must be >= 1, got {args.max_attempts}")
    if args.health_interval <= 0:
        problems.append(f"--health-interval must be > 0, got {args.health_interval}")
    config = RouterConfig(
        replicas=args.replica, policy=args.policy, model=args.model, upstream_api_key=args.upstream_api_key,
        max_in_flight=args.max_in_flight, queue_timeout_s=args.queue_timeout, max_attempts=args.max_attempts,
        health_interval_s=args.health_interval, state_file=args.state_file, max_request_bytes=args.max_request_bytes,
    )
    try:
        if problems:
            raise ValueError("; ".join(problems))
        serve(config, front=Front.from_args(args), reuse_port=args.reuse_port)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    return 0
