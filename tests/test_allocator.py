"""rollwise.model.allocator: rollwise's processes keep freed memory for reuse up to a bound (no page faults again
for a step's buffers) and give back what is beyond it; the old unbounded policy and glibc's defaults as bench arms."""

import json
import subprocess
import sys

import pytest

from rollwise.bench.allocator import ARMS, arm_environment, format_allocator_bench, run_allocator_bench
from rollwise.model.allocator import ENVIRONMENT, OPT_OUT, tuning_applies

# First 256 MiB of 64 MiB blocks (above the 32 MiB bound) are freed: prints the resident MiB given back. Then a
# step's pattern, over and over: tensors of 24, 12 and 20 MiB (below the bound) allocated and freed; prints the minor
# page faults (memory faulted in) of ten steps after five warm-up steps.
_STEPS = """
import resource, torch
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
blocks = [torch.ones(16 << 20) for _ in range(4)]
held = resident()
del blocks
out = [held - resident()]
def step():
    x = torch.ones(6 << 20); y = torch.ones(3 << 20); del x; z = torch.ones(5 << 20); del y, z
for _ in range(5):
    step()
before = faults()
for _ in range(10):
    step()
print(*out, faults() - before)
"""


@pytest.fixture(scope="module")
def measured() -> dict[str, list[int]]:
    """Per arm, each in a fresh process: [MiB given back of 256 MiB of large blocks, page faults of ten steps]."""
    out = {}
    for arm in ARMS:
        proc = subprocess.run([sys.executable, "-c", _STEPS], env=arm_environment(arm), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[arm] = [int(v) for v in proc.stdout.split()[-2:]]
    return out


def test_the_default_policy_gives_back_blocks_above_its_bound_and_the_old_one_kept_them(measured):
    assert measured["bounded"][0] >= 240, measured  # mmapped, given back when freed
    assert measured["system"][0] >= 240, measured
    assert measured["unbounded"][0] < 32, measured  # kept for good: how the default run grew to 9.5 GB


def test_the_default_policy_reuses_a_step_s_freed_memory_below_its_bound(measured):
    pages = 10 * (56 << 20) // 4096  # ten steps' tensors in 4 KiB pages
    assert measured["bounded"][1] < pages // 50, measured  # kept in the heap: resident memory reused


def test_who_is_switched_over():
    assert tuning_applies({}, "Linux", "glibc")
    assert not tuning_applies({OPT_OUT: "system"}, "Linux", "glibc")  # the opt-out
    assert not tuning_applies({}, "Darwin", "")  # not glibc
    assert not tuning_applies({}, "Linux", "musl")
    assert not tuning_applies({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "Linux", "glibc")
    assert not tuning_applies({"MALLOC_ARENA_MAX_": "2"}, "Linux", "glibc")  # the user's own glibc settings win
    assert not tuning_applies({"MALLOC_ARENA_MAX": "2"}, "Linux", "glibc")  # (glibc reads this one without the _)
    assert tuning_applies({"MALLOCATOR": "x"}, "Linux", "glibc")  # not a glibc variable


def test_the_rollwise_command_passes_the_settings_to_the_processes_it_starts():
    env = arm_environment("system")
    env.pop(OPT_OUT)
    code = "import os, sys; from rollwise.cli import main; main(['config']); sys.stderr.write(repr({k: os.environ.get(k) for k in %r}))" % (
        list(ENVIRONMENT),)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith(repr(ENVIRONMENT)), proc.stderr[-500:]


def test_the_quick_bench_runs_every_arm_in_fresh_processes():
    result = run_allocator_bench(quick=True, workloads=("engine",))
    workload = result["workloads"]["engine"]
    assert [len(workload["runs"][arm]) for arm in ARMS] == [1, 1, 1]
    assert workload["wall_ratio_bounded_to_system"] > 0 and workload["wall_ratio_unbounded_to_system"] > 0
    assert workload["system_wall_s"] > 0 and workload["bounded_peak_rss_gib"] > 0
    text = format_allocator_bench(result)
    assert "bounded / system" in text and "unbounded / system" in text
    json.dumps(result)
