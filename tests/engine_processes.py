"""Test helper: `rollwise serve engine` replicas as real subprocesses on loopback ports (the router
tests kill and restart them). Imported by the test modules; not a test module itself."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from rollwise.local_server import free_port

MODEL = "tiny:0"


def engine_subprocess(port: int, *, max_num_seqs: int = 8, max_model_len: int = 1024,
                      extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rollwise.cli", "serve", "engine", "--model", MODEL, "--port", str(port),
         "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--log-level", "warning",
         *extra_args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "replica exited"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@contextlib.contextmanager
def engine_processes(n: int) -> Iterator[tuple[list[int], list[subprocess.Popen], list[str]]]:
    """n healthy replicas: (ports, processes, urls); killed on exit (the list may be refilled by a test)."""
    ports = [free_port() for _ in range(n)]
    procs = [engine_subprocess(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        yield ports, procs, urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
