"""Where the time went in a torch.profiler timeline (`voiced bench e2e --profile-level N --profile-trace`):
how busy the GPU was (each stream, and any stream), each thread's CPU-side time in CUDA calls that wait
for the GPU, and, for the slowest instances of each engine method the bench marks (the StepTimer's
record_function ranges), what the GPU ran while they lasted: the thread's own kernels, or others'.

    python -m benchmarks.trace_summary trace-grpc-16.json.gz [--top 5] [--json out.json]

It answers one question the step timings cannot: a recognition step that takes 50 ms of wall time for
5 ms of CPU time was waiting, but for what: the GPU busy with the TTS engine's kernels, or the thread
not running at all (the GIL). torch.profiler records the CPU side of the thread that started it only (the
bench starts it on the recognition engine's thread) and the kernels of every stream: kernels whose launch
it did not record count as another thread's."""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# CUDA runtime calls in which a thread waits for the GPU (or for a copy that waits for it).
WAITING_CALLS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy", "cudaEventQuery")


def load(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X" and "dur" in e]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of [lo, hi) the union of `intervals` covers."""
    return union_us([(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi])


def summarize(events: list[dict], top: int = 5) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    cpu = [e for e in events if e.get("cat") not in GPU_CATS]
    if not events:
        return {"window_ms": 0.0}
    lo = min(e["ts"] for e in events)
    hi = max(e["ts"] + e["dur"] for e in events)
    window = hi - lo
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in gpu:
        streams[str(e.get("args", {}).get("stream", e.get("tid")))].append((e["ts"], e["ts"] + e["dur"]))
    all_gpu = [iv for ivs in streams.values() for iv in ivs]
    out: dict = {"window_ms": round(window / 1e3, 1),
                 "gpu_busy": round(union_us(all_gpu) / window, 3) if window else 0.0,
                 "streams": {s: {"busy": round(union_us(ivs) / window, 3), "kernels": len(ivs)}
                             for s, ivs in sorted(streams.items(), key=lambda kv: -len(kv[1]))}}
    # The stream each thread's launches went to (by correlation id), so a range's own kernels are told apart.
    launch_tid = {e["args"]["correlation"]: e.get("tid") for e in cpu
                  if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_tid: dict = defaultdict(list)
    for e in gpu:
        by_tid[launch_tid.get(e.get("args", {}).get("correlation"))].append((e["ts"], e["ts"] + e["dur"]))
    threads: dict = {}
    for tid in sorted({e.get("tid") for e in cpu}, key=str):
        mine = [e for e in cpu if e.get("tid") == tid]
        waits = [e for e in mine if e.get("cat") == "cuda_runtime" and any(w in e["name"] for w in WAITING_CALLS)]
        ranges: dict[str, list[dict]] = defaultdict(list)
        for e in mine:
            if e.get("cat") == "user_annotation" and not e["name"].startswith("ProfilerStep"):
                ranges[e["name"]].append(e)
        ops = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e.get("cat") in ("cpu_op", "cuda_runtime")]
        own_gpu = by_tid.get(tid, [])
        others_gpu = [iv for t, ivs in by_tid.items() if t != tid for iv in ivs]
        entry = {"ops_ms": round(union_us(ops) / 1e3, 1), "gpu_wait_ms": round(sum(e["dur"] for e in waits) / 1e3, 1),
                 "own_kernels_ms": round(union_us(own_gpu) / 1e3, 1), "ranges": {}}
        for name, evs in sorted(ranges.items()):
            durs = sorted(e["dur"] for e in evs)
            slow = []
            for e in sorted(evs, key=lambda e: -e["dur"])[:top]:
                a, b = e["ts"], e["ts"] + e["dur"]
                slow.append({"ms": round(e["dur"] / 1e3, 1),
                             "in_ops_ms": round(overlap_us(ops, a, b) / 1e3, 1),
                             "in_gpu_wait_ms": round(overlap_us([(w["ts"], w["ts"] + w["dur"]) for w in waits], a, b) / 1e3, 1),
                             "own_kernels_ms": round(overlap_us(own_gpu, a, b) / 1e3, 1),
                             "other_kernels_ms": round(overlap_us(others_gpu, a, b) / 1e3, 1)})
            entry["ranges"][name] = {"n": len(evs), "total_ms": round(sum(durs) / 1e3, 1),
                                     "p50_ms": round(durs[len(durs) // 2] / 1e3, 2),
                                     "max_ms": round(durs[-1] / 1e3, 1), "slowest": slow}
        if entry["ranges"] or entry["ops_ms"] > 0.05 * window / 1e3:
            threads[str(tid)] = entry
    out["threads"] = threads
    return out


def gpu_gaps(events: list[dict], top: int = 10, min_us: float = 5.0) -> dict:
    """Where the GPU sat idle within the timeline's window (no kernel, copy or memset on any stream) and
    what the CPU was in then: each gap of at least `min_us` is put down to the innermost marked range
    (record_function) in progress at its middle, and to the CUDA runtime call in progress there (a sync,
    a copy that waits, a launch), if any. For one request's timeline this is the time its latency spends
    off the GPU: host work between launches, and the host's own waits."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)
    if not events:
        return {"idle_ms": 0.0, "by_range": {}, "longest": []}
    lo = min(e["ts"] for e in events)
    hi = max(e["ts"] + e["dur"] for e in events)
    gaps, end = [], lo
    for a, b in gpu:
        if a - end >= min_us:
            gaps.append((end, a))
        end = max(end, b)
    if hi - end >= min_us:
        gaps.append((end, hi))
    ranges = _marked_ranges(events)
    calls = [e for e in events if e.get("cat") == "cuda_runtime"]
    by_range: dict[str, float] = defaultdict(float)
    described = []
    for a, b in gaps:
        mid = (a + b) / 2
        inner = _enclosing(ranges, mid)
        where = inner["name"] if inner else "(no marked range)"
        by_range[where] += b - a
        call = _enclosing(calls, mid)
        described.append({"ms": round((b - a) / 1e3, 3), "at_ms": round((a - lo) / 1e3, 3), "range": where,
                          "call": call["name"] if call else None})
    return {"idle_ms": round(sum(b - a for a, b in gaps) / 1e3, 3),
            "by_range": {k: round(v / 1e3, 3) for k, v in sorted(by_range.items(), key=lambda kv: -kv[1])},
            "longest": sorted(described, key=lambda g: -g["ms"])[:top]}


def host_waits(events: list[dict], top: int = 10, min_us: float = 20.0) -> dict:
    """Where the host waited for the GPU: each CUDA runtime call that waits (WAITING_CALLS) for at least
    `min_us`, put down to the innermost marked range around it and to the outermost operator of that range
    which made it: the call from Python that synchronised, which the runtime call's name does not say (an
    indexed assignment whose value is copied from pageable memory is `aten::index_put_`; a read-back,
    `aten::to` or `aten::_local_scalar_dense`)."""
    ranges, ops = defaultdict(list), defaultdict(list)  # each thread's
    for e in _marked_ranges(events):
        ranges[e.get("tid")].append(e)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e.get("tid")].append(e)
    by_op: dict[str, float] = defaultdict(float)
    described = []
    lo = min((e["ts"] for e in events), default=0.0)
    for w in events:
        if w.get("cat") != "cuda_runtime" or w["dur"] < min_us or not any(c in w["name"] for c in WAITING_CALLS):
            continue
        inner = _enclosing(ranges[w.get("tid")], w["ts"], min)
        since = inner["ts"] if inner else float("-inf")
        op = _enclosing([e for e in ops[w.get("tid")] if e["ts"] >= since], w["ts"], max)
        where = f"{inner['name'] if inner else '(no marked range)'}: {op['name'] if op else w['name']}"
        by_op[where] += w["dur"]
        described.append({"ms": round(w["dur"] / 1e3, 3), "at_ms": round((w["ts"] - lo) / 1e3, 3),
                          "where": where, "call": w["name"]})
    return {"wait_ms": round(sum(by_op.values()) / 1e3, 3),
            "by_op": {k: round(v / 1e3, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "longest": sorted(described, key=lambda d: -d["ms"])[:top]}


def _marked_ranges(events: list[dict]) -> list[dict]:
    """The record_function ranges (the StepTimer's engine parts), without the profiler's own steps."""
    return [e for e in events if e.get("cat") == "user_annotation" and not e["name"].startswith("ProfilerStep")]


def _enclosing(evs: list[dict], t: float, pick=min) -> dict | None:
    """Of the events in progress at `t`, the innermost (`pick` min: the shortest) or the outermost (max)."""
    inside = [e for e in evs if e["ts"] <= t < e["ts"] + e["dur"]]
    return pick(inside, key=lambda e: e["dur"]) if inside else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a Chrome-trace JSON (.json or .json.gz) from torch.profiler")
    ap.add_argument("--top", type=int, default=5, help="slowest instances of each range to break down")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()
    s = summarize(load(args.trace), args.top)
    text = json.dumps(s, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
