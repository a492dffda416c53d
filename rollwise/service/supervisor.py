"""`rollwise serve tinker`: this process loads the base models and runs the worker; the HTTP API runs as a child
process (rollwise.service.api) that is started again whenever it dies. Requests are rows in the store, so a
killed API loses nothing it accepted: the worker keeps running them and the next API process answers them.

`GET /api/v1/healthz` answers 503 until the base models are loaded, then 200: ready.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

from rollwise.service.base_models import BaseModels
from rollwise.service.options import api_settings, base_models, database_url, sdk_key_warnings
from rollwise.service.errors import ServiceUserError
from rollwise.service.sampler import Samplers
from rollwise.service.store import Store
from rollwise.service.worker import Worker
from rollwise.service.worker_ops import WorkerState

log = logging.getLogger("rollwise.service")
RESTART_DELAY_S = 0.5
QUICK_FAILURE_S = 60.0  # an API process that dies this soon after starting, MAX_QUICK_FAILURES times in a row:
MAX_QUICK_FAILURES = 4  # not a crash to ride out but a setup error (port taken): stop with the reason


class ApiChild:
    """The API process, restarted when it exits while the supervisor still runs. One that keeps failing soon after
    it starts (a taken port, a broken install) is not restarted for ever: `gave_up` is set with the reason and the
    supervisor stops."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.stopping = threading.Event()
        self.gave_up = threading.Event()
        self.reason = ""
        self._thread = threading.Thread(target=self._watch, name="api-child", daemon=True)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command)
        self._thread.start()

    def _watch(self) -> None:
        quick_failures = 0
        while not self.stopping.is_set():
            proc, started = self.proc, time.monotonic()
            assert proc is not None
            code = proc.wait()
            if self.stopping.is_set():
                return
            quick_failures = quick_failures + 1 if time.monotonic() - started < QUICK_FAILURE_S else 0
            if quick_failures >= MAX_QUICK_FAILURES:
                self.reason = (f"the API process exited {quick_failures} times in a row within {QUICK_FAILURE_S:.0f} s "
                               f"of starting (last exit code {code}; its error is above): is the port taken?")
                self.gave_up.set()
                return
            self.restarts += 1
            print(f"rollwise serve tinker: the API process {proc.pid} exited ({code}); starting it again "
                  f"(restart {self.restarts}); accepted requests are kept", file=sys.stderr, flush=True)
            time.sleep(RESTART_DELAY_S)
            if not self.stopping.is_set():
                self.proc = subprocess.Popen(self.command)

    def stop(self) -> None:
        self.stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # stop now (SIGTERM would drain the long-polls first)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def check_port_free(host: str, port: int) -> None:
    """Refuse a taken port in one line before anything loads (the API child would fail to bind, again and again)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); choose a free port "
                             "or stop what holds it") from None


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    from rollwise.serve.front import Front

    front = Front.from_args(args)  # refuses bad keys / an open non-loopback bind before anything loads
    api_settings(args)
    for line in sdk_key_warnings(front.keys):
        print(f"rollwise serve tinker: {line}", file=sys.stderr, flush=True)
    check_port_free(args.host, args.port)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data_dir = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(database_url(args))
    store.set_bases([])  # not ready (healthz 503) until this run's base models are loaded
    names = base_models(args)
    # The API child starts while the base models load (its imports take seconds): healthz answers 503 until then.
    child = ApiChild([sys.executable, "-m", "rollwise.service.api", *argv])
    child.start()
    try:
        bases = BaseModels(data_dir, names)
        try:
            loaded = [bases.get(name) for name in names]
        except ServiceUserError as exc:
            raise ValueError(f"--base-model: {exc}") from None
        samplers = Samplers(bases)
        worker = Worker(WorkerState(store=store, data_dir=data_dir, bases=bases, samplers=samplers))
        store.set_bases((b.name, b.tokenizer_id, b.max_context_length) for b in loaded)
        print(f"rollwise serve tinker: base models {names}; API on http://{args.host}:{args.port}/api/v1 "
              f"({front.who_may_call()}); store {store.url}", flush=True)
        try:
            worker.run(child.gave_up)
        finally:
            samplers.close()  # the full-parameter samplers' engine pool threads
    finally:
        child.stop()
    if child.gave_up.is_set():
        raise ValueError(child.reason)
    return 0
