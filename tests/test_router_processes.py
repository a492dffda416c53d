"""`rollwise bench router` reads each router process's CPU time: to the nanosecond, not in 10 ms clock ticks.

A quick round costs a router 10-40 ms of CPU in all, so tick-counted readings (/proc's user + system times)
made the per-request comparison between routers a matter of 1-4 ticks (issue 25).
"""

from __future__ import annotations

import subprocess
import sys

from rollwise.bench.router_processes import RouterProcess

# Burns ~15 ms of CPU per line it reads, then prints its own CPU seconds (time.process_time: every thread).
CHILD = """
import sys, time
for _ in sys.stdin:
    end = time.process_time() + 0.015
    while time.process_time() < end:
        pass
    print(time.process_time(), flush=True)
"""


def test_router_cpu_reading_matches_the_process_own_clock_to_the_millisecond():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reader = RouterProcess("http://unused", child.pid)
        for _ in range(3):
            child.stdin.write("burn\n")
            child.stdin.flush()
            own = float(child.stdout.readline())
            measured = reader.cpu_s()
            # After printing, the child only waits on stdin: the bench's reading must agree with the child's
            # own clock within 1 ms (a tick-counted reading is off by up to 10 ms).
            assert own - 0.001 <= measured <= own + 0.001, (own, measured)
    finally:
        child.kill()
        child.wait()


def test_router_cpu_reading_of_a_process_that_is_gone_is_zero():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert RouterProcess("http://unused", child.pid).cpu_s() == 0.0


def test_the_profile_switch_writes_the_serving_router_s_stats(tmp_path):
    """ROLLWISE_ROUTER_PROFILE=PATH: the router process's cProfile stats from the moment it serves (its start-up
    left out), written when it is stopped the way the bench stops it (SIGTERM)."""
    import os
    import pstats
    import time

    import httpx

    from rollwise.local_server import free_port
    from rollwise.router.profiling import PROFILE_ENV

    port, path = free_port(), tmp_path / "router.prof"
    router = subprocess.Popen([sys.executable, "-m", "rollwise.cli", "serve", "router", "--replica", "http://127.0.0.1:1",
                               "--port", str(port), "--log-level", "warning"],
                              env={**os.environ, PROFILE_ENV: str(path)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, router.stderr.read()
            try:  # no replica answers: the router serves, and refuses generations with 503
                r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt_ids": [1, 2, 3]}, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the router never listened"
                time.sleep(0.1)
        assert r.status_code == 503, r.text
    finally:
        router.terminate()
        stderr = router.communicate(timeout=30)[1]
    assert "router profile written" in stderr, stderr
    functions = {(file, name) for file, _, name in pstats.Stats(str(path)).stats}
    assert any(file.endswith("relay.py") and name == "generate" for file, name in functions)
    # Start-up (the router's first probes, before it serves) is not in the profile.
    assert not any(name == "probe_all" for _, name in functions)


def test_vllm_router_is_found_beside_this_python_when_its_bin_is_not_on_path(monkeypatch, tmp_path):
    """`.venv/bin/rollwise bench router` (the venv not activated): vllm-router in the same bin/ still runs its arm."""
    from rollwise.bench.router_processes import arms, vllm_router_executable

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm-router").write_text("#!/bin/sh\n")
    (bin_dir / "vllm-router").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert vllm_router_executable() == str(bin_dir / "vllm-router")
    found, skipped = arms(["prefix"])
    assert [arm.router for arm in found] == ["rollwise", "vllm-router"] and not skipped
