"""benchmarks.trace_summary: what a profile's timeline says about the GPU and each thread's waits."""

import gzip
import json
import threading

import torch

from benchmarks.trace_summary import gpu_gaps, host_waits, load, overlap_us, summarize, union_us


def test_union_and_overlap_count_shared_time_once():
    assert union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_us([(0, 30), (5, 10)]) == 30
    assert overlap_us([(0, 10), (5, 15), (20, 30)], 8, 25) == 12


def test_the_gpus_idle_time_is_put_down_to_the_host_range_and_call_in_progress():
    """One request's 10 ms: the encoder kernel (0-5 ms), then 1 ms idle while the host chooses a token
    after a sync, a chunk of steps (6-9 ms) with 0.5 ms of launch gaps in it, then 1 ms idle at the end;
    gaps shorter than the threshold (a kernel boundary) are not idle time."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "_admit", "tid": 1, "ts": 0, "dur": 6_000},
        {"ph": "X", "cat": "user_annotation", "name": "_select", "tid": 1, "ts": 5_000, "dur": 1_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "tid": 1, "ts": 4_900, "dur": 300},
        {"ph": "X", "cat": "user_annotation", "name": "_greedy_chunk", "tid": 1, "ts": 6_000, "dur": 4_000},
        {"ph": "X", "cat": "kernel", "name": "encoder", "tid": 7, "ts": 0, "dur": 5_000},
        {"ph": "X", "cat": "kernel", "name": "step", "tid": 7, "ts": 6_000, "dur": 1_000},
        {"ph": "X", "cat": "kernel", "name": "step", "tid": 7, "ts": 7_002, "dur": 998},  # a 2 us boundary
        {"ph": "X", "cat": "kernel", "name": "step", "tid": 7, "ts": 8_500, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "_finish", "tid": 1, "ts": 9_000, "dur": 1_000},
    ]
    g = gpu_gaps(ev, top=2)
    assert g["idle_ms"] == 2.5
    assert g["by_range"] == {"_select": 1.0, "_finish": 1.0, "_greedy_chunk": 0.5}
    assert g["longest"][0] == {"ms": 1.0, "at_ms": 5.0, "range": "_select", "call": None}
    assert [x["range"] for x in g["longest"]] == ["_select", "_finish"]


def test_each_host_wait_is_put_down_to_the_operator_that_made_it():
    """An admission's token choice: an indexed assignment copies its value from pageable memory and waits
    5 ms for the encoder inside `aten::index_put_`; the read-back after it waits 0.01 ms (under the 20 us
    threshold); a chunk's read-back waits 2 ms inside `aten::to`. Another thread's wait is its own; an event
    query that returns at once is no wait."""
    op = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur}
    rt = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": ts, "dur": dur}
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "_admit", "tid": 1, "ts": 0, "dur": 12_000},
        {"ph": "X", "cat": "user_annotation", "name": "_select", "tid": 1, "ts": 1_000, "dur": 6_000},
        op("aten::index_put_", 1_100, 5_200), op("aten::to", 1_150, 5_100), op("aten::copy_", 1_160, 5_080),
        rt("cudaMemcpyAsync", 1_170, 10), rt("cudaStreamSynchronize", 1_190, 5_000),
        op("aten::to", 6_500, 30), rt("cudaMemcpyAsync", 6_510, 10),
        {"ph": "X", "cat": "user_annotation", "name": "_greedy_chunk", "tid": 1, "ts": 8_000, "dur": 3_000},
        op("aten::to", 8_100, 2_100), op("aten::copy_", 8_110, 2_080), rt("cudaMemcpyAsync", 8_120, 2_000),
        rt("cudaEventQuery", 10_500, 3),
        op("aten::to", 3_000, 1_000, tid=2), rt("cudaStreamSynchronize", 3_100, 800, tid=2),
    ]
    w = host_waits(ev, top=2)
    assert w["by_op"] == {"_select: aten::index_put_": 5.0, "_greedy_chunk: aten::to": 2.0,
                          "(no marked range): aten::to": 0.8}
    assert w["wait_ms"] == 7.8
    assert w["longest"] == [
        {"ms": 5.0, "at_ms": 1.19, "where": "_select: aten::index_put_", "call": "cudaStreamSynchronize"},
        {"ms": 2.0, "at_ms": 8.12, "where": "_greedy_chunk: aten::to", "call": "cudaMemcpyAsync"}]


def test_a_range_waiting_on_another_threads_kernels_is_told_apart(tmp_path):
    """Thread 1's range lasts 10 ms: 1 ms launching its own kernel, 8 ms in a stream sync while the
    GPU runs thread 2's kernels on another stream."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "_admit", "tid": 1, "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 100, "dur": 900,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": 1, "ts": 1_500, "dur": 8_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 2, "ts": 0, "dur": 50,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "vocoder", "tid": 9, "ts": 200, "dur": 8_800,
         "args": {"stream": 9, "correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "encoder", "tid": 7, "ts": 9_000, "dur": 500,
         "args": {"stream": 7, "correlation": 1}},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = summarize(load(path))
    assert s["window_ms"] == 10.0 and s["gpu_busy"] == 0.93
    assert s["streams"]["9"]["busy"] == 0.88
    slow = s["threads"]["1"]["ranges"]["_admit"]["slowest"][0]
    assert slow["ms"] == 10.0 and slow["in_gpu_wait_ms"] == 8.0
    assert slow["own_kernels_ms"] == 0.5 and slow["other_kernels_ms"] == 8.8


def test_reads_a_real_profilers_timeline_of_two_threads(tmp_path):
    """torch.profiler's own Chrome trace (CPU here): the marked ranges of the thread that started it are
    found and counted (it records no other thread's CPU side, which the summary says)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def work(name, n):
        for _ in range(n):
            with record_function(name):
                torch.ones(64, 64) @ torch.ones(64, 64)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work("_admit", 3)
        t = threading.Thread(target=work, args=("_vocode", 2))
        t.start()
        t.join()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    s = summarize(load(path))
    found = {name: r["n"] for th in s["threads"].values() for name, r in th["ranges"].items()}
    assert found.get("_admit") == 3
    assert s["gpu_busy"] == 0.0
