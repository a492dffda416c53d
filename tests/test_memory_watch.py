"""rollwise.observe.memory: a warning before the machine runs out of memory, and the run's peak."""

import subprocess
import sys
import time

from rollwise.observe.memory import GIB, MemoryReading, MemoryWatch, read_memory


def _replay(readings):
    it = iter(readings)
    return lambda: next(it)


def test_warns_once_per_fall_below_the_line_and_again_only_after_memory_came_back():
    total = 100 * GIB  # line: max(5% of 100 GiB, 1 GiB) = 5 GiB; re-armed above 10 GiB
    available = [40, 6, 4.9, 3, 4, 9, 4, 11, 2]  # GiB
    warned: list[str] = []
    watch = MemoryWatch(warned.append, "engine.kv_cache_gib=2",
                        read=_replay([MemoryReading(int(a * GIB), total, int((50 - a) * GIB)) for a in available]))
    for _ in available:
        watch.check()
    assert len(warned) == 2 and watch.warnings == 2  # at 4.9 (first fall) and at 2 (after 11 re-armed it)
    assert "4.9 GiB of 100.0 GiB is left" in warned[0] and "45.1 GiB" in warned[0]
    assert "engine.kv_cache_gib=2" in warned[0] and "Killed" in warned[0]
    summary = watch.summary()
    assert summary["peak_rss_run_gb"] == 48 and summary["min_available_memory_gb"] == 2
    assert summary["low_memory_warnings"] == 2


def test_a_small_machine_gets_the_one_gib_floor():
    warned: list[str] = []
    watch = MemoryWatch(warned.append, "hints", read=_replay([MemoryReading(int(0.9 * GIB), 8 * GIB, GIB)]))
    watch.check()  # 5% of 8 GiB is 0.4 GiB: the 1 GiB floor is the line
    assert len(warned) == 1


def test_the_real_reading_counts_child_processes_and_the_thread_warns_at_start():
    child = subprocess.Popen([sys.executable, "-c", "x = bytearray(300 * 1024 * 1024); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while read_memory().run_rss < 300 * 1024 * 1024 and time.monotonic() < deadline:
            time.sleep(0.1)
        reading = read_memory()
        assert 0 < reading.available <= reading.total and reading.run_rss >= 300 * 1024 * 1024
        warned: list[str] = []
        # A line above any machine's free memory: the warning comes from start(), before the thread's first tick.
        watch = MemoryWatch(warned.append, "hints", low_fraction=0.999, interval_s=0.05).start()
        time.sleep(0.3)
        watch.stop()
        assert len(warned) == 1 and watch.peak_run_rss >= 300 * 1024 * 1024
    finally:
        child.kill()
        child.wait()
