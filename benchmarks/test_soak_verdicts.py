"""The soaks' verdicts (voiced bench soak, benchmarks/gpu_soak.py): one set of process checks, so a leak
either soak sees is judged the same way by both."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.gpu_soak import GpuSample, GpuSoakReport
from voiced.bench.soak import Sample, SoakReport


def cpu_report(change=lambda warm: {}) -> SoakReport:
    warm = Sample("after warm-up", 10, rss_mb=500.0, fds=40, threads=12, tasks=8, active_sessions=0, t=0.0,
                  thread_names={"engine": 1, "asyncio": 4})
    end = dataclasses.replace(warm, label="end", sessions_done=200, t=60.0, **change(warm))
    r = SoakReport(command=["soak"], sequential_planned=100, sequential_completed=100, concurrent=4,
                   concurrent_completed=4, warmup_concurrent_completed=4, samples=[warm, end])
    r.judge()
    return r


def gpu_report(change=lambda warm: {}) -> GpuSoakReport:
    warm = GpuSample("after warm-up", 0.0, rss_mb=2000.0, fds=60, threads=30, tasks=9, active_sessions=0,
                     gpu_allocated_mb=3000.0, gpu_reserved_mb=5000.0, thread_names={"engine": 1})
    end = dataclasses.replace(warm, label="end", t_s=600.0, **change(warm))
    r = GpuSoakReport(command=["gpu-soak"], warmup={"completed": 8, "sessions": 8},
                      soak={"completed": 500, "sessions": 500}, samples=[warm, end])
    r.judge()
    return r


def missed(report) -> list[str]:
    return [k for k, v in report.verdicts.items() if not v.startswith("met")]


def test_a_clean_run_meets_every_verdict():
    assert missed(cpu_report()) == [] and missed(gpu_report()) == []


@pytest.mark.parametrize("change,verdict", [
    (lambda w: {"rss_mb": w.rss_mb + 75}, "RSS growth after warm-up < 50 MB"),
    (lambda w: {"tasks": w.tasks + 3}, "no leaked asyncio tasks"),
    (lambda w: {"threads": w.threads + 2, "thread_names": {**w.thread_names, "stray": 2}}, "no leaked threads"),
    (lambda w: {"fds": w.fds + 5}, "no leaked descriptors"),
    (lambda w: {"active_sessions": 1}, "no session left open"),
])
def test_both_soaks_name_the_same_leak(change, verdict):
    assert missed(cpu_report(change)) == [verdict]
    assert missed(gpu_report(change)) == [verdict]


def test_the_gpu_soak_also_judges_gpu_memory():
    assert missed(gpu_report(lambda w: {"gpu_allocated_mb": w.gpu_allocated_mb + 100})) == [
        "GPU memory allocated back to the baseline (within 16 MB)"]
