"""How much CPU work this machine does at once, for the simulators' processor sharing (rollwise.sim.cores).

`os.cpu_count()` overstates it on a VM: single-threaded processes side by side each run slower than alone
(shared caches and memory bandwidth, hyperthreads, a hypervisor's steal). Measured with the work the
benchmarks run on one torch thread each, a tiny model's forward and backward (a trainer) and, for the
pool, a reference engine's decode step: N processes follow one schedule of short phases (process 0
alone, process 1 alone, ..., then all together, over and over); each times its work units in its
"alone" and its "together" phases, and

    effective cores = sum over the processes of (mean unit time alone / mean unit time together)

N when they do not slow each other, 1 when only one runs at a time. The phases interleave finely (a
quarter second) on purpose: this machine's speed drifts by 10-40% within a minute, so timing "alone"
and "together" one after the other, even back to back, measured 1.3 to 2.3 cores for the same two
(interleaved: 1.8-2.0).

Crowded, with more processes at work than cores (an engine and 2-4 trainers on these 2 cores), they
lose more to each other (context switches, caches): five measured 1.56-1.84 against 1.78-2.03 for two,
the same way. rollwise.sim.cores takes the two points and interpolates between them (`crowding`).

The same schedule on threads of one process (two reference engines stepping on two threads, as the
CPU pool's slots do) measured 0.6-0.8 engines' worth together: tight stepping loops lose time handing
the interpreter lock over. The real pool's threads also wait on HTTP and on each other, and bench mux's
shared arm matches one engine's worth (pool_cores=1) better, so the pool simulation uses 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

# One timing process: a trainer's unit of work (a forward and backward pass) or, as the pool's stand-in,
# an engine's (one decode step of 32 sequences). The phases are on CLOCK_MONOTONIC, which every process
# on the machine shares.
_WORKER = '''
import json, sys, time, torch
torch.set_num_threads(1)
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.model.loading import load_model
model, _ = load_model("tiny:0")
if sys.argv[5] == "engine":
    engine = ReferenceEngine(model, max_num_seqs=32, max_model_len=192, seed=0)
    params = SamplingParams(max_tokens=96, n=8, ignore_eos=True)
    def unit():
        if not engine.has_unfinished():
            for g in range(4):
                engine.add_request(GenerationRequest(f"r{time.monotonic_ns()}-{g}", [3 + g] * 8, params))
        engine.step()
else:
    x = torch.randint(3, 90, (4, 96))
    unit = lambda: model(x).logits.sum().backward()
unit()  # warm up (allocator, kernels)
print("ready", flush=True)
i, n, phase_s, cycles = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
t0 = float(sys.stdin.readline())
# Process i of n works in phase i (alone) and phase n (together) and sleeps in the others. Only units
# that start and end inside one phase count.
end = t0 + cycles * (n + 1) * phase_s
stats = {"alone": [0, 0.0], "together": [0, 0.0]}
while True:
    now = time.monotonic()
    if now >= end:
        break
    k = int((now - t0) // phase_s) if now >= t0 else -1
    phase_end = t0 + (k + 1) * phase_s
    if k < 0 or k % (n + 1) not in (i, n):
        time.sleep(max(0.0, min(phase_end, end) - now))
        continue
    start = time.monotonic()
    unit()
    stop = time.monotonic()
    if stop <= phase_end:
        kind = "together" if k % (n + 1) == n else "alone"
        stats[kind][0] += 1
        stats[kind][1] += stop - start
print(json.dumps(stats), flush=True)
'''


def measure_effective_cores(processes: int | None = None, seconds: float = 20.0, phase_s: float = 0.25,
                            engine: bool = False) -> dict[str, Any]:
    """How many cores' worth of single-threaded work `processes` processes (default: one per core) do at
    once here, relative to each alone. `engine`: process 0 steps an engine (bench mux's pool), the others
    train; otherwise all train. About `seconds` plus the workers' start."""
    processes = processes or os.cpu_count() or 1
    if processes < 1 or seconds <= 0 or phase_s <= 0:
        raise ValueError("processes must be >= 1, seconds and phase_s > 0")
    cycles = max(1, round(seconds / ((processes + 1) * phase_s)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    kinds = ["engine" if engine and i == 0 else "train" for i in range(processes)]
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(i), str(processes), str(phase_s), str(cycles),
                                 kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
               for i, kind in enumerate(kinds)]
    try:
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a timing process exited early (code {w.wait()})")
        t0 = time.monotonic() + 0.2
        for w in workers:
            w.stdin.write(f"{t0}\n")
            w.stdin.flush()
        stats = [json.loads(w.stdout.readline()) for w in workers]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    ratios = []  # per process: mean unit time alone / together
    for st in stats:
        (n_alone, t_alone), (n_together, t_together) = st["alone"], st["together"]
        if n_alone == 0 or n_together == 0:
            raise RuntimeError("a process timed no work in one of its phases: make the phases longer")
        ratios.append((t_alone / n_alone) / (t_together / n_together))
    return {"effective_cores": sum(ratios), "per_process": ratios, "processes": processes,
            "cpu_count": os.cpu_count(), "units": [st["alone"][0] + st["together"][0] for st in stats],
            "kinds": kinds, "seconds": seconds}


def measure_cpu_host(processes: int = 2) -> dict[str, Any]:
    """This machine for the pool simulator (rollwise.sim.mux.Host.measured): its effective cores with an
    engine and a trainer side by side, shared by the trainers and the pool, and, for `processes` > 2 (a
    benchmark's trainers and its pool), with that many at once: crowded, they lose more to each other.
    The CPU pool's engine slots, threads of one Python process, make one engine's worth of steps together
    (they take turns under the interpreter lock). About 25 s per measurement."""
    two = measure_effective_cores(2, engine=True)
    crowding = [(2, two["effective_cores"])]
    crowded = []
    if processes > 2:
        crowded.append(measure_effective_cores(processes, engine=True))
        crowding.append((processes, crowded[-1]["effective_cores"]))
    return {"cores": two["effective_cores"], "pool_cores": 1.0, "crowding": crowding,
            "effective_cores": two, "crowded": crowded}
