"""The rollout controller: which problems are generated when, and which finished groups train next.

Three modes (rollout.mode), one code path:

- sync:   submit one batch of groups, wait for all of them, train, repeat. The engine idles while
          the trainer trains and while the batch's longest sample finishes: the baseline.
- sorted: SortedRL. Keep `oversubscription x prompts_per_step` groups in flight so the engine stays
          at its concurrency; a group is trainable once all its samples are done; update batches
          are the first complete groups in completion order (short first). Generation continues
          while the trainer trains (for max_staleness >= 1), and samples that are still running at
          a weight update either continue from their cached prefix under the new weights or are
          aborted and regenerated (rollout.partial_rollout).
- async:  AReaL-style. Generation never waits for the trainer except for admission control: group
          k may start only while k // prompts_per_step <= trainer version + max_staleness.

Which groups start and how many complete groups one update trains (rollout.update_batch: fixed, or
SortedRL's flexible update batch) are pure rules in rollwise.rollout.admission, which the cluster
simulator runs unchanged through this controller. A complete group goes to the Scorer at once; the reward
pool scores it in the background while generation goes on (rollwise.rollout.group_scoring).

In every mode the staleness bound eta = rollout.max_staleness holds for every trained token:
after each weight update to version V, an in-flight sample that could only be trained with
staleness > eta is regenerated (and recorded as such in the ledger), never trained.

A group starts as one n-sample request (one shared prefill, sample i seeded with group seed + i,
exactly the spine's requests). A sample that has to be generated again (aborted at a weight update,
or too stale) goes back alone as an n=1 request with fresh randomness. Benchmarks that force each
sample's length submit every sample as its own request (the engine still shares the prefill of
identical prompts admitted in the same step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollwise.config import RunConfig
from rollwise.engine.speculation.drafter import Drafter
from rollwise.types.generation import Completion, GenerationRequest, SamplingParams
from rollwise.types.contracts import RolloutBackend, Scorer
from rollwise.rollout import admission
from rollwise.rollout.admission import AdmissionPolicy, RolloutCounts
from rollwise.rollout.data import ProblemStream
from rollwise.rollout.group_scoring import GroupScoring
from rollwise.types.ledger import RolloutLedger
from rollwise.rollout.sync_rollout import PromptEncoder, RolloutPlan, build_requests, sampling_seed, to_samples
from rollwise.types.compact import lowest_version, token_array
from rollwise.types.sample import Sample
from rollwise.types.task import Problem
from rollwise.train.advantages import assign_advantages

# Forces a sample's generation length (benchmarks): (group index, sample index) -> max_tokens.
LengthFn = Callable[[int, int], int]


@dataclass
class _Group:
    index: int
    problem: Problem
    prompt_ids: list[int]
    seed: int
    finished: dict[int, Sample] = field(default_factory=dict)  # sample index -> finished sample
    completed_at: float | None = None

    def __post_init__(self) -> None:
        # The prompt once per group in compact form, shared by its samples (16 copies cost as much as
        # a sample's response); requests keep the list (it goes over the wire as JSON).
        self.prompt_array = token_array(self.prompt_ids, f"group {self.index} prompt_ids")


@dataclass
class _Running:
    group: int
    samples: list[int]  # completion index -> sample index within the group
    submitted_version: int  # the policy version when it was submitted (<= every token's version)
    remaining: set[int] = field(default_factory=set)  # completion indices not yet returned


class RolloutController:
    # RolloutControl's GRPO defaults (rollwise.types.contracts): group advantages, no extra step metrics (the agent
    # layer's controller has its own: one advantage per episode, tool-call counts).
    def assign_advantages(self, samples: list[Sample], mode: str) -> float:
        return assign_advantages(samples, mode)

    def step_metrics(self) -> dict[str, float]:  # generation during scoring (rollwise.rollout.group_scoring)
        return {"reward_overlapped_completions": float(self.scoring.overlapped_completions())}

    def __init__(
        self,
        cfg: RunConfig,
        worker: RolloutBackend,
        encoder: PromptEncoder,
        stream: ProblemStream,
        scorer: Scorer,
        *,
        policy_version: int = 0,
        updates: int | None = None,
        start_group: int = 0,
        pending_groups: list[int] | None = None,
        length_fn: LengthFn | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.cfg = cfg
        self.mode = cfg.rollout.mode
        self.eta = cfg.rollout.max_staleness
        self.batch_groups = cfg.rollout.prompts_per_step
        self.group_size = cfg.rollout.group_size
        # Which groups start and how many train per update: pure rules, shared with the simulator.
        self.policy = AdmissionPolicy(self.mode, self.eta, self.batch_groups, cfg.rollout.oversubscription,
                                      self.group_size, cfg.rollout.update_batch, cfg.rollout.max_batch_factor)
        self._running_samples = 0  # submitted and not finished (kept as a count: admission asks per completion)
        # flexible: completions are taken and new groups started *while the trainer trains* (pump()); a
        # controller only acting inside next_batch left the engines draining through every train step
        # (docs/benchmarks.md, issue 26). A thread pumps for real engines; the simulator pumps at its events.
        self.pump_in_background = True
        self._pump_thread: threading.Thread | None = None
        self._pump_stop = threading.Event()
        self._pump_error: BaseException | None = None
        self.worker = worker
        self.encoder = encoder
        self.stream = stream
        self.scorer = scorer  # the reward layer (rollwise.reward), built by the placement
        self.scoring = GroupScoring(scorer)  # complete groups being scored (in the background for the reward pool)
        self.length_fn = length_fn
        self.version = policy_version
        # Train steps taken (skipped ones included): async admission runs ahead of these, not of the
        # version, which a step without signal leaves unchanged. Resumed: the checkpoint's step.
        self.updates = policy_version if updates is None else updates
        self.ledger = RolloutLedger()
        self.groups: dict[int, _Group] = {}
        self.running: dict[str, _Running] = {}  # request id -> what it is
        self.ready: list[int] = []  # complete, scored groups in completion order
        self.next_group = start_group
        # Groups a checkpoint had in flight: generated again first, so none is lost on resume.
        self._redo = sorted(pending_groups or [])
        self.paused_for_update = False
        # Time next_batch spent scoring (inline) or waiting for generated groups' scores: the step's reward time.
        self.score_seconds = 0.0
        # Requests are handed to the engine in one call per round: each call waits for the gap between
        # two engine steps, and requests admitted in the same step share their prompt's prefill.
        self._outbox: list[GenerationRequest] = []
        self._training_groups = 0  # groups of the batch handed out by next_batch, until it is trained
        # Speculation from rollout history (issue 19): every finished sample feeds the drafter. The
        # reference engine feeds its own drafter on its stepping thread as each sample finishes (so
        # `rollwise train engine.speculation=history` needs nothing here); a drafter given here must be
        # one no engine thread touches (HistoryDrafter is not thread-safe). A sample key makes a second
        # feed of the same sample a no-op.
        self.drafter = drafter

    # ------------------------------------------------------------ public

    def next_batch(self, progress: Callable[[int], None] | None = None) -> list[Sample]:
        """Block until an update batch of complete groups is ready; return its samples (scored)."""
        self._stop_pump()
        if self.mode == "sync":
            for _ in range(self.batch_groups):
                self._start_group()
        while not self._batch_ready():
            self._collect_scored()
            if self._batch_ready():
                break
            self._top_up()
            self._flush()
            # Generated enough, not yet scored: the trainer waits on the reward alone.
            waiting_on_reward = admission.batch_ready(self.policy, len(self.ready) + len(self.scoring))
            t = time.monotonic()
            if waiting_on_reward and not self._running_samples:
                self.scoring.wait(timeout=0.05)
            # Scoring in flight: look back soon, a group may become ready without a completion.
            elif (completion := self.worker.next_completion(timeout=0.005 if len(self.scoring) else 0.05)) is not None:
                self._on_completion(completion, progress)
            if waiting_on_reward:
                self.score_seconds += time.monotonic() - t
        if self.mode == "sync":
            self.ready.sort()  # group order, exactly as the spine's synchronous rollout
        # Groups that would exceed eta if they waited one more update go first (oldest first),
        # then the rest in completion order: short groups train early.
        running = self._running_versions()  # one pass, not one per ready group (linear at 1000s of engines)
        oldest = {g: self._oldest_version(g, running) for g in self.ready}
        urgent = sorted((g for g in self.ready if self._urgent(oldest[g])), key=oldest.__getitem__)
        urgent_set = set(urgent)
        order = urgent + [g for g in self.ready if g not in urgent_set]
        taken = order[: admission.batch_size(self.policy, len(order))]
        taken_set = set(taken)
        self.ready = [g for g in self.ready if g not in taken_set]
        self._training_groups = len(taken)
        samples = []
        for g in taken:
            group = self.groups.pop(g)
            for i in range(self.group_size):
                sample = group.finished[i]
                staleness = self.version - lowest_version(sample.versions, self.version)
                if staleness > self.eta:  # after_update guarantees this never happens
                    raise RuntimeError(f"group {g} sample {i} has staleness {staleness} > eta={self.eta}")
                self.ledger.move((g, i), "batched")
                samples.append(sample)
        if self.policy.update_batch == "flexible" and self.mode != "sync":
            # The next batch comes at the next version at the earliest: what is older cannot make it.
            self._regenerate_older_than(admission.oldest_trainable_after_batch(self.policy, self.version),
                                        reason=f"cannot be trained within eta={self.eta} after the batch at v{self.version}")
        # Refill now: the engine generates these groups while the trainer trains on this batch.
        self._top_up()
        self._flush()
        return samples

    def _running_versions(self) -> dict[int, int]:
        """For each group with requests running: the oldest version any of them was submitted at."""
        oldest: dict[int, int] = {}
        for r in self.running.values():
            oldest[r.group] = min(oldest.get(r.group, r.submitted_version), r.submitted_version)
        return oldest

    def _oldest_version(self, g: int, running: dict[int, int]) -> int:
        """The oldest policy version that sampled (or may sample) a token of group g."""
        versions = [lowest_version(s.versions, self.version) for s in self.groups[g].finished.values()]
        if g in running:
            versions.append(running[g])
        return min(versions, default=self.version)

    def _urgent(self, oldest_version: int) -> bool:
        """A group this old must be in the batch trained at the current version, or it will exceed eta."""
        return admission.is_urgent(self.policy, oldest_version, self.version)

    def _batch_ready(self) -> bool:
        return admission.batch_ready(self.policy, len(self.ready))

    def counts(self) -> RolloutCounts:
        """Groups generating, complete and waiting, and in training (the admission policy's input)."""
        return RolloutCounts(generating=len(self.groups) - len(self.ready), ready=len(self.ready),
                             training=self._training_groups, running_samples=self._running_samples)

    def run_requests(self, requests: list[GenerationRequest], progress: Callable[[int], None] | None = None
                     ) -> list[Completion]:
        """Generate other requests (held-out evaluation) on the same engine, beside any rollout in
        flight; returns their completions in (request order, sample index) order."""
        wanted = {r.request_id: i for i, r in enumerate(requests)}
        if wanted.keys() & self.running.keys():
            raise ValueError("request ids collide with rollout requests in flight")
        remaining = sum(r.params.n for r in requests)
        self.worker.submit(requests)
        done: list[Completion] = []
        while remaining:
            self._flush()  # regenerations triggered by arriving rollout samples
            completion = self.worker.next_completion(timeout=0.05)
            if completion is None:
                continue
            if completion.request_id in wanted:
                done.append(completion)
                remaining -= 1
                if progress is not None:
                    progress(1)
            else:
                self._on_completion(completion, None)
        return sorted(done, key=lambda c: (wanted[c.request_id], c.index))

    def evaluate_problems(self, problems: list[Problem], params: SamplingParams, label: str,
                          progress: Callable[[int], None] | None = None) -> list[Sample]:
        """One greedy sample per held-out problem (request ids eval<label>-<slot>), unscored."""
        few_shot = [self.cfg.prompt.few_shot_in_eval] * len(problems)
        requests = build_requests(self.encoder, RolloutPlan(problems, params, f"eval{label}", few_shot=few_shot))
        completions = self.run_requests(requests, progress=progress)
        return to_samples(completions, requests, problems, self.encoder.tokenizer)

    def before_update(self) -> None:
        """The trainer is about to train on a batch taken at self.version. With eta = 0 nothing may be
        sampled by the current policy and trained after the update, so generation pauses."""
        if self.mode != "sync" and self.eta == 0:
            self.worker.pause()
            self.paused_for_update = True
        elif self.pumps_while_training and self.pump_in_background:
            self._pump_stop.clear()
            self._pump_thread = threading.Thread(target=self._pump_until_stopped, name="rollout-pump", daemon=True)
            self._pump_thread.start()

    @property
    def pumps_while_training(self) -> bool:
        """flexible: admission keeps running through the train step (pump())."""
        return self.policy.update_batch == "flexible" and self.mode != "sync" and self.eta > 0

    def pump(self) -> int:
        """Take every completion already there, start what admission allows, never wait. Called while
        the trainer trains, from one thread at a time (the pump thread, or the simulator's loop)."""
        n = 0
        while (completion := self.worker.next_completion(timeout=0)) is not None:
            self._on_completion(completion, None)
            n += 1
        self._collect_scored()
        self._top_up()
        self._flush()
        return n

    def _pump_until_stopped(self) -> None:
        try:
            while not self._pump_stop.is_set():
                completion = self.worker.next_completion(timeout=0.05)
                if completion is not None:
                    self._on_completion(completion, None)
                self._collect_scored()
                self._top_up()
                self._flush()
        except BaseException as exc:  # re-raised on the caller's thread by _stop_pump
            self._pump_error = exc

    def _stop_pump(self) -> None:
        """Stop the pump thread (if one runs) before anything else touches the controller."""
        if self._pump_thread is not None:
            self._pump_stop.set()
            self._pump_thread.join()
            self._pump_thread = None
        if self._pump_error is not None:
            error, self._pump_error = self._pump_error, None
            raise RuntimeError("the rollout pump failed while the trainer trained") from error

    def mark_trained(self, samples: list[Sample]) -> None:
        self._stop_pump()  # nothing else touches the controller while the pump runs
        for s in samples:
            self.ledger.move(_slot(s), "trained")
        self._training_groups = 0

    def after_update(self, version: int) -> None:
        """The engine now samples with `version`: regenerate whatever could not be trained within eta."""
        self._stop_pump()
        self.version = version
        self.updates += 1
        if self.mode != "sync":
            limit = admission.trainable_limit(self.policy, version)  # oldest version a trainable token may have
            if self.cfg.rollout.partial_rollout == "abort":
                self._abort_and_requeue(list(self.running), reason=f"in flight at weight update to v{version}")
            self._regenerate_older_than(limit, reason=f"stale at v{version} (eta={self.eta})")
            self._top_up()  # the new version may admit more groups (async)
            self._flush()
        if self.paused_for_update:
            self.worker.resume()
            self.paused_for_update = False

    def pending_groups(self) -> list[int]:
        """Groups started but not yet trained: a checkpoint stores them so resume regenerates them."""
        return sorted(set(self.groups) | set(self._redo))

    def close(self, reason: str = "the run ended") -> None:
        """Abort everything in flight; what was never trained is recorded as dropped, with the reason."""
        self._stop_pump()
        self._flush()
        if self.running:
            self.worker.abort(list(self.running))
        self.running.clear()
        self._running_samples = 0
        # Samples that finished just before the abort are already queued (the worker queues a step's
        # completions before it runs the next command): discard them, they are recorded as dropped.
        while self.worker.next_completion(timeout=0) is not None:
            pass
        self.groups.clear()
        self.ready.clear()
        self.scoring.clear()  # results still coming are for groups recorded as dropped here
        for (g, i), record in self.ledger.slots.items():
            if record.state not in ("trained", "dropped", "batched"):
                self.ledger.move((g, i), "dropped", reason)

    def in_flight(self) -> int:
        """Groups started and not yet trained, the batch being trained included: everything here
        must be trainable within eta, so counting the training batch keeps admission from running
        a batch further ahead than the staleness bound allows (which would only be regenerated)."""
        return len(self.groups) + self._training_groups

    def _regenerate_older_than(self, limit: int, reason: str) -> None:
        """Generate again every sample (running or finished, not yet batched) with a token older than
        policy version `limit`: it could only be trained with staleness above eta."""
        stale = [rid for rid, r in self.running.items() if r.submitted_version < limit]
        self._abort_and_requeue(stale, reason=f"in flight, {reason}")
        for group in list(self.groups.values()):
            for i, sample in list(group.finished.items()):
                if lowest_version(sample.versions, self.version) < limit:
                    self._regenerate(group, i, reason=reason)

    # ------------------------------------------------------------ admission

    def _top_up(self) -> None:
        while True:
            next_index = self._redo[0] if self._redo else self.next_group
            if not admission.may_admit(self.policy, self.counts(), next_index, self.updates):
                return
            self._start_group()

    def _start_group(self) -> None:
        if self._redo:
            index = self._redo.pop(0)
        else:
            index = self.next_group
            self.next_group += 1
        step, slot = divmod(index, self.batch_groups)
        problem = self.stream.batch(step, self.batch_groups)[slot]
        # Few-shot annealing: the first round(fraction x groups) slots of each step show the examples.
        with_few_shot = slot < round(self.cfg.prompt.few_shot_fraction(step) * self.batch_groups)
        group = _Group(index, problem, self.encoder(problem, with_few_shot),
                       sampling_seed(self.cfg.seed, step, slot, self.group_size))
        self.groups[index] = group
        self.ledger.add_group(index, self.group_size)
        if self.length_fn is None:
            self._submit_request(group, f"g{index}", list(range(self.group_size)), group.seed, self.cfg.rollout.max_tokens)
        else:
            for i in range(self.group_size):
                self._submit_sample(group, i)

    def _submit_sample(self, group: _Group, i: int) -> None:
        attempt = self.ledger.slots[(group.index, i)].attempts
        # Attempt 0 draws exactly what sample i of the group request would; a regeneration draws afresh.
        seed = (group.seed + i + attempt * 1_000_033) % (2**31)
        max_tokens = self.length_fn(group.index, i) if self.length_fn else self.cfg.rollout.max_tokens
        self._submit_request(group, f"g{group.index}/{i}#{attempt}", [i], seed, max_tokens)

    def _submit_request(self, group: _Group, request_id: str, samples: list[int], seed: int, max_tokens: int) -> None:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
            top_k=self.cfg.rollout.top_k, n=len(samples), seed=seed, ignore_eos=self.length_fn is not None,
        )
        self.running[request_id] = _Running(group.index, samples, self.version, set(range(len(samples))))
        self._running_samples += len(samples)
        for i in samples:
            self.ledger.move((group.index, i), "running")
        self._outbox.append(GenerationRequest(request_id, group.prompt_ids, params))

    def _flush(self) -> None:
        if self._outbox:
            requests, self._outbox = self._outbox, []
            self.worker.submit(requests)

    # ------------------------------------------------------------ completions

    def _on_completion(self, c: Completion, progress: Callable[[int], None] | None) -> None:
        info = self.running.get(c.request_id)
        if info is None or c.index not in info.remaining:
            raise RuntimeError(f"completion for unknown request {c.request_id!r} sample {c.index}")
        info.remaining.discard(c.index)
        self._running_samples -= 1
        if not info.remaining:
            del self.running[c.request_id]
        if self.drafter is not None and c.finish_reason != "abort":
            self.drafter.observe(c.prompt_ids, c.token_ids, max(c.versions, default=self.version),
                                 key=f"{c.request_id}/{c.index}")
        index = info.samples[c.index]
        group = self.groups[info.group]
        sample = Sample.from_completion(
            c, problem_id=group.problem.id, sample_id=f"g{info.group}/{index}", group_id=f"g{info.group}",
            prompt_ids=group.prompt_array,
            # A tokenizer takes a list (the simulator's ids come as TokenRuns)
            response_text=self.encoder.tokenizer.decode(c.token_ids if isinstance(c.token_ids, list)
                                                        else list(c.token_ids), skip_special_tokens=True),
            group_index=info.group, sample_index=index, request_id=c.request_id,
        )
        for source, target in c.migrations:  # it moved between engines while it ran (same attempt, not regenerated)
            self.ledger.migrate((info.group, index), source, target)
        self.ledger.move((info.group, index), "finished")
        self.scoring.arrived()
        group.finished[index] = sample
        if progress is not None:
            progress(1)
        # It may have finished in the engine step just before a weight update's abort reached it.
        if self.mode != "sync" and lowest_version(sample.versions, self.version) < self.version - self.eta:
            self._regenerate(group, index, reason=f"stale on arrival at v{self.version}")
            return
        if len(group.finished) == self.group_size:
            group.completed_at = time.monotonic()
            # The pool scores in the background: the group is ready once _collect_scored sees it done.
            samples = [group.finished[i] for i in range(self.group_size)]
            self.score_seconds += self.scoring.submit(group.index, samples, group.completed_at)
            self._collect_scored()

    def _collect_scored(self) -> None:  # scored groups become trainable, in the order they were submitted
        self.ready += [g for g in self.scoring.collect() if g in self.groups]

    def _abort_and_requeue(self, request_ids: list[str], reason: str) -> None:
        if not request_ids:
            return
        aborted = self.worker.abort(request_ids)
        # A request with no abort completion finished just before the abort: it is in the completion
        # queue and arrives through _on_completion, where its staleness is checked.
        for c in aborted:
            info = self.running[c.request_id]
            info.remaining.discard(c.index)
            self._running_samples -= 1
            if not info.remaining:
                del self.running[c.request_id]
            i = info.samples[c.index]
            self.ledger.move((info.group, i), "queued", reason, discarded_tokens=len(c.token_ids))
            self._submit_sample(self.groups[info.group], i)

    def _regenerate(self, group: _Group, i: int, reason: str) -> None:
        discarded = len(group.finished.pop(i).response_ids)
        self.scoring.discard(group.index)  # being scored: it is scored again once complete
        if group.index in self.ready:  # a complete group loses a sample: no longer trainable
            self.ready.remove(group.index)
            group.completed_at = None
        self.ledger.move((group.index, i), "queued", reason, discarded_tokens=discarded)
        self._submit_sample(group, i)


def _slot(sample: Sample) -> tuple[int, int]:
    return sample.extra["group_index"], sample.extra["sample_index"]
