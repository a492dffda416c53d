"""How much CPU work this machine does at once: its *effective* cores, for the simulators' processor
sharing (rollwise.sim.cores); and how much engine work the CPU pool's slots do at once, as threads of
one Python process (`measure_interpreter_cores`).

`os.cpu_count()` overstates it on a VM: two single-threaded processes each run ~10% slower side by side
than alone here (shared caches and memory bandwidth, hyperthreads, a hypervisor's steal), so a
simulation that gives each its full core is optimistic exactly when the machine is loaded (bench mux's
shared arm: 10-13% below the measured walls with 2 cores, within 7% with the measured 1.8).

Measured with the work the benchmarks run: a tiny model's forward and backward passes on one torch
thread, alone and in `processes` processes at once, back to back, in rounds (median):

    effective cores = sum over the processes of (time alone / its time side by side)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from typing import Any

_WORKER = """
import sys, time, torch
torch.set_num_threads(1)
from rollwise.model.loading import load_model
model, _ = load_model("tiny:0")
x = torch.randint(3, 90, (16, 96))
model(x).logits.sum().backward()  # warm up (allocator, kernels) before timing
print("ready", flush=True)
for line in sys.stdin:  # "N": run N iterations now, answer the seconds they took
    t = time.perf_counter()
    for _ in range(int(line)):
        model(x).logits.sum().backward()
    print(time.perf_counter() - t, flush=True)
"""


def measure_effective_cores(processes: int | None = None, rounds: int = 7, iterations: int = 40) -> dict[str, Any]:
    """Median over `rounds` of sum(time alone / time side by side) for `processes` (default: every core)
    copies of the same single-threaded work. Each round times the work alone and then side by side right
    after (the order alternating), on warm processes: this machine's speed drifts by tens of percent over
    minutes, so only back-to-back pairs compare."""
    processes = processes or os.cpu_count() or 1
    if processes < 1 or rounds < 1 or iterations < 1:
        raise ValueError("processes, rounds and iterations must be >= 1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env, text=True) for _ in range(processes)]

    def run(group: list[subprocess.Popen]) -> list[float]:
        for w in group:
            w.stdin.write(f"{iterations}\n")
            w.stdin.flush()
        return [float(w.stdout.readline()) for w in group]

    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a timing process exited early (code {w.wait()})")
        values, alone = [], []
        for r in range(rounds):
            if r % 2 == 0:
                one, together = run(workers[:1])[0], run(workers)
            else:
                together, one = run(workers), run(workers[:1])[0]
            alone.append(one)
            values.append(sum(one / t for t in together))
    finally:
        for w in workers:
            w.kill()
            w.wait()
    return {"effective_cores": statistics.median(values), "rounds": values, "processes": processes,
            "cpu_count": os.cpu_count(), "alone_s": alone}


_ENGINE_THREADS = """
import json, sys, threading, time, torch
torch.set_num_threads(1)
from rollwise.engine.factory import create_engine
from rollwise.engine.types import GenerationRequest, SamplingParams
from rollwise.model.loading import load_model
slots, rounds, steps = (int(a) for a in sys.argv[1:4])
engines = []
for k in range(slots):  # as the pool builds them: one reference engine per job, each its own tiny model
    model, tok = load_model(f"tiny:{k}")
    engines.append(create_engine("reference", model, tok, max_num_seqs=32, max_model_len=192, seed=0))
def keep_busy(engine, n, out, i):
    t, done, r = time.perf_counter(), 0, 0
    while done < n:
        if not engine.has_unfinished():  # a sync GRPO step's batch: 4 prompts x 8 samples
            r += 1
            for g in range(4):
                engine.add_request(GenerationRequest(f"r{r}g{g}", [3 + g, 5, 7, 11], SamplingParams(
                    max_tokens=96, temperature=1.0, n=8, seed=r)))
        engine.step()
        done += 1
    out[i] = time.perf_counter() - t
def run(k):  # the first k engines, each stepped on a thread of its own (the pool's EngineWorkers)
    out = [0.0] * k
    threads = [threading.Thread(target=keep_busy, args=(engines[i], steps, out, i)) for i in range(k)]
    for th in threads: th.start()
    for th in threads: th.join()
    return out
run(slots)  # warm up
values = []
for r in range(rounds):
    if r % 2 == 0:
        one, together = run(1)[0], run(slots)
    else:
        together, one = run(slots), run(1)[0]
    values.append(sum(one / t for t in together))
print(json.dumps(values))
"""


def measure_interpreter_cores(slots: int = 2, rounds: int = 7, steps: int = 150) -> dict[str, Any]:
    """How many engines' worth of steps `slots` reference engines make per second when each steps on a
    thread of one Python process (the CPU pool's slots), relative to one alone: 1.0 when they only take
    turns under the interpreter lock, less when the handoffs cost extra, up to `slots` if steps ran in
    parallel. Median over `rounds` back-to-back pairs (alone, together)."""
    if slots < 1 or rounds < 1 or steps < 1:
        raise ValueError("slots, rounds and steps must be >= 1")
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _ENGINE_THREADS, str(slots), str(rounds), str(steps)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the engine-thread timing failed (exit {out.returncode}): {out.stderr[-2000:]}")
    values = json.loads(out.stdout.strip().splitlines()[-1])
    return {"interpreter_cores": statistics.median(values), "rounds": values, "slots": slots}


def measure_cpu_host(pool_slots: int = 2) -> dict[str, Any]:
    """This machine for the pool simulator (rollwise.sim.mux.Host): its effective cores, and how many
    cores' worth of engine steps the CPU pool's slots make together (`pool_slots` engine threads of one
    process). About a minute."""
    cores = measure_effective_cores()
    interpreter = measure_interpreter_cores(slots=pool_slots)
    return {"cores": cores["effective_cores"], "pool_cores": interpreter["interpreter_cores"],
            "effective_cores": cores, "interpreter": interpreter}
