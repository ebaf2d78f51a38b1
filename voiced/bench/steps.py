"""Timing of engine steps for the benchmarks: how long each step took and, for slow ones, which of
the engine's methods the time went to."""

from __future__ import annotations

import contextlib
import inspect
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
    """Wraps an engine's `step` (and `step_parts`, which an overlapping engine thread runs instead) to
    record how long each step takes (a slow step delays every caller), and, for a step over `slow_ms`,
    where its time went: the engine methods named in `parts`, timed too.

    Wall and this thread's CPU time, per part: CPU ~ wall is work (or CUDA's spin-wait on the GPU);
    CPU << wall is the thread not running, e.g. waiting for the GIL. A step run in parts counts its wall
    time from its launch to its last read-back and only its own parts' CPU time (between them the thread
    serves the other engine). `gap_ms`: how long the engine was idle before the step."""

    def __init__(self, engine, parts: tuple[str, ...], slow_ms: float = 50.0):
        self.step, self.durations, self.slow, self.slow_ms = engine.step, [], [], slow_ms
        self.cpu_ms = 0.0
        self._parts: dict[str, tuple[float, float]] = {}
        self._last_end = 0.0
        self._in_step = False
        self._wrapped: list[tuple[object, str]] = []
        self.step_parts = getattr(engine, "step_parts", None)
        if self.step_parts is not None:
            engine.step_parts = self._parts_call
            self._wrapped.append((engine, "step_parts"))
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

        def add(wall: float, cpu: float) -> None:
            w, c = self._parts.get(name, (0.0, 0.0))
            self._parts[name] = (w + wall, c + cpu)

        if inspect.isgeneratorfunction(fn):  # a part that yields (step_parts): timed across its resumes
            return lambda *a, **kw: _resumes_timed(fn(*a, **kw), add, lambda: record_function(name))

        def run(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                with record_function(name):
                    return fn(*a, **kw)
            finally:
                add((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3)
        return run

    def _begin(self) -> float:
        self._parts = {}
        t0 = time.perf_counter()
        return (t0 - self._last_end) * 1e3 if self._last_end else 0.0

    def _record(self, wall_ms: float, cpu_ms: float, gap_ms: float) -> None:
        self._last_end = time.perf_counter()
        self.durations.append(wall_ms)
        self.cpu_ms += cpu_ms
        if wall_ms > self.slow_ms:
            entry = {"ms": round(wall_ms, 1), "cpu_ms": round(cpu_ms, 1), "gap_ms": round(gap_ms, 1)}
            for k, (wall, cpu) in self._parts.items():
                entry[k] = [round(wall, 1), round(cpu, 1)]
            self.slow.append(entry)

    def __call__(self):
        gap = self._begin()
        t0, c0 = time.perf_counter(), time.thread_time()
        self._in_step = True
        try:
            return self.step()
        finally:
            self._in_step = False
            self._record((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3, gap)

    def _parts_call(self):
        if self._in_step:  # `step` runs its own parts: timed once, as the step
            return self.step_parts()
        gap = self._begin()
        return _resumes_timed(self.step_parts(), lambda wall, cpu: self._record(wall, cpu, gap))

    def remove(self) -> None:
        """Put the engine's own methods back."""
        for owner, attr in self._wrapped:
            owner.__dict__.pop(attr, None)

    def take(self) -> dict:
        d, slow, self.durations, self.slow = self.durations, self.slow, [], []
        cpu, self.cpu_ms = self.cpu_ms, 0.0
        # cpu_s: this engine's thread CPU in its own steps (a step that yields: in its own resumes only;
        # a wait on the GPU spins, so it counts too), what the engine costs the thread both engines share
        return {**pct(d), "max": round(max(d), 1) if d else 0.0, "cpu_s": round(cpu / 1e3, 2), "slow": slow}


def _resumes_timed(parts, record, mark=contextlib.nullcontext):
    """Run a generator's parts as they are asked for; at the end, `record(wall_ms, cpu_ms)`: wall from
    the first resume to the last, CPU of this thread during its own resumes only. Each resume runs inside
    `mark()` (a part's named range in a profile: one range per resume, since across its yields the thread
    may run another engine's parts, which a range spanning them would wrongly contain)."""
    t0, cpu = time.perf_counter(), 0.0
    try:
        while True:
            c0 = time.thread_time()
            try:
                with mark():
                    next(parts)
            except StopIteration as done:
                return done.value
            finally:
                cpu += time.thread_time() - c0
            yield
    finally:
        record((time.perf_counter() - t0) * 1e3, cpu * 1e3)


class RequestTimer:
    """How long a worker holds each request: from its submission to this worker (`_submit`) to its final
    output or error (`_deliver`). On an engine process's worker that is the command queue and the engine
    (asr_engine_ms); on the daemon's side of the pipe (RemoteWorker), the pipe both ways besides
    (asr_worker_ms). Beside the session's figure (from the end of speech), the rest is the event loop.
    Where the worker's engine admits requests into batch rows (`_give_rows`: WhisperEngine, SparkTTSEngine),
    the engine's share is split into the wait for a row and the time in one (`take`'s "queue_ms" and
    "held_ms", and its slowest requests): a wait for a row means every row was taken."""

    def __init__(self, worker):
        self.requests: list[tuple[float, float | None, int, float]] = []  # (total, queued, tokens, submitted)
        self._since = time.perf_counter()  # the last `take`: the level's start
        self._start: dict[int, float] = {}
        self._admitted: dict[int, float] = {}
        submit, cancel, deliver = worker._submit, worker._cancel, worker._deliver

        def timed_submit(request_id: int, request) -> None:
            self._start[request_id] = time.perf_counter()
            submit(request_id, request)

        def timed_cancel(request_id: int) -> None:
            self._start.pop(request_id, None)
            self._admitted.pop(request_id, None)
            cancel(request_id)

        def timed_deliver(out) -> None:
            if out.final or out.error is not None:
                t0 = self._start.pop(out.request_id, None)
                admitted = self._admitted.pop(out.request_id, None)
                if t0 is not None:
                    now = time.perf_counter()
                    queued = None if admitted is None else (admitted - t0) * 1e3
                    tokens = getattr(out.value, "tokens", None) or ()  # a transcript's ids; a reply's count
                    tokens = tokens if isinstance(tokens, int) else len(tokens)
                    self.requests.append(((now - t0) * 1e3, queued, tokens, t0 - self._since))
            deliver(out)

        worker._submit, worker._cancel, worker._deliver = timed_submit, timed_cancel, timed_deliver
        give_rows = getattr(worker.engine, "_give_rows", None)
        if give_rows is not None:
            def timed_give_rows(chosen):
                now = time.perf_counter()
                for req in chosen:
                    if req.rid in self._start:
                        self._admitted.setdefault(req.rid, now)
                return give_rows(chosen)
            worker.engine._give_rows = timed_give_rows

    def take(self) -> dict:
        reqs, self.requests = self.requests, []
        self._since = time.perf_counter()
        out = pct([t for t, _, _, _ in reqs])
        if reqs and any(q is not None for _, q, _, _ in reqs):
            queued = [(t, t if q is None else q, n, at) for t, q, n, at in reqs]  # never admitted: all queue
            out["queue_ms"] = pct([q for _, q, _, _ in queued])
            out["held_ms"] = pct([t - q for t, q, _, _ in queued])
            out["slowest"] = [{"ms": round(t, 1), "queued_ms": round(q, 1), "tokens": n, "at_s": round(at, 2)}
                              for t, q, n, at in sorted(queued, reverse=True)[:8]]
            # When in the level the slow ones (over twice the median) were submitted: a burst at the level's
            # start or end (every caller connecting or hanging up at once) or all through it.
            out["slow_at_s"] = pct([at for t, _, _, at in queued if t > 2 * out["p50"]])
        return out


class LoopLag:
    """How late the daemon's event loop runs a callback due every `every_s` (every caller's frames wait
    that long too): `start` on the loop's thread, `take` the level's lateness and when its worst was."""

    def __init__(self, loop, every_s: float = 0.01):
        self.loop, self.every_s = loop, every_s
        self.lags: list[tuple[float, float]] = []  # (seconds into the level, ms late)
        self._since = time.perf_counter()

    def start(self) -> None:
        self.loop.call_soon_threadsafe(self._arm, time.perf_counter() + self.every_s)

    def _arm(self, due: float) -> None:
        self.loop.call_later(max(0.0, due - time.perf_counter()), self._tick, due)

    def _tick(self, due: float) -> None:
        now = time.perf_counter()
        self.lags.append((due - self._since, (now - due) * 1e3))
        self._arm(max(due + self.every_s, now))

    def take(self) -> dict:
        lags, self.lags = self.lags, []
        self._since = time.perf_counter()
        out = pct([ms for _, ms in lags])
        if lags:
            at, worst = max(lags, key=lambda x: x[1])
            out.update(max=round(worst, 1), max_at_s=round(at, 2))
        return out


# What the timers break a slow step into (methods of WhisperEngine / SparkTTSEngine; a capture or a
# compile while serving shows up as its own entry).
STEP_PARTS = {"asr": ("_admit", "admission._audio", "admission._prefill", "admission._encode_into_cache",
                      "fast_encoder.run", "model.decoder.prefill", "steps.graphs.capture", "fast_encoder.graphs.capture",
                      "steps.run", "_select", "_greedy_chunk", "_finish"),
              "tts": ("_admit", "_prefill_step", "_prefill_fresh", "lm.prefill_many", "_load_state", "_advance",
                      "_decode_step", "_vocode")}
