"""`rollwise serve tinker ...`: its own argument parser (rollwise/cli.py hands the arguments over)."""

from __future__ import annotations

from rollwise.service.options import build_parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from rollwise.service.supervisor import serve

    from rollwise.control.stop_signal import Stopped

    try:
        return serve(args, argv)
    except ValueError as exc:  # a bad flag, key file or base model: one line, nothing started
        print(f"error: {exc}")
        return 2
    except Stopped as stop:  # SIGTERM: the API child is stopped, accepted rows stay in the store
        print(f"rollwise serve tinker: stopped by {stop}")
        return stop.exit_code
    except KeyboardInterrupt:
        print("rollwise serve tinker: interrupted")
        return 130
