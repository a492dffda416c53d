"""How much CPU work this machine does at once, for the simulators' processor sharing (rollwise.sim.cores):

- effective cores: `os.cpu_count()` overstates it on a VM. Single-threaded processes side by side each
  run slower than alone (shared caches and memory bandwidth, hyperthreads, a hypervisor's steal);
- interpreter cores: the CPU pool's engine slots are threads of one Python process; together they make
  about one engine's worth of steps (they take turns under the interpreter lock), less when the
  handoffs cost.

Both are measured the same way, with the work the benchmarks run (a tiny model's forward and backward
on one torch thread; a reference engine's decode steps). N members (processes or threads) follow one
schedule of short phases: member 0 alone, member 1 alone, ..., then all together, over and over. Each
member times its work units in its "alone" and its "together" phases, and

    effective = sum over members of (mean unit time alone / mean unit time together)

N when they do not slow each other, 1 when only one runs at a time. The phases interleave finely (a
quarter second) on purpose: this machine's speed drifts by 10-40% within a minute, so timing "alone"
and "together" one after the other, even back to back, measured 1.3 to 2.3 cores for the same two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

# One member's loop; the phases are on CLOCK_MONOTONIC, which every process on the machine shares.
_SCHEDULE = '''
import time

def follow(i, n, t0, phase_s, cycles, unit):
    """Member i of n: work in phase i (alone) and phase n (together), sleep in the others. Only units
    that start and end inside one phase count."""
    end = t0 + cycles * (n + 1) * phase_s
    stats = {"alone": [0, 0.0], "together": [0, 0.0]}
    while True:
        now = time.monotonic()
        if now >= end:
            return stats
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
'''

_PROCESS_MEMBER = _SCHEDULE + '''
import json, sys, torch
torch.set_num_threads(1)
from rollwise.model.loading import load_model
model, _ = load_model("tiny:0")
x = torch.randint(3, 90, (4, 96))
unit = lambda: model(x).logits.sum().backward()
unit()  # warm up (allocator, kernels)
print("ready", flush=True)
i, n, phase_s, cycles = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
t0 = float(sys.stdin.readline())
print(json.dumps(follow(i, n, t0, phase_s, cycles, unit)), flush=True)
'''

_THREAD_MEMBERS = _SCHEDULE + '''
import json, sys, threading, torch
torch.set_num_threads(1)
from rollwise.engine.factory import create_engine
from rollwise.engine.types import GenerationRequest, SamplingParams
from rollwise.model.loading import load_model
n, phase_s, cycles = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

def engine_unit(k):  # one decode step of a reference engine kept busy with a GRPO batch (4 prompts x 8)
    model, tok = load_model(f"tiny:{k}")
    engine = create_engine("reference", model, tok, max_num_seqs=32, max_model_len=192, seed=0)
    batch = [0]
    def unit():
        if not engine.has_unfinished():
            batch[0] += 1
            for g in range(4):
                engine.add_request(GenerationRequest(f"b{batch[0]}g{g}", [3 + g, 5, 7, 11],
                                                     SamplingParams(max_tokens=96, temperature=1.0, n=8, seed=g)))
        engine.step()
    unit()
    return unit

units = [engine_unit(k) for k in range(n)]
t0 = time.monotonic() + 0.5
out = [None] * n
threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, follow(i, n, t0, phase_s, cycles, units[i])))
           for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
'''


def _combine(stats: list[dict[str, list]], members: int) -> dict[str, Any]:
    ratios = []
    for s in stats:
        (n_alone, t_alone), (n_together, t_together) = s["alone"], s["together"]
        if n_alone == 0 or n_together == 0:
            raise RuntimeError("a member timed no work in one of its phases: make the phases longer")
        ratios.append((t_alone / n_alone) / (t_together / n_together))
    return {"value": sum(ratios), "per_member": ratios, "members": members,
            "units": [s["alone"][0] + s["together"][0] for s in stats]}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def measure_effective_cores(processes: int | None = None, seconds: float = 20.0,
                            phase_s: float = 0.25) -> dict[str, Any]:
    """How many cores' worth of single-threaded work `processes` processes (default: one per core) do at
    once here, relative to each alone. About `seconds` plus the workers' start."""
    import time

    processes = processes or os.cpu_count() or 1
    if processes < 1 or seconds <= 0 or phase_s <= 0:
        raise ValueError("processes must be >= 1, seconds and phase_s > 0")
    cycles = max(1, round(seconds / ((processes + 1) * phase_s)))
    workers = [subprocess.Popen([sys.executable, "-c", _PROCESS_MEMBER, str(i), str(processes), str(phase_s),
                                 str(cycles)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(), text=True)
               for i in range(processes)]
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
    result = _combine(stats, processes)
    return {"effective_cores": result["value"], "per_process": result["per_member"], "processes": processes,
            "cpu_count": os.cpu_count(), "units": result["units"], "seconds": seconds}


def measure_interpreter_cores(slots: int = 2, seconds: float = 15.0, phase_s: float = 0.25) -> dict[str, Any]:
    """How many engines' worth of decode steps `slots` reference engines make when each steps on a thread
    of one Python process (the CPU pool's slots), relative to each alone."""
    if slots < 1 or seconds <= 0 or phase_s <= 0:
        raise ValueError("slots must be >= 1, seconds and phase_s > 0")
    cycles = max(1, round(seconds / ((slots + 1) * phase_s)))
    out = subprocess.run([sys.executable, "-c", _THREAD_MEMBERS, str(slots), str(phase_s), str(cycles)],
                         env=_env(), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the engine-thread timing failed (exit {out.returncode}): {out.stderr[-2000:]}")
    result = _combine(json.loads(out.stdout.strip().splitlines()[-1]), slots)
    return {"interpreter_cores": result["value"], "per_thread": result["per_member"], "slots": slots,
            "units": result["units"], "seconds": seconds}


def measure_cpu_host(pool_slots: int = 2) -> dict[str, Any]:
    """This machine for the pool simulator (rollwise.sim.mux.Host): its effective cores, and how many
    cores' worth of engine steps the CPU pool's slots make together (`pool_slots` engine threads of one
    process). About 45 s."""
    cores = measure_effective_cores()
    interpreter = measure_interpreter_cores(slots=pool_slots)
    return {"cores": cores["effective_cores"], "pool_cores": interpreter["interpreter_cores"],
            "effective_cores": cores, "interpreter": interpreter}
