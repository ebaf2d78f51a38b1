"""Prometheus metrics (served on `--metrics-listen` by voiced.doors.http.MetricsListener).

One registry per server so tests can run several servers in a process. Latencies are histograms
in seconds, as Prometheus expects.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_active = Gauge(
            "voiced_sessions_active", "Streaming sessions open now, by front door", ["front"], registry=r
        )
        self.sessions_total = Counter(
            "voiced_sessions_total", "Streaming sessions, by front door and how they ended", ["front", "outcome"],
            registry=r,
        )
        self.utterances_total = Counter("voiced_utterances_total", "Utterances segmented", registry=r)
        self.transcripts_dropped = Counter(
            "voiced_transcripts_dropped_total", "Final transcripts dropped as hallucinations", registry=r
        )
        self.asr_latency = Histogram(
            "voiced_asr_latency_seconds", "End of speech detected to final transcript sent",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.agent_latency = Histogram(
            "voiced_agent_first_text_seconds", "End of speech to the agent's first text",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.tts_first_chunk = Histogram(
            "voiced_tts_first_chunk_seconds", "Reply text handed to TTS to its first audio chunk",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.voice_to_voice = Histogram(
            "voiced_voice_to_voice_seconds", "End of speech detected to the first reply audio sent",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        # Smart turn detection: where the time between the short pause and the end of a turn goes.
        self.turn_decode = Histogram(
            "voiced_turn_decode_seconds", "Short pause noticed to its transcript ready (the words the end-of-turn "
            "rule reads)", buckets=LATENCY_BUCKETS, registry=r,
        )
        self.turn_decision = Histogram(
            "voiced_turn_decision_seconds", "End-of-turn evidence ready (transcript and audio model) to the turn "
            "ended: the rule's own wait", buckets=LATENCY_BUCKETS, registry=r,
        )
        self.barge_ins = Counter("voiced_barge_ins_total", "Replies interrupted by the caller", registry=r)
        self.engine_active = Gauge(
            "voiced_engine_active_requests", "Requests queued or in a batch slot", ["engine"], registry=r
        )
        self.engine_pending = Gauge(
            "voiced_engine_pending_requests", "Requests sessions are waiting on", ["engine"], registry=r
        )
        self.errors = Counter(
            "voiced_errors_total", "Errors returned to callers, by front door and code", ["front", "code"], registry=r
        )
        # What a leak would grow: watched by operators and by the soak (voiced.bench.soak).
        self.asyncio_tasks = Gauge("voiced_asyncio_tasks", "asyncio tasks alive in the daemon's event loop",
                                   registry=r)
        self.threads = Gauge("voiced_threads", "Python threads alive in the daemon", registry=r)
        self.threads.set_function(threading.active_count)
        # Free C-heap memory the engine thread hands back when quiet after a wide batch (voiced.heap).
        self.heap_returned = Counter("voiced_heap_returned_bytes_total",
                                     "Resident memory handed back to the OS by heap trims", registry=r)
        self.heap_trim = Histogram("voiced_heap_trim_seconds", "How long each heap trim took",
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.gpu_memory = gpu_memory_readings  # (device, kind, bytes) at each scrape
        r.register(GpuMemoryCollector(self))

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count the tasks of the daemon's event loop at each scrape."""
        self.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

    def observe_engine(self, name: str, engine) -> None:
        self.engine_active.labels(name).set(engine.active_requests())

    def observe_heap_release(self, release) -> None:
        """A `voiced.heap.Release`; RSS can rise meanwhile (other threads allocate): counted as none."""
        self.heap_returned.inc(max(0, release.returned))
        self.heap_trim.observe(release.seconds)


class GpuMemoryCollector:
    """`voiced_gpu_memory_bytes{device, kind}`: what PyTorch's caching allocator holds, read at scrape
    time (`gpu_memory_readings`, or what `Metrics.gpu_memory` is set to: the engine process's readings
    where the engines run in one, voiced.engine_process). kind: allocated (tensors alive now),
    peak_allocated (the most allocated at once since the allocator's peak was last reset: the TTS warm-up
    resets it after each of its phases, which it logs, so while serving this is the peak since warm-up),
    reserved (held from the driver, cached blocks included)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        try:
            readings = self.metrics.gpu_memory()
        except Exception as e:  # the engine process is gone: a scrape still answers, without these
            log.warning("no GPU memory readings: %s", e)
            return
        if not readings:
            return
        g = GaugeMetricFamily("voiced_gpu_memory_bytes", "GPU memory held by PyTorch's caching allocator",
                              labels=["device", "kind"])
        for device, kind, value in readings:
            g.add_metric([device, kind], value)
        yield g


def gpu_memory_readings() -> list[tuple[str, str, int]]:
    """(device, kind, bytes) of this process's CUDA devices, once an engine brought torch and CUDA up:
    a daemon on the CPU never imports torch for this."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        d = f"cuda:{i}"
        out += [(d, "allocated", torch.cuda.memory_allocated(i)), (d, "peak_allocated", torch.cuda.max_memory_allocated(i)),
                (d, "reserved", torch.cuda.memory_reserved(i))]
    return out
