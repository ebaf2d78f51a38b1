"""The listening daemon end to end: a real server on localhost, a tiny random Whisper checkpoint in
OpenAI's format, espeak-ng speech streamed as 20 ms frames."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import (
    MAX_NEW_TOKENS,
    audio_requests,
    daemon_config,
    frames_of,
    heard_audio,
    of_kind,
    run_stream,
    session_config,
    start_daemon,
    stream_blocking,
    wire_audio,
)
from tests.speech import RATE, layout, phrase, write_wav
from tests.until import GUARD_S, until, until_async
from tests.whisper_fixtures import make_openai_checkpoint
from voiced import heap
from voiced.audio.ingest import Format
from voiced.cli import main as voiced_main
from voiced.config import Config

PHRASES = ["The quick brown fox jumps over the lazy dog.", "Please call me back tomorrow morning.",
           "Seven apples and three oranges."]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    ckpt = make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=3)
    d = start_daemon(ckpt)
    yield d
    d.stop()


def transcribe_cli(checkpoint, audio16k_int16: np.ndarray, tmp_path, capsys) -> list[int]:
    wav = write_wav(tmp_path / "utt.wav", audio16k_int16)
    code = voiced_main(["transcribe", str(wav), "--model", str(checkpoint), "--language", "en",
                        "--max-new-tokens", str(MAX_NEW_TOKENS), "--window", Config().asr.window, "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]


def ms(samples: int) -> float:
    return samples * 1000 / RATE


@pytest.mark.parametrize("fmt", [Format("LINEAR16", 16000), Format("MULAW", 8000), Format("ALAW", 8000),
                                 Format("LINEAR16", 48000)], ids=lambda f: f"{f.encoding}-{f.sample_rate}")
def test_each_phrase_gives_one_speech_pair_and_one_transcript(daemon, fmt, tmp_path, capsys):
    lay = layout(PHRASES, gap_s=1.0)
    data = wire_audio(lay.audio, fmt)
    cfg = session_config(fmt)
    events, code, details = asyncio.run(run_stream(daemon.address, audio_requests(cfg, data, fmt)))
    assert code == grpc.StatusCode.OK, details
    started = of_kind(events, "started")[0].started
    seg = started.effective_config.segmentation
    speech = of_kind(events, "speech")
    starts = [e for e in speech if e.speech.type == pb.SpeechActivity.SPEECH_STARTED]
    ends = [e for e in speech if e.speech.type == pb.SpeechActivity.SPEECH_ENDED]
    finals = [e for e in of_kind(events, "transcript") if e.transcript.is_final]
    assert len(starts) == len(ends) == len(finals) == len(PHRASES)
    for (a, b), s, e in zip(lay.spans, starts, ends):
        assert abs(s.speech.offset_ms - ms(a)) <= 100
        assert abs(e.speech.offset_ms - (ms(b) + seg.hangover_ms)) <= 100
    assert [f.turn_id for f in finals] == [1, 2, 3]
    assert [s.turn_id for s in starts] == [1, 2, 3]

    # Each transcript's tokens equal `voiced transcribe` on the audio of that utterance.
    heard = heard_audio(data, fmt)
    for f in finals:
        t = f.transcript
        assert t.language == "en" and len(t.tokens) > 0 and t.latency_ms >= 0
        begin = int(t.start_ms * RATE // 1000) - seg.pre_roll_ms * RATE // 1000
        clip = heard[max(begin, 0) : int(t.end_ms * RATE // 1000)]
        assert list(t.tokens) == transcribe_cli(daemon.checkpoint, clip, tmp_path, capsys)


def test_the_same_events_on_either_event_loop(daemon):
    """uvloop is the daemon's loop unless server.event_loop says asyncio; a caller gets the same events
    (speech offsets, turns, transcripts' tokens) from a daemon on each."""
    import uvloop

    assert daemon_config().server.event_loop == "uvloop" and isinstance(daemon.loop, uvloop.Loop)
    config = daemon_config()
    config.server.event_loop = "asyncio"
    plain = start_daemon(daemon.checkpoint, config)
    try:
        assert not isinstance(plain.loop, uvloop.Loop)
        fmt = Format("MULAW", 8000)
        data = wire_audio(layout(PHRASES, gap_s=1.0).audio, fmt)
        heard = []
        for d in (daemon, plain):
            events, code, details = asyncio.run(run_stream(d.address, audio_requests(session_config(fmt), data, fmt)))
            assert code == grpc.StatusCode.OK, details
            heard.append([(e.turn_id, e.speech.type, e.speech.offset_ms) for e in of_kind(events, "speech")]
                         + [(e.turn_id, list(e.transcript.tokens), e.transcript.start_ms, e.transcript.end_ms)
                            for e in of_kind(events, "transcript") if e.transcript.is_final])
        assert heard[0] == heard[1] and len(heard[0]) == 3 * len(PHRASES)
    finally:
        plain.stop()


def test_push_to_talk_yields_exactly_the_marked_spans(daemon):
    fmt = Format("LINEAR16", 16000)
    lay = layout(PHRASES[:2])
    frames = frames_of(wire_audio(lay.audio, fmt), fmt)
    marks = {10: "talk_start", 70: "talk_end", 90: "talk_start", 150: "talk_end"}
    cfg = session_config(fmt, segmentation=pb.SegmentationConfig(mode=pb.PUSH_TO_TALK))
    requests = [pb.SessionRequest(config=cfg)]
    for i, f in enumerate(frames):
        if i in marks:
            requests.append(pb.SessionRequest(control=pb.Control(**{marks[i]: getattr(pb, marks[i].title().replace("_", ""))()})))
        requests.append(pb.SessionRequest(audio=f))
    events, code, details = asyncio.run(run_stream(daemon.address, requests))
    assert code == grpc.StatusCode.OK, details
    finals = [e.transcript for e in of_kind(events, "transcript")]
    assert [(t.start_ms, t.end_ms) for t in finals] == [(200, 1400), (1800, 3000)]
    speech = [(e.speech.type, e.speech.offset_ms) for e in of_kind(events, "speech")]
    S, E = pb.SpeechActivity.SPEECH_STARTED, pb.SpeechActivity.SPEECH_ENDED
    assert speech == [(S, 200), (E, 1400), (S, 1800), (E, 3000)]


def test_a_call_that_fails_while_its_first_event_is_being_sent_gets_its_status(daemon, monkeypatch):
    """The session fails (here: an error injected the moment the call's first event starts to be written)
    while that write is in flight: the caller still gets the status. grpc's aio server counts the response
    headers as sent only once the first write completes; a first write given up midway made it send them
    again with the status, which gRPC's core refuses, and the caller waited forever for an answer (seen
    once in CI, in the bad-input catalogue, on a loaded machine)."""
    from voiced.core.errors import ErrorKind, SessionError
    from voiced.core.session import Session

    real = Session.writing

    async def writing(self, write):
        error = SessionError(ErrorKind.BAD_INPUT, "failed while the first event was being written")
        asyncio.get_running_loop().call_soon(self.fail, error)  # runs once the write has started
        return await real(self, write)

    monkeypatch.setattr(Session, "writing", writing)
    cfg = session_config(Format("LINEAR16", 16000), segmentation=pb.SegmentationConfig(mode=pb.PUSH_TO_TALK),
                         recognition=pb.RecognitionConfig(disabled=True))
    requests = [pb.SessionRequest(config=cfg), pb.SessionRequest(control=pb.Control(talk_start=pb.TalkStart()))]
    _, code, details = stream_blocking(daemon.address, requests, timeout=GUARD_S)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "failed while the first event was being written")


@pytest.mark.slow
def test_fifty_concurrent_sessions_while_one_sends_garbage(daemon):
    fmt = Format("LINEAR16", 16000)
    data = wire_audio(layout([PHRASES[0]], lead_s=0.3, tail_s=0.8).audio, fmt)
    good = audio_requests(session_config(fmt), data, fmt)
    bad = [pb.SessionRequest(config=session_config(fmt)), pb.SessionRequest(audio=b"\x01" * 641)]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=51) as pool:  # all 51 calls open at once
        futures = [pool.submit(stream_blocking, daemon.address, good) for _ in range(50)]
        futures.append(pool.submit(stream_blocking, daemon.address, bad))
        results = [f.result() for f in futures]
    assert daemon.services.peak_sessions >= 50
    *goods, garbage = results
    assert garbage[1] == grpc.StatusCode.INVALID_ARGUMENT and "odd length" in garbage[2]
    tokens = set()
    for events, code, details in goods:
        assert code == grpc.StatusCode.OK, details
        finals = [e for e in of_kind(events, "transcript") if e.transcript.is_final]
        assert len(finals) == 1
        tokens.add(tuple(finals[0].transcript.tokens))
    assert len(tokens) == 1  # batched with 49 others, every caller got the same answer for the same audio
    assert daemon.services.asr.engine.active_requests() == 0
    if heap.available():
        # Quiet after that wide batch, the daemon hands the heap's freed buffers back to the OS, and counts it.
        log = daemon.services.asr.thread.step_log

        def trimmed_after_the_batch():
            entries = list(log)
            wide = max(i for i, (_, event, ids) in enumerate(entries) if event == "step" and len(ids) > 1)
            return ("engines", "trim", ()) in entries[wide:]

        until(trimmed_after_the_batch, "the heap trim after the wide batch")
        assert daemon.services.metrics.registry.get_sample_value("voiced_heap_trim_seconds_count") >= 1


def _cfg(**kw):
    return pb.SessionRequest(config=pb.SessionConfig(**kw))


L16 = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)


@pytest.mark.parametrize("requests,code,words", [
    ([pb.SessionRequest(audio=b"\0\0" * 320)], grpc.StatusCode.INVALID_ARGUMENT, "first message must be `config`"),
    ([_cfg(input_format=pb.AudioFormat(encoding=7, sample_rate_hz=16000))], grpc.StatusCode.INVALID_ARGUMENT,
     "LINEAR16, MULAW or ALAW"),
    ([_cfg(input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=4000))],
     grpc.StatusCode.INVALID_ARGUMENT, "outside 8000..48000"),
    ([_cfg(input_format=pb.AudioFormat(encoding=pb.MULAW, sample_rate_hz=96000))],
     grpc.StatusCode.INVALID_ARGUMENT, "outside 8000..48000"),
    ([_cfg(input_format=L16), pb.SessionRequest(audio=b"\0" * 321)], grpc.StatusCode.INVALID_ARGUMENT,
     "odd length"),
    ([_cfg(input_format=L16), _cfg(input_format=L16)], grpc.StatusCode.INVALID_ARGUMENT, "config was already sent"),
    ([_cfg()], grpc.StatusCode.INVALID_ARGUMENT, "input_format is required"),
    ([_cfg(input_format=L16, segmentation=pb.SegmentationConfig(vad_aggressiveness=5))],
     grpc.StatusCode.INVALID_ARGUMENT, "vad_aggressiveness 5"),
    ([_cfg(input_format=L16), pb.SessionRequest(control=pb.Control(talk_start=pb.TalkStart()))],
     grpc.StatusCode.INVALID_ARGUMENT, "PUSH_TO_TALK"),
    ([_cfg(input_format=L16), pb.SessionRequest(audio=b"\0" * (2 * 1024 * 1024))],
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
], ids=["audio-before-config", "unknown-encoding", "rate-too-low", "rate-too-high", "odd-linear16",
        "second-config", "no-format", "bad-vad", "ptt-mark-in-auto", "oversize"])
def test_bad_input_gets_the_right_status_and_says_what_to_fix(daemon, requests, code, words):
    events, got, details = asyncio.run(run_stream(daemon.address, requests))
    assert got == code, details
    assert words in details


def test_a_caller_vanishing_mid_utterance_leaves_nothing_behind(daemon):
    fmt = Format("LINEAR16", 16000)
    data = wire_audio(layout(PHRASES, gap_s=0.8).audio, fmt)
    frames = frames_of(data, fmt)

    async def vanish(after_event: str):
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.VoicedStub(channel)
            queue: asyncio.Queue = asyncio.Queue()
            await queue.put(pb.SessionRequest(config=session_config(fmt)))
            for f in frames:
                await queue.put(pb.SessionRequest(audio=f))

            async def gen():
                while True:
                    yield await queue.get()

            call = stub.StreamingRecognize(gen())
            async for ev in call:
                if ev.WhichOneof("event") == "speech" and ev.speech.type == getattr(pb.SpeechActivity, after_event):
                    call.cancel()  # the caller is gone: no half-close, no goodbye
                    break

    for point in ("SPEECH_STARTED", "SPEECH_ENDED"):
        asyncio.run(vanish(point))
        until(lambda: daemon.services.active_sessions == 0 and not daemon.session_tasks(), "the session to end")
        assert daemon.services.asr.pending == 0
        until(lambda: daemon.services.asr.engine.active_requests() == 0, "the engine to drop the request")


def test_speech_events_only_when_transcription_is_off(daemon):
    fmt = Format("LINEAR16", 16000)
    data = wire_audio(layout(PHRASES[:2]).audio, fmt)
    cfg = session_config(fmt, recognition=pb.RecognitionConfig(disabled=True))
    events, code, _ = asyncio.run(run_stream(daemon.address, audio_requests(cfg, data, fmt)))
    assert code == grpc.StatusCode.OK
    assert len(of_kind(events, "speech")) == 4 and of_kind(events, "transcript") == []


def test_interim_results_come_before_the_final_of_their_turn(daemon):
    fmt = Format("LINEAR16", 16000)
    speech = layout([PHRASES[0] + " " + PHRASES[1]])
    data = wire_audio(speech.audio, fmt)
    cfg = session_config(fmt, recognition=pb.RecognitionConfig(interim_results=True, word_timestamps=True))
    # The caller pauses mid-sentence (1.5 s into the speech, past the first interim request) until an
    # interim result arrives, whatever the engine's speed: an interim is only sent while speech goes on.
    hold_at = (speech.spans[0][0] + int(1.5 * RATE)) * 2 // len(frames_of(data, fmt)[0])

    async def caller():
        reqs = audio_requests(cfg, data, fmt)
        interim = asyncio.Event()
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.VoicedStub(channel)

            async def gen():
                for i, r in enumerate(reqs):
                    yield r
                    if i == 1 + hold_at:
                        await asyncio.wait_for(interim.wait(), GUARD_S)

            events = []
            async for ev in stub.StreamingRecognize(gen()):
                events.append(ev)
                if ev.WhichOneof("event") == "transcript" and not ev.transcript.is_final:
                    interim.set()
            return events

    events = asyncio.run(caller())
    transcripts = [e.transcript for e in of_kind(events, "transcript")]
    assert transcripts[-1].is_final and sum(t.is_final for t in transcripts) == 1
    assert any(not t.is_final for t in transcripts)
    # Word timings are for final transcripts only.
    assert transcripts[-1].words and not any(t.words for t in transcripts if not t.is_final)


def word_times_cli(checkpoint, audio16k_int16: np.ndarray, tmp_path, capsys) -> list[tuple[str, float, float]]:
    wav = write_wav(tmp_path / "utt.wav", audio16k_int16)
    code = voiced_main(["transcribe", str(wav), "--model", str(checkpoint), "--language", "en",
                        "--max-new-tokens", str(MAX_NEW_TOKENS), "--word-timestamps", "--window", Config().asr.window,
                        "--json"])
    assert code == 0
    words = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["words"]
    return [(w["word"], w["start"], w["end"]) for w in words]


def test_word_timestamps_in_streaming_finals_and_recognize(daemon, tmp_path, capsys):
    fmt = Format("MULAW", 8000)
    lay = layout(PHRASES[:2], gap_s=1.0)
    data = wire_audio(lay.audio, fmt)
    cfg = session_config(fmt, recognition=pb.RecognitionConfig(word_timestamps=True))
    events, code, details = asyncio.run(run_stream(daemon.address, audio_requests(cfg, data, fmt)))
    assert code == grpc.StatusCode.OK, details
    assert of_kind(events, "started")[0].started.effective_config.recognition.word_timestamps
    finals = [e.transcript for e in of_kind(events, "transcript")]
    assert len(finals) == 2
    heard = heard_audio(data, fmt)
    pre_roll = of_kind(events, "started")[0].started.effective_config.segmentation.pre_roll_ms
    for t in finals:
        # The words of `voiced transcribe --word-timestamps` on the utterance's audio, moved to the
        # caller's clock (the utterance's audio starts pre_roll_ms before its start_ms).
        begin = t.start_ms - pre_roll
        clip = heard[begin * RATE // 1000: t.end_ms * RATE // 1000]
        want = word_times_cli(daemon.checkpoint, clip, tmp_path, capsys)
        assert len(want) > 0
        assert [(w.word, w.start_ms, w.end_ms) for w in t.words] == [(w, round(s * 1000) + begin,
                                                                      round(e * 1000) + begin) for w, s, e in want]
        assert all(0 <= w.probability <= 1 for w in t.words)
    # Without asking, no words
    events, _, _ = asyncio.run(run_stream(daemon.address, audio_requests(session_config(fmt), data, fmt)))
    assert not any(e.transcript.words for e in of_kind(events, "transcript"))

    # Recognize: the same words for one clip, in the clip's time
    clip = (np.clip(phrase(PHRASES[1]), -1, 1) * 32767).astype(np.int16)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        resp = stub.Recognize(pb.RecognizeRequest(format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000),
                                                  audio=clip.tobytes(),
                                                  recognition=pb.RecognitionConfig(word_timestamps=True)))
    want = word_times_cli(daemon.checkpoint, clip, tmp_path, capsys)
    (result,) = resp.results
    assert [(w.word, w.start_ms, w.end_ms) for w in result.words] == [(w, round(s * 1000), round(e * 1000))
                                                                      for w, s, e in want]


def test_session_limit_answers_resource_exhausted(daemon):
    fmt = Format("LINEAR16", 16000)
    limits = daemon.services.config.server
    old, limits.max_sessions = limits.max_sessions, 0
    try:
        _, code, details = asyncio.run(run_stream(daemon.address, [pb.SessionRequest(config=session_config(fmt))]))
    finally:
        limits.max_sessions = old
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 0 concurrent sessions" in details


def test_recognize_a_wav_clip_and_server_info(daemon):
    audio = phrase(PHRASES[1])
    buf = io.BytesIO()
    import wave

    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22050)
        import soxr

        w.writeframes((np.clip(soxr.resample(audio, RATE, 22050), -1, 1) * 32767).astype("<i2").tobytes())
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        resp = stub.Recognize(pb.RecognizeRequest(audio=buf.getvalue()))
        assert len(resp.results) == 1 and len(resp.results[0].tokens) > 0
        assert abs(resp.duration_s - len(audio) / RATE) < 0.01
        with pytest.raises(grpc.RpcError) as e:
            stub.Recognize(pb.RecognizeRequest(audio=b"\0\0" * 100))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "format is required" in e.value.details()
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.asr.backend == "torch" and info.asr.device == "cpu" and not info.HasField("tts")
        assert "echo" in info.agents and info.min_sample_rate_hz == 8000
        assert [(d.name, d.address) for d in info.doors] == [("grpc", daemon.address)]


def test_health_and_reflection(daemon):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "voiced.v1.Voiced"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "voiced.v1.Voiced" in services and "grpc.health.v1.Health" in services


def test_health_is_not_serving_while_models_load_and_during_drain(tmp_path):
    import threading

    from tests.daemon_harness import daemon_config
    from voiced.core.services import Engines
    from voiced.daemon import Daemon

    release = threading.Event()

    def slow_load():
        release.wait(30)
        return Engines()  # (none: the requests below never reach an engine)

    async def scenario():
        server = Daemon(daemon_config(), load=slow_load)
        starting = asyncio.create_task(server.start())
        await until_async(lambda: server.port, "the server to listen")
        address = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    r = await health.Check(health_pb2.HealthCheckRequest())
                    break
                await asyncio.sleep(0.02)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            _, code, details = await run_stream(address, [pb.SessionRequest(config=session_config(Format("LINEAR16", 16000)))])
            assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
            release.set()
            await starting
            r = await health.Check(health_pb2.HealthCheckRequest())
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            server.services.draining = True  # what SIGTERM starts with
            _, code, details = await run_stream(address, [pb.SessionRequest(config=session_config(Format("LINEAR16", 16000)))])
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        await server.drain_and_stop(grace=0)

    asyncio.run(scenario())


def test_bearer_token_is_required_when_configured(tmp_path):
    from tests.daemon_harness import daemon_config
    from voiced.daemon import running

    config = daemon_config()
    config.server.auth_token = "s3cret"

    async def scenario():
        async with running(config) as server:
            address = f"127.0.0.1:{server.port}"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.VoicedStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.GetServerInfo(pb.GetServerInfoRequest())
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=[("authorization", "Bearer nope")])
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                info = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=[("authorization", "Bearer s3cret")])
                assert info.version
                _, code, _ = await run_stream(address, [pb.SessionRequest(config=session_config(Format("LINEAR16", 16000)))])
                assert code == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(channel)  # load balancers probe without a token
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())


@pytest.mark.slow
def test_sigterm_drains_then_exits_and_metrics_are_served(daemon, tmp_path):
    """The real `voiced serve` process: SIGTERM stops new sessions, lets the open one finish, exits 0."""
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time
    import urllib.request

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--asr-model", str(daemon.checkpoint),
                             "--no-tts", "--device", "cpu", "--listen", f"127.0.0.1:{port}",
                             "--metrics-listen", f"127.0.0.1:{mport}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    if health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
            fmt = Format("LINEAR16", 16000)
            frames = frames_of(wire_audio(layout([PHRASES[0]], lead_s=0.3, tail_s=0.8).audio, fmt), fmt)
            half = len(frames) // 2
            sent_half = threading.Event()
            finish = threading.Event()

            def requests():
                yield pb.SessionRequest(config=session_config(fmt))
                for i, f in enumerate(frames):
                    if i == half:
                        sent_half.set()
                        finish.wait(30)
                    yield pb.SessionRequest(audio=f)

            result = {}
            caller = threading.Thread(target=lambda: result.update(
                events=list(pb_grpc.VoicedStub(channel).StreamingRecognize(requests()))))
            caller.start()
            assert sent_half.wait(GUARD_S)

            def metrics():
                return urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=GUARD_S).read().decode()

            until(lambda: 'voiced_sessions_active{front="grpc"} 1.0' in metrics(), "the session in the metrics", interval_s=0.05)
            assert "voiced_asr_latency_seconds_bucket" in metrics()
            proc.send_signal(signal.SIGTERM)
            while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                time.sleep(0.05)
            _, code, details = stream_blocking(address, [pb.SessionRequest(config=session_config(fmt))])
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
            finish.set()  # the open session finishes its utterance and gets its transcript
            caller.join(30)
            assert [e.transcript.is_final for e in result["events"] if e.WhichOneof("event") == "transcript"] == [True]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_full_recognition_queue_is_a_clear_retryable_error_not_a_crash(daemon):
    engine = daemon.services.asr.engine
    fmt = Format("LINEAR16", 16000)
    data = wire_audio(layout(PHRASES[:2], gap_s=1.0).audio, fmt)
    engine.max_queue = 0  # no room for anything: every submission is refused
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.VoicedStub(channel).Recognize(pb.RecognizeRequest(
                    audio=data, format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.value.details()
        events, code, details = stream_blocking(daemon.address, audio_requests(session_config(fmt), data, fmt))
        assert code == grpc.StatusCode.OK, details
        assert [e.notice.code for e in of_kind(events, "notice")] == ["ASR_BUSY", "ASR_BUSY"]
        assert len(of_kind(events, "speech")) == 4  # the session went on hearing the caller
    finally:
        engine.max_queue = None
    events, code, _ = stream_blocking(daemon.address, audio_requests(session_config(fmt), data, fmt))
    assert code == grpc.StatusCode.OK and len(of_kind(events, "transcript")) == 2  # and recovers


def test_hallucinations_are_dropped_unless_asked_for(daemon):
    """Thresholds that judge every result a hallucination: dropped, counted, or sent flagged on request."""
    fmt = Format("LINEAR16", 16000)
    data = wire_audio(layout(PHRASES[:2], gap_s=1.0).audio, fmt)
    strict = pb.RecognitionConfig(no_speech_threshold=-1.0, logprob_threshold=0.0)
    dropped = daemon.services.metrics.transcripts_dropped._value.get()
    events, code, _ = stream_blocking(daemon.address, audio_requests(session_config(fmt, recognition=strict), data, fmt))
    assert code == grpc.StatusCode.OK
    assert of_kind(events, "transcript") == [] and len(of_kind(events, "speech")) == 4
    assert daemon.services.metrics.transcripts_dropped._value.get() == dropped + 2
    drops = of_kind(events, "dropped")  # the caller learns what was dropped and why
    assert [e.turn_id for e in drops] == [e.turn_id for e in of_kind(events, "speech")][1::2]
    for e in drops:
        assert "no-speech probability" in e.dropped.reason and "under 0" in e.dropped.reason, e.dropped
        assert e.dropped.end_ms > e.dropped.start_ms
    strict.keep_hallucinations = True
    events, code, _ = stream_blocking(daemon.address, audio_requests(session_config(fmt, recognition=strict), data, fmt))
    assert [e.transcript.is_hallucination for e in of_kind(events, "transcript")] == [True, True]
