"""CPU per caller frame: what the daemon's process spends on each incoming 20 ms frame (issue 26).

    python -m benchmarks.frame_cost --asr-model tiny.en-pypi --sessions 16 32 64 --duration 20 \\
        --tree /path/to/old/tree --tree .

At 128 callers the event loop reads 6,400 frames a second in the process whose engine threads step
the GPU, and every microsecond of Python spent on a frame holds the GIL those threads wait for. This
measures that cost on the common path: Converse or StreamingRecognize, 16 kHz LINEAR16, 640-byte
frames, AUTO segmentation (webrtcvad).

One `voiced serve` per tree (`--tree`, default the tree this runs from; give an old tree and a new one
to compare them in the same run: the levels alternate between them). Each level streams N real-time
callers of the clip (`voiced-client load`, in this process: it shares the machine's cores, so watch its
lateness) and reads the daemon's CPU time from /proc over a window in which every caller streams:
the whole process (utime + stime, 10 ms ticks) and the event-loop thread (schedstat, ns), divided by
the frames the callers sent in that window (callers x window / 20 ms).

Modes (`--mode`): `vad`, StreamingRecognize with recognition disabled (decode, re-frame, VAD,
segmenter, speech events: the frame path alone, no Whisper call); `converse`, Converse with final
transcripts (tiny.en on a small CPU saturates: there the event loop's figure is the frames' cost, the
process's includes Whisper).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from voiced.bench.soak import DaemonProcess, machine

log = logging.getLogger("voiced.frame_cost")

FRAME_S = 0.020
WARMUP_SESSIONS, WARMUP_S = 4, 4.0
TEXT = ("Please call me back tomorrow morning. I will be at the office after nine, "
        "so you can reach me there.")


@dataclass
class Level:
    tree: str
    mode: str
    sessions: int
    frames: int  # frames the callers sent inside the window
    window_s: float
    process_us: float  # daemon process CPU per frame (all threads)
    loop_us: float  # the event-loop (main) thread's CPU per frame
    threads_us: dict[str, float]  # CPU per frame by thread name, for the threads that ran
    completed: int
    errors: dict[str, int]
    lateness_p99_ms: float  # the load generator's own lateness: large means its figures are not to be trusted
    load_avg: float  # the machine's 1-minute load average as the level ended (other jobs share the cores)


def process_ticks(pid: int) -> int:
    """utime + stime of the whole process, dead threads included (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ns(pid: int) -> dict[int, tuple[str, int]]:
    """Each live thread's name and time on a CPU (ns, schedstat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[int(task.name)] = (name, int((task / "schedstat").read_text().split()[0]))
        except OSError:  # the thread ended meanwhile
            continue
    return out


class Window:
    """The daemon's CPU between two moments of a load, read from another thread while it runs."""

    def __init__(self, pid: int, start_in: float, stop_in: float):
        self.pid = pid
        self.t = [0.0, 0.0]
        self.ticks = [0, 0]
        self.threads: list[dict[int, tuple[str, int]]] = [{}, {}]
        self._timers = [threading.Timer(start_in, self._read, (0,)), threading.Timer(stop_in, self._read, (1,))]

    def _read(self, i: int) -> None:
        self.t[i] = time.monotonic()
        self.ticks[i] = process_ticks(self.pid)
        self.threads[i] = thread_ns(self.pid)

    def __enter__(self):
        for timer in self._timers:
            timer.start()
        return self

    def __exit__(self, *exc) -> None:
        for timer in self._timers:
            timer.cancel()

    def per_thread_ns(self) -> dict[str, int]:
        """CPU ns in the window by thread name (threads alive at both ends)."""
        before, after = self.threads
        out: dict[str, int] = {}
        for tid, (name, ns) in after.items():
            if tid in before:
                key = "event loop" if tid == self.pid else name
                out[key] = out.get(key, 0) + ns - before[tid][1]
        return out


def run_level(daemon: DaemonProcess, tree: str, mode: str, sessions: int, duration: float, clip: bytes,
              ramp: float) -> Level:
    from voiced_client.audio import AudioFormat, Encoding
    from voiced_client.connect import Target
    from voiced_client.load import FIRST_EVENT_WAIT_S, LoadConfig, run_load
    from voiced_client.session import SessionOptions

    fmt = AudioFormat(Encoding.LINEAR16, 16000)
    options = SessionOptions(input_format=fmt, language="en", recognition_disabled=mode == "vad")
    cfg = LoadConfig(sessions=sessions, duration_s=duration, options=options, transcribe_only=mode == "vad",
                     ramp_s=ramp)
    # Every caller streams from (its start + its first answer) to that + duration: the window keeps
    # clear of both ends.
    start_in = ramp + min(FIRST_EVENT_WAIT_S, 1.0) + 1.0
    stop_in = duration - 0.5
    if stop_in - start_in < 2.0:
        raise SystemExit(f"--duration {duration:g} leaves no window after the ramp; make it >= {ramp + 5:g}")
    with Window(daemon.proc.pid, start_in, stop_in) as window:
        report = asyncio.run(run_load(Target(daemon.address), clip, cfg))
    if not window.t[1]:
        raise RuntimeError("the load ended before the window closed")
    span = window.t[1] - window.t[0]
    frames = round(sessions * span / FRAME_S)
    us = 1e6 / frames
    threads = {k: round(v / 1000 / frames, 2) for k, v in sorted(window.per_thread_ns().items(), key=lambda kv: -kv[1])
               if v > 0}
    summary = report.summary()
    return Level(tree=tree, mode=mode, sessions=sessions, frames=frames, window_s=round(span, 2),
                 process_us=round((window.ticks[1] - window.ticks[0]) / os.sysconf("SC_CLK_TCK") * us, 2),
                 loop_us=threads.get("event loop", 0.0), threads_us=threads, completed=report.completed,
                 errors=dict(report.errors), lateness_p99_ms=summary["client_lateness_ms"].get("p99", 0.0),
                 load_avg=os.getloadavg()[0])


def make_clip(directory: Path) -> Path:
    """Two espeak-ng sentences with a pause between them (the load adds a second of silence after)."""
    import numpy as np
    from voiced_client.wavio import write_wav

    from voiced.bench.speech_set import speak

    first, second = TEXT.split(". ", 1)
    audio = np.concatenate([speak(first + ".", "en-us", 175), np.zeros(8000, np.float32),
                            speak(second, "en-us", 175)])
    path = directory / "frame-cost.wav"
    write_wav(path, audio, 16000)
    return path


def start_daemon(tree: Path, asr_model: str, log_path: Path, turn_detection: str | None = None) -> DaemonProcess:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'client'}")
    turns = ["--turn-detection", turn_detection] if turn_detection else []
    return DaemonProcess(["--asr-model", asr_model, "--device", "cpu", "--no-tts", "--max-sessions", "2000", *turns],
                         log_path, cwd=tree, env=env)


def format_table(levels: list[Level]) -> str:
    lines = [f"{'mode':<9}{'callers':>8}  {'tree':<28}{'process us/frame':>17}{'loop us/frame':>14}"
             f"{'frames':>8}{'late p99':>9}{'load':>6}{'ok':>6}"]
    for r in levels:
        lines.append(f"{r.mode:<9}{r.sessions:>8}  {r.tree[-28:]:<28}{r.process_us:>17.1f}{r.loop_us:>14.1f}"
                     f"{r.frames:>8}{r.lateness_p99_ms:>9.1f}{r.load_avg:>6.2f}{r.completed:>4}/{r.sessions}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--asr-model", default="tiny.en-pypi", help="Whisper model name or path for the daemon")
    p.add_argument("--sessions", type=int, nargs="+", default=[16, 32, 64], help="callers per level")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each caller streams per level")
    p.add_argument("--ramp", type=float, default=2.0, help="caller starts spread over this long")
    p.add_argument("--mode", nargs="+", choices=["vad", "converse"], default=["vad"])
    p.add_argument("--tree", action="append", type=Path,
                   help="a voiced source tree to run the daemon from (repeat: the levels alternate between them)")
    p.add_argument("--turn-detection", nargs="+", choices=["smart", "silence"],
                   help="run a daemon with each (`voiced serve --turn-detection`; default: the daemon's own) and "
                        "alternate the levels between them, as between trees: what the end-of-turn detector "
                        "costs on the frame path")
    p.add_argument("--repeat", type=int, default=1, help="run every level this many times")
    p.add_argument("--wav", help="the clip every caller streams (default: two espeak-ng sentences)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", help="write the levels as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from voiced_client.audio import AudioFormat, Encoding
    from voiced_client.session import load_clip

    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[2]])]
    work = Path(tempfile.mkdtemp(prefix="frame-cost-"))
    wav = Path(args.wav) if args.wav else make_clip(work)
    clip = load_clip(wav, AudioFormat(Encoding.LINEAR16, 16000))
    runs = [(t, td) for t in trees for td in (args.turn_detection or [None])]
    labels = [str(t) + (f" [{td}]" if td else "") for t, td in runs]
    daemons = [start_daemon(t, args.asr_model, work / f"daemon-{i}.log", td) for i, (t, td) in enumerate(runs)]
    levels: list[Level] = []
    try:
        for d in daemons:
            d.wait_serving(args.start_timeout)
        for label, d in zip(labels, daemons):  # first-use costs out of the way
            for mode in args.mode:
                run_level(d, label, mode, WARMUP_SESSIONS, WARMUP_S + args.ramp + 4, clip, args.ramp)
        for _ in range(args.repeat):
            for n in args.sessions:
                for mode in args.mode:
                    for label, d in zip(labels, daemons):
                        d.wait_idle()
                        level = run_level(d, label, mode, n, args.duration, clip, args.ramp)
                        log.info("%s", format_table([level]).splitlines()[1])
                        levels.append(level)
    finally:
        for d in daemons:
            d.stop()
    print(f"daemon logs in {work}; {machine()}")
    print(format_table(levels))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": [sys.executable, "-m", "benchmarks.frame_cost",
                                                          *(argv if argv is not None else sys.argv[1:])],
                                              "machine": machine(), "levels": [asdict(x) for x in levels]},
                                             indent=1))
    return 0 if all(x.completed == x.sessions for x in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
