"""What a `rollwise sim` subcommand is (`SimCommand`), and how every command writes its --json (`write_json`).

Its own module, below the simulator's command line (rollwise.sim.cli) and the subcommands defined beside
it (rollwise.sim.intercept_cli, rollwise.sim.lora) or on the bench side (rollwise.bench.sim_commands),
so that each imports it and none imports the command line back.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console


def write_json(path: Path | None, data: Any, console: Console) -> None:
    """Write `data` as JSON to `path` when one was given (--json), and say so."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        console.print(f"wrote {path}")


@dataclass(frozen=True)
class SimCommand:
    """A `rollwise sim` subcommand defined outside the command line's own module: intercept and lora beside
    their models here, calibrate and validate* on the bench side (rollwise.bench.sim_commands: they run real
    engines and benchmarks, and the simulator imports nothing of bench; rollwise/cli.py hands them to
    rollwise.sim.cli.main)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Console], int]
