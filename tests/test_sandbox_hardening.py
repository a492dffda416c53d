"""Sandbox hardening (issue 24, items 7-10): complete teardown, whole-sandbox limits, defence in
depth, and results instead of exceptions. Real bubblewrap, real processes; nothing of ours mocked."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollwise.sandbox.launch import IsolationLevel
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import SandboxLimits
from rollwise.sandbox.pool import SandboxPool
from rollwise.sandbox.isolation import detect_isolation
from rollwise.sandbox.limits import limits_in_force
from rollwise.sandbox.cgroups import cgroup_support
from rollwise.sandbox.workspace import remove_tree

pytestmark = pytest.mark.timeout(180)

REPORT = detect_isolation()
LIMITS = limits_in_force(REPORT)
MiB = 2**20
SMALL = SandboxLimits(timeout_s=10, cpu_s=5, memory_bytes=512 * MiB, max_processes=32,
                      disk_bytes=8 * MiB, max_files=1000, tmp_bytes=4 * MiB, max_file_bytes=32 * MiB)
needs_bwrap = pytest.mark.skipif(REPORT.level is not IsolationLevel.BWRAP,
                                 reason="needs bubblewrap (CI installs it)")


def _procs(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], check=False, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _deep_tree(depth: int) -> str:
    return f"for i in $(seq {depth}); do mkdir d && cd d || exit 1; done; echo x > f; chmod 000 ."


# -- 7: teardown -------------------------------------------------------------------------------------
def test_100_timeout_killed_commands_leave_no_process_and_no_file():
    """Background children that leave the process group and write in a loop: when run() returns
    they are gone (the file stops growing at once), and closing removes every file."""
    marker = f"writer{uuid.uuid4().hex[:8]}"
    # setsid: a new session, out of the command's process group; the loop appends forever.
    cmd = (f"for k in 1 2 3; do setsid sh -c 'while :; do echo {marker} >> out.txt; done' & done; "
           f"sleep 30 # {marker}")
    with SandboxPool(SMALL, max_sandboxes=4, max_concurrent_runs=4) as pool:
        paths = []

        def size(path) -> int:  # -1: no writer got to it before the kill (a loaded machine: 0.3 s is short)
            return os.path.getsize(path) if path.exists() else -1

        def one(_):
            with pool.sandbox() as sb:
                r = sb.run(cmd, timeout_s=0.3)
                before = size(sb.inner.host_path / "out.txt") if r.killed else -2
                time.sleep(0.05)
                after = size(sb.inner.host_path / "out.txt")
                paths.append(sb.inner.host_path)
                return r.killed and r.limit == "timeout", before, after

        with ThreadPoolExecutor(4) as ex:
            results = list(ex.map(one, range(100)))
    assert all(killed for killed, _, _ in results)
    assert sum(before > 0 for _, before, _ in results) >= 10, "the writers hardly ever ran: the test proves nothing"
    grew = [(a, b) for _, a, b in results if a != b]
    assert grew == [], f"{len(grew)} of 100 kept writing after run() returned"
    assert _procs(marker) == []
    assert not any(p.exists() for p in paths)


def test_close_removes_a_deep_read_only_tree_and_never_raises():
    sb = LocalSandbox(SMALL.model_copy(update={"max_files": 5000}))
    assert sb.run(_deep_tree(1500) + "; cd /workspace; mkdir ro && touch ro/f && chmod 500 ro").ok
    sb.close()  # RecursionError / "Permission denied" / "Directory not empty" before
    assert not sb.host_path.exists() and sb.leftovers == []


def test_remove_tree_reports_instead_of_raising(tmp_path):
    top = tmp_path / "t"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):  # deeper than the recursion limit, and 43 KB of path: past PATH_MAX
        os.mkdir("a_rather_long_directory_name", dir_fd=fd)
        child = os.open("a_rather_long_directory_name", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.fchmod(fd, 0o500)  # the deepest one read-only
    os.close(fd)
    assert remove_tree(top) == [] and not top.exists()
    assert remove_tree(top) == []  # already gone: nothing to report


# -- 8: whole-sandbox limits -------------------------------------------------------------------------
@needs_bwrap
@pytest.mark.parametrize("where", ["/tmp/big", "/dev/shm/big", "big"])
def test_writing_past_the_size_limits_is_stopped(where):
    with LocalSandbox(SMALL) as sb:
        r = sb.run(f"head -c 20000000 /dev/zero > {where}")
        assert not r.ok and r.limit == "disk" and "No space left" in r.stderr, r
        assert "disk limit" in r.reason


def test_memfd_past_the_file_size_limit_is_stopped():
    limits = SMALL.model_copy(update={"max_file_bytes": 4 * MiB})
    with LocalSandbox(limits) as sb:
        if not sb.run("command -v python3").ok:
            pytest.skip("no python3 in the sandbox")
        r = sb.run("python3 -c \"import os; fd = os.memfd_create('x'); "
                   "[os.write(fd, b'x' * 2**20) for _ in range(64)]\"")
        # Python ignores SIGXFSZ, so the write fails with EFBIG ("File too large") instead.
        assert not r.ok and r.limit == "file_size" and "File too large" in r.stderr, r


def test_inode_quota_refuses_30k_files_or_the_report_says_none():
    if not LIMITS.enforced("workspace_inode_quota"):
        assert "workspace_inode_quota: NO" in LIMITS.describe()
        return
    with LocalSandbox(SMALL.model_copy(update={"max_files": 10_000})) as sb:
        r = sb.run("mkdir m && cd m && i=0; while [ $i -lt 30000 ]; do : > f$i || exit 1; i=$((i+1)); done")
        assert not r.ok and r.limit == "inodes", r
        assert len(os.listdir(sb.host_path / "m")) < 10_000


# A memory cgroup per command: processes (and tmpfs/memfd pages) together are bounded.
CGROUPS = cgroup_support()
WHOLE = SMALL.model_copy(update={"memory_bytes": 256 * MiB, "sandbox_memory_bytes": 192 * MiB,
                                 "tmp_bytes": 128 * MiB, "max_file_bytes": 96 * MiB})


def _alloc(mib: int) -> str:
    """A process that touches `mib` MiB and holds it for a moment (RLIMIT_AS allows 256 MiB each)."""
    return f"python3 -c \"import time; b = b'x' * ({mib} << 20); time.sleep(0.5)\""


def _needs_python3(sb: LocalSandbox) -> None:
    if not sb.run("command -v python3").ok:
        pytest.skip("no python3 in the sandbox")


def _memory_cgroup_or_report_says_no() -> bool:
    if CGROUPS.usable:
        assert LIMITS.enforced("memory_all_processes")
        return True
    assert "memory_all_processes: NO" in LIMITS.describe() and CGROUPS.detail in LIMITS.describe()
    return False


def test_processes_together_past_the_sandbox_memory_limit_are_killed():
    if not _memory_cgroup_or_report_says_no():
        return
    with LocalSandbox(WHOLE) as sb:
        _needs_python3(sb)
        alone = sb.run(_alloc(120))
        assert alone.ok and alone.limit is None, alone  # one is within every limit
        r = sb.run(f"{_alloc(120)} & {_alloc(120)}; wait $!")  # 240 MiB together, 192 allowed
        assert r.limit == "memory" and "memory limit" in r.reason, r
        assert sb.run("echo fine").stdout == "fine\n"  # the next command gets a fresh budget


def _memfd_then_alloc(mib: int) -> str:
    """86 MiB in a memfd, then `mib` MiB more, in one process."""
    return ("python3 -c \"import os; fd = os.memfd_create('m'); [os.write(fd, b'x' * 2**20) for _ in range(86)]; "
            f"b = b'x' * ({mib} << 20)\"")


@needs_bwrap
@pytest.mark.parametrize("holder", ["dev_shm", "memfd"])
def test_tmpfs_and_memfd_pages_count_against_the_sandbox_memory_limit(holder):
    if not _memory_cgroup_or_report_says_no():
        return
    with LocalSandbox(WHOLE) as sb:
        _needs_python3(sb)
        cmd = {"dev_shm": lambda mib: "head -c 90000000 /dev/zero > /dev/shm/f && " + _alloc(mib),
               "memfd": _memfd_then_alloc}[holder]
        under = sb.run(cmd(40))  # 86 + 40 MiB of 192
        assert under.ok, under
        r = sb.run(cmd(120))  # 86 + 120 MiB: over, though each part is within its own limit
        assert r.limit == "memory" and r.killed and r.exit_code is None, r


def test_no_cgroup_is_left_behind_after_20_runs():
    if not _memory_cgroup_or_report_says_no():
        return
    mine = f"rollwise-sandbox-{os.getpid()}-*"
    parents = {p for p in (CGROUPS.memory_parent, CGROUPS.pids_parent) if p is not None}
    with LocalSandbox(WHOLE) as sb:
        for i in range(20):  # ordinary exits, timeouts, background leftovers, OOM kills
            cmd = ("sleep 5 & sleep 5" if i % 4 == 1 else "sleep 5 &" if i % 4 == 2
                   else "head -c 250000000 /dev/zero | sh -c 'v=$(cat); echo ${#v}'" if i % 4 == 3 else "true")
            sb.run(cmd, timeout_s=0.3)
            assert [d for p in parents for d in p.glob(mine)] == [], f"run {i} left its cgroup"


def test_start_up_report_names_every_mechanism(caplog):
    import logging

    text = LIMITS.describe()
    for name in ("workspace_disk_quota", "workspace_inode_quota", "tmp_and_shm_size", "memory_all_processes",
                 "processes_all", "nested_user_namespaces_denied", "seccomp_deny_list"):
        assert f"{name}: " in text
    with caplog.at_level(logging.INFO, logger="rollwise.sandbox"):
        from rollwise.sandbox import limits as limits_mod

        limits_mod._announced.clear()
        with SandboxPool(SMALL, max_sandboxes=1) as pool:
            assert pool.limits_report == LIMITS
    assert any(rec.getMessage().startswith("sandbox limits: ") for rec in caplog.records)


# -- 9: defence in depth ----------------------------------------------------------------------------
@needs_bwrap
def test_no_nested_user_namespace_no_mount_and_seccomp():
    with LocalSandbox(SMALL) as sb:
        r = sb.run("unshare -Ur true")
        assert not r.ok, r
        if LIMITS.enforced("nested_user_namespaces_denied") or LIMITS.enforced("seccomp_deny_list"):
            assert "Operation not permitted" in r.stderr or "No space left" in r.stderr, r
        assert not sb.run("touch /x").ok and not sb.run("touch /dev/x").ok  # root and /dev read-only
        if LIMITS.enforced("seccomp_deny_list"):
            status = sb.run("grep Seccomp: /proc/self/status").stdout
            assert "2" in status, status  # SECCOMP_MODE_FILTER
            if sb.run("command -v python3").ok:
                r = sb.run("python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                           "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\"")
                assert r.stdout.split() == ["-1", "1"], r  # EPERM from the filter
        assert sb.run("echo ok; sh -c 'echo child'").stdout == "ok\nchild\n"  # ordinary forks still work


@needs_bwrap
def test_mountinfo_does_not_show_the_host_workspace_path():
    with LocalSandbox(SMALL) as sb:
        info = sb.run("cat /proc/self/mountinfo").stdout
        if LIMITS.enforced("host_paths_hidden_in_mountinfo"):
            assert str(sb.host_path) not in info and "rollwise-sandbox" not in info, info
        else:
            assert "host_paths_hidden_in_mountinfo: NO" in LIMITS.describe()


# -- 10: results, not exceptions ----------------------------------------------------------------------
def test_stdin_larger_than_the_pipe_buffer_arrives_whole():
    data = os.urandom(3 * MiB)
    with LocalSandbox(SMALL) as sb:
        r = sb.run("cat > in.bin; wc -c < in.bin", stdin=data)
        assert r.ok and r.stdout.strip() == str(len(data)), r
        assert sb.read_file("in.bin", max_bytes=4 * MiB) == data
        r = sb.run("sleep 30", timeout_s=0.5, stdin=data)  # never reads it: the timeout still holds
        assert r.limit == "timeout" and r.wall_s < 5


def test_nul_byte_and_overlong_command_are_results():
    with LocalSandbox(SMALL) as sb:
        for cmd, needle in (("echo a\0b", "NUL byte"), ("echo " + "a" * 300_000, "too long")):
            r = sb.run(cmd)
            assert not r.ok and r.exit_code not in (0, None) and r.limit == "launch", r
            assert needle in r.reason
        assert sb.run("echo still fine").stdout == "still fine\n"
