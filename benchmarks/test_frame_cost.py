"""`python -m benchmarks.frame_cost`: the daemon's CPU read from /proc, by process and by thread, over a window."""

from __future__ import annotations

import os
import time

from benchmarks.frame_cost import Level, Window, format_table, process_ticks


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_window_counts_the_cpu_the_process_and_its_main_thread_spent_inside_it():
    pid = os.getpid()  # pytest runs the test on the main thread: the one the bench calls the event loop
    ticks = process_ticks(pid)
    with Window(pid, 0.05, 0.55) as window:
        time.sleep(0.1)
        _spin(0.2)  # inside the window: the main thread spends 0.2 s of CPU
        time.sleep(0.6)
    threads = window.per_thread_ns()
    assert window.t[1] - window.t[0] > 0.45
    assert 0.1e9 < threads["event loop"] < 0.3e9
    assert (window.ticks[1] - window.ticks[0]) / os.sysconf("SC_CLK_TCK") >= 0.05
    assert process_ticks(pid) >= ticks


def test_the_table_names_tree_mode_and_callers():
    level = Level(tree="/tmp/old", mode="vad", sessions=16, frames=8000, window_s=10.0, process_us=120.5,
                  loop_us=80.25, threads_us={"event loop": 80.25}, completed=16, errors={}, lateness_p99_ms=2.0,
                  load_avg=1.5)
    row = format_table([level]).splitlines()[1]
    assert row.split()[:3] == ["vad", "16", "/tmp/old"] and "120.5" in row and "80.2" in row
