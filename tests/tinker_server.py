"""One `rollwise serve tinker` for a test module (tests/test_tinker_service.py, tests/test_tinker_cookbook.py): the
real CLI in its own process on a loopback port, waited for on /api/v1/healthz by the benchmarks' own
`wait_healthy`, and stopped at the end. SDK clients made through `client()` are closed first, so no heartbeat
thread outlives the server (no "Session heartbeat failed" lines at the end of the suite)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
import tinker

from rollwise.bench.router_processes import wait_healthy
from rollwise.local_server import free_port


class TinkerServer:
    def __init__(self, url: str, data_dir: Path, proc: subprocess.Popen, key: str) -> None:
        self.url, self.data_dir, self.proc, self.key = url, data_dir, proc, key
        self._clients: list[tinker.ServiceClient] = []

    def post(self, path: str, key: str | None = None, headers: dict[str, str] | None = None, **kw: object
             ) -> httpx.Response:
        return httpx.post(f"{self.url}/api/v1/{path}", headers={"X-API-Key": key or self.key, **(headers or {})},
                          timeout=60, **kw)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        return httpx.get(f"{self.url}/api/v1/{path}", headers={"X-API-Key": key or self.key}, timeout=60)

    def client(self, key: str | None = None) -> tinker.ServiceClient:
        """An SDK client of this server, closed when the server stops."""
        client = tinker.ServiceClient(base_url=self.url, api_key=key or self.key)
        self._clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self._clients:  # finishes its session on the server, stops its heartbeat thread
            client.close("success").result(timeout=30)
        self._clients.clear()


S = TypeVar("S", bound=TinkerServer)


@contextmanager
def tinker_server(root: Path, keys: Sequence[str], base_model: str, *extra: str, timeout_s: float = 120,
                  server_cls: type[S] = TinkerServer) -> Iterator[S]:
    """The server on `base_model` with `keys` (the first is the default for requests), its data and log under
    `root` (server.log: its output, shown if it fails to start); `server_cls`: a TinkerServer with a module's own
    helpers."""
    key_file = root / "keys.txt"
    key_file.write_text("".join(f"{k}\n" for k in keys))
    port = free_port()
    env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK clients of this test process
    with (root / "server.log").open("w+b") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollwise.cli", "serve", "tinker", "--host", "127.0.0.1", "--port", str(port),
             "--api-keys", str(key_file), "--base-model", base_model, "--data-dir", str(root / "data"), *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        server = server_cls(f"http://127.0.0.1:{port}", root / "data", proc, keys[0])
        try:
            wait_healthy(server.url, proc, log, "rollwise serve tinker", timeout_s=timeout_s, path="/api/v1/healthz",
                         headers={"X-API-Key": keys[0]})
            yield server
        finally:
            server.close_clients()
            proc.send_signal(signal.SIGINT)  # the supervisor stops its API child with it
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
