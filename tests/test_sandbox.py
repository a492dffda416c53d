"""The sandbox runtime against real processes: real bubblewrap where installed, else the fallback
it reports. Nothing of ours is mocked; each test checks what the sandboxed command could actually do.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from rollwise.sandbox.launch import IsolationLevel
from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import SandboxError, SandboxLimits
from rollwise.sandbox.pool import SandboxPool
from rollwise.sandbox.isolation import detect_isolation
from rollwise.sandbox.cgroups import cgroup_support
from rollwise.sandbox.launch import NOBODY, candidate_modes

pytestmark = pytest.mark.timeout(120)

REPORT = detect_isolation()
# Every level this machine can run, strongest first (forced with max_level), to test the fallbacks too.
LEVELS = [lvl for lvl in (IsolationLevel.BWRAP, IsolationLevel.UNSHARE, IsolationLevel.RLIMITS)
          if detect_isolation(max_level=lvl).level is lvl]
# Without a pid namespace every killed command waits ~1-2 s for the host's init to reap its orphans
# (rollwise.sandbox.process.wait_group_gone); the slowest tests skip that level, which
# test_every_launch_mode_has_the_features_it_claims and the network test still cover.
NAMESPACED = [lvl for lvl in LEVELS if lvl is not IsolationLevel.RLIMITS]
FAST = SandboxLimits(timeout_s=10, cpu_s=5, memory_bytes=512 * 2**20, max_processes=32)


def _sandbox(level: IsolationLevel | None = None, limits: SandboxLimits = FAST) -> LocalSandbox:
    return LocalSandbox(limits, max_level=level)


def _need_python(sb: LocalSandbox) -> None:
    if not sb.run("command -v python3").ok:
        pytest.skip("no python3 inside the sandbox (Debian's python3 is what the sandbox sees)")


SANDBOX_UID = NOBODY[0]  # the uid sandboxed commands run as


def _zombies(uid: int) -> set[int]:
    """Pids of the zombies of `uid` on the host right now."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue  # exited while we looked
        if fields.get("State", "").strip().startswith("Z") and fields.get("Uid", "").split()[:1] == [str(uid)]:
            found.add(int(status.parent.name))
    return found


def _wait_for_orphans_reaped(uid: int, timeout_s: float = 15.0) -> None:
    """A killed command's processes that the group kill orphaned (at the levels without bubblewrap) stay
    zombies until the host's PID 1 reaps them (about 2 s on a firecracker VM). Zombies count against the
    uid's RLIMIT_NPROC, so a test that bounds processes by that limit waits for them first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _zombies(uid):
            return
        time.sleep(0.2)


def _leftovers(marker: str) -> list[str]:
    """Host processes whose command line carries `marker`, other than pgrep itself."""
    out = subprocess.run(["pgrep", "-af", marker], check=False, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_bwrap_is_the_level_tested_when_installed():
    """CI installs bubblewrap, so there the tests must exercise bwrap, not a silent fallback."""
    if shutil.which("bwrap"):
        assert REPORT.level is IsolationLevel.BWRAP, REPORT.describe()
        assert {"network", "filesystem", "pid"} <= REPORT.mode.features
    else:
        assert REPORT.level in (IsolationLevel.UNSHARE, IsolationLevel.RLIMITS)
        assert "filesystem" in REPORT.missing
        assert "MISSING filesystem" in REPORT.describe()
    assert REPORT.mode.name.split()[0] == REPORT.level.value
    assert len(candidate_modes()) >= 1


@pytest.mark.parametrize("level", LEVELS, ids=lambda lvl: lvl.value)
def test_network_is_blocked_or_reported_missing(level):
    # A server on the host's loopback: from a network namespace, 127.0.0.1 is another machine's.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    try:
        with _sandbox(level) as sb:
            _need_python(sb)
            assert sb.level is level
            loopback = sb.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), "
                              "timeout=3); print('connected')\"")
            outside = sb.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 443), timeout=3)\"")
            dns = sb.run("python3 -c \"import socket; print(socket.getaddrinfo('pypi.org', 443))\"")
            if "network" in sb.isolation.mode.features:
                assert not loopback.ok and "connected" not in loopback.stdout, loopback
                assert not outside.ok, outside
                assert not dns.ok and "gaierror" in dns.stderr, dns
                devices = sb.run("cat /proc/net/dev").stdout.splitlines()[2:]  # after the two header lines
                assert {d.split(":")[0].strip() for d in devices} <= {"lo"}  # lo, or none under some kernels
            else:  # the fallback reaches the host, and says so
                assert loopback.ok and "connected" in loopback.stdout, loopback
                assert "network" in sb.isolation.missing
                assert "CAN REACH THE NETWORK" in sb.isolation.describe()
    finally:
        server.close()


def test_memory_hog_is_stopped_and_reported():
    with _sandbox(limits=FAST.model_copy(update={"memory_bytes": 256 * 2**20})) as sb:
        _need_python(sb)
        r = sb.run("python3 -c 'x = bytearray(1024**3); print(len(x))'")
        assert not r.ok and r.exit_code != 0
        assert r.limit == "memory", r
        assert "memory limit" in r.reason and "MemoryError" in r.stderr


@pytest.mark.parametrize("level", NAMESPACED, ids=lambda lvl: lvl.value)
def test_infinite_loop_hits_cpu_limit_and_sleep_hits_timeout(level):
    with _sandbox(level, FAST.model_copy(update={"cpu_s": 1})) as sb:
        r = sb.run("while :; do :; done", timeout_s=20)
        assert r.limit == "cpu_time" and r.signal in ("SIGXCPU", "SIGKILL"), r
        assert not r.ok and r.wall_s < 15

        start = time.monotonic()
        r = sb.run("sleep 30", timeout_s=1)
        assert r.killed and r.limit == "timeout" and r.exit_code is None, r
        assert "timeout after 1 s" in r.reason
        assert time.monotonic() - start < 5


@pytest.mark.parametrize("level", NAMESPACED, ids=lambda lvl: lvl.value)
def test_fork_bomb_is_contained(level):
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    with _sandbox(level, FAST.model_copy(update={"max_processes": 16})) as sb:
        # Too many children at once: the 17th fork fails, the shell says so and stops.
        r = sb.run("for i in $(seq 60); do sleep 2 & done; wait")
        assert r.limit == "processes" and not r.ok, r
        # A real fork bomb: contained by RLIMIT_NPROC, ended by the timeout, nothing left behind.
        r = sb.run(f"# {marker}\nb() {{ b | b & }}; b; sleep 30", timeout_s=1.5)
        # Ended by the timeout, or refused its first fork (without a pid namespace, the dying
        # processes of the previous command still count against this uid's RLIMIT_NPROC).
        assert not r.ok and r.limit in ("timeout", "processes"), r
        time.sleep(0.2)
        assert _leftovers(marker) == []
        with _sandbox(level) as other:  # the host and other sandboxes are unaffected
            assert other.run("echo alive").stdout == "alive\n"


@pytest.mark.skipif(REPORT.level is not IsolationLevel.BWRAP, reason="bubblewrap is not this machine's level")
def test_commands_leave_no_zombie_behind():
    """No command leaves a zombie of the sandbox uid on the host, however it ends. bwrap's own pid-1 init
    outlived bwrap by a moment, and killing bwrap's group then orphaned it to the host's PID 1: a zombie
    after every command, counted against the uid's RLIMIT_NPROC until PID 1 reaped it (~2 s here, never
    in a container whose PID 1 does not reap), so a burst of commands could not fork."""
    with _sandbox(limits=FAST.model_copy(update={"max_output_bytes": 4096, "kill_output_bytes": 65536})) as sb:
        for command, timeout_s in (("true", None), ("sleep 30 & echo left running", None),
                                   ("sleep 30", 0.5), ("yes", None)):
            before = _zombies(SANDBOX_UID)
            r = sb.run(command, timeout_s=timeout_s)
            assert _zombies(SANDBOX_UID) - before == set(), (command, r)
        assert sb.run("echo alive").stdout == "alive\n"


@pytest.mark.skipif(REPORT.level is not IsolationLevel.BWRAP, reason="bubblewrap is not this machine's level")
def test_closing_a_sandbox_while_its_command_runs_leaves_no_zombie():
    """close() from another thread while a command runs stops it the way a timeout does (the namespace's init
    first, then the launcher's group), not by killing the launcher's group first, which orphaned the init."""
    for _ in range(3):
        before = _zombies(SANDBOX_UID)
        sb = _sandbox()
        results = []
        hang = threading.Thread(target=lambda: results.append(sb.run("sleep 300", timeout_s=600)))
        hang.start()
        deadline = time.monotonic() + 10
        while sb._running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # bwrap has started its init and the command
        sb.close()
        hang.join(timeout=10)
        assert results and results[0].killed and "closed" in results[0].reason, results
        assert _zombies(SANDBOX_UID) - before == set()


def test_file_size_and_output_limits():
    limits = FAST.model_copy(update={"max_file_bytes": 1 << 20, "max_output_bytes": 1024,
                                     "kill_output_bytes": 1 << 20})
    with _sandbox(limits=limits) as sb:
        r = sb.run("head -c 5000000 /dev/zero > big.bin")
        assert r.limit == "file_size" and r.signal == "SIGXFSZ", r
        assert os.path.getsize(sb.host_path / "big.bin") <= 1 << 20

        r = sb.run("seq 100000")  # more than we keep, less than the kill limit: head + tail + marker
        assert r.ok and r.stdout_truncated and r.stdout_bytes == len("".join(f"{i}\n" for i in range(1, 100001)))
        assert r.stdout.startswith("1\n2\n") and r.stdout.endswith("99999\n100000\n")
        assert "[rollwise: output truncated" in r.stdout

        r = sb.run("yes")  # gigabytes of output: killed at the limit, not buffered
        assert r.killed and r.limit == "output" and r.stdout_bytes > 1 << 20, r
        assert len(r.stdout) < 2048


@pytest.mark.parametrize("level", LEVELS, ids=lambda lvl: lvl.value)
def test_workspace_persists_across_turns(level):
    with _sandbox(level) as sb:
        assert sb.run("echo one > notes.txt && mkdir -p src && echo 'x = 1' > src/a.py").ok
        r = sb.run("cat notes.txt src/a.py && pwd")
        assert r.stdout == f"one\nx = 1\n{sb.workdir}\n"
        assert sb.run("cat > from_stdin.txt; echo read", stdin=b"piped\n").stdout == "read\n"
        assert sb.read_file("from_stdin.txt") == b"piped\n"
        sb.write_file("src/b.py", "y = 2\n")
        sb.write_file(f"{sb.workdir}/deep/er/c.txt", b"bytes")
        assert sb.run("cat src/b.py deep/er/c.txt").stdout == "y = 2\nbytes"
        assert sb.read_file("notes.txt") == b"one\n"
        assert [(f.path, f.kind) for f in sb.list()] == [
            ("deep", "dir"), ("from_stdin.txt", "file"), ("notes.txt", "file"), ("src", "dir")]
        assert [f.path for f in sb.list("src")] == ["src/a.py", "src/b.py"]
        r = sb.run("sleep 60 & echo started")  # processes do not outlive their command
        assert r.ok and r.wall_s < 5


def test_fork_copies_state_and_diverges():
    with _sandbox() as parent:
        parent.run("echo base > shared.txt && mkfifo pipe && ln -s shared.txt link && chmod 600 shared.txt")
        child = parent.fork()
        try:
            assert child.id != parent.id and child.host_path != parent.host_path
            assert child.read_file("shared.txt") == b"base\n"
            assert child.run("cat link && stat -c %a shared.txt && test -p pipe").stdout == "base\n600\n"
            child.run("echo child > shared.txt && touch only_child")
            parent.run("echo parent > shared.txt")
            assert parent.read_file("shared.txt") == b"parent\n"
            assert child.read_file("shared.txt") == b"child\n"
            assert "only_child" not in {f.path for f in parent.list()}
        finally:
            child.close()
        assert parent.read_file("shared.txt") == b"parent\n"  # closing a fork leaves the parent alone


def test_host_file_access_never_leaves_the_workspace():
    with _sandbox() as sb, _sandbox() as neighbour:
        sb.run("ln -s /etc/hostname host && ln -s / rootlink && mkfifo fifo")
        for path in ("host", "rootlink/etc/hostname", "../x", "/etc/hostname", "fifo"):
            with pytest.raises(SandboxError):
                sb.read_file(path)
        for path in ("rootlink/tmp/escape", "../escape", "/tmp/escape", "host"):
            with pytest.raises(SandboxError):
                sb.write_file(path, "x")
        assert not os.path.exists("/tmp/escape")
        if "filesystem" in sb.isolation.mode.features:
            # The system is read-only, and a neighbour's workspace does not exist in this view.
            assert not sb.run("touch /usr/escape || touch /etc/escape").ok
            assert not os.path.exists("/usr/escape")
            r = sb.run(f"ls {neighbour.host_path}")
            assert not r.ok and "No such file" in r.stderr
            assert sb.run("touch /tmp/private && ls /tmp").stdout == "private\n"
            # Host paths outside the system dirs do not exist in the sandbox's view at all.
            assert sb.run("ls /root /home /work /var 2>&1 | grep -c 'No such file'").stdout.strip() == "4"
            assert not os.path.exists("/tmp/private")
        with pytest.raises(SandboxError, match="closed"):
            neighbour.close()
            neighbour.run("true")


def test_close_kills_hanging_command_and_removes_everything():
    marker = f"hang{uuid.uuid4().hex[:8]}"
    pool = SandboxPool(FAST, max_sandboxes=4, warm=1)
    root = pool._root.path
    a = pool.acquire()
    b = a.fork()
    a.run(f"sleep 300 & # {marker}")
    results = []
    hang = threading.Thread(target=lambda: results.append(b.run(f"sleep 300 # {marker}", timeout_s=600)))
    hang.start()
    deadline = time.monotonic() + 10
    while not _leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    workspaces = [a.inner.host_path, b.inner.host_path]
    assert all(p.exists() for p in workspaces)
    pool.close()
    hang.join(timeout=10)
    assert not hang.is_alive()
    assert results and results[0].killed and results[0].exit_code is None and "closed" in results[0].reason
    time.sleep(0.2)
    assert _leftovers(marker) == []
    assert not any(p.exists() for p in workspaces) and not root.exists()
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()


def test_pool_limits_concurrency_and_sandboxes():
    with SandboxPool(FAST, max_sandboxes=3, max_concurrent_runs=2, acquire_timeout_s=0.3) as pool:
        boxes = [pool.acquire() for _ in range(3)]
        with pytest.raises(SandboxError, match="exhausted"):
            pool.acquire()
        with pytest.raises(SandboxError, match="exhausted"):
            boxes[0].fork()
        threads = [threading.Thread(target=sb.run, args=("sleep 0.4",)) for sb in boxes for _ in range(2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pool.stats.peak_running == 2
        assert time.monotonic() - start >= 3 * 0.4 * 0.9  # 6 runs, 2 at a time
        boxes[0].close()
        boxes[0].close()  # idempotent
        with pool.sandbox() as sb:
            assert sb.run("echo ok").stdout == "ok\n"
        assert pool.stats.peak_live == 3 and pool.stats.live == 2


def test_pool_warm_sandboxes_come_set_up():
    def setup(sb):
        sb.write_file("setup.txt", "prepared once")

    with SandboxPool(FAST, max_sandboxes=4, warm=2, setup=setup) as pool:
        assert pool.wait_warm(timeout_s=10)
        assert pool.stats.warm == 2
        with pool.sandbox() as sb:
            assert sb.read_file("setup.txt") == b"prepared once"
            sibling = sb.fork()  # GRPO siblings: the setup is copied, not re-run
            assert sibling.run("cat setup.txt").stdout == "prepared once"
            sibling.close()
        assert pool.stats.created >= 2


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="kill_output_bytes"):
        SandboxLimits(max_output_bytes=4096, kill_output_bytes=2048)
    with pytest.raises(ValueError, match="warm"):
        SandboxPool(FAST, max_sandboxes=2, warm=3)
    with pytest.raises(SandboxError, match="weaker than the required"):
        detect_isolation(max_level="rlimits", min_level="bwrap")
    with _sandbox() as sb:
        with pytest.raises(SandboxError, match="timeout_s"):
            sb.run("true", timeout_s=0)
        with pytest.raises(SandboxError, match="no such file"):
            sb.read_file("missing.txt")


def test_cli_check_sandbox_prints_level_and_probes(tmp_path, capsys):
    import json

    from rollwise.cli import main

    out_json = tmp_path / "check.json"
    code = main(["check", "sandbox", "--json", str(out_json)])
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert f"sandbox isolation: {REPORT.mode.name}" in printed and "sandbox probes" in printed
    assert result["level"] == REPORT.level.value
    names = [p["name"] for p in result["probes"]]
    assert names[:2] == ["network blocked", "filesystem confined"] and "fork workspace" in names
    failed = [p for p in result["probes"] if p["passed"] is False]
    if REPORT.full:
        assert code == 0 and failed == [], failed
    else:  # what the fallback lacks shows up as a failed probe, and in the exit code
        assert ("network blocked" in [p["name"] for p in failed]) == ("network" in REPORT.missing)
        assert code == (1 if failed else 0)


def test_workspace_roots_are_removed_at_exit_and_swept_after_a_kill():
    import sys

    from rollwise.sandbox.workspace import sweep_stale_roots

    script = ("import os, sys\nfrom rollwise.sandbox.local import LocalSandbox\n"
              "sb = LocalSandbox()\nsb.run('echo x > f')\nprint(sb.host_path.parent, flush=True)\n"
              "if sys.argv[1] == 'kill':\n    os.kill(os.getpid(), 9)\n")
    exited = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, check=True)
    assert not os.path.exists(exited.stdout.strip())  # atexit removed it, unclosed sandbox included
    killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, text=True, check=False)
    root = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(root)  # SIGKILL: no atexit
    assert any(str(p) == root for p in sweep_stale_roots())  # the next process sweeps it
    assert not os.path.exists(root)


@pytest.mark.parametrize("mode", candidate_modes(), ids=lambda m: m.name)
def test_every_launch_mode_has_the_features_it_claims(mode):
    """Each fallback this machine can run is checked against its own feature list, both ways:
    what it claims holds, and what it says is missing is really missing (the warning is honest)."""
    from rollwise.sandbox.isolation import IsolationReport, probe_mode
    from rollwise.sandbox.workspace import default_root

    why = probe_mode(mode, default_root())
    if why is not None:
        pytest.skip(f"{mode.name} does not work on this machine: {why}")
    limits = FAST.model_copy(update={"max_processes": 16})
    _wait_for_orphans_reaped(SANDBOX_UID)  # the earlier modes' bwrap zombies count against RLIMIT_NPROC
    with LocalSandbox(limits, isolation=IsolationReport(mode, ())) as sb:
        devices = [line.split(":")[0].strip() for line in sb.run("cat /proc/net/dev").stdout.splitlines()[2:]]
        # A fresh network namespace lists lo, or nothing at all under some kernels: either way no
        # device reaches beyond the sandbox.
        assert (set(devices) <= {"lo"}) == ("network" in mode.features), devices
        sees_host = sb.run(f"test -e {sb.host_path.parent}").ok
        assert sees_host == ("filesystem" not in mode.features)
        pids = sb.run("ls /proc | grep -c '^[0-9]'").stdout.strip()
        assert (int(pids) < 10) == ("pid" in mode.features), pids
        procs = sb.run("for i in $(seq 40); do sleep 0.3 & done; wait")
        # As root RLIMIT_NPROC does not hold; the command's pids cgroup does, where there is one.
        bounded = "unprivileged_uid" in mode.features or cgroup_support().pids_parent is not None
        assert (procs.limit == "processes") == bounded, procs
