"""The benchmarks' one timer of GPU work (benchmarks/gpu_time.py), on the host path the CPU smoke runs take."""

from __future__ import annotations

import time

import pytest

from benchmarks.gpu_time import per_call_ms


def test_per_call_time_counts_the_timed_calls_only():
    """Warm-up calls run first and are not timed: 3 warm-ups of 30 ms and 4 timed calls of 10 ms give
    ~10 ms a call (not (90 + 40) / 4), and every call ran."""
    calls = []

    def fn():
        time.sleep(0.03 if len(calls) < 3 else 0.01)
        calls.append(1)

    ms = per_call_ms(fn, 4, warmup=3, device="cpu")
    assert len(calls) == 7
    assert 9.5 <= ms < 25, ms


def test_no_timed_call_is_refused():
    with pytest.raises(ValueError, match="reps"):
        per_call_ms(lambda: None, 0, device="cpu")
