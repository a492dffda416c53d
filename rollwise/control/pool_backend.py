"""A training job's side of the shared engine pool (`rollwise serve pool`).

`attach_to_pool` is what `rollwise train pool.url=...` calls (rollwise.control.placement.pool): it
attaches the job, pushes the trainer's current weights, and returns the job's `PoolWorker`, the
RolloutBackend (rollwise.types.contracts) over HTTP, so the rollout controller drives a pool job exactly
as it drives a local engine. A weight update travels as checksummed buckets (the HTTP transport of
rollwise.sync); the pool checks the whole update, then commits it.

A receiver thread long-polls the job's finished samples into a local queue (next_completion reads
it without a round trip) and keeps the engine view's timeline (the job's running sequences, on this
process's monotonic clock) current. abort() keeps EngineWorker's ordering guarantee: when it returns,
every sample of the job that finished before the abort is already in the local queue.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import torch
from torch import nn

from rollwise.config import ConfigError, RunConfig, check_engine_fits
from rollwise.engine.client import EngineServerError, read_response
from rollwise.types.generation import ModelInfo
from rollwise.types.generation import Completion, GenerationRequest
from rollwise.serve.settings import CLIENT_KEY_ENV
from rollwise.types.weight_update import WeightUpdate
from rollwise.types.bucket_layout import build_manifest, flatten_bucket
from rollwise.types.routing import RoutedExperts


# Weight updates travel in pieces of this size (httpcore re-slices a bytes body after every socket send, which
# is quadratic in the body: a 540 MB body in one piece took ~90 s on loopback, in 8 MiB pieces ~seconds).
CHUNK_BYTES = 8 * 2**20


class PoolServerError(EngineServerError):
    """The pool answered with an error; `message` names the offending field where there is one."""


class PoolClient:
    """The pool's HTTP API for one job: attach() and state() carry the API key (a pool started with keys needs
    one; default: $ROLLWISE_API_KEY), every call of the job after attach() carries the job's token."""

    def __init__(self, base_url: str, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.api_key = api_key if api_key is not None else (os.environ.get(CLIENT_KEY_ENV) or None)
        self.job: str | None = None
        self.token: str | None = None
        self.info: dict[str, Any] = {}

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = dict(kwargs.pop("headers", {}) or {})
        secret = self.token if path.startswith("/jobs/") else self.api_key  # the job's own calls: its token
        if secret is not None:
            headers["Authorization"] = f"Bearer {secret}"
        return read_response(self._http.request(method, path, headers=headers, **kwargs), PoolServerError)

    def _job_path(self, suffix: str = "") -> str:
        if self.job is None:
            raise RuntimeError("attach() first")
        return f"/jobs/{self.job}{suffix}"

    def attach(self, job: str, model: str, priority: float = 1.0, tokenizer_fingerprint: str | None = None,
               lora: bool = False) -> dict[str, Any]:
        info = self._request("POST", "/jobs", json={"job": job, "model": model, "priority": priority,
                                                    "tokenizer_fingerprint": tokenizer_fingerprint, "lora": lora})
        self.job, self.token, self.info = info["job"], info["token"], info
        return info

    def push_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, tokenizer_fingerprint: str,
                     timeout: float = 600.0, adapter: Any = None) -> dict[str, Any]:
        """One whole update: manifest (names, shapes, dtypes, checksums) + the flat bytes; the pool checks it
        all before applying any of it. `adapter` (an AdapterSpec): the tensors are a LoRA job's adapter."""
        state = {name: t.detach().cpu() for name, t in state_dict.items()}
        manifest = build_manifest(state, version, tokenizer_fingerprint, bucket_mb=CHUNK_BYTES / 2**20, checksum=True)
        if adapter is not None:
            manifest = manifest.model_copy(update={"adapter": adapter})
        head = manifest.model_dump_json().encode()

        def body():  # noqa: ANN202 - bytes in pieces: no second copy of the model, and no quadratic send
            yield len(head).to_bytes(8, "big") + head
            buf = None
            for bucket in manifest.buckets:
                buf = flatten_bucket(bucket, state, out=buf if buf is not None and buf.numel() >= bucket.nbytes
                                     else None)
                flat = buf[: bucket.nbytes].numpy()
                for i in range(0, bucket.nbytes, CHUNK_BYTES):
                    yield flat[i : i + CHUNK_BYTES].tobytes()

        size = 8 + len(head) + sum(b.nbytes for b in manifest.buckets)
        return self._request("PUT", self._job_path("/weights"), params={"version": version}, content=body(),
                             headers={"Content-Length": str(size)}, timeout=timeout)

    def submit(self, requests: list[GenerationRequest]) -> None:
        body = {"requests": [{"request_id": r.request_id, "prompt_ids": list(r.prompt_ids), "params": asdict(r.params)}
                             for r in requests]}
        self._request("POST", self._job_path("/requests"), json=body)

    def generate(self, prompt_ids: list[int], **sampling: Any) -> list[Completion]:
        out = self._request("POST", self._job_path("/generate"), json={"prompt_ids": list(prompt_ids), **sampling})
        return [Completion(out["request_id"], c["index"], out["prompt_ids"], c["token_ids"], c["logprobs"],
                           c["versions"], c["finish_reason"], c["cached_prompt_tokens"],
                           routed_experts=RoutedExperts.from_choice(c, out["request_id"])) for c in out["choices"]]

    def poll(self, after: int, timeout: float) -> dict[str, Any]:
        return self._request("GET", self._job_path("/completions"), params={"after": after, "timeout": timeout},
                             timeout=timeout + 30)

    def abort(self, request_ids: list[str]) -> dict[str, Any]:
        return self._request("POST", self._job_path("/abort"), json={"request_ids": list(request_ids)})

    def pause(self) -> None:
        self._request("POST", self._job_path("/pause"))

    def resume(self) -> None:
        self._request("POST", self._job_path("/resume"))

    def detach(self) -> dict[str, Any]:
        return self._request("DELETE", self._job_path())

    def state(self) -> dict[str, Any]:
        return self._request("GET", "/state")


def completion_of(entry: dict[str, Any]) -> Completion:
    return Completion(entry["request_id"], entry["index"], entry["prompt_ids"], entry["token_ids"], entry["logprobs"],
                      entry["versions"], entry["finish_reason"], entry.get("cached_prompt_tokens", 0),
                      routed_experts=RoutedExperts.from_choice(entry, entry["request_id"]),
                      migrations=[(f"slot-{s}", f"slot-{t}") for s, t in entry.get("migrations", [])])


class PoolWorker:
    """The RolloutBackend (rollwise.types.contracts) for one pool job, over HTTP."""

    def __init__(self, client: PoolClient, tokenizer_fingerprint: str, poll_s: float = 0.25) -> None:
        self.client = client
        self.fingerprint = tokenizer_fingerprint
        self.poll_s = poll_s
        self.completions: queue.Queue[Completion] = queue.Queue()
        self.timeline: list[tuple[float, int]] = []  # (this process's monotonic time, the job's running samples)
        self.policy_version: int | None = None
        self._seq = 0  # last outbox entry received
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # Its own connection: a long poll must not queue behind (or in front of) the trainer's calls.
        self._poller = PoolClient(client.base_url, api_key=client.api_key)
        self._poller.job, self._poller.token = client.job, client.token
        self.engine: PoolEngineView | None = None  # the engine view (attach_to_pool sets it); the agent layer reads worker.engine
        self._thread = threading.Thread(target=self._receive, name=f"pool-receiver-{client.job}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the RolloutBackend protocol

    def submit(self, requests: list[GenerationRequest]) -> None:
        self._raise_if_failed()
        if requests:
            self.client.submit(requests)

    def next_completion(self, timeout: float) -> Completion | None:
        self._raise_if_failed()
        try:
            return self.completions.get(timeout=timeout) if timeout > 0 else self.completions.get_nowait()
        except queue.Empty:
            self._raise_if_failed()
            return None

    def abort(self, request_ids: list[str]) -> list[Completion]:
        self._raise_if_failed()
        if not request_ids:
            return []
        out = self.client.abort(request_ids)
        deadline = time.monotonic() + 120
        with self._cond:  # samples that finished before the abort come through the queue first
            while self._seq < out["upto"]:
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pool job {self.client.job}: finished samples up to #{out['upto']} never arrived")
                self._cond.wait(0.1)
        return [completion_of(e) for e in out["aborted"]]

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    def load_weights(self, update: WeightUpdate) -> None:
        """Ship the update's tensors to the pool as checksummed buckets; the pool checks the whole update
        against the job's model and tokenizer, then commits it (or refuses it: PoolServerError). A train.lora
        update carries the adapter only (its manifest's `adapter`)."""
        self.client.push_weights(update.tensors(), update.version, update.tokenizer_fingerprint,
                                 adapter=update.manifest.adapter)
        self.policy_version = update.version

    def model_info(self) -> ModelInfo:
        """The job's engines in the pool, from the attach answer (at the version last pushed)."""
        info = self.client.info
        return ModelInfo(engine=info.get("engine", "reference"), model=info.get("model", ""),
                         vocab_size=int(info["vocab_size"]), max_model_len=int(info["max_model_len"]),
                         max_num_seqs=int(info["max_num_seqs"]), eos_token_ids=list(info.get("eos_token_ids", [])),
                         tokenizer_fingerprint=info.get("tokenizer_fingerprint"),
                         policy_version=self.policy_version or 0)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._stop.set()  # the receiver ends after its current long poll (at most poll_s)
        self._thread.join(timeout=self.poll_s + 5)
        self._poller.close()

    # ------------------------------------------------------------ the receiver thread

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pool job {self.client.job}: lost the pool: {self._error!r}") from self._error

    def _receive(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                out = self._poller.poll(self._seq, self.poll_s)
                failures = 0
            except (httpx.HTTPError, PoolServerError) as exc:
                failures += 1
                if failures >= 5 or (isinstance(exc, PoolServerError) and exc.status in (403, 404)):
                    self._error = exc
                    with self._cond:
                        self._cond.notify_all()
                    return
                time.sleep(0.2 * failures)
                continue
            # The pool's monotonic clock -> ours (same machine: ~equal; elsewhere: offset at the poll's return).
            offset = time.monotonic() - out["now"] if abs(time.monotonic() - out["now"]) > 1.0 else 0.0
            self.timeline.extend((t + offset, n) for t, n in out["timeline"])
            with self._cond:
                for entry in out["completions"]:
                    if entry["seq"] > self._seq:
                        if "error" in entry and self._error is None:  # a sample the pool could not generate
                            self._error = PoolServerError(409, f"request {entry['request_id']!r}: {entry['error']}")
                        self.completions.put(completion_of(entry))
                        self._seq = entry["seq"]
                if out.get("fault") and self._error is None:  # the pool stopped running this job
                    self._error = PoolServerError(409, str(out["fault"]))
                self._cond.notify_all()


@dataclass
class PoolEngineView:
    """What the training loop reads from 'the engine' (rollwise.control.placement.base.EngineView)."""

    name: str
    max_num_seqs: int
    timeline: list[tuple[float, int]] = field(default_factory=list)


def _default_job_name(cfg: RunConfig) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "-", cfg.model.split("/")[-1].replace("bundled:", "").replace(":", "-"))
    return f"{model}-{os.getpid()}"


@dataclass
class PoolAttachment:
    """A job attached to the pool: its worker, the loop's engine view, a console line, and detach()."""

    worker: PoolWorker
    view: PoolEngineView
    description: str
    detach: Callable[[], None]


def attach_to_pool(cfg: RunConfig, model: nn.Module, tokenizer: Any, *, fingerprint: str, policy_version: int,
                   initial: WeightUpdate | None = None) -> PoolAttachment:
    """Attach this run to the pool at cfg.pool.url as job cfg.pool.job; push the trainer's weights (`initial`:
    this update instead, e.g. a train.lora run's adapter: the job then attaches as a LoRA job)."""
    url = cfg.pool.url
    job = cfg.pool.job or _default_job_name(cfg)
    client = PoolClient(url)
    try:
        info = client.attach(job, cfg.model, cfg.pool.priority, fingerprint,
                             lora=initial is not None and initial.manifest.adapter is not None)
    except httpx.HTTPError as exc:
        client.close()
        raise ConfigError(f"pool.url={url}: no pool answers there ({exc}); start one with "
                          "`rollwise serve pool --port PORT`, or unset pool.url to use this run's own engine") from exc
    except PoolServerError as exc:
        client.close()
        if exc.status == 401:
            raise ConfigError(f"pool.url={url}: the pool needs an API key to attach job {job!r}: set "
                              f"{CLIENT_KEY_ENV} to one of the pool's keys ({exc.message})") from exc
        raise ConfigError(f"pool.url={url}: the pool refused job {job!r}: {exc.message}") from exc
    if info.get("tokenizer_fingerprint") != fingerprint:  # the pool checks too; never train on foreign ids
        client.detach()
        client.close()
        raise ConfigError(f"pool.url={url}: tokenizer fingerprint mismatch for {cfg.model!r}: the pool's "
                          f"{str(info.get('tokenizer_fingerprint'))[:16]}..., the trainer's {fingerprint[:16]}...")
    try:  # the pool's engines have their own sizes (not engine.*): this run's requests must fit them
        check_engine_fits(cfg, int(info["max_num_seqs"]), int(info["max_model_len"]),
                          ("the pool's max_num_seqs (rollwise serve pool --max-num-seqs)",
                           "the pool's max_model_len (rollwise serve pool --max-model-len)"))
    except ValueError as exc:
        client.detach()
        client.close()
        raise ConfigError(f"pool.url={url}: {exc}") from None
    worker = PoolWorker(client, fingerprint)
    try:
        worker.load_weights(initial or WeightUpdate.of_state(model.state_dict(), policy_version, fingerprint))
    except Exception:
        worker.close()
        client.detach()
        client.close()
        raise
    view = PoolEngineView(f"pool/{info.get('engine', 'reference')}", int(info["max_num_seqs"]), worker.timeline)
    worker.engine = view

    def detach() -> None:
        try:
            client.detach()
        except (httpx.HTTPError, PoolServerError):
            pass  # the pool is gone or already forgot the job
        finally:
            client.close()

    description = (f"shared pool {url} as job {job!r} (priority {cfg.pool.priority:g}; {info['engines']} reference "
                   f"engine(s) of max_num_seqs={info['max_num_seqs']}, time-sliced)")
    return PoolAttachment(worker, view, description, detach)
