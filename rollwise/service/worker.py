"""The worker: claims request rows from the store and runs them, per model in seq_id order, batched across tenants.

Each pass over the queued rows:
1. sampler creations run first (a sampler exists before any sample of it arrives: the API inserts the creation
   before it answers);
2. training rows run per model in the SDK's seq_id order (create or create-from-load = 0, then 1, 2, ...); a
   model whose next seq_id has not arrived waits (the SDK sends chunks concurrently, the first one last). Of the
   models whose next row is a forward_backward, all go into one `forward_backward_many` call: LoRA tenants on one
   base share one forward over it. Other ops (optim_step, save, load) run one at a time, in order;
3. all queued samples, of every tenant, go to the samplers in one `sample_many` call (one engine batch).

`run` does 1 and 3 on a sampling thread of their own and 2 on the calling thread, so one tenant's sample never
waits for another's forward_backward. Each row is claimed by exactly one of them (by kind), and each keeps the
order above within its kinds: a sampler's creation runs before its samples (the same thread, in arrival order),
and an ephemeral save_weights_for_sampler publishes before the API can accept a sample of it (the sampler row
is added after the publish). `run_once` does one pass of all three on the calling thread.

Results and errors go back into the rows: ServiceUserError -> category "user" (the request was wrong and nothing
was applied), anything else -> "server". A row whose seq_id is behind its model's (a resent number) fails as a
user error. Models are in this process's memory: a worker restart fails the rows of models it does not hold.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

from tinker import types

from rollwise.service.datums import ForwardBackwardBatch, decode_forward_backward, encode_forward_backward_output
from rollwise.service.errors import ServiceUserError
from rollwise.service.sampler import SampleJob
from rollwise.service.store import RequestRow
from rollwise.service.tenant_model import TenantModel, forward_backward_many
from rollwise.service.worker_ops import SINGLE_OPS, WorkerState

log = logging.getLogger("rollwise.service.worker")

SESSION_TIMEOUT_S = 600.0  # a session without heartbeat this long is over (the SDK sends one every 10 s)
SWEEP_EVERY_S = 1.0
IDLE_MIN_S, IDLE_MAX_S = 0.005, 0.05  # a lane's store polling: while the service is active, and when idle
# Active: a row finished on either lane this recently. A tenant's next request follows its last result within a
# client round trip (tens of ms), so a lane keeps polling fast this long before it backs off.
ACTIVE_S = 0.25
TRAINING_KINDS = frozenset({"create_model", "forward_backward", "optim_step", "save_weights",
                            "save_weights_for_sampler", "load_weights"})
SAMPLING_KINDS = frozenset({"create_sampling_session", "sample"})


class Worker:
    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.next_seq: dict[str, int] = {}
        self.started_at = time.time()
        self.stop = threading.Event()
        self.swept_at = 0.0

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until `stop`: training rows on this thread, sampler rows on a thread of their own."""
        stop = stop or self.stop
        self.state.store.fail_interrupted()
        halt = threading.Event()  # this thread's loop ended (stop, or an exception such as KeyboardInterrupt)
        # Each lane wakes the other when it finishes rows: a tenant's next request is usually for the other lane
        # (sample -> forward_backward -> optim_step -> save_weights_for_sampler -> sample), so the other lane
        # polls at once and then fast, instead of after its idle backoff (up to IDLE_MAX_S a step, each way).
        training_wake, sampling_wake = threading.Event(), threading.Event()
        sampling = threading.Thread(target=self._serve,
                                    args=(stop, self.run_sampling_once, sampling_wake, training_wake, halt),
                                    name="rollwise-tinker-sampling", daemon=True)
        sampling.start()
        try:
            self._serve(stop, self.run_training_once, training_wake, sampling_wake)
        finally:
            halt.set()
            sampling_wake.set()  # stop waiting now, not after the backoff
            sampling.join(timeout=30)  # a sample batch still running must not keep the server from exiting (daemon)

    @staticmethod
    def _serve(stop: threading.Event, one_pass: Callable[[], int], wake: threading.Event, wake_other: threading.Event,
               halt: threading.Event | None = None) -> None:
        """Poll with `one_pass` until `stop` (or `halt`): at once after rows ran or when the other lane sets `wake`,
        every IDLE_MIN_S for ACTIVE_S after either, then after a backoff growing to IDLE_MAX_S (true idleness:
        the store is not polled in a busy loop)."""
        idle, active_at = IDLE_MIN_S, time.monotonic()
        while not stop.is_set() and not (halt is not None and halt.is_set()):
            wake.clear()  # a wake from here on is seen by the wait below: none is lost
            try:
                ran = one_pass()
            except Exception:  # noqa: BLE001 - e.g. the database briefly unreachable: log it, keep serving
                log.error("worker pass failed:\n%s", traceback.format_exc())
                stop.wait(1.0)
                continue
            if ran:
                idle, active_at = IDLE_MIN_S, time.monotonic()
                wake_other.set()
            elif wake.wait(idle):  # the other lane finished rows: this lane's row likely follows within a round trip
                idle, active_at = IDLE_MIN_S, time.monotonic()
            elif time.monotonic() - active_at > ACTIVE_S:
                idle = min(idle * 1.5, IDLE_MAX_S)

    def sweep(self) -> None:
        """Drop the models of sessions that finished or went silent: a long-running server's memory is bounded by
        its live sessions (their rows then fail as 'not loaded'; checkpoints stay)."""
        now = time.time()
        if now - self.swept_at < SWEEP_EVERY_S or not self.state.models:
            return
        self.swept_at = now
        for model_id in self.state.store.ended_models(list(self.state.models), now - SESSION_TIMEOUT_S):
            del self.state.models[model_id]
            log.info("model %s unloaded: its session ended", model_id)

    def run_once(self) -> int:
        """One pass over the queued rows of every kind; how many rows finished."""
        return self.run_training_once() + self.run_sampling_once()

    def run_training_once(self) -> int:
        """One pass over the queued training rows (and rows of unknown kinds); how many finished."""
        self.sweep()
        rows = [r for r in self.state.store.claimable() if r.kind not in SAMPLING_KINDS]
        if not rows:
            return 0
        done = self._run_training([r for r in rows if r.kind in TRAINING_KINDS])
        for row in rows:  # kinds nobody handles: a server bug, never a hang
            if row.kind not in TRAINING_KINDS:
                self._fail(row, f"unknown request kind {row.kind!r}", "server")
                done += 1
        return done

    def run_sampling_once(self) -> int:
        """One pass over the queued sampler creations, then the samples; how many rows finished."""
        rows = [r for r in self.state.store.claimable() if r.kind in SAMPLING_KINDS]
        done = 0
        for row in rows:
            if row.kind == "create_sampling_session":
                done += self._run_single(row)
        samples = [r for r in rows if r.kind == "sample"]
        if samples:
            done += self._run_samples(samples)
        return done

    # ------------------------------------------------------------------ training, in seq order
    def _expected(self, model_id: str) -> int | None:
        """The next seq_id the model runs; None: a model this worker cannot run (created before it started)."""
        nxt = self.next_seq.get(model_id)
        if nxt is not None:
            return nxt
        row = self.state.store.model(model_id)
        if row is not None and float(str(row["created_at"])) < self.started_at - 1.0:
            return None
        return 0

    def _run_training(self, rows: list[RequestRow]) -> int:
        by_key: dict[tuple[str, int], RequestRow] = {}
        done = 0
        for row in rows:
            if row.model_id is None or row.seq_id is None:
                self._fail(row, "a training request without model_id and seq_id", "server")
                done += 1
                continue
            expected = self._expected(row.model_id)
            if expected is None:
                self._fail(row, f"model {row.model_id!r} is not loaded: the server restarted since it was created; "
                                "create it again or create it from a checkpoint", "server")
                done += 1
            elif row.seq_id < expected:
                self._fail(row, f"seq_id {row.seq_id} of model {row.model_id!r} comes after seq_id {expected - 1} "
                                "ran; number each operation once, in order (1, 2, ...)", "user")
                done += 1
            else:
                by_key[(row.model_id, row.seq_id)] = row
        while True:
            heads = [row for (m, s), row in by_key.items() if s == self.next_seq.get(m, 0)]
            for row in heads:
                del by_key[(row.model_id or "", row.seq_id or 0)]
            if not heads:
                return done
            fwd = [r for r in heads if r.kind == "forward_backward"]
            for row in heads:
                if row.kind != "forward_backward":
                    done += self._run_single(row)
            if fwd:
                done += self._run_forward_backward(fwd)

    def _advance(self, row: RequestRow) -> None:
        if row.model_id is not None and row.seq_id is not None:
            self.next_seq[row.model_id] = row.seq_id + 1

    def _run_single(self, row: RequestRow) -> int:
        op = SINGLE_OPS[row.kind]
        self.state.store.mark_running([row.id])
        row = self.state.store.with_body(row)
        self._guarded(row, lambda: self.state.store.finish(row.id, *op(self.state, row)))
        self._advance(row)
        return 1

    def _run_forward_backward(self, rows: list[RequestRow]) -> int:
        self.state.store.mark_running([r.id for r in rows])
        items: list[tuple[RequestRow, TenantModel, ForwardBackwardBatch]] = []
        for row in rows:
            def decode(row: RequestRow = row) -> None:
                batch = decode_forward_backward(self.state.store.with_body(row).body)
                if batch.model_id != row.model_id or batch.seq_id != row.seq_id:
                    raise ServiceUserError("model_id/seq_id in the body differ from the request's")
                tm = self.state.model(row.model_id or "")
                tm.check(batch)  # refused before anything runs, and out of the batch
                items.append((row, tm, batch))
            self._guarded(row, decode)
            self._advance(row)
        if not items:
            return len(rows)
        try:
            outs = forward_backward_many([(tm, batch) for _, tm, batch in items])
        except Exception:  # noqa: BLE001 - one tenant's failure must not fail the others: run each alone
            log.warning("batched forward_backward failed; running the %d tenants one by one", len(items))
            for row, tm, batch in items:
                self._guarded(row, lambda row=row, tm=tm, batch=batch: self.state.store.finish(
                    row.id, encode_forward_backward_output(*tm.forward_backward(batch)), "proto"))
            return len(rows)
        for (row, _, _), (logprobs, metrics) in zip(items, outs, strict=True):
            self._guarded(row, lambda row=row, lp=logprobs, m=metrics: self.state.store.finish(
                row.id, encode_forward_backward_output(lp, m), "proto"))
        return len(rows)

    # ------------------------------------------------------------------ sampling, one batch across tenants
    def _run_samples(self, rows: list[RequestRow]) -> int:
        self.state.store.mark_running([r.id for r in rows])
        jobs: list[tuple[RequestRow, SampleJob]] = []
        for row in rows:
            def build(row: RequestRow = row) -> None:
                body = types.SampleRequest.model_validate_json(self.state.store.with_body(row).body)
                jobs.append((row, SampleJob.from_request(body)))
            self._guarded(row, build)
        if not jobs:
            return len(rows)
        try:
            results = self.state.samplers.sample_many([job for _, job in jobs])
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every row says why
            for row, _ in jobs:
                self._fail(row, f"sampling failed: {exc.__class__.__name__}: {exc}", "server")
            log.error("sample_many failed:\n%s", traceback.format_exc())
            return len(rows)
        for (row, _), result in zip(jobs, results, strict=True):
            if isinstance(result, ServiceUserError):
                self._fail(row, str(result), "user")
            else:
                self.state.store.finish(row.id, result, "proto")
        return len(rows)

    # ------------------------------------------------------------------ errors into rows
    def _guarded(self, row: RequestRow, fn: Callable[[], None]) -> None:
        try:
            fn()
        except ServiceUserError as exc:
            self._fail(row, str(exc), "user")
        except Exception as exc:  # noqa: BLE001 - a server error is answered, the worker keeps serving
            log.error("request %s (%s) failed:\n%s", row.request_id, row.kind, traceback.format_exc())
            self._fail(row, f"{exc.__class__.__name__}: {exc}", "server")

    def _fail(self, row: RequestRow, error: str, category: str) -> None:
        self.state.store.fail(row.id, error, category)
