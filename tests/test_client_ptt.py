"""voiced_client.ptt without a sound card: the state machine, playback and barge-in, a whole
session against a scripted in-process server, and the message when sounddevice is missing."""

from __future__ import annotations

import asyncio
import builtins
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from voiced_client import ptt
from voiced_client.audio import AudioFormat, Encoding, encode
from voiced_client.errors import ClientError
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc
from voiced_client.session import SessionOptions

from tests.until import GUARD_S, until_async


class Sink:
    """Speakers that record what they were asked to play."""

    def __init__(self, sample_rate: int = 16000) -> None:
        self.sample_rate = sample_rate
        self.buffer = ptt.PlaybackBuffer()
        self.played: list[np.ndarray] = []
        self.flushes = 0

    def play(self, pcm):
        self.played.append(pcm)
        self.buffer.write(pcm)

    def flush(self):
        self.flushes += 1
        self.buffer.clear()

    def close(self):
        pass


class Source:
    """A microphone the test pushes frames through."""

    sample_rate = 16000

    def __init__(self) -> None:
        self.on_frame = None
        self.stopped = False

    def start(self, on_frame):
        self.on_frame = on_frame

    def stop(self):
        self.stopped = True


def drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def kinds(requests) -> list[str]:
    return [
        r.control.WhichOneof("event") if r.HasField("control") else r.WhichOneof("request") for r in requests
    ]


def audio_event(reply_id: int, seq: int, n: int = 320, value: int = 1000) -> pb.SessionEvent:
    return pb.SessionEvent(
        audio=pb.AudioChunk(
            reply_id=reply_id, sequence=seq, audio=encode(np.full(n, value, np.int16), Encoding.LINEAR16)
        )
    )


async def test_toggle_sends_marks_and_audio_only_while_talking():
    sink = Sink()
    c = ptt.PttController(sink, show=lambda s: None)
    frame = np.arange(320, dtype=np.int16)
    c.on_mic_frame(frame)  # idle: the microphone stays private
    c.toggle()
    assert c.state is ptt.TalkState.TALKING
    c.on_mic_frame(frame)
    c.on_mic_frame(frame)
    c.toggle()
    assert c.state is ptt.TalkState.IDLE
    c.on_mic_frame(frame)
    sent = drain(c.requests)
    assert kinds(sent) == ["talk_start", "audio", "audio", "talk_end"]
    assert sent[1].audio == frame.astype("<i2").tobytes()
    c.quit()
    assert drain(c.requests) == [None]  # half-close


async def test_quit_while_talking_ends_the_span_first():
    c = ptt.PttController(Sink(), show=lambda s: None)
    c.toggle()
    c.quit()
    assert kinds(drain(c.requests)[:-1]) == ["talk_start", "talk_end"]


async def test_reply_audio_is_played_and_interrupt_stops_it():
    sink = Sink()
    shown = []
    c = ptt.PttController(sink, show=shown.append)
    c.handle_event(pb.SessionEvent(reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=1)))
    c.handle_event(audio_event(1, 0))
    c.handle_event(audio_event(1, 1))
    assert len(sink.played) == 2 and sink.buffer.queued == 640
    c.handle_event(
        pb.SessionEvent(
            reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_INTERRUPTED, reply_id=1, audio_sent_ms=40)
        )
    )
    assert sink.flushes == 1 and sink.buffer.queued == 0  # silent at once
    c.handle_event(audio_event(1, 2))  # a straggler of the interrupted reply is not played
    assert len(sink.played) == 2
    c.handle_event(audio_event(2, 0))  # the next reply plays
    assert len(sink.played) == 3
    assert any("interrupted" in line for line in shown)


async def test_talking_over_a_reply_stops_playback_and_the_server():
    sink = Sink()
    c = ptt.PttController(sink, show=lambda s: None)
    c.handle_event(pb.SessionEvent(reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=3)))
    c.handle_event(audio_event(3, 0))
    c.toggle()
    assert sink.flushes == 1 and sink.buffer.queued == 0
    assert kinds(drain(c.requests)) == ["stop_speaking", "talk_start"]
    c.handle_event(audio_event(3, 1))
    assert len(sink.played) == 1


async def test_no_stop_speaking_when_nothing_plays():
    c = ptt.PttController(Sink(), show=lambda s: None)
    c.handle_event(pb.SessionEvent(reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=1)))
    c.handle_event(pb.SessionEvent(reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_FINISHED, reply_id=1)))
    c.toggle()
    assert kinds(drain(c.requests)) == ["talk_start"]


async def test_output_in_another_format_is_decoded_and_resampled():
    sink = Sink(sample_rate=16000)
    c = ptt.PttController(sink, show=lambda s: None)
    c.handle_event(
        pb.SessionEvent(
            started=pb.SessionStarted(
                effective_config=pb.SessionConfig(
                    input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000),
                    output_format=pb.AudioFormat(encoding=pb.MULAW, sample_rate_hz=8000),
                )
            )
        )
    )
    c.handle_event(pb.SessionEvent(audio=pb.AudioChunk(reply_id=1, sequence=0, audio=b"\xff" * 160)))
    assert len(sink.played[0]) == 320 and sink.played[0].dtype == np.int16


def test_playback_buffer_pads_with_silence():
    b = ptt.PlaybackBuffer()
    b.write(np.array([1, 2, 3], np.int16))
    b.write(np.array([4, 5], np.int16))
    assert b.read(4).tolist() == [1, 2, 3, 4]
    assert b.read(3).tolist() == [5, 0, 0]
    assert b.queued == 0


# ------------------------------------------------------------------ a whole session over gRPC


class PttServer(pb_grpc.VoicedServicer):
    """Scripted peer: on talk_end it replies with three chunks; StopSpeaking interrupts the reply."""

    def __init__(self) -> None:
        self.received: list[pb.SessionRequest] = []
        self.talk_ended = asyncio.Event()

    async def Converse(self, request_iterator, context):
        first = await request_iterator.__anext__()
        self.received.append(first)
        yield pb.SessionEvent(
            session_id="p", started=pb.SessionStarted(session_id="p", effective_config=first.config)
        )
        async for req in request_iterator:
            self.received.append(req)
            kind = req.control.WhichOneof("event") if req.HasField("control") else None
            if kind == "talk_end":
                yield pb.SessionEvent(turn_id=1, transcript=pb.Transcript(text="hi", is_final=True))
                yield pb.SessionEvent(
                    turn_id=1, reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=1)
                )
                for seq in range(3):
                    yield audio_event(1, seq)
                self.talk_ended.set()
            elif kind == "stop_speaking":
                yield pb.SessionEvent(
                    turn_id=1,
                    reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_INTERRUPTED, reply_id=1, audio_sent_ms=60),
                )
                yield audio_event(1, 3)  # a late chunk the client must not play


async def test_run_ptt_session_against_a_server():
    servicer = PttServer()
    server = grpc.aio.server()
    pb_grpc.add_VoicedServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        source, sink, keys, shown = Source(), Sink(), asyncio.Queue(), []
        options = SessionOptions(AudioFormat(Encoding.LINEAR16, 16000), push_to_talk=True)
        task = asyncio.create_task(ptt.run_ptt(channel, options, source, sink, keys, show=shown.append))
        await until_async(lambda: source.on_frame is not None, "the microphone to start")
        keys.put_nowait("toggle")
        await until_async(lambda: any(line.startswith("● talking") for line in shown), "the talking state")
        for _ in range(5):  # the microphone delivers from its own thread
            await asyncio.to_thread(source.on_frame, np.zeros(320, np.int16))
        await until_async(lambda: kinds(servicer.received).count("audio") == 5, "the server to get 5 frames")
        keys.put_nowait("toggle")
        await until_async(servicer.talk_ended.is_set, "the reply to the turn")
        await until_async(lambda: len(sink.played) == 3, "the reply's 3 chunks to play")
        keys.put_nowait("toggle")  # talk over the reply
        keys.put_nowait("quit")  # run_ptt half-closes and reads what the server still sends
        controller = await asyncio.wait_for(task, GUARD_S)
    finally:
        await channel.close()
        await server.stop(None)
    got = kinds(servicer.received)
    assert got[0] == "config" and servicer.received[0].config.segmentation.mode == pb.PUSH_TO_TALK
    assert got[1:] == ["talk_start"] + ["audio"] * 5 + ["talk_end", "stop_speaking", "talk_start", "talk_end"]
    assert len(sink.played) == 3 and sink.flushes >= 1  # the late chunk 3 was dropped
    assert source.stopped and controller.state is ptt.TalkState.IDLE
    assert "you: hi" in shown


# ----------------------------------------------------------------------- missing sound support


def _failing_import(exc):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "sounddevice":
            raise exc
        return real(name, *args, **kwargs)

    return fake


def test_missing_sounddevice_says_what_to_install(monkeypatch):
    monkeypatch.setattr(builtins, "__import__", _failing_import(ImportError("No module named 'sounddevice'")))
    with pytest.raises(ClientError, match=r"pip install '\./client\[ptt\]'"):
        ptt.import_sounddevice()


def test_missing_portaudio_says_what_to_install(monkeypatch):
    monkeypatch.setattr(builtins, "__import__", _failing_import(OSError("PortAudio library not found")))
    with pytest.raises(ClientError, match="libportaudio2"):
        ptt.import_sounddevice()


def test_cli_prints_one_line_and_fails(monkeypatch, capsys):
    from voiced_client.cli import main

    monkeypatch.setitem(sys.modules, "sounddevice", None)  # makes `import sounddevice` fail
    assert main(["ptt", "--server", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install './client[ptt]'" in err[0] and "voiced-client[" not in err[0]


def test_no_input_device_is_a_clear_error():
    class NoDevices:
        class PortAudioError(Exception):
            pass

        def query_devices(self, device=None, kind=None):
            if kind == "input":
                raise self.PortAudioError("Error querying device -1")
            return {"default_samplerate": 48000.0}

    with pytest.raises(ClientError, match="no usable audio input device"):
        ptt.open_devices(NoDevices(), None, None)
