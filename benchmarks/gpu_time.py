"""Timing GPU work for the benchmarks, one way: calls run back to back between two CUDA events.

What the events measure is the GPU's time for the calls, launch gaps included; the host's own waiting
before the first and after the last is not in it. On a CPU (the benchmarks' smoke runs) it is wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def per_call_ms(fn: Callable[[], object], reps: int, warmup: int = 1, device: str | torch.device = "cuda") -> float:
    """Milliseconds per call of `fn`: `warmup` calls first (lazy initialisations, compiles, caches), then
    `reps` calls timed, on the current CUDA stream of `device` (events) or on the host (a CPU device)."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, not {reps}")
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1000 / reps
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
