"""rollwise.model.allocator: glibc keeps freed memory for reuse in rollwise's processes (no page faults again)."""

import json
import subprocess
import sys

from rollwise.bench.allocator import arm_environment, format_allocator_bench, run_allocator_bench
from rollwise.model.allocator import ENVIRONMENT, OPT_OUT, tuning_applies

# A step's pattern, over and over: tensors of 64, 12 and 20 MiB allocated and freed. Prints the minor page faults
# (memory faulted in) of ten steps after twenty warm-up steps (the heap settles into its layout).
_CHURN = """
import resource, torch
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    x = torch.ones(16 << 20); y = torch.ones(3 << 20); del x; z = torch.ones(5 << 20); del y, z
for _ in range(20):
    step()
before = faults()
for _ in range(10):
    step()
print(faults() - before)
"""


def _churn_faults(env: dict[str, str]) -> int:
    proc = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_a_process_started_with_rollwise_s_environment_reuses_freed_memory_instead_of_faulting_it_in():
    system, kept = _churn_faults(arm_environment("system")), _churn_faults(arm_environment("kept"))
    pages = 10 * (96 << 20) // 4096
    assert system >= pages // 2, system  # glibc unmaps every block this big when it is freed: faulted in again
    assert kept < pages // 100, kept  # the heap keeps them: the next step reuses resident memory


def test_who_is_switched_over():
    assert tuning_applies({}, "Linux", "glibc")
    assert not tuning_applies({OPT_OUT: "system"}, "Linux", "glibc")  # the opt-out
    assert not tuning_applies({}, "Darwin", "")  # not glibc
    assert not tuning_applies({}, "Linux", "musl")
    assert not tuning_applies({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "Linux", "glibc")
    assert not tuning_applies({"MALLOC_ARENA_MAX_": "2"}, "Linux", "glibc")  # the user's own glibc settings win
    assert tuning_applies({"MALLOCATOR": "x"}, "Linux", "glibc")  # not a glibc variable


def test_the_rollwise_command_passes_the_settings_to_the_processes_it_starts():
    env = arm_environment("system")
    env.pop(OPT_OUT)
    code = "import os, sys; from rollwise.cli import main; main(['config']); sys.stderr.write(repr({k: os.environ.get(k) for k in %r}))" % (
        list(ENVIRONMENT),)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith(repr(ENVIRONMENT)), proc.stderr[-500:]


def test_the_quick_bench_runs_both_arms_in_fresh_processes():
    result = run_allocator_bench(quick=True, workloads=("engine",))
    workload = result["workloads"]["engine"]
    assert len(workload["runs"]["system"]) == len(workload["runs"]["kept"]) == 1
    assert workload["wall_ratio_kept_to_system"] > 0 and workload["system_wall_s"] > 0
    assert "kept / system" in format_allocator_bench(result)
    json.dumps(result)
