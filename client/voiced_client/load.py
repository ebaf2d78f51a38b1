"""Load generator: N concurrent real-time sessions streaming a clip in a loop.

Built to be cheaper than the server it measures: one event loop, one writer and one reader task
per session, frames serialised once and shared by every session, absolute-deadline pacing.

What it measures, per session and event:
- speech events: `arrival - sent(decisive frame)`, where the decisive frame is the one holding
  audio time `offset_ms + lag`, lag being how much audio past the offset the server must see before
  it can decide. The daemon dates SPEECH_ENDED at the decision itself (last voiced frame plus the
  hangover), so its lag is 0, and SPEECH_STARTED at the first voiced frame, decided once
  `min_speech_ms` of voiced frames have arrived, so its lag is the session's effective
  min_speech_ms (a start whose voiced frames had gaps was decided a little later, so its delay
  reads a little high: the SPEECH_ENDED figure is the exact one). Both lags can be overridden.
  This is the server's processing delay, queueing included.
- transcripts: the server's own `latency_ms` (end of speech -> result sent).
- session start: config sent -> SessionStarted received.
- client lateness: how late frames left against their schedule; when this grows, the client (not
  the server) is the bottleneck and the figures above are not to be trusted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np

from .audio import FRAME_MS, AudioFormat, silence, split_frames
from .connect import Target, aio_channel
from .proto import voiced_pb2 as pb
from .session import SessionOptions, load_clip

log = logging.getLogger(__name__)

FIRST_EVENT_WAIT_S = 2.0
SESSIONS_PER_CHANNEL = 100  # one HTTP/2 connection per this many streams spreads the transport work


@dataclass
class LoadConfig:
    sessions: int
    duration_s: float
    options: SessionOptions
    transcribe_only: bool = False
    gap_s: float = 1.0  # silence between repetitions, so that each repetition ends its utterances
    ramp_s: float = 2.0  # session starts are spread over this long
    channels: int = 0  # 0: one per SESSIONS_PER_CHANNEL sessions
    started_lag_ms: float | None = None  # None: the effective min_speech_ms of each session
    ended_lag_ms: float = 0.0
    drain_timeout_s: float = 30.0  # after the last frame, how long the server may take to end
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass
class LoadReport:
    sessions: int
    completed: int = 0
    errors: Counter = field(default_factory=Counter)  # status name -> sessions
    events: Counter = field(default_factory=Counter)  # event kind -> count
    delays_ms: dict[str, array] = field(
        default_factory=lambda: {
            k: array("d") for k in ("speech_started", "speech_ended", "transcript", "session_start")
        }
    )
    lateness_ms: array = field(default_factory=lambda: array("d"))
    audio_s: float = 0.0  # audio streamed, all sessions together
    wall_s: float = 0.0
    error_examples: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict:
        def stats(values: array) -> dict:
            if not values:
                return {"count": 0}
            a = np.frombuffer(values, dtype=np.float64)
            p50, p95, p99 = np.percentile(a, [50, 95, 99])
            return {
                "count": len(a),
                "p50": round(p50, 1),
                "p95": round(p95, 1),
                "p99": round(p99, 1),
                "max": round(float(a.max()), 1),
                "min": round(float(a.min()), 1),
            }

        return {
            "sessions": self.sessions,
            "completed": self.completed,
            "errors": dict(self.errors),
            "error_examples": self.error_examples,
            "events": dict(self.events),
            "delay_ms": {k: stats(v) for k, v in self.delays_ms.items()},
            "client_lateness_ms": stats(self.lateness_ms),
            "audio_s": round(self.audio_s, 1),
            "wall_s": round(self.wall_s, 1),
        }

    def format(self) -> str:
        s = self.summary()
        lines = [
            (
                f"sessions completed {s['completed']}/{s['sessions']}, "
                f"{s['audio_s']:.0f} s of audio in {s['wall_s']:.1f} s"
            ),
            "errors: " + (", ".join(f"{k} ×{v}" for k, v in s["errors"].items()) or "none"),
        ]
        lines += [f"  {k}: {v}" for k, v in s["error_examples"].items()]
        lines.append("events: " + (", ".join(f"{k} {v}" for k, v in sorted(s["events"].items())) or "none"))
        lines.append(f"{'delay (ms)':<22}{'count':>8}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}")
        rows = dict(s["delay_ms"], client_lateness=s["client_lateness_ms"])
        for name, st in rows.items():
            if st["count"]:
                lines.append(
                    f"{name:<22}{st['count']:>8}{st['p50']:>9.1f}{st['p95']:>9.1f}{st['p99']:>9.1f}{st['max']:>9.1f}"
                )
            else:
                lines.append(f"{name:<22}{0:>8}")
        late = s["client_lateness_ms"]
        if late["count"] and late["p99"] > 10:
            lines.append(
                f"warning: the client sent frames late (p99 {late['p99']:.0f} ms): its CPU is short "
                "(shared with the server?); the delays above include that. Run it on another machine."
            )
        return "\n".join(lines)


def _serialized_cycle(clip: bytes, fmt: AudioFormat, gap_s: float) -> list[bytes]:
    """The clip plus the gap as serialised SessionRequest frames, padded to whole frames so that
    frame k of the loop always starts at audio time k * frame duration."""
    frames = split_frames(clip + silence(fmt, int(gap_s * 1000)), fmt)
    size = fmt.frame_bytes()
    if frames and len(frames[-1]) < size:
        pad = silence(fmt, FRAME_MS)[: size - len(frames[-1])]
        frames[-1] += pad
    return [pb.SessionRequest(audio=f).SerializeToString() for f in frames]


class _Session:
    def __init__(self, index: int, cfg: LoadConfig, report: LoadReport, frame_s: float) -> None:
        self.index = index
        self.cfg = cfg
        self.report = report
        self.frame_s = frame_s
        self.sent = array("d")  # monotonic send time of each frame
        self.config_sent = 0.0
        self.answered = asyncio.Event()  # the first event (or the end of the call) arrived
        self.started_lag_ms = cfg.started_lag_ms

    def decisive_frame(self, audio_ms: float) -> int:
        # The frame whose end reaches audio_ms; an offset on a boundary belongs to the frame before.
        idx = math.ceil(audio_ms / 1000.0 / self.frame_s - 1e-9) - 1
        return min(max(idx, 0), len(self.sent) - 1)

    def on_event(self, event: pb.SessionEvent, now: float) -> None:
        kind = event.WhichOneof("event")
        report = self.report
        if kind == "speech":
            started = event.speech.type == pb.SpeechActivity.SPEECH_STARTED
            name = "speech_started" if started else "speech_ended"
            report.events[name] += 1
            lag = (self.started_lag_ms or 0.0) if started else self.cfg.ended_lag_ms
            if self.sent:
                at = self.sent[self.decisive_frame(event.speech.offset_ms + lag)]
                report.delays_ms[name].append((now - at) * 1000.0)
            return
        report.events[kind or "none"] += 1
        if kind == "transcript":
            if event.transcript.is_final:
                report.delays_ms["transcript"].append(event.transcript.latency_ms)
        elif kind == "started":
            report.delays_ms["session_start"].append((now - self.config_sent) * 1000.0)
            seg = event.started.effective_config.segmentation
            if self.started_lag_ms is None:
                self.started_lag_ms = float(seg.min_speech_ms) if seg.HasField("min_speech_ms") else 0.0

    async def run(
        self,
        channel: grpc.aio.Channel,
        method: str,
        cycle: list[bytes],
        config: bytes,
        start_at: float,
        n_frames: int,
    ) -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        # Requests are pre-serialised bytes (no request serializer): 50 frames/s × N sessions of
        # protobuf encoding would otherwise cost the client more CPU than the server spends on them.
        call = channel.stream_stream(
            method, request_serializer=None, response_deserializer=pb.SessionEvent.FromString
        )(metadata=self.cfg.metadata or None)
        reader = asyncio.create_task(self._read(call))
        try:
            self.config_sent = time.monotonic()
            await call.write(config)
            # Audio starts once the server has answered the config. A refusal (admission control's
            # RESOURCE_EXHAUSTED) then arrives before any frame is written, so it is reported as the
            # server sent it rather than as INTERNAL (see below). A server that says nothing before
            # it hears audio costs a short wait, no more.
            try:
                await asyncio.wait_for(self.answered.wait(), FIRST_EVENT_WAIT_S)
            except asyncio.TimeoutError:
                pass
            t0 = time.monotonic()
            lateness = self.report.lateness_ms
            for k in range(n_frames):
                deadline = t0 + k * self.frame_s
                delay = deadline - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                # Never write to a finished call: grpc.aio would replace the server's status (say
                # RESOURCE_EXHAUSTED from admission control) with INTERNAL (grpc/grpc#36066).
                if call.done():
                    break
                now = time.monotonic()
                lateness.append((now - deadline) * 1000.0)
                self.sent.append(now)
                await call.write(cycle[k % len(cycle)])
            if not call.done():
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream failed; the reader has (or will get) the status
        self.report.audio_s += len(self.sent) * self.frame_s
        try:
            await asyncio.wait_for(reader, self.cfg.drain_timeout_s)
        except asyncio.TimeoutError:
            call.cancel()
            self.report.errors["DRAIN_TIMEOUT"] += 1
            self.report.error_examples.setdefault(
                "DRAIN_TIMEOUT",
                f"the server did not end the stream {self.cfg.drain_timeout_s:.0f} s after the last frame",
            )

    async def _read(self, call) -> None:
        try:
            async for event in call:
                self.answered.set()
                self.on_event(event, time.monotonic())
            self.report.completed += 1
        except grpc.aio.AioRpcError as e:
            name = e.code().name
            self.report.errors[name] += 1
            self.report.error_examples.setdefault(name, e.details() or "")
        finally:
            self.answered.set()


async def run_load(target: Target, clip: bytes, cfg: LoadConfig) -> LoadReport:
    """Run the load and return the report. `clip` is in cfg.options.input_format."""
    fmt = cfg.options.input_format
    frame_s = fmt.frame_samples() / fmt.sample_rate
    cycle = _serialized_cycle(clip, fmt, cfg.gap_s)
    n_frames = max(1, round(cfg.duration_s / frame_s))
    base_config = cfg.options.to_proto()

    def config_for(i: int) -> bytes:
        c = pb.SessionConfig()
        c.CopyFrom(base_config)
        if c.session_id:
            c.session_id = f"{c.session_id}-{i}"  # one label per session, for the server's logs
        return pb.SessionRequest(config=c).SerializeToString()

    method = "/voiced.v1.Voiced/" + ("StreamingRecognize" if cfg.transcribe_only else "Converse")
    cfg.metadata = tuple(cfg.metadata) + target.metadata()

    n_channels = cfg.channels or math.ceil(cfg.sessions / SESSIONS_PER_CHANNEL)
    # A local subchannel pool per channel keeps grpc from sharing one TCP connection among them.
    channels = [aio_channel(target, [("grpc.use_local_subchannel_pool", 1)]) for _ in range(n_channels)]
    report = LoadReport(cfg.sessions)
    sessions = [_Session(i, cfg, report, frame_s) for i in range(cfg.sessions)]
    rng = random.Random(0)
    t_start = time.monotonic() + 0.1
    try:
        # Starts spread over the ramp and a random phase within one frame, so that the N sessions do
        # not all send in the same millisecond of every 20 ms period.
        tasks = [
            s.run(
                channels[i % n_channels],
                method,
                cycle,
                config_for(i),
                t_start + cfg.ramp_s * i / cfg.sessions + rng.random() * frame_s,
                n_frames,
            )
            for i, s in enumerate(sessions)
        ]
        await asyncio.gather(*tasks)
    finally:
        report.wall_s = time.monotonic() - t_start
        for ch in channels:
            await ch.close()
    return report


def run_cli(args: argparse.Namespace, target: Target, fmt: AudioFormat) -> int:
    options = SessionOptions(
        input_format=fmt,
        language=args.language,
        interim_results=args.interim,
        recognition_disabled=args.vad_only,
        hangover_ms=args.hangover_ms,
        session_id=args.session_id,
    )
    cfg = LoadConfig(
        sessions=args.sessions,
        duration_s=args.duration,
        options=options,
        transcribe_only=args.transcribe_only or args.vad_only,
        gap_s=args.gap,
        ramp_s=args.ramp,
        channels=args.channels,
        started_lag_ms=args.started_lag_ms,
        ended_lag_ms=args.ended_lag_ms,
    )
    clip = load_clip(args.file, fmt)
    report = asyncio.run(run_load(target, clip, cfg))
    print(json.dumps(report.summary()) if args.json else report.format())
    # Non-zero when any session failed, so scripts can tell a clean run from a broken one.
    return 0 if report.completed == report.sessions else 1
