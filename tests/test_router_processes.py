"""`rollwise bench router` reads each router process's CPU time: to the nanosecond, not in 10 ms clock ticks.

A quick round costs a router 10-40 ms of CPU in all, so tick-counted readings (/proc's user + system times)
made the per-request comparison between routers a matter of 1-4 ticks (issue 25).
"""

from __future__ import annotations

import subprocess
import sys

from rollwise.bench.router_processes import RouterProcess

# Burns ~15 ms of CPU per line it reads, then prints its own CPU seconds (time.process_time: every thread).
CHILD = """
import sys, time
for _ in sys.stdin:
    end = time.process_time() + 0.015
    while time.process_time() < end:
        pass
    print(time.process_time(), flush=True)
"""


def test_router_cpu_reading_matches_the_process_own_clock_to_the_millisecond():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reader = RouterProcess("http://unused", child.pid)
        for _ in range(3):
            child.stdin.write("burn\n")
            child.stdin.flush()
            own = float(child.stdout.readline())
            measured = reader.cpu_s()
            # After printing, the child only waits on stdin: the bench's reading must agree with the child's
            # own clock within 1 ms (a tick-counted reading is off by up to 10 ms).
            assert own - 0.001 <= measured <= own + 0.001, (own, measured)
    finally:
        child.kill()
        child.wait()


def test_router_cpu_reading_of_a_process_that_is_gone_is_zero():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert RouterProcess("http://unused", child.pid).cpu_s() == 0.0
