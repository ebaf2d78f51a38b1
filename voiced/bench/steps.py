"""Timing of engine steps for the benchmarks: how long each step took and, for slow ones, which of
the engine's methods the time went to."""

from __future__ import annotations

import statistics
import time


def pct(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 1)

    return {"n": len(v), "p50": q(50), "p90": q(90), "p95": q(95), "p99": q(99),
            "mean": round(statistics.fmean(v), 1)}


class StepTimer:
    """Wraps an engine's `step` to record how long each one takes (a slow step delays every caller),
    and, for a step over `slow_ms`, where its time went: the engine methods named in `parts`, timed too."""

    def __init__(self, engine, parts: tuple[str, ...], slow_ms: float = 50.0):
        self.step, self.durations, self.slow, self.slow_ms = engine.step, [], [], slow_ms
        self._parts: dict[str, tuple[float, float]] = {}
        self._last_end = 0.0
        self._wrapped: list[tuple[object, str]] = []
        for name in parts:  # "method" of the engine, or "attr.method" of something it holds
            *path, attr = name.split(".")
            owner = engine
            for p in path:
                owner = getattr(owner, p, None)
            if owner is not None and hasattr(owner, attr):
                setattr(owner, attr, self._timed(name, getattr(owner, attr)))
                self._wrapped.append((owner, attr))

    def _timed(self, name: str, fn):
        from torch.profiler import record_function  # a named range in a profile (e2e_bench --profile-level)

        def run(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                with record_function(name):
                    return fn(*a, **kw)
            finally:
                wall, cpu = self._parts.get(name, (0.0, 0.0))
                self._parts[name] = (wall + (time.perf_counter() - t0) * 1e3, cpu + (time.thread_time() - c0) * 1e3)
        return run

    def __call__(self):
        # Wall and this thread's CPU time, per part: CPU ~ wall is work (or CUDA's spin-wait on the
        # GPU); CPU << wall is the thread not running, e.g. waiting for the GIL. `gap_ms`: how long
        # the engine was idle before the step.
        self._parts = {}
        t0, c0 = time.perf_counter(), time.thread_time()
        gap = (t0 - self._last_end) * 1e3 if self._last_end else 0.0
        try:
            return self.step()
        finally:
            end = time.perf_counter()
            ms = (end - t0) * 1e3
            self._last_end = end
            self.durations.append(ms)
            if ms > self.slow_ms:
                entry = {"ms": round(ms, 1), "cpu_ms": round((time.thread_time() - c0) * 1e3, 1),
                         "gap_ms": round(gap, 1)}
                for k, (wall, cpu) in self._parts.items():
                    entry[k] = [round(wall, 1), round(cpu, 1)]
                self.slow.append(entry)

    def remove(self) -> None:
        """Put the engine's own methods back."""
        for owner, attr in self._wrapped:
            owner.__dict__.pop(attr, None)

    def take(self) -> dict:
        d, slow, self.durations, self.slow = self.durations, self.slow, [], []
        return {**pct(d), "max": round(max(d), 1) if d else 0.0, "slow": slow}


# What the timers break a slow step into (methods of WhisperEngine / SparkTTSEngine; a capture or a
# compile while serving shows up as its own entry).
STEP_PARTS = {"asr": ("_admit", "_encode_into_cache", "_encode_bucket", "model.decoder.prefill", "steps.graphs.capture",
                      "fast_encoder.graphs.capture", "steps.run", "_select", "_greedy_chunk", "_finish"),
              "tts": ("_admit", "_prefill_step", "_prefill_fresh", "lm.prefill_many", "_load_state", "_advance",
                      "_decode_step", "_vocode")}
