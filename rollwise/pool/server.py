"""`rollwise serve pool`: one set of engines shared by several `rollwise train` jobs.

Each job attaches with its own model and gets a secret token; every call it makes carries the token
and names the job, so one job can never submit to, read from or update another. A job's requests are
queued in the pool and admitted only to an engine instance built for that job, holding that job's
current weights (checked on every admission, and every completion is stamped with the job and the
policy versions that sampled it).

Engines ("slots") are time-sliced across jobs by the pure policy in rollwise.pool.scheduler. On a
switch, the outgoing job's engine instance goes to sleep (KV cache freed, weights kept in host
memory) and the incoming one wakes, or is built from the job's model and its latest pushed weights
if it was evicted (rollwise.pool.states; every transition is timed). Each slot is an EngineWorker
thread whose engine is swapped between two steps (EngineWorker.swap_engine), plus a control thread
that routes finished samples and admits work.

Modules: engine_pool.py (EnginePool: jobs, weights, requests, reports), slots.py (the slot loops),
jobs.py (the records), weights.py (the weight upload), app.py (the routes), metrics.py (/metrics);
this module starts the server.

Endpoints (JSON; `Authorization: Bearer TOKEN` on every /jobs/{job}/... call):

    POST   /jobs                         attach {job, model, priority, tokenizer_fingerprint, lora} -> {token, ...}
                                         (`Authorization: Bearer API_KEY` when the pool has keys; 401 without,
                                         429 past --max-jobs(-per-key), 503 when the model does not fit in memory)
                                         (lora: the job pushes adapters on `model` and shares that base's
                                         engines with the other LoRA jobs on it, in one batch)
    PUT    /jobs/{job}/weights?version=V  a whole weight update: 8-byte big-endian manifest length, the
                                         rollwise.weights/v2 manifest (JSON), then every bucket's flat bytes;
                                         validated whole (names, shapes, dtypes, checksums, tokenizer) or refused
                                         (a LoRA job: its adapter, loaded under the job's name only)
    GET    /jobs/{job}/adapter           a LoRA job's adapter as served: name, version, rank, alpha, targets
    POST   /jobs/{job}/requests          {requests: [{request_id, prompt_ids, params}]} queued, all or none
                                         (429 + Retry-After past --max-queued-per-job requests in flight)
    GET    /jobs/{job}/completions?after=SEQ&timeout=S
                                         long poll: finished samples with seq > SEQ (acknowledges <= SEQ),
                                         plus the job's running-sequence timeline since the last poll
    POST   /jobs/{job}/generate          one token-level request, answered when done (the engine server's /generate)
    POST   /jobs/{job}/abort             {request_ids} -> aborted samples + `upto`, the last seq of samples that
                                         finished before the abort (the client waits for those)
    POST   /jobs/{job}/pause, /resume    freeze / continue the job's generation
    DELETE /jobs/{job}                   detach: abort its work, evict its engines; returns its accounting
    GET    /state                        slots, (slot, job) states, jobs' queues and engine-hours, measured
                                         transition costs, the transition log (an API key, when the pool has keys)
    GET    /health, /metrics (Prometheus text)

Who may attach: the pool's API keys (rollwise.serve.auth: `--api-keys FILE` or ROLLWISE_API_KEYS; trainers send
ROLLWISE_API_KEY). Without keys it serves only a loopback address, where anyone on this machine may attach;
other addresses need keys, or --insecure-no-auth to accept anyone who reaches the port. A job's token then
guards the job. A tenant's failure stays its own: weights or an adapter that fail on an engine fault that job
only (rollwise.pool.slots: its requests are answered with the error, the slot keeps serving the others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from rollwise.pool.app import create_app
from rollwise.pool.engine_pool import EnginePool
from rollwise.pool.cache_settings import CacheSettings
from rollwise.pool.scheduler import Policy
from rollwise.pool.startup_cost import calibrate
from rollwise.serve.drain import serve_app
from rollwise.serve.front import Front
from rollwise.serve.settings import FrontSettings


def serve(engines: int = 1, front: Front | None = None, max_num_seqs: int = 16,
          max_model_len: int = 1024, min_slice_s: float = 5.0, max_sleeping: int = 4,
          drain_by: Literal["migration", "wait"] = "migration",
          job_timeout_s: float = 120.0, on_start: Callable[[EnginePool], None] | None = None,
          max_jobs: int = 16, max_jobs_per_key: int | None = None,
          max_queued_per_job: int = 4096, memory_budget_bytes: int | None = None,
          cache: CacheSettings | None = None) -> None:
    """Serve a pool behind `front` (default: 127.0.0.1:8300, no keys) until SIGTERM drains it."""
    front = front or Front.from_settings(FrontSettings(port=8300))
    who = front.who_may_call()
    host, port = front.settings.host, front.settings.port
    if min_slice_s < 0:
        raise ValueError(f"--min-slice must be >= 0 seconds, got {min_slice_s}")
    pool = EnginePool(engines, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      policy=Policy(min_slice_s=min_slice_s, drain_by=drain_by), max_sleeping=max_sleeping,
                      job_timeout_s=job_timeout_s,
                      max_jobs=max_jobs, max_jobs_per_key=max_jobs_per_key, max_queued_per_job=max_queued_per_job,
                      memory_budget_bytes=memory_budget_bytes, cache=cache,
                      startup=calibrate(16 * 2**20))  # this machine's tier bandwidths, for placement
    if on_start is not None:
        on_start(pool)
    print(f"rollwise serve pool: {engines} reference engine(s), max_num_seqs={max_num_seqs}, max_model_len="
          f"{max_model_len}, min slice {min_slice_s:g}s, up to {max_sleeping} sleeping engines per slot; "
          f"http://{host}:{port}/state", flush=True)
    print(f"rollwise serve pool: {who}; at most {max_jobs} jobs ({pool.quota.per_key} per key), "
          f"{pool.memory.budget / 2**30:.1f} GiB of host memory for them, {max_queued_per_job} requests in flight "
          "per job", flush=True)
    serve_app(create_app(pool, front=front), front)
