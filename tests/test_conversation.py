"""The conversation end to end: agents, replies spoken back in the caller's format, barge-in, voices
over the wire. Tiny random Whisper and Spark-TTS checkpoints in their real formats, a real server."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import pytest
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import (
    audio_requests,
    collector_off,
    daemon_config,
    frames_of,
    of_kind,
    session_config,
    start_daemon,
    stream_blocking,
    wire_audio,
)
from tests.spark_fixtures import cached_spark_checkpoint
from tests.speech import RATE, layout, write_wav
from tests.until import GUARD_S, until, until_async
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format
from voiced.cli import main as voiced_main

SEED = 11
REPLY_S = 1.0  # cap on each reply: random LMs never stop on their own
PHONE = Format("MULAW", 8000)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_openai_checkpoint(root / "whisper", seed=3), cached_spark_checkpoint(tmp_path_factory)


def _tts(spark, voices_dir):
    from voiced.engines.spark.engine import SparkTTSEngine

    return SparkTTSEngine.load(str(spark), device="cpu", max_batch=4, voices_dir=voices_dir)


@pytest.fixture(scope="module")
def daemon(models, tmp_path_factory):
    whisper, spark = models
    config = daemon_config()
    config.tts.enabled = True
    config.tts.first_chunk_tokens = 5
    config.tts.chunk_tokens = 10
    d = start_daemon(whisper, config, tts_engine=_tts(spark, tmp_path_factory.mktemp("voices")))
    yield d
    d.stop()


def converse_config(**kw) -> pb.SessionConfig:
    cfg = session_config(PHONE, speech=pb.SpeechConfig(seed=SEED, max_seconds=REPLY_S), **kw)
    cfg.output_format.CopyFrom(pb.AudioFormat(encoding=pb.MULAW, sample_rate_hz=8000))
    return cfg


def test_echo_loopback_on_a_phone_line_equals_voiced_speak(daemon, models, tmp_path, capsys):
    lay = layout(["Hello, I would like to book a table for two."], tail_s=0.8)
    data = wire_audio(lay.audio, PHONE)
    events, code, details = stream_blocking(daemon.address, audio_requests(converse_config(), data, PHONE), "Converse")
    assert code == grpc.StatusCode.OK, details
    [final] = [e.transcript for e in of_kind(events, "transcript") if e.transcript.is_final]
    texts = [e.agent_text for e in of_kind(events, "agent_text")]
    assert "".join(t.text for t in texts) == final.text.strip() and texts[-1].last
    chunks = [e.audio for e in of_kind(events, "audio")]
    assert [c.sequence for c in chunks] == list(range(len(chunks))) and chunks[-1].last
    assert chunks[0].latency_ms > 0
    replies = [e.reply.type for e in of_kind(events, "reply")]
    assert replies == [pb.ReplyEvent.REPLY_STARTED, pb.ReplyEvent.REPLY_FINISHED]
    streamed = b"".join(c.audio for c in chunks)

    # The same text, voice and seed offline, through the same conversion to 8 kHz mu-law.
    out = tmp_path / "offline.wav"
    assert voiced_main(["speak", final.text.strip(), "--model", str(models[1]), "--seed", str(SEED),
                        "--max-seconds", str(REPLY_S), "--device", "cpu", "--out", str(out),
                        "--encoding", "mulaw", "--sample-rate", "8000"]) == 0
    raw = out.read_bytes()
    assert raw[20:22] == b"\x07\x00"  # a mu-law WAV (format tag 7), as telephony tools expect
    offline = raw[raw.index(b"data") + 8 :][: int.from_bytes(raw[raw.index(b"data") + 4 : raw.index(b"data") + 8], "little")]
    assert len(streamed) > 0 and streamed == offline


def _barge_in(daemon, min_speech_ms: int, enabled: bool = True):
    """Speak, wait for the reply to start streaming, then talk over it.

    Returns the events up to the final transcript of the interruption (then the caller hangs up) and
    how many TTS requests the engine had cancelled shortly after REPLY_INTERRUPTED arrived.
    """
    question = wire_audio(layout(["What time does the shop open tomorrow?"], tail_s=0.7).audio, PHONE)
    interruption = frames_of(wire_audio(layout(["No wait, stop, I meant on Sunday."], lead_s=0.0,
                                                tail_s=1.0).audio, PHONE), PHONE)
    silence = frames_of(wire_audio(np.zeros(RATE // 50, np.float32), PHONE), PHONE)[0]
    # French, which the over-talk word lists do not cover: the length alone decides, on the frame that
    # reaches the minimum (the words' rule runs on real speech in tests/test_overtalk_session.py).
    cfg = converse_config(barge_in=pb.BargeInConfig(enabled=enabled, min_speech_ms=min_speech_ms),
                          recognition=pb.RecognitionConfig(language="fr"))
    cfg.speech.max_seconds = 30.0  # a long reply: still being written when the caller cuts in
    worker = daemon.services.tts
    seen: dict = {}

    async def run():
        events = []
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            call = pb_grpc.VoicedStub(channel).Converse()
            await call.write(pb.SessionRequest(config=cfg))
            for f in frames_of(question, PHONE):
                await call.write(pb.SessionRequest(audio=f))
            got_audio, heard_twice = asyncio.Event(), asyncio.Event()

            async def read():
                async for ev in call:
                    events.append(ev)
                    kind = ev.WhichOneof("event")
                    if kind == "audio":
                        got_audio.set()
                    elif kind == "reply" and ev.reply.type == pb.ReplyEvent.REPLY_INTERRUPTED:
                        # the engine applies the cancellation on its own thread
                        await until_async(lambda: worker.stats.cancelled > seen["cancelled_before"],
                                          "the reply's cancellation to reach the engine")
                        seen["cancelled_at_cut"] = worker.stats.cancelled
                    elif kind == "transcript" and ev.transcript.is_final and ev.turn_id == 2:
                        heard_twice.set()
                        return

            seen["cancelled_before"] = worker.stats.cancelled
            reader = asyncio.create_task(read())
            while not got_audio.is_set():  # real-time silence until the reply streams
                await call.write(pb.SessionRequest(audio=silence))
                await asyncio.sleep(0.02)
            # The interruption goes out as fast as the caller can send it: the reply is cut in the
            # caller's audio time either way, and this way it is still being written (a tiny random
            # model writes its whole reply in under a second on the CPU).
            for f in interruption:
                await call.write(pb.SessionRequest(audio=f))
            while not heard_twice.is_set():
                await call.write(pb.SessionRequest(audio=silence))
                await asyncio.sleep(0.02)
            await asyncio.wait_for(reader, GUARD_S)
            call.cancel()  # hang up
        return events

    return asyncio.run(run()), seen


def test_barge_in_cuts_the_reply_at_once_and_frees_its_slot(daemon):
    worker = daemon.services.tts
    events, seen = _barge_in(daemon, min_speech_ms=300)
    cut = next(i for i, e in enumerate(events) if e.WhichOneof("event") == "reply"
               and e.reply.type == pb.ReplyEvent.REPLY_INTERRUPTED)
    interrupted = events[cut].reply
    # Not one chunk of that reply after INTERRUPTED.
    assert not any(e.audio.reply_id == interrupted.reply_id for e in events[cut:] if e.WhichOneof("event") == "audio")
    sent = sum(len(e.audio.audio) for e in events[:cut] if e.WhichOneof("event") == "audio")
    assert interrupted.audio_sent_ms == sent * 1000 // 8000
    # The cut came within 100 ms of caller audio after the minimum speech duration.
    barge_start = [e.speech.offset_ms for e in events[:cut] if e.WhichOneof("event") == "speech"
                   and e.speech.type == pb.SpeechActivity.SPEECH_STARTED][-1]
    assert 0 <= interrupted.caller_offset_ms - (barge_start + 300) <= 100
    # The barge-in cancelled the reply's request in the engine...
    assert seen["cancelled_at_cut"] == seen["cancelled_before"] + 1
    assert daemon.services.metrics.barge_ins._value.get() >= 1
    # The interruption itself is heard; then the caller hangs up and every slot is given back.
    assert any(e.WhichOneof("event") == "transcript" and e.turn_id == 2 for e in events[cut:])
    until(lambda: worker.engine.active_requests() == 0 and worker.pending == 0, "the TTS slots to be freed")
    # ... while it was still being written: the engine thread logs a cancel only for a request it holds.
    log = list(worker.thread.step_log)
    cancelled = [ids[0] for name, event, ids in log if (name, event) == ("tts", "cancel")]
    assert cancelled and ("tts", "done", (cancelled[-1],)) not in log


def test_barge_in_can_be_switched_off(daemon):
    events, _ = _barge_in(daemon, min_speech_ms=300, enabled=False)
    assert any(e.WhichOneof("event") == "transcript" and e.turn_id == 2 for e in events)
    assert not any(e.WhichOneof("event") == "reply" and e.reply.type == pb.ReplyEvent.REPLY_INTERRUPTED
                   for e in events)


def test_client_driven_speak_and_stop(daemon):
    silence = wire_audio(np.zeros(RATE, np.float32), PHONE)
    requests = audio_requests(converse_config(agent=pb.AgentConfig(name="client")), silence, PHONE)
    requests.insert(2, pb.SessionRequest(control=pb.Control(speak=pb.Speak(text="Welcome to the shop."))))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    assert of_kind(events, "agent_text") == []  # the caller wrote it: nothing to echo
    assert [e.reply.text for e in of_kind(events, "reply")][0] == "Welcome to the shop."
    assert of_kind(events, "audio")[-1].audio.last
    bad = audio_requests(converse_config(), silence, PHONE)
    bad.insert(1, pb.SessionRequest(control=pb.Control(speak=pb.Speak(text="  "))))
    _, code, details = stream_blocking(daemon.address, bad, "Converse")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "speak.text is empty" in details


def test_typed_text_is_answered_and_spoken_like_a_spoken_turn(daemon):
    """A desktop client types instead of talking: the echo agent answers it and the reply is spoken."""
    requests = [pb.SessionRequest(config=converse_config()), pb.SessionRequest(text="Is the shop open today?")]
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    assert [t.agent_text.text for t in of_kind(events, "agent_text")] == ["Is the shop open today?"]
    assert of_kind(events, "transcript") == []  # nothing was heard: the text was the turn
    replies = [e.reply.type for e in of_kind(events, "reply")]
    assert replies == [pb.ReplyEvent.REPLY_STARTED, pb.ReplyEvent.REPLY_FINISHED]
    chunks = [e.audio for e in of_kind(events, "audio")]
    assert chunks and chunks[-1].last and len(b"".join(c.audio for c in chunks)) >= 8000 * 0.1


def test_an_agent_ends_the_call_after_its_last_words(daemon):
    """The caller stays on the line; the agent says goodbye and hangs up: the reply plays out, a
    HANGUP notice says why, and the stream ends with OK."""
    from voiced.core.agents import EndCall

    class Goodbye:
        async def reply(self, text):
            yield "Thank you for calling."
            yield EndCall("the caller was helped")

    daemon.services.agents.register("goodbye", lambda config, prompt: Goodbye())
    lay = layout(["I would like to cancel my order."], tail_s=0.8)
    requests = audio_requests(converse_config(agent=pb.AgentConfig(name="goodbye")), wire_audio(lay.audio, PHONE), PHONE)
    hung_up = threading.Event()

    def caller():
        yield from requests
        hung_up.wait(120)  # never hangs up by itself

    with grpc.insecure_channel(daemon.address) as channel:
        call = pb_grpc.VoicedStub(channel).Converse(caller())
        events = list(call)
        hung_up.set()
        assert call.code() == grpc.StatusCode.OK
    assert [e.agent_text.text for e in of_kind(events, "agent_text")] == ["Thank you for calling."]
    assert of_kind(events, "audio")[-1].audio.last
    assert events[-2].reply.type == pb.ReplyEvent.REPLY_FINISHED
    assert events[-1].notice.code == "HANGUP" and events[-1].notice.message == "the caller was helped"


def test_a_refused_session_leaves_nothing_behind(daemon):
    """A caller refused mid-stream (INVALID_ARGUMENT) must not leave its session, audio buffers and
    codecs alive in the server: gRPC keeps the abort exception, which used to hold them all."""
    import gc

    from voiced.audio.ingest import FrameDecoder
    from voiced.core.session import Session

    def alive():
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (Session, FrameDecoder)]

    # Only this test's sessions are judged: another test's may still be winding down in the process.
    earlier = weakref.WeakSet(alive())
    silence = wire_audio(np.zeros(RATE, np.float32), PHONE)
    bad = audio_requests(converse_config(), silence, PHONE)
    bad.insert(1, pb.SessionRequest(control=pb.Control(speak=pb.Speak(text="  "))))
    for _ in range(3):
        _, code, _ = stream_blocking(daemon.address, bad, "Converse")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    until(lambda: not [o for o in alive() if o not in earlier], "the refused sessions to be collected",
          interval_s=0.05)


def test_a_finished_call_is_freed_when_it_ends_not_by_the_collector(daemon):
    """A call that ran to its end (a turn heard, answered and spoken) leaves nothing in a reference cycle: its
    session, conversation, segmenter and codecs go as soon as the call does. Objects in a cycle outlive the
    call until the collector's next full pass, which pauses the event loop every caller shares for as long
    as it takes to free them (60 ms at 224 callers on an H200, docs/BENCHMARKS.md session 25)."""
    lay = layout(["Hello, I would like to book a table for two."], tail_s=0.8)
    requests = audio_requests(converse_config(), wire_audio(lay.audio, PHONE), PHONE)
    with collector_off() as new_call_objects:
        events, code, details = stream_blocking(daemon.address, requests, "Converse")
        assert code == grpc.StatusCode.OK, details
        assert of_kind(events, "audio")[-1].audio.last  # answered and spoken to the end
        until(lambda: not new_call_objects(), "the finished call's objects to be freed", timeout_s=10,
              interval_s=0.05)


# ----------------------------------------------------------------------------- the openai agent


class FakeLLM(BaseHTTPRequestHandler):
    """A real OpenAI-compatible HTTP endpoint (server-sent events), scripted by the test."""

    stall: threading.Event | None = None  # set: answer only once it is set (the agent times out first)
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeLLM.seen.append(body)
        if FakeLLM.stall is not None:
            FakeLLM.stall.wait(GUARD_S)
            return  # the agent gave up long ago: nothing to answer
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        answer = "Sure. The shop opens at nine in the morning. See you then!"
        for i in range(0, len(answer), 7):
            delta = {"choices": [{"index": 0, "delta": {"content": answer[i : i + 7]}}]}
            self.wfile.write(f"data: {json.dumps(delta)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture()
def llm():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeLLM.seen, FakeLLM.stall = [], None
    yield server
    if FakeLLM.stall is not None:
        FakeLLM.stall.set()
    server.shutdown()


@pytest.fixture(scope="module")
def listening(models):
    """A --no-tts daemon whose default agent is `openai`: agent text without speech."""
    config = daemon_config()
    config.agent.default = "openai"
    config.agent.openai_timeout_s = 1.0
    d = start_daemon(models[0], config)
    yield d
    d.stop()


def _two_turns():
    return wire_audio(layout(["When do you open?", "And on Sunday?"], gap_s=1.0).audio, PHONE)


def test_openai_agent_streams_sentences_and_keeps_history(listening, llm):
    listening.services.config.agent.openai_base_url = f"http://127.0.0.1:{llm.server_port}/v1"
    cfg = converse_config(agent=pb.AgentConfig(system_prompt="Be brief."))
    events, code, details = stream_blocking(listening.address, audio_requests(cfg, _two_turns(), PHONE), "Converse")
    assert code == grpc.StatusCode.OK, details
    texts = [e.agent_text for e in of_kind(events, "agent_text")]
    assert texts[0].text == "Sure. The shop opens at nine in the morning." and texts[1].text == "See you then!"
    assert texts[1].last and texts[0].latency_ms > 0
    assert len(FakeLLM.seen) == 2
    second = FakeLLM.seen[1]["messages"]
    assert second[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"].startswith("Sure.") and FakeLLM.seen[1]["stream"] is True


def test_typed_text_reaches_the_llm_as_a_user_turn_and_a_listening_server_answers_in_text(listening, llm):
    listening.services.config.agent.openai_base_url = f"http://127.0.0.1:{llm.server_port}/v1"
    # The audio goes in at once, faster than real time: on a loaded machine the second turn could start while
    # the first one's answer streams, and talking over it cuts it (barge-in, with the exchange dropped from the
    # history: seen once in a fresh-clone run). Each answer is to be heard whole here.
    requests = audio_requests(converse_config(barge_in=pb.BargeInConfig(enabled=False)), _two_turns(), PHONE)
    requests.insert(1, pb.SessionRequest(text="Hi, I am typing."))  # typed first, then two spoken turns
    events, code, details = stream_blocking(listening.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    assert len(FakeLLM.seen) == 3 and FakeLLM.seen[0]["messages"][1:] == [{"role": "user", "content": "Hi, I am typing."}]
    assert [m["role"] for m in FakeLLM.seen[2]["messages"]] == ["system"] + ["user", "assistant"] * 2 + ["user"]
    assert len(of_kind(events, "agent_text")) == 6 and of_kind(events, "audio") == []  # no TTS: text only
    assert [e.reply.type for e in of_kind(events, "reply")].count(pb.ReplyEvent.REPLY_FINISHED) == 3


def test_openai_agent_down_or_slow_gives_a_notice_and_the_session_goes_on(listening, llm):
    config = listening.services.config.agent
    for url, stall, code_word in ((f"http://127.0.0.1:{_free_port()}/v1", None, "AGENT_UNAVAILABLE"),
                                  (f"http://127.0.0.1:{llm.server_port}/v1", threading.Event(), "AGENT_TIMEOUT")):
        config.openai_base_url, FakeLLM.stall = url, stall  # a stalled endpoint: never answers in time
        events, code, details = stream_blocking(listening.address, audio_requests(converse_config(), _two_turns(),
                                                                                  PHONE), "Converse")
        assert code == grpc.StatusCode.OK, details
        notices = [e for e in of_kind(events, "notice")]
        assert len(notices) == 2 and all(n.notice.code == code_word for n in notices)
        assert url.split("/v1")[0] in notices[0].notice.message
        # Both turns were still heard and transcribed.
        assert len([e for e in of_kind(events, "transcript") if e.transcript.is_final]) == 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- voices over the wire


def test_synthesize_and_add_voice_through_reflection_then_speak_with_it(daemon, tmp_path):
    from tests.test_grpcurl import Grpcurl

    ref = write_wav(tmp_path / "ref.wav", layout(["This is my voice, recorded for the assistant."], lead_s=0.2,
                                                  tail_s=0.2).audio)
    with grpc.insecure_channel(daemon.address) as channel:
        grpcurl = Grpcurl(channel)
        body = json.dumps({"name": "alice", "audio": base64.b64encode(ref.read_bytes()).decode(),
                           "transcript": "This is my voice, recorded for the assistant."})
        added = grpcurl(["grpcurl", "-plaintext", "-d", body, daemon.address, "voiced.v1.Voiced/AddVoice"])
        assert added == {"name": "alice", "kind": "cloned", "description": added["description"]}
        voices = grpcurl(["grpcurl", "-plaintext", daemon.address, "voiced.v1.Voiced/ListVoices"])["voices"]
        assert "alice" in [v["name"] for v in voices] and "female" in [v["name"] for v in voices]

        # Synthesize is server streaming: read it the way grpcurl prints it, one JSON object per message.
        stub = pb_grpc.VoicedStub(channel)
        request = pb.SynthesizeRequest(text="Thanks for calling.", speech=pb.SpeechConfig(
            voice="alice", seed=SEED, max_seconds=REPLY_S))
        chunks = [r.audio for r in stub.Synthesize(request)]
        assert [c.sequence for c in chunks] == list(range(len(chunks))) and chunks[-1].last
        assert sum(len(c.audio) for c in chunks) == int(REPLY_S * RATE) * 2  # LINEAR16 16 kHz by default
        again = b"".join(r.audio.audio for r in stub.Synthesize(request))
        assert again == b"".join(c.audio for c in chunks)  # same voice, text and seed: same audio

        with pytest.raises(grpc.RpcError) as e:
            list(stub.Synthesize(pb.SynthesizeRequest(text="Hi.", speech=pb.SpeechConfig(voice="nobody"))))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nobody' is not a voice" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.AddVoice(pb.AddVoiceRequest(name="bob", audio=ref.read_bytes(), transcript=""))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "transcript is empty" in e.value.details()


def test_listening_only_server_refuses_speech_rpcs_clearly(listening):
    with grpc.insecure_channel(listening.address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Synthesize(pb.SynthesizeRequest(text="Hello.")))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--no-tts" in e.value.details()

