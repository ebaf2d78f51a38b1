"""GPU soak: many concurrent Converse callers for minutes against one daemon on one GPU.

    python -m benchmarks.gpu_soak --wav .devdata/speech.wav --tiktoken-dir .devdata --callers 64 \
        --minutes 10 --out gpu-soak.json

The daemon is the end-to-end benchmark's (`voiced.bench.bench_daemon.start_server`: `voiced serve`'s
server, sessions, schedulers and engines, the engines in a process of their own on a GPU as `voiced serve`
runs them (`--engine-process`), random full-size weights of Whisper large-v3-turbo and Spark-TTS-0.5B,
forced transcript and reply lengths, the echo agent). The callers
run in a child process: each one calls Converse sessions back to back, `--session-seconds` each,
streaming the WAV in real time as 20 ms frames from its own point of the loop and reading every reply,
until the time is up. Phases:

1. warm-up: the same callers for `--warmup-seconds`; then, idle, the baseline sample;
2. soak: the callers for `--minutes`, the daemon sampled every `--sample-every` seconds;
3. idle again: the last sample.

"Idle" is no session open and the heap trimmed after the callers' last batch (voiced.heap; up to
30 s waited for it).

Each sample: resident memory, open descriptors and OS threads (the daemon's process and its engine
process together), asyncio tasks of the daemon's loop, sessions open, and what PyTorch's allocator holds on
the GPU (read where the engines run, as the daemon's metrics read it). Per minute of the soak: sessions completed, errors,
and voice-to-voice as the callers hear it (e2e_bench's clock). Judged as the CPU soak is
(`voiced.bench.soak`), plus: GPU memory allocated back to the baseline once idle.

`--tiny-cpu` runs the same thing on the CPU with tiny random models: a dry run of the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from voiced.bench.soak import _verdict, process_figures, process_verdicts, thread_names
from voiced.bench.steps import pct

log = logging.getLogger("benchmarks.gpu_soak")

GPU_GROWTH_LIMIT_MB = 16.0  # allocated (not reserved) memory of an idle daemon: caches are fixed at start


@dataclass
class GpuSample:
    label: str
    t_s: float  # since the soak phase began (negative: before it)
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    active_sessions: int
    gpu_allocated_mb: float
    gpu_reserved_mb: float
    thread_names: dict[str, int] = field(default_factory=dict)


@dataclass
class GpuSoakReport:
    command: list[str]
    machine: dict = field(default_factory=dict)
    callers: int = 0
    minutes: float = 0.0
    session_seconds: float = 0.0
    warmup: dict = field(default_factory=dict)  # the warm-up's caller report
    soak: dict = field(default_factory=dict)  # the soak's caller report
    samples: list[GpuSample] = field(default_factory=list)
    daemon_outcomes: dict[str, int] = field(default_factory=dict)  # voiced_sessions_total by outcome
    heap_trims: dict = field(default_factory=dict)  # the daemon's heap trims (voiced.heap): count, MB, ms
    verdicts: dict[str, str] = field(default_factory=dict)

    def judge(self) -> None:
        warm = next(s for s in self.samples if s.label == "after warm-up")
        end = self.samples[-1]
        completed, sessions = self.soak.get("completed", 0), self.soak.get("sessions", 0)
        gpu_growth = end.gpu_allocated_mb - warm.gpu_allocated_mb
        self.verdicts = {
            "every session completed": _verdict(
                sessions > 0 and completed == sessions and self.warmup.get("completed") == self.warmup.get("sessions"),
                f"{completed}/{sessions} in the soak, {self.warmup.get('completed')}/{self.warmup.get('sessions')} "
                f"in the warm-up, errors {self.soak.get('errors') or 'none'}"),
            **process_verdicts(warm, end),
            f"GPU memory allocated back to the baseline (within {GPU_GROWTH_LIMIT_MB:.0f} MB)": _verdict(
                gpu_growth < GPU_GROWTH_LIMIT_MB,
                f"{warm.gpu_allocated_mb:.1f} -> {end.gpu_allocated_mb:.1f} MB ({gpu_growth:+.1f}); reserved "
                f"{warm.gpu_reserved_mb:.0f} -> {end.gpu_reserved_mb:.0f} MB"),
        }

    def format(self) -> str:
        lines = [f"{'sample':<22}{'t s':>7}{'RSS MB':>9}{'fds':>6}{'threads':>8}{'tasks':>7}{'open':>6}"
                 f"{'GPU alloc MB':>13}{'reserved':>10}"]
        for s in self.samples:
            lines.append(f"{s.label:<22}{s.t_s:>7.0f}{s.rss_mb:>9.1f}{s.fds:>6}{s.threads:>8}{s.tasks:>7}"
                         f"{s.active_sessions:>6}{s.gpu_allocated_mb:>13.1f}{s.gpu_reserved_mb:>10.0f}")
        for m in self.soak.get("minutes", []):
            lines.append(f"minute {m['minute']}: {m['completed']} sessions completed, errors {m['errors'] or 'none'}, "
                         f"voice-to-voice {m['v2v_client_ms']}")
        lines.append(f"heap trims: {self.heap_trims}")
        lines += [f"{v:<5} {k}" for k, v in self.verdicts.items()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- callers (child process)


async def soak_callers(address: str, wav: Path, callers: int, seconds: float, session_s: float,
                       reply_s: float) -> dict:
    """`callers` callers, each calling Converse sessions of `session_s` back to back for `seconds`."""
    import grpc
    from voiced_client.wavio import read_wav

    from voiced.bench.e2e_bench import one_caller

    samples, rate = read_wav(wav)
    if rate != 16000:
        raise SystemExit("the soak WAV must be 16 kHz")
    pcm = samples.astype("<i2").tobytes()
    n_frames = len(pcm) // 640
    keys = ("asr_ms", "agent_ms", "first_audio_ms", "tts_first_chunk_ms", "rtf", "late_ms", "notices",
            "v2v_client_ms", "asr_client_ms", "unmatched_replies")
    minutes: dict[int, dict] = {}
    t0 = time.monotonic()
    end = t0 + seconds

    def minute(now: float) -> dict:
        m = int((now - t0) // 60)
        if m not in minutes:
            minutes[m] = {"completed": 0, "errors": Counter(), "out": {k: [] for k in keys}}
        return minutes[m]

    async def caller(k: int) -> None:
        start = (n_frames * k) // callers
        seed = k
        while (left := end - time.monotonic()) > 1.0:
            bucket = minute(time.monotonic())
            try:
                await one_caller(address, pcm, start, min(session_s, left), reply_s, seed, bucket["out"])
                bucket["completed"] += 1
            except grpc.aio.AioRpcError as e:
                bucket["errors"][e.code().name] += 1
                log.warning("caller %d: %s: %s", k, e.code().name, e.details())
            except Exception as e:  # noqa: BLE001 - counted and reported, not fatal to the other callers
                bucket["errors"][type(e).__name__] += 1
                log.warning("caller %d: %r", k, e)
            start += int(session_s / 0.02)
            seed += callers

    await asyncio.gather(*(caller(k) for k in range(callers)))
    report = {"sessions": 0, "completed": 0, "errors": Counter(), "minutes": [],
              "wall_s": round(time.monotonic() - t0, 1)}
    every = {k: [] for k in keys}
    for m in sorted(minutes):
        b = minutes[m]
        sessions = b["completed"] + sum(b["errors"].values())
        report["sessions"] += sessions
        report["completed"] += b["completed"]
        report["errors"].update(b["errors"])
        for k in keys:
            every[k] += b["out"][k]
        report["minutes"].append({"minute": m, "sessions": sessions, "completed": b["completed"],
                                  "errors": dict(b["errors"]), "v2v_client_ms": pct(b["out"]["v2v_client_ms"]),
                                  "asr_ms": pct(b["out"]["asr_ms"])})
    report["errors"] = dict(report["errors"])
    report.update({k: pct(every[k]) for k in ("v2v_client_ms", "asr_ms", "first_audio_ms", "tts_first_chunk_ms",
                                              "rtf", "late_ms")})
    report["notices"] = dict(Counter(every["notices"]))
    report["unmatched_replies"] = len(every["unmatched_replies"])
    return report


# ----------------------------------------------------------------------------------- daemon side


class Sampler:
    """Samples the daemon (its process and its engines' own, where they run in one) on a thread while the
    callers run."""

    def __init__(self, server, loop, tiny_cpu: bool):
        self.server, self.loop, self.tiny_cpu = server, loop, tiny_cpu
        self.t0 = time.monotonic()

    def sample(self, label: str) -> GpuSample:
        pids = ["self", *self.server.engine_pids]
        figures = [process_figures(pid) for pid in pids]
        rss_mb, fds, threads = (sum(f[i] for f in figures) for i in range(3))
        names: Counter = Counter()
        for pid in pids:
            names.update({(n if pid == "self" else f"engines:{n}"): k for n, k in thread_names(pid).items()})

        async def count_tasks() -> int:
            return len(asyncio.all_tasks())

        tasks = asyncio.run_coroutine_threadsafe(count_tasks(), self.loop).result(30) - 1  # not this one
        active = 0.0
        for metric in self.server.services.metrics.registry.collect():
            if metric.name == "voiced_sessions_active":
                active = sum(s.value for s in metric.samples)
        gpu = {kind: n for _, kind, n in self.server.services.metrics.gpu_memory()}  # where the engines run
        alloc, reserved = gpu.get("allocated", 0) / 2**20, gpu.get("reserved", 0) / 2**20
        s = GpuSample(label, round(time.monotonic() - self.t0, 1), round(rss_mb, 1), fds, threads, tasks, int(active),
                      round(alloc, 1), round(reserved, 1), dict(sorted(names.items())))
        log.info("%s", s)
        return s

    def outcomes(self) -> dict[str, int]:
        out: Counter = Counter()
        for metric in self.server.services.metrics.registry.collect():
            if metric.name == "voiced_sessions":
                for s in metric.samples:
                    if s.name == "voiced_sessions_total":
                        out[s.labels["outcome"]] += int(s.value)
        return dict(out)

    def heap_trims(self) -> dict:
        r = self.server.services.metrics.registry
        trims = self.trims()
        return {"trims": trims, "returned_mb": round((r.get_sample_value("voiced_heap_returned_bytes_total") or 0) / 2**20, 1),
                "mean_ms": round(1000 * r.get_sample_value("voiced_heap_trim_seconds_sum") / trims, 2) if trims else None}

    def trims(self) -> int:
        """Heap trims so far (voiced.heap: the engine thread's, once quiet after a wide batch)."""
        return int(self.server.services.metrics.registry.get_sample_value("voiced_heap_trim_seconds_count") or 0)

    def wait_idle(self, trims_before: int, timeout: float = 120) -> None:
        """No session open, and the heap trimmed since the callers finished (or 30 s given up waiting)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sample("waiting for idle").active_sessions == 0:
                break
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while self.trims() <= trims_before and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # let the last calls' tasks unwind before counting


def run_callers(args, address: str, seconds: float, sampler: Sampler | None, samples: list) -> dict:
    """The callers in a child process; samples the daemon every --sample-every seconds meanwhile."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_soak", "--wav", str(args.wav), "--tiktoken-dir",
           str(args.tiktoken_dir), "--callers", str(args.callers), "--session-seconds", str(args.session_seconds),
           "--reply-seconds", str(args.reply_seconds), "--caller", f"{address}@{seconds}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    next_at = time.monotonic() + args.sample_every
    while proc.poll() is None:
        time.sleep(0.5)
        if sampler is not None and time.monotonic() >= next_at:
            samples.append(sampler.sample("serving"))
            next_at += args.sample_every
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"the callers exited with {proc.returncode}")
    return json.loads(stdout[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wav", type=Path, required=True, help="16 kHz speech with pauses (looped by every caller)")
    ap.add_argument("--tiktoken-dir", type=Path, required=True, help="folder holding multilingual.tiktoken")
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--session-seconds", type=float, default=60.0, help="length of each caller's sessions")
    ap.add_argument("--warmup-seconds", type=float, default=30.0)
    ap.add_argument("--sample-every", type=float, default=30.0)
    ap.add_argument("--reply-seconds", type=float, default=2.0, help="forced reply length (random weights)")
    ap.add_argument("--asr-dims", default="large-v3-turbo")
    ap.add_argument("--asr-tokens", type=int, default=24, help="forced transcript length (random weights)")
    ap.add_argument("--asr-batch", type=int, default=64)
    ap.add_argument("--tts-batch", type=int, default=64)
    ap.add_argument("--first-chunk-tokens", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=25)
    ap.add_argument("--tiny-cpu", action="store_true", help="dry run on the CPU with tiny random models")
    ap.add_argument("--engine-process", choices=["auto", "inline", "separate"], default="auto",
                    help="the engines in the daemon's process or in one of their own; auto: as `voiced serve` "
                         "(engines.process: separate on a GPU, inline on the CPU)")
    ap.add_argument("--end-by", type=float, default=0.0,
                    help="wall-clock time (Unix seconds) by which the run must be over: shortens --minutes to what "
                         "is left after start-up and warm-up (a machine lent for a fixed time)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--caller", help=argparse.SUPPRESS)  # internal: ADDRESS@SECONDS, run the callers only
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.caller:
        address, seconds = args.caller.rsplit("@", 1)
        report = asyncio.run(soak_callers(address, args.wav, args.callers, float(seconds), args.session_seconds,
                                          args.reply_seconds))
        print(json.dumps(report))
        return 0

    import platform

    import torch

    from voiced.bench.bench_daemon import start_server

    args.front = ["grpc"]  # (start_server reads the e2e benchmark's options; the soak has the others)
    server = start_server(args)
    address, loop = server.addresses["grpc"], server.loop
    report = GpuSoakReport(command=[sys.executable, "-m", "benchmarks.gpu_soak", *(argv or sys.argv[1:])],
                           callers=args.callers, minutes=args.minutes, session_seconds=args.session_seconds)
    report.machine = {"gpu": "cpu (dry run)" if args.tiny_cpu else torch.cuda.get_device_name(),
                      "torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    sampler = Sampler(server, loop, args.tiny_cpu)
    try:
        report.samples.append(sampler.sample("start"))
        report.warmup = run_callers(args, address, args.warmup_seconds, None, [])
        sampler.wait_idle(sampler.trims())
        report.samples.append(sampler.sample("after warm-up"))
        seconds = args.minutes * 60
        if args.end_by:
            seconds = min(seconds, args.end_by - time.time() - 30)  # 30 s: the callers' last replies, the report
            if seconds < 60:
                raise SystemExit(f"--end-by leaves {seconds:.0f} s for the soak after start-up and warm-up")
            report.minutes = round(seconds / 60, 2)
            log.info("--end-by: the soak runs %.1f minutes", report.minutes)
        sampler.t0 = time.monotonic()
        report.soak = run_callers(args, address, seconds, sampler, report.samples)
        sampler.wait_idle(sampler.trims())
        report.samples.append(sampler.sample("idle at the end"))
        report.daemon_outcomes = sampler.outcomes()
        report.heap_trims = sampler.heap_trims()
    finally:
        server.stop()
    report.judge()
    print(report.format())
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if all(v.startswith("met") for v in report.verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
