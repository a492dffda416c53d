"""`rollwise check sandbox`: what isolation this machine gives, proven by trying to break out.

Each probe runs a real command in a real sandbox and checks the outcome: a probe passes when the
sandbox contained what the command tried. Probes that need Python inside the sandbox (Debian's
python3, seen through the read-only /usr) are skipped when it is not there.
"""

from __future__ import annotations

import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollwise.sandbox.isolation import IsolationReport, detect_isolation
from rollwise.sandbox.launch import IsolationLevel
from rollwise.sandbox.limits import limits_in_force
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import MiB, SandboxLimits

PROBE_LIMITS = SandboxLimits(timeout_s=10, cpu_s=1, memory_bytes=256 * MiB, max_processes=16,
                             max_file_bytes=1 * MiB, max_output_bytes=4096, kill_output_bytes=1 * MiB)


@dataclass(frozen=True)
class ProbeResult:
    name: str
    passed: bool | None  # None: skipped
    detail: str
    seconds: float = 0.0


# Connects to a port the host listens on (loopback), to the internet, and resolves a name.
_NET_PROBE = """
import socket
for addr in [('127.0.0.1', PORT), ('1.1.1.1', 443)]:
    try:
        socket.create_connection(addr, timeout=2)
        print('REACHED', addr)
    except OSError as e:
        print('blocked', addr[0], e.strerror or e)
try:
    socket.getaddrinfo('pypi.org', 443)
    print('REACHED dns')
except OSError as e:
    print('blocked dns', e)
"""


def _python(sb: LocalSandbox) -> bool:
    return sb.run("command -v python3").ok


def _network(sb: LocalSandbox) -> tuple[bool | None, str]:
    if not _python(sb):
        dns = sb.run("getent hosts pypi.org")
        return (not dns.ok, "DNS lookup failed (blocked)" if not dns.ok else "DNS lookup WORKED")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        port = server.getsockname()[1]
        r = sb.run(f"python3 -c {shlex.quote(_NET_PROBE.replace('PORT', str(port)))}")
    finally:
        server.close()
    reached = [line for line in r.stdout.splitlines() if line.startswith("REACHED")]
    if reached:
        return False, "; ".join(reached) + " (host loopback / internet / DNS reachable)"
    return True, "host loopback port, 1.1.1.1:443 and DNS all blocked"


def _filesystem(sb: LocalSandbox) -> tuple[bool | None, str]:
    r = sb.run("touch /usr/rollwise-probe 2>&1; touch /etc/rollwise-probe 2>&1; "
               f"ls {sb.host_path.parent} >/dev/null 2>&1 && echo SAW_HOST_TEMP_ROOT; true")
    wrote = [p for p in ("/usr/rollwise-probe", "/etc/rollwise-probe") if sb.run(f"test -e {p}").ok]
    if wrote or "SAW_HOST_TEMP_ROOT" in r.stdout:
        return False, f"wrote {wrote} / saw the host temp root: {r.stdout.strip()[:120]}"
    if "filesystem" not in sb.isolation.mode.features:
        return True, "/usr and /etc not writable, but only because of the uid: the host filesystem is visible"
    return True, "/usr and /etc read-only, other workspaces invisible"


def _memory(sb: LocalSandbox) -> tuple[bool | None, str]:
    if not _python(sb):
        return None, "skipped: no python3 in the sandbox"
    r = sb.run("python3 -c 'x = bytearray(1024**3)'")
    limit_mib = PROBE_LIMITS.memory_bytes // MiB
    return r.limit == "memory", f"1 GiB allocation under a {limit_mib} MiB limit: {r.reason or 'NOT STOPPED'}"


@dataclass(frozen=True)
class LimitProbe:
    """A command that one limit must stop: passes when the sandbox says that limit stopped it. `detail` is
    formatted with the command's RunResult as `r` and `outcome`: its reason, or `unstopped` when none."""

    command: str
    limit: str
    detail: str
    unstopped: str
    timeout_s: float | None = None  # None: the sandbox's own

    def __call__(self, sb: LocalSandbox) -> tuple[bool | None, str]:
        r = sb.run(self.command, timeout_s=self.timeout_s)
        return r.limit == self.limit, self.detail.format(r=r, outcome=r.reason or self.unstopped)


def _fork(sb: LocalSandbox) -> tuple[bool | None, str]:
    sb.run("echo parent > state.txt")
    child = sb.fork()
    try:
        child.run("echo child > state.txt")
        ok = sb.read_file("state.txt") == b"parent\n" and child.read_file("state.txt") == b"child\n"
    finally:
        child.close()
    gone = not child.host_path.exists()
    return ok and gone, "copy diverges from its parent; closed copy removed" if ok and gone else "FAILED"


PROBES: list[tuple[str, Callable[[LocalSandbox], tuple[bool | None, str]]]] = [
    ("network blocked", _network),
    ("filesystem confined", _filesystem),
    ("memory limit", _memory),
    ("CPU time limit", LimitProbe("while :; do :; done", "cpu_time", "busy loop: {outcome} after {r.wall_s:.1f} s",
                                  "not stopped by the CPU limit", timeout_s=10)),
    ("process limit (fork bomb)", LimitProbe("for i in $(seq 64); do sleep 1 & done; wait", "processes",
                                             "64 background processes: {outcome}", "ALL STARTED")),
    ("file size limit", LimitProbe("head -c 10000000 /dev/zero > big.bin", "file_size", "10 MB file: {outcome}",
                                   "WRITTEN")),
    ("wall-clock timeout", LimitProbe("sleep 30", "timeout", "sleep 30: {outcome} ({r.wall_s:.1f} s)", "NOT KILLED",
                                      timeout_s=1)),
    ("output limit", LimitProbe("yes", "output", "endless output: {outcome}, {r.stdout_bytes} bytes read",
                                "NOT KILLED")),
    ("fork workspace", _fork),
]


def run_probes(max_level: IsolationLevel | str | None = None) -> tuple[IsolationReport, list[ProbeResult]]:
    report = detect_isolation(max_level=max_level)
    results = []
    with LocalSandbox(PROBE_LIMITS, isolation=report) as sb:
        for name, probe in PROBES:
            start = time.monotonic()
            try:
                passed, detail = probe(sb)
            except Exception as exc:  # noqa: BLE001 -- a probe that errors is a failed probe, keep going
                passed, detail = False, f"probe error: {type(exc).__name__}: {exc}"
            results.append(ProbeResult(name, passed, detail, time.monotonic() - start))
    return report, results


def cli_check_sandbox(args, console) -> int:
    """`rollwise check sandbox [--level L] [--json PATH]`: the report, then the probes as a table.
    Exit code 1 when a probe fails (the sandbox let something through), else 0."""
    import json

    from rich.table import Table

    report, results = run_probes(max_level=getattr(args, "level", None))
    console.print(report.describe(), highlight=False)
    console.print(limits_in_force(report).describe(), highlight=False)
    table = Table(title=f"sandbox probes (level {report.level.value})")
    table.add_column("probe")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    table.add_column("s", justify="right")
    marks = {True: "[green]contained[/]", False: "[bold red]NOT contained[/]", None: "[yellow]skipped[/]"}
    for r in results:
        table.add_row(r.name, marks[r.passed], r.detail, f"{r.seconds:.2f}")
    console.print(table)
    if getattr(args, "json", None):
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "level": report.level.value, "mode": report.mode.name, "missing": list(report.missing),
            "refused": [list(r) for r in report.refused],
            "probes": [{"name": r.name, "passed": r.passed, "detail": r.detail, "seconds": r.seconds}
                       for r in results],
        }, indent=2))
        console.print(f"wrote {args.json}")
    return 1 if any(r.passed is False for r in results) else 0
