"""Which whole-sandbox limits and hardening are in force on this machine, in one report.

Per-process limits (rlimits: CPU, address space, processes, open files, file size) hold at every
isolation level. What a sandbox as a whole may use depends on the machine, so it is detected, not
assumed, and said at start-up (one log line) and by `rollwise check sandbox`:

    from rollwise.sandbox.limits import limits_in_force
    print(limits_in_force().describe())
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

import rollwise.sandbox.seccomp as seccomp
from rollwise.sandbox.cgroups import cgroup_support
from rollwise.sandbox.isolation import IsolationReport, detect_isolation
from rollwise.sandbox.launch import IsolationLevel, bwrap_supports
from rollwise.sandbox.workspace import quota_in_force

log = logging.getLogger("rollwise.sandbox")


@dataclass(frozen=True)
class LimitsReport:
    """One line per guarantee: (name, in force?, how / why not)."""

    items: tuple[tuple[str, bool, str], ...]

    def enforced(self, name: str) -> bool:
        return next(ok for n, ok, _ in self.items if n == name)

    def describe(self) -> str:
        lines = ["sandbox limits in force:"]
        for name, ok, how in self.items:
            lines.append(f"  {name}: {'yes' if ok else 'NO'} ({how})")
        return "\n".join(lines)

    def one_line(self) -> str:
        return "sandbox limits: " + "; ".join(f"{n}={'yes' if ok else 'NO'}" for n, ok, _ in self.items)


def limits_in_force(isolation: IsolationReport | None = None) -> LimitsReport:
    iso = isolation or detect_isolation()
    bwrap = iso.level is IsolationLevel.BWRAP
    userns = bwrap and iso.mode.user_namespace
    no_quota = quota_in_force()
    prog = seccomp.program() if bwrap else None
    cgroups = cgroup_support()
    items = [
        ("workspace_disk_quota", no_quota is None,
         "a tmpfs of SandboxLimits.disk_bytes per workspace" if no_quota is None else no_quota),
        ("workspace_inode_quota", no_quota is None,
         "tmpfs nr_inodes = SandboxLimits.max_files" if no_quota is None else no_quota),
        ("tmp_and_shm_size", bwrap and bwrap_supports("--size"),
         "bwrap --size SandboxLimits.tmp_bytes on /tmp and /dev/shm" if bwrap and bwrap_supports("--size")
         else "needs bubblewrap >= 0.5 (the fallback levels share the host's /tmp and /dev/shm)"),
        ("memfd_size", True, "RLIMIT_FSIZE (SandboxLimits.max_file_bytes) per memfd, times max_open_files"),
        ("memory_all_processes", cgroups.usable,
         f"a memory cgroup per command ({cgroups.detail} = SandboxLimits.sandbox_memory_bytes), tmpfs and "
         "memfd pages included; an over-limit process is OOM-killed, limit='memory'" if cgroups.usable
         else f"per-process RLIMIT_AS only, several processes together can use max_processes x memory_bytes "
         f"(no usable memory cgroup: {cgroups.detail})"),
        ("processes_all", cgroups.usable and cgroups.pids_parent is not None,
         "pids.max = SandboxLimits.max_processes + launcher in the command's cgroup, plus RLIMIT_NPROC"
         if cgroups.usable and cgroups.pids_parent is not None
         else "RLIMIT_NPROC only (per user namespace at the bwrap level; not enforced for a root sandbox uid)"),
        ("nested_user_namespaces_denied", userns and bwrap_supports("--disable-userns"),
         "bwrap --disable-userns" if userns and bwrap_supports("--disable-userns")
         else "needs bubblewrap >= 0.8 with a user namespace"),
        ("seccomp_deny_list", prog is not None,
         f"{len(seccomp.denied_syscalls())} syscalls denied (mount, unshare, setns, ptrace, bpf, ...)"
         if prog is not None else f"needs bubblewrap and an x86_64/aarch64 host (this is {platform.machine()})"),
        ("host_paths_hidden_in_mountinfo", bwrap and no_quota is None,
         "the workspace is its own tmpfs, so /proc/self/mountinfo shows '/' for it" if bwrap and no_quota is None
         else "the workspace is a bind mount: its host path shows in /proc/self/mountinfo"),
    ]
    return LimitsReport(tuple(items))


_announced: set[str] = set()


def announce_limits(isolation: IsolationReport | None = None) -> LimitsReport:
    """limits_in_force(), logged once per distinct result (pools call it at start-up)."""
    report = limits_in_force(isolation)
    line = report.one_line()
    if line not in _announced:
        _announced.add(line)
        log.info("%s", line)
    return report
