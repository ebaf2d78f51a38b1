"""`voiced-client file` and `load` against a scripted in-process gRPC peer: what goes on the wire
(config first, 20 ms frames in the chosen format, talk marks, half-close), what is printed, the
reply WAV, the bearer token, and one-line errors with the status name."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from voiced_client import load
from voiced_client.audio import AudioFormat, Encoding, decode, to_wire
from voiced_client.cli import main
from voiced_client.connect import Target
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc
from voiced_client.session import SessionOptions, format_from_proto, stream_file, talk_marks
from voiced_client.wavio import read_wav, write_wav

REPLY = (np.sin(np.arange(1600) / 7) * 12000).astype(np.int16)  # 100 ms at 16 kHz


class ScriptedVoiced(pb_grpc.VoicedServicer):
    """A peer with fixed, simple rules (this tests the client, not the daemon):
    SessionStarted echoing the config; SPEECH_STARTED after 100 ms of audio and SPEECH_ENDED at
    half-close; then a transcript naming the bytes received and, in Converse, REPLY audio in the
    session's output format. A sample rate of 12345 Hz is refused with INVALID_ARGUMENT; with
    `token` set, other callers get UNAUTHENTICATED."""

    def __init__(self, token: str | None = None, limit: int | None = None) -> None:
        self.token = token
        self.limit = limit
        self.active = 0
        self.sessions: list[list[pb.SessionRequest]] = []
        self.arrivals: list[list[float]] = []

    async def _session(self, request_iterator, context, converse: bool):
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        received: list[pb.SessionRequest] = []
        arrivals: list[float] = []
        self.sessions.append(received)
        self.arrivals.append(arrivals)
        first = await request_iterator.__anext__()
        received.append(first)
        if not first.HasField("config"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the config")
        cfg = first.config
        if self.limit is not None and self.active >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"session limit {self.limit} reached")
        self.active += 1
        try:
            async for event in self._converse(request_iterator, context, cfg, received, arrivals, converse):
                yield event
        finally:
            self.active -= 1

    async def _converse(self, request_iterator, context, cfg, received, arrivals, converse: bool):
        if cfg.input_format.sample_rate_hz == 12345:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sample_rate_hz 12345 is not supported")
        effective = pb.SessionConfig()
        effective.CopyFrom(cfg)
        if not effective.HasField("output_format"):
            effective.output_format.CopyFrom(cfg.input_format)
        effective.segmentation.min_speech_ms = 60
        yield pb.SessionEvent(
            session_id="x", started=pb.SessionStarted(session_id="x", effective_config=effective)
        )
        fmt = format_from_proto(cfg.input_format)
        nbytes, started = 0, False
        async for req in request_iterator:
            received.append(req)
            arrivals.append(time.monotonic())
            nbytes += len(req.audio)
            ms = int(fmt.duration_s(nbytes) * 1000)
            if not started and ms >= 100:
                started = True
                yield pb.SessionEvent(
                    session_id="x",
                    turn_id=1,
                    speech=pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_STARTED, offset_ms=40),
                )
        yield pb.SessionEvent(
            session_id="x",
            turn_id=1,
            speech=pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_ENDED, offset_ms=ms),
        )
        yield pb.SessionEvent(
            session_id="x",
            turn_id=1,
            transcript=pb.Transcript(text=f"{nbytes} bytes", is_final=True, latency_ms=12.5),
        )
        if converse:
            out = format_from_proto(effective.output_format)
            wire = to_wire(REPLY, 16000, out)
            half = len(wire) // 2 // out.encoding.bytes_per_sample * out.encoding.bytes_per_sample
            yield pb.SessionEvent(
                session_id="x",
                turn_id=1,
                reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=1, text="ok"),
            )
            for seq, part in enumerate((wire[:half], wire[half:])):
                yield pb.SessionEvent(
                    session_id="x",
                    turn_id=1,
                    audio=pb.AudioChunk(reply_id=1, sequence=seq, audio=part, last=seq == 1),
                )
            yield pb.SessionEvent(
                session_id="x",
                turn_id=1,
                reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_FINISHED, reply_id=1, audio_sent_ms=100),
            )

    # grpc.aio tells streaming handlers apart by being async generator functions themselves.
    async def Converse(self, request_iterator, context):
        async for event in self._session(request_iterator, context, converse=True):
            yield event

    async def StreamingRecognize(self, request_iterator, context):
        async for event in self._session(request_iterator, context, converse=False):
            yield event


class ServerThread:
    """The scripted server on its own event loop in a thread, so that the blocking CLI can run here."""

    def __init__(self, servicer: ScriptedVoiced) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()

        async def start():
            self.server = grpc.aio.server()
            pb_grpc.add_VoicedServicer_to_server(self.servicer, self.server)
            port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            return port

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def speech_wav(tmp_path) -> Path:
    # 1 s stereo 22.05 kHz 16-bit: the client must mix down and resample before sending.
    t = np.arange(22050) / 22050
    x = 0.3 * np.sin(2 * np.pi * 220 * t)
    path = tmp_path / "in.wav"
    write_wav(path, np.stack([x, x], axis=1), 22050)
    return path


def audio_of(session) -> list[bytes]:
    return [r.audio for r in session if r.WhichOneof("request") == "audio"]


@pytest.mark.parametrize(
    "encoding, rate, frame_bytes",
    [
        ("linear16", 16000, 640),
        ("mulaw", 8000, 160),
        ("alaw", 8000, 160),
        ("linear16", 48000, 1920),
    ],
)
def test_file_sends_config_then_20ms_frames(speech_wav, capsys, encoding, rate, frame_bytes):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        rc = main(
            [
                "file",
                str(speech_wav),
                "--server",
                server,
                "--encoding",
                encoding,
                "--sample-rate",
                str(rate),
                "--language",
                "en",
            ]
        )
    assert rc == 0
    (session,) = servicer.sessions
    cfg = session[0].config
    assert cfg.input_format.sample_rate_hz == rate
    assert pb.AudioEncoding.Name(cfg.input_format.encoding).lower() == encoding
    assert cfg.recognition.language == "en" and cfg.segmentation.mode == pb.AUTO
    frames = audio_of(session)
    assert len(session) == 1 + len(frames)  # nothing but config and audio
    assert all(len(f) == frame_bytes for f in frames[:-1]) and len(frames[-1]) <= frame_bytes
    sent = b"".join(frames)
    bps = 2 if encoding == "linear16" else 1
    assert len(sent) == rate * bps  # the whole second, resampled
    if encoding != "linear16":  # what was sent decodes to the tone
        pcm = decode(sent, Encoding(encoding)).astype(float)
        assert 0.25 * 32768 < np.abs(pcm).max() < 0.35 * 32768
    out = capsys.readouterr().out
    assert "speech started at 0.04 s" in out and f"{rate * bps} bytes" in out and "reply 1 finished" in out


def test_file_json_and_reply_wav(speech_wav, tmp_path, capsys):
    servicer = ScriptedVoiced()
    reply = tmp_path / "reply.wav"
    with ServerThread(servicer) as server:
        rc = main(
            [
                "file",
                str(speech_wav),
                "--server",
                server,
                "--encoding",
                "mulaw",
                "--sample-rate",
                "8000",
                "--json",
                "--out",
                str(reply),
            ]
        )
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kinds = [next(k for k in d if k in ("started", "speech", "transcript", "reply", "audio")) for d in lines]
    assert kinds == ["started", "speech", "speech", "transcript", "reply", "audio", "audio", "reply"]
    chunks = [d["audio"] for d in lines if "audio" in d]
    assert all("audio" not in c and c["audio_bytes"] > 0 for c in chunks)
    assert sum(c["audio_bytes"] for c in chunks) == 800  # 100 ms at 8 kHz mu-law
    assert all("received_ms" in d for d in lines)
    # The reply WAV holds the session's output format decoded: 8 kHz, and the mu-law of the tone.
    pcm, rate = read_wav(reply)
    expected = decode(to_wire(REPLY, 16000, AudioFormat(Encoding.MULAW, 8000)), Encoding.MULAW)
    assert rate == 8000 and np.array_equal(pcm, expected)


def test_file_reply_in_another_output_format(speech_wav, tmp_path):
    servicer = ScriptedVoiced()
    reply = tmp_path / "reply.wav"
    with ServerThread(servicer) as server:
        assert (
            main(
                [
                    "file",
                    str(speech_wav),
                    "--server",
                    server,
                    "--out-encoding",
                    "alaw",
                    "--out-sample-rate",
                    "8000",
                    "--out",
                    str(reply),
                ]
            )
            == 0
        )
    cfg = servicer.sessions[0][0].config
    assert cfg.output_format.encoding == pb.ALAW and cfg.output_format.sample_rate_hz == 8000
    assert read_wav(reply)[1] == 8000


def test_transcribe_only_uses_streaming_recognize(speech_wav, capsys):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        assert main(["file", str(speech_wav), "--server", server, "--transcribe-only"]) == 0
    out = capsys.readouterr().out
    assert "transcript" in out and "reply" not in out


def test_push_to_talk_marks_are_placed_at_their_frames(speech_wav):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        assert (
            main(["file", str(speech_wav), "--server", server, "--mode", "ptt", "--talk", "0.2-0.5,0.6-2"])
            == 0
        )
    session = servicer.sessions[0]
    assert session[0].config.segmentation.mode == pb.PUSH_TO_TALK
    seq = ["audio" if r.HasField("audio") else r.control.WhichOneof("event") for r in session[1:]]
    marks = [(i, k) for i, k in enumerate(seq) if k != "audio"]
    # Frames before each mark: 0.2 s = 10 frames, 0.5 s = 25, 0.6 s = 30; 2 s is past the end (50).
    frames_before = [seq[:i].count("audio") for i, _ in marks]
    assert [k for _, k in marks] == ["talk_start", "talk_end", "talk_start", "talk_end"]
    assert frames_before == [10, 25, 30, 50]


def test_talk_marks_validation():
    assert talk_marks([(0.0, 1.0)], 10, 0.02) == {0: ["talk_start"], 10: ["talk_end"]}
    with pytest.raises(ValueError):
        talk_marks([(1.0, 0.5)], 100, 0.02)
    with pytest.raises(ValueError):
        talk_marks([(0.0, 1.0), (0.5, 2.0)], 100, 0.02)


def test_realtime_paces_frames(speech_wav):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        t0 = time.monotonic()
        events = stream_file(
            server,
            speech_wav,
            SessionOptions(AudioFormat(Encoding.LINEAR16, 16000)),
            realtime=True,
            transcribe_only=True,
        )
    # 1 s of audio in 50 frames: the last one cannot leave before 0.98 s (how much later depends on the
    # machine's load; the pacing's own timing is checked on a clock of the test's below).
    assert len(servicer.arrivals[0]) == 50 and servicer.arrivals[0][-1] - t0 >= 0.98
    assert events[0].WhichOneof("event") == "started"


def test_realtime_pacing_keeps_to_the_clip_time_when_woken_late(monkeypatch):
    """Each frame leaves at its own deadline from the start; a late wake-up is caught up, not added on."""
    from voiced_client import session as client_session

    class Clock:
        now = 100.0

        def monotonic(self):
            return self.now

        def sleep(self, s):
            self.now += s + 0.007  # every wake-up 7 ms late

    clock = Clock()
    monkeypatch.setattr(client_session, "time", clock)
    frames = [bytes(640)] * 50
    requests = client_session.ClipRequests(pb.SessionConfig(), frames, 0.02, realtime=True)
    left = []
    for r in requests:
        if r.HasField("audio"):
            left.append(clock.now - requests.started_at)
    # Frame i leaves at i * 20 ms (+ that one wake-up's 7 ms), never later: no drift accumulates.
    assert left[0] == 0.0
    assert all(0.02 * i <= t <= 0.02 * i + 0.007 + 1e-9 for i, t in enumerate(left)), left


def test_token_is_sent(speech_wav, capsys):
    servicer = ScriptedVoiced(token="s3cret")
    with ServerThread(servicer) as server:
        assert main(["file", str(speech_wav), "--server", server, "--token", "s3cret"]) == 0
        assert main(["file", str(speech_wav), "--server", server, "--token", "wrong"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "UNAUTHENTICATED" in err[0] and "--token" in err[0]


def test_error_status_is_one_line_with_its_name(speech_wav, capsys):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        rc = main(["file", str(speech_wav), "--server", server, "--sample-rate", "12345"])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["voiced-client file: error: INVALID_ARGUMENT: sample_rate_hz 12345 is not supported"]


def test_unreachable_server(speech_wav, capsys):
    assert main(["file", str(speech_wav), "--server", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the server at 127.0.0.1:1: UNAVAILABLE" in err[0]


def test_local_problems_are_one_line(tmp_path, speech_wav, capsys):
    assert main(["file", str(tmp_path / "missing.wav")]) == 1
    assert main(["file", str(speech_wav), "--sample-rate", "96000"]) == 1
    (tmp_path / "junk.wav").write_bytes(b"not a wav")
    assert main(["file", str(tmp_path / "junk.wav")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert "no such file" in err[0] and "8000..48000" in err[1] and "sox" in err[2]


def test_load_reports_delays_and_completions(speech_wav):
    servicer = ScriptedVoiced()
    with ServerThread(servicer) as server:
        cfg = load.LoadConfig(
            sessions=20,
            duration_s=0.6,
            options=SessionOptions(AudioFormat(Encoding.MULAW, 8000)),
            transcribe_only=True,
            gap_s=0.2,
            ramp_s=0.2,
            channels=2,
        )
        clip = to_wire(read_wav(speech_wav)[0], 22050, cfg.options.input_format)
        report = asyncio.run(load.run_load(Target(server), clip, cfg))
    s = report.summary()
    assert s["completed"] == 20 and s["errors"] == {}
    assert s["events"]["speech_started"] == 20 and s["events"]["speech_ended"] == 20
    assert s["events"]["transcript"] == 20 and s["events"]["started"] == 20
    # All sessions streamed 0.6 s in real time (30 frames of 160 B each).
    assert all(
        len(audio_of(sess)) == 30 and all(len(f) == 160 for f in audio_of(sess)) for sess in servicer.sessions
    )
    # SPEECH_STARTED at offset 40 ms + the effective min_speech_ms 60 ms is decided by frame 4, which the
    # server (answering once it has 100 ms) had received: the delay is measured from that frame's send
    # time, so it is never negative (its size is the machine's; test_decisive_frame pins the frame).
    started = s["delay_ms"]["speech_started"]
    assert started["count"] == 20 and started["p50"] >= 0.0
    assert s["delay_ms"]["transcript"]["p50"] == 12.5
    assert s["audio_s"] == pytest.approx(12.0)
    assert "sessions completed 20/20" in report.format()


def test_decisive_frame():
    """The frame whose end reaches an audio offset (20 ms frames): 100 ms is frame 4's end, 101 ms in frame 5."""
    cfg = load.LoadConfig(sessions=1, duration_s=1.0, options=SessionOptions(AudioFormat(Encoding.MULAW, 8000)))
    sess = load._Session(0, cfg, load.LoadReport(1), 0.02)
    sess.sent.extend(float(i) for i in range(30))
    assert [sess.decisive_frame(ms) for ms in (0.0, 20.0, 20.5, 100.0, 101.0, 5000.0)] == [0, 0, 1, 4, 5, 29]


def test_load_cli_counts_errors(speech_wav, capsys):
    assert (
        main(
            [
                "load",
                "--server",
                "127.0.0.1:1",
                "--sessions",
                "3",
                "--file",
                str(speech_wav),
                "--duration",
                "0.2",
                "--ramp",
                "0",
                "--json",
            ]
        )
        == 1
    )
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 0 and s["errors"] == {"UNAVAILABLE": 3}


def test_load_reports_the_servers_status_for_refused_sessions(speech_wav):
    servicer = ScriptedVoiced(limit=4)
    with ServerThread(servicer) as server:
        cfg = load.LoadConfig(
            sessions=7,
            duration_s=1.0,
            options=SessionOptions(AudioFormat(Encoding.LINEAR16, 16000)),
            transcribe_only=True,
            ramp_s=0.1,
        )
        clip = to_wire(read_wav(speech_wav)[0], 22050, cfg.options.input_format)
        report = asyncio.run(load.run_load(Target(server), clip, cfg))
    assert report.completed == 4
    assert dict(report.errors) == {"RESOURCE_EXHAUSTED": 3}
    assert report.error_examples["RESOURCE_EXHAUSTED"] == "session limit 4 reached"
