"""The processes of `rollwise bench router`: engine replicas, and every router arm in its own process.

Each arm is a router in front of the same replicas: rollwise's router (`rollwise serve router --policy P`)
or vLLM's (`vllm-router --policy cache_aware`, the optional extra `rollwise[vllm-router]`). A router in its
own process pays its own costs (JSON, routing, HTTP) on its own CPU time, which the benchmark reads from
/proc, instead of hiding them in the client's process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO

import httpx
import psutil

from rollwise.local_server import free_port

MODEL_SIZE = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
# Every arm probes each replica's health this often: rollwise's router by default, vllm-router told so (its
# default is 60 s). A probe is an HTTP round trip on the router's CPU, so arms probing at different rates
# would not compare per-request CPU on the same footing.
HEALTH_INTERVAL_S = 1.0
VLLM_ROUTER = "vllm-router"
VLLM_ROUTER_MISSING = ("vllm-router is not installed, so its cache_aware arm is skipped: "
                       "pip install 'rollwise[vllm-router]' (vllm-router==0.1.17) to compare against it")


@dataclass(frozen=True)
class Arm:
    """One router configuration the benchmark runs: `name` labels its results."""

    name: str
    router: str  # "rollwise" or "vllm-router"
    policy: str


def vllm_router_executable() -> str | None:
    """vllm-router on PATH, or beside this Python (a virtual environment's bin/, not on PATH when `rollwise` is
    run by its full path)."""
    return shutil.which(VLLM_ROUTER) or shutil.which(VLLM_ROUTER, path=os.path.dirname(sys.executable))


def arms(policies: list[str], with_vllm_router: bool = True) -> tuple[list[Arm], list[str]]:
    """rollwise's router under each policy, then vllm-router's cache_aware when it is installed; and the
    messages for arms that were skipped."""
    out = [Arm(p, "rollwise", p) for p in policies]
    skipped = []
    if with_vllm_router:
        if vllm_router_executable() is None:
            skipped.append(VLLM_ROUTER_MISSING)
        else:
            out.append(Arm("vllm-router:cache_aware", VLLM_ROUTER, "cache_aware"))
    return out, skipped


def _log_file() -> IO[bytes]:
    """Where a child's stderr goes: a file, never a pipe nobody reads (a full pipe would block the child)."""
    return tempfile.TemporaryFile()


def _tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-2000:]


def wait_healthy(url: str, proc: subprocess.Popen, log: IO[bytes], what: str, timeout_s: float = 180,
                 path: str = "/health", headers: Mapping[str, str] | None = None) -> None:
    """Wait until GET url+path (with `headers`, e.g. an API key) answers 200; RuntimeError with the child's log
    (`log`: a readable file its output goes to) if it exits first, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}{path}", headers=dict(headers or {}), timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {url} did not answer {path} in {timeout_s:g} s")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# ==================================================================== engine replicas


def replica_main(argv: list[str]) -> None:
    """One benchmark replica: `python -m rollwise.bench.router_processes --replica-worker --port P`."""
    p = argparse.ArgumentParser()
    p.add_argument("--replica-worker", action="store_true")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--prefix-cache-tokens", type=int, default=16384)
    args = p.parse_args(argv)
    import uvicorn

    from rollwise.bench.replica_server import timed_app  # the engine server, its steps' CPU on /bench/engine_cpu

    app = timed_app(MODEL_SIZE, args.max_num_seqs, args.max_model_len, args.prefix_cache_tokens)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


@contextlib.contextmanager
def replicas(count: int, max_num_seqs: int, max_model_len: int) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(count)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [_log_file() for _ in ports]
    procs = [subprocess.Popen([sys.executable, "-m", "rollwise.bench.router_processes", "--replica-worker",
                               "--port", str(p), "--max-num-seqs", str(max_num_seqs),
                               "--max-model-len", str(max_model_len)],
                              env=env, stdout=subprocess.DEVNULL, stderr=log) for p, log in zip(ports, logs)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc, log in zip(urls, procs, logs):
            wait_healthy(url, proc, log, "benchmark replica")
        yield urls
    finally:
        stop(procs)
        for log in logs:
            log.close()


def flush_caches(urls: list[str]) -> None:
    """Every replica's prefix cache emptied, directly (not every router forwards /flush_cache)."""
    for url in urls:
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()


# ==================================================================== routers


def _router_command(arm: Arm, urls: list[str], port: int) -> list[str]:
    if arm.router == VLLM_ROUTER:
        return [vllm_router_executable() or VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", arm.policy,
                "--worker-urls", *urls, "--request-timeout-secs", "600", "--queue-timeout-secs", "300",
                "--health-check-interval-secs", f"{HEALTH_INTERVAL_S:g}", "--log-level", "warning"]
    replica_flags = [flag for url in urls for flag in ("--replica", url)]
    # --model: the replicas' tokenizer (their /model_info names a model built in code); token-in requests
    # route by their ids anyway.
    return [sys.executable, "-m", "rollwise.cli", "serve", "router", *replica_flags, "--policy", arm.policy,
            "--port", str(port), "--model", "tiny:0", "--queue-timeout", "300", "--health-interval", f"{HEALTH_INTERVAL_S:g}",
            "--log-level", "warning"]


def cpu_clock_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, every thread included (those that ended too), to the
    nanosecond: the kernel's per-process CPU clock (clock_gettime on MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)).
    /proc's user and system times count whole clock ticks (10 ms), as coarse as a quick round's whole
    router cost. Falls back to them (psutil) where the clock cannot be read."""
    try:
        return time.clock_gettime((~pid << 3) | 2)  # CPUCLOCK_SCHED of the process `pid`
    except OSError:
        return sum(psutil.Process(pid).cpu_times()[:2])


@dataclass
class RouterProcess:
    url: str
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the router and any process it started."""
        try:
            process = psutil.Process(self.pid)
            total = cpu_clock_s(self.pid)
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    total += cpu_clock_s(child.pid)
            return total
        except (psutil.Error, OSError):
            return 0.0


@contextlib.contextmanager
def router_process(arm: Arm, urls: list[str]) -> Iterator[RouterProcess]:
    """The arm's router, started fresh (an empty prefix tree) in its own process."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = _log_file()
    proc = subprocess.Popen(_router_command(arm, urls, port), env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, f"router {arm.name}")
        yield RouterProcess(url, proc.pid)
    finally:
        stop([proc])
        log.close()


if __name__ == "__main__":
    if "--replica-worker" in sys.argv:
        replica_main(sys.argv[1:])
