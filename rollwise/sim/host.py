"""How much CPU work this machine does at once: its *effective* cores, for the simulators' processor
sharing (rollwise.sim.cores).

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
