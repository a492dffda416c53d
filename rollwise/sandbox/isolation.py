"""Find the strongest isolation this machine allows, once, and say loudly what is missing.

Each candidate launch mode (rollwise.sandbox.launch.candidate_modes, strongest first) is tried
for real: a probe command writes and reads a file in a scratch workspace. The first that works is
used. Everything it lacks compared with full bubblewrap isolation, and why the stronger modes
were refused (their stderr, e.g. "bwrap: No permissions to creating new namespace"), is logged once
as a warning, or as an error when the network is not isolated. Never silently weaker.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from rollwise.sandbox.launch import (
    FEATURES,
    MISSING_MEANS,
    IsolationLevel,
    LaunchMode,
    build_launch,
    candidate_modes,
)
from rollwise.sandbox.process import run_bounded
from rollwise.sandbox.types import SandboxError, SandboxLimits
from rollwise.sandbox.workspace import WorkspaceRoot, default_root

log = logging.getLogger("rollwise.sandbox")

_ORDER = [IsolationLevel.RLIMITS, IsolationLevel.UNSHARE, IsolationLevel.BWRAP]
_PROBE_LIMITS = SandboxLimits(timeout_s=20, cpu_s=5, memory_bytes=512 * 1024 * 1024)


@dataclass(frozen=True)
class IsolationReport:
    mode: LaunchMode
    refused: tuple[tuple[str, str], ...]  # (stronger mode, why it did not work here)

    @property
    def level(self) -> IsolationLevel:
        return self.mode.level

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if f not in self.mode.features)

    @property
    def full(self) -> bool:
        return not self.missing

    def describe(self) -> str:
        lines = [f"sandbox isolation: {self.mode.name} (level {self.level.value})"]
        for f in self.missing:
            lines.append(f"  MISSING {f}: {MISSING_MEANS[f]}")
        for name, why in self.refused:
            lines.append(f"  refused: {name}: {why}")
        if self.missing and self.level is not IsolationLevel.BWRAP:
            lines.append("  fix: apt-get install -y bubblewrap, and allow user namespaces "
                         "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)")
        return "\n".join(lines)


def probe_mode(mode: LaunchMode, root: WorkspaceRoot) -> str | None:
    """None if `mode` works on this machine, else why not (one line)."""
    ws = root.new_workspace(mode.sandbox_uid)
    try:
        launch = build_launch(mode, ws, "echo probe > probe.txt && cat probe.txt", _PROBE_LIMITS)
        try:
            out = run_bounded(launch.argv, cwd=launch.cwd, env=launch.env, timeout_s=_PROBE_LIMITS.timeout_s,
                              keep_bytes=4096, kill_bytes=65536, user=launch.user, group=launch.group,
                              preexec_fn=launch.preexec_fn)
        except OSError as exc:  # e.g. the uid switch itself was refused
            return f"{type(exc).__name__}: {exc}"
        if out.returncode == 0 and out.stdout.text().strip() == "probe":
            return None
        detail = (out.stderr.text().strip() or out.stdout.text().strip()).splitlines()
        status = "timed out" if out.killed_for else f"exit code {out.returncode}"
        return f"{status}: {detail[-1][:300] if detail else 'no output'}"
    finally:
        root.remove(ws)


_cache: dict[tuple, IsolationReport] = {}
_lock = threading.Lock()


def detect_isolation(
    max_level: IsolationLevel | str | None = None,
    min_level: IsolationLevel | str | None = None,
    ro_binds: tuple[str, ...] = (),
) -> IsolationReport:
    """The strongest working mode at or below `max_level` (tests use it to exercise fallbacks).

    Raises SandboxError if it is weaker than `min_level` (a deployment that must not run unisolated).
    Cached per arguments; the warning about what is missing is logged once per distinct result.
    """
    top = IsolationLevel(max_level) if max_level is not None else IsolationLevel.BWRAP
    key = (top, tuple(ro_binds))
    with _lock:
        report = _cache.get(key)
        if report is None:
            report = _detect(top, tuple(ro_binds))
            _cache[key] = report
            _announce(report)
    if min_level is not None and _ORDER.index(report.level) < _ORDER.index(IsolationLevel(min_level)):
        raise SandboxError(f"sandbox isolation {report.level.value} is weaker than the required "
                           f"{IsolationLevel(min_level).value}:\n{report.describe()}")
    return report


def _detect(top: IsolationLevel, ro_binds: tuple[str, ...]) -> IsolationReport:
    refused: list[tuple[str, str]] = []
    root = default_root()
    for mode in candidate_modes(ro_binds):
        if _ORDER.index(mode.level) > _ORDER.index(top):
            continue
        why = probe_mode(mode, root)
        if why is None:
            return IsolationReport(mode=mode, refused=tuple(refused))
        refused.append((mode.name, why))
    # Even a plain process failed: nothing can run commands here, which is an error, not a fallback.
    raise SandboxError("no sandbox launch mode works on this machine:\n" +
                       "\n".join(f"  {n}: {w}" for n, w in refused))


def _announce(report: IsolationReport) -> None:
    if report.full:
        log.info("%s", report.describe())
    elif "network" in report.missing:
        log.error("%s", report.describe())
    else:
        log.warning("%s", report.describe())
