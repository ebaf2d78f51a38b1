"""Building a SessionConfig and streaming a clip through `Converse` / `StreamingRecognize`.

`stream_clip` / `stream_file` send the config, then the clip as 20 ms frames (paced at real time if
asked), then half-close, and collect every event until the server ends the stream; an error status
is raised as `grpc.RpcError`. `astream_file` is the same for async callers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from .audio import FRAME_MS, AudioFormat, Encoding, from_wire, split_frames, to_wire
from .connect import Target, sync_channel
from .proto import voiced_pb2 as pb
from .proto import voiced_pb2_grpc as pb_grpc
from .wavio import read_wav

log = logging.getLogger(__name__)

_ENCODING_TO_PB = {Encoding.LINEAR16: pb.LINEAR16, Encoding.MULAW: pb.MULAW, Encoding.ALAW: pb.ALAW}
_PB_TO_ENCODING = {v: k for k, v in _ENCODING_TO_PB.items()}


def format_to_proto(fmt: AudioFormat) -> pb.AudioFormat:
    return pb.AudioFormat(encoding=_ENCODING_TO_PB[fmt.encoding], sample_rate_hz=fmt.sample_rate)


def format_from_proto(fmt: pb.AudioFormat) -> AudioFormat:
    if fmt.encoding not in _PB_TO_ENCODING:
        raise ValueError(f"unsupported audio encoding {pb.AudioEncoding.Name(fmt.encoding)}")
    return AudioFormat(_PB_TO_ENCODING[fmt.encoding], fmt.sample_rate_hz)


@dataclass
class SessionOptions:
    """What a client asks of a session; unset values take the server's defaults."""

    input_format: AudioFormat
    output_format: AudioFormat | None = None  # None: same as input (the server's rule)
    push_to_talk: bool = False
    language: str = ""
    interim_results: bool = False
    recognition_disabled: bool = False  # speech-activity events only
    voice: str = ""
    agent: str = ""
    session_id: str = ""
    hangover_ms: int | None = None
    pre_roll_ms: int | None = None
    min_speech_ms: int | None = None
    vad_aggressiveness: int | None = None
    barge_in: bool | None = None

    def to_proto(self) -> pb.SessionConfig:
        seg = pb.SegmentationConfig(mode=pb.PUSH_TO_TALK if self.push_to_talk else pb.AUTO)
        for name in ("hangover_ms", "pre_roll_ms", "min_speech_ms", "vad_aggressiveness"):
            if getattr(self, name) is not None:
                setattr(seg, name, getattr(self, name))
        cfg = pb.SessionConfig(
            input_format=format_to_proto(self.input_format),
            segmentation=seg,
            recognition=pb.RecognitionConfig(
                disabled=self.recognition_disabled,
                language=self.language,
                interim_results=self.interim_results,
            ),
            session_id=self.session_id,
        )
        if self.output_format is not None:
            cfg.output_format.CopyFrom(format_to_proto(self.output_format))
        if self.voice:
            cfg.speech.voice = self.voice
        if self.agent:
            cfg.agent.name = self.agent
        if self.barge_in is not None:
            cfg.barge_in.enabled = self.barge_in
        return cfg


def output_format_of(events: Sequence[pb.SessionEvent], requested: pb.SessionConfig) -> AudioFormat:
    """The session's reply format: the server's effective config if it sent one, else the request's."""
    for ev in events:
        if ev.HasField("started") and ev.started.effective_config.HasField("input_format"):
            cfg = ev.started.effective_config
            break
    else:
        cfg = requested
    chosen = cfg.output_format if cfg.HasField("output_format") else cfg.input_format
    return format_from_proto(chosen)


def reply_audio(events: Sequence[pb.SessionEvent], fmt: AudioFormat) -> np.ndarray:
    """All reply audio of a session, decoded to int16 at the output rate, in arrival order."""
    parts = [from_wire(ev.audio.audio, fmt) for ev in events if ev.HasField("audio")]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)


def talk_marks(spans: Sequence[tuple[float, float]], n_frames: int, frame_s: float) -> dict[int, list[str]]:
    """Push-to-talk spans in seconds -> {frame index: ["talk_start"/"talk_end", ...]} sent before it.

    A mark at or past the end of the clip is sent after the last frame (index n_frames)."""
    marks: dict[int, list[str]] = {}
    last_end = -1.0
    for start, end in spans:
        if not 0 <= start < end or start < last_end:
            raise ValueError(f"push-to-talk spans must be ordered and non-overlapping: {list(spans)}")
        last_end = end
        for t, what in ((start, "talk_start"), (end, "talk_end")):
            marks.setdefault(min(round(t / frame_s), n_frames), []).append(what)
    return marks


@dataclass
class ClipRequests:
    """The request stream for one clip: config, frames (paced or not), talk marks, half-close."""

    config: pb.SessionConfig
    frames: list[bytes]
    frame_s: float
    realtime: bool = False
    marks: dict[int, list[str]] = field(default_factory=dict)
    started_at: float | None = None  # monotonic time of the first request, set when it is sent

    def __iter__(self) -> Iterator[pb.SessionRequest]:
        self.started_at = time.monotonic()
        yield pb.SessionRequest(config=self.config)
        for i in range(len(self.frames) + 1):
            for what in self.marks.get(i, ()):
                yield pb.SessionRequest(control=pb.Control(**{what: getattr(pb, _CONTROL[what])()}))
            if i == len(self.frames):
                break
            if self.realtime:
                # Absolute deadlines: a late wake-up is caught up, never accumulated as drift.
                delay = self.started_at + i * self.frame_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            yield pb.SessionRequest(audio=self.frames[i])


_CONTROL = {"talk_start": "TalkStart", "talk_end": "TalkEnd"}


def load_clip(path: str | Path, fmt: AudioFormat) -> bytes:
    """A WAV file converted to the wire format `fmt` (mono, resampled, encoded)."""
    pcm, rate = read_wav(path, np.int16)
    return to_wire(pcm, rate, fmt)


def stream_clip(
    target: Target | grpc.Channel,
    clip: bytes,
    options: SessionOptions,
    *,
    transcribe_only: bool = False,
    realtime: bool = False,
    talk_spans: Sequence[tuple[float, float]] | None = None,
    on_event: Callable[[pb.SessionEvent, float], None] | None = None,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float | None = None,
) -> list[pb.SessionEvent]:
    """Stream wire-format bytes `clip` as one session and return every event the server sent.

    `target` is a Target (a channel is opened and closed here) or an open grpc.Channel.
    `on_event(event, seconds_since_first_request)` is called as each event arrives.
    In push-to-talk mode without `talk_spans`, the whole clip is one span.
    An error status raises grpc.RpcError (with .code() and .details()).

    This uses the blocking gRPC API on purpose: grpc.aio (1.85) reports INTERNAL "Internal error
    from Core" instead of the server's status when the server ends the call while the client is
    still writing (grpc/grpc#36066), and a file streamed as fast as possible always is. The sync
    API sends requests from its own thread and reports the server's status."""
    fmt = options.input_format
    frames = split_frames(clip, fmt)
    frame_s = fmt.frame_samples(FRAME_MS) / fmt.sample_rate
    marks: dict[int, list[str]] = {}
    if options.push_to_talk:
        spans = talk_spans if talk_spans is not None else [(0.0, len(frames) * frame_s)]
        marks = talk_marks(spans, len(frames), frame_s)
    elif talk_spans:
        raise ValueError("talk spans need push-to-talk mode")
    requests = ClipRequests(options.to_proto(), frames, frame_s, realtime, marks)

    own_channel = isinstance(target, Target)
    channel = sync_channel(target) if own_channel else target
    if own_channel:
        metadata = tuple(metadata) + target.metadata()
    call = None
    try:
        stub = pb_grpc.VoicedStub(channel)
        rpc = stub.StreamingRecognize if transcribe_only else stub.Converse
        call = rpc(iter(requests), metadata=tuple(metadata) or None, timeout=timeout)
        events: list[pb.SessionEvent] = []
        for event in call:
            events.append(event)
            if on_event is not None:
                on_event(event, time.monotonic() - (requests.started_at or time.monotonic()))
        return events
    finally:
        if call is not None and call.is_active():
            call.cancel()  # we stopped early (an exception in on_event, Ctrl-C): free the server's side
        if own_channel:
            channel.close()


def stream_file(
    server: str | Target | grpc.Channel,
    path: str | Path,
    options: SessionOptions | None = None,
    **kwargs,
) -> list[pb.SessionEvent]:
    """Stream a WAV file as one session and return its events (blocking; see stream_clip).

    `options` defaults to 16 kHz LINEAR16 with the server's defaults for everything else."""
    target = Target(server) if isinstance(server, str) else server
    options = options or SessionOptions(AudioFormat(Encoding.LINEAR16, 16000))
    return stream_clip(target, load_clip(path, options.input_format), options, **kwargs)


async def astream_file(
    server: str | Target | grpc.Channel,
    path: str | Path,
    options: SessionOptions | None = None,
    **kwargs,
) -> list[pb.SessionEvent]:
    """`stream_file` from async code: runs in a worker thread (so `on_event` is called there)."""
    return await asyncio.to_thread(stream_file, server, path, options, **kwargs)
