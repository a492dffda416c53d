"""Rollouts of an environment service, with their exact tokens: the agent proxy on loopback records every
model call an environment makes (one proxy session per rollout), the service's worker returns the reward.

    with EnvRunner(generator, tokenizer, service, limits=SessionLimits(...)) as runner:
        results = runner.run([RolloutJob(rollout_id="g0-0", index=0, ...), ...])
        results[0].samples        # trainer Samples: the engine's sampled ids, logprobs, versions (TITO)
        results[0].reply          # the environment's reward and metrics, or why the rollout failed

The environment never returns tokens: what the trainer gets is what the proxy recorded from the engine.
"""

from __future__ import annotations

import socket
from collections import Counter
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rollwise.agent.episode import end_session
from rollwise.agent.generator import Generator, UpstreamError
from rollwise.agent.proxy import SessionStore, create_proxy_app
from rollwise.agent.samples import trajectory_samples
from rollwise.agent.session import SessionLimits
from rollwise.agent.trajectory import Trajectory
from rollwise.environments.protocol import RolloutReply, RolloutRequest, Sampling
from rollwise.environments.workers import EnvService
from rollwise.types.sample import Sample

MODEL_NAME = "rollwise-policy"


@dataclass
class RolloutJob:
    rollout_id: str  # the proxy session's id too: 1-128 of A-Z a-z 0-9 _ . : -
    group_id: str
    problem_id: str
    index: int
    split: str = "train"
    sampling: Sampling | None = None
    seed: int = 0


@dataclass
class RolloutResult:
    job: RolloutJob
    reply: RolloutReply
    trajectory: Trajectory | None
    samples: list[Sample]


class _ProxyThread:
    """The proxy app served by uvicorn on a free port of `host` (loopback unless workers run on other nodes), on a
    thread of this process."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="env-proxy")
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the environment proxy did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class EnvRunner:
    def __init__(self, generator: Generator, tokenizer: Any, service: EnvService, *,
                 limits: SessionLimits | None = None, parser: str = "hermes", concurrency: int = 64,
                 describe_tools: bool = True, proxy_host: str = "127.0.0.1") -> None:
        self.service, self.concurrency = service, concurrency
        app = create_proxy_app(generator, tokenizer, model_name=MODEL_NAME, limits=limits or SessionLimits(),
                               parser=parser, max_concurrent_turns=max(concurrency, 8), describe_tools=describe_tools)
        self.store: SessionStore = app.state.store
        self._proxy = _ProxyThread(app, proxy_host)
        self.url = self._proxy.url

    def __enter__(self) -> EnvRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._proxy.close()

    def _one(self, job: RolloutJob, group_size: int) -> RolloutResult:
        request = RolloutRequest(id=job.rollout_id, split=job.split, index=job.index,  # type: ignore[arg-type]
                                 base_url=f"{self.url}/sessions/{job.rollout_id}/v1", model=MODEL_NAME,
                                 sampling=job.sampling or Sampling(), seed=job.seed, group=job.group_id,
                                 group_size=group_size)
        reply = self.service.run(request)
        session = self.store.sessions.get(job.rollout_id)
        if session is None:  # the environment never called the model
            return RolloutResult(job, reply, None, [])
        with session.lock:  # a turn the environment left running (it timed out) finishes first
            trajectory = session.trajectory()
        try:
            end_session(session)  # the engine may drop what it retains for the session
        except UpstreamError:
            pass  # best effort: an engine that cannot costs only memory it frees later
        self.forget(job.rollout_id)
        samples = trajectory_samples(trajectory, problem_id=job.problem_id, group_id=job.group_id,
                                     episode_id=job.rollout_id, response_text=reply.final_text)
        return RolloutResult(job, reply, trajectory, samples)

    def forget(self, session_id: str) -> None:
        """Drop a finished rollout's session (the store would otherwise fill up to max_sessions)."""
        self.store.sessions.pop(session_id, None)
        self.store.finished.pop(session_id, None)
        self.store.tool_out.pop(session_id, None)

    def run(self, jobs: list[RolloutJob]) -> list[RolloutResult]:
        """All jobs, concurrently (up to `concurrency`), in order. Never raises for what an environment does."""
        if not jobs:
            return []
        sizes = Counter(job.group_id for job in jobs)
        # A group's members wait for each other in an environment that scores groups: all must run at once.
        workers = max(min(self.concurrency, len(jobs)), max(sizes.values()))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-rollout") as pool:
            return list(pool.map(lambda job: self._one(job, sizes[job.group_id]), jobs))
