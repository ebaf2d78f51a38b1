"""`voiced serve --engine-process separate`: the engines in a child process of their own (voiced.engine_process),
the real daemon as a user starts it, the real tiny.en and a random Spark-TTS checkpoint in the real format, and
espeak-ng speech over gRPC stubs generated from proto/."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import Format, audio_requests, of_kind, session_config, stream_blocking, wire_audio
from tests.real_whisper import tiny_en_dir
from tests.spark_fixtures import cached_spark_checkpoint
from tests.speech import layout, need_espeak

FMT = Format("LINEAR16", 16000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(address: str):
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return None


@contextlib.contextmanager
def _serve(tmp_path_factory, http: bool = False):
    """`voiced serve` with its engines in a process of their own, once SERVING: (daemon, address, engine
    process's pid, log)."""
    need_espeak()
    spark = cached_spark_checkpoint(tmp_path_factory)
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    log = tmp_path_factory.mktemp("engine-process") / "serve.log"
    env = dict(os.environ, VOICED_CACHE=str(tmp_path_factory.mktemp("cache")))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--engine-process", "separate",
                                 "--asr-model", str(tiny_en_dir()), "--tts-model", str(spark), "--device", "cpu",
                                 "--turn-detection", "silence", "--listen", f"127.0.0.1:{port}",
                                 "--metrics-listen", f"127.0.0.1:{metrics_port}",
                                 *(["--http", f"127.0.0.1:{http_port}"] if http else [])],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while _health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        child = int(re.search(r"engines serve from process (\d+)", log.read_text()).group(1))
        yield proc, address, child, log, http_port, metrics_port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with _serve(tmp_path_factory) as daemon:
        yield daemon


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def test_a_conversation_is_transcribed_and_answered_by_the_engine_process(served):
    proc, address, child, log, _, _ = served
    assert child != proc.pid and _alive(child)
    lay = layout(["Please book a table for two people tonight."], tail_s=1.0)
    cfg = session_config(FMT, speech=pb.SpeechConfig(seed=1, max_seconds=1.0))
    cfg.output_format.CopyFrom(pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000))
    events, code, details = stream_blocking(address, audio_requests(cfg, wire_audio(lay.audio, FMT), FMT), "Converse",
                                            timeout=120)
    assert code == grpc.StatusCode.OK, details
    [final] = [e.transcript for e in of_kind(events, "transcript") if e.transcript.is_final]
    assert "table for two" in final.text.lower(), final.text
    chunks = [e.audio for e in of_kind(events, "audio")]
    assert chunks and [c.sequence for c in chunks] == list(range(len(chunks))) and chunks[-1].last
    assert sum(len(c.audio) for c in chunks) > 0.5 * 16000 * 2  # at least half the reply's second of audio


def test_both_processes_take_their_start_up_heaps_out_of_the_collectors_scans(served):
    """The engine process freezes what loading made, and the daemon's process what its own start-up made:
    unfrozen, the daemon's imports alone cost full collections of ~100 ms on the event loop mid-call."""
    proc, _, child, log, _, _ = served
    frozen = {int(pid): int(n) for n, pid in
              re.findall(r"froze \d+ objects allocated at start-up .* \((\d+) in all, process (\d+)\)", log.read_text())}
    assert set(frozen) == {proc.pid, child}, log.read_text()[-3000:]
    assert min(frozen.values()) > 10000, frozen  # each process's imports at the least


def test_voices_and_server_info_reach_through_the_engine_process(served):
    """What the daemon reads of the engines it does not hold: ServerInfo names both models; a voice added
    from a recording (its tokens computed in the engine process) is listed, speaks, and a name the server
    lacks is NOT_FOUND saying which voices it has."""
    _, address, _, _, _, _ = served
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        assert info.asr.name and info.tts.name, info
        before = {v.name for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=30).voices}
        recording = wire_audio(layout(["This is my voice, recorded for the assistant to speak with."],
                                      lead_s=0.2, tail_s=0.2).audio, FMT)
        voice = stub.AddVoice(pb.AddVoiceRequest(name="caller-voice", audio=recording, format=pb.AudioFormat(
            encoding=pb.LINEAR16, sample_rate_hz=16000), transcript="This is my voice, recorded for the "
            "assistant to speak with."), timeout=120)
        assert voice.name == "caller-voice" and voice.kind == "cloned"
        after = {v.name for v in stub.ListVoices(pb.ListVoicesRequest(), timeout=30).voices}
        assert after == before | {"caller-voice"}
        chunks = [r.audio for r in stub.Synthesize(pb.SynthesizeRequest(
            text="Your table is booked.", speech=pb.SpeechConfig(voice="caller-voice", seed=3, max_seconds=1.0)),
            timeout=120)]
        assert chunks and chunks[-1].last and sum(len(c.audio) for c in chunks) > 0
        with pytest.raises(grpc.RpcError) as missing:
            list(stub.Synthesize(pb.SynthesizeRequest(text="Hello.", speech=pb.SpeechConfig(voice="nobody")),
                                 timeout=30))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "caller-voice" in missing.value.details()


def test_the_engine_process_heap_trims_reach_the_daemons_metrics(served):
    """The engines hand free C-heap memory back to the OS when they go quiet after a wide batch
    (voiced.heap); with them in their own process that happens there, and the daemon's metrics still count
    it: two replies synthesized together, then a quiet spell, and /metrics shows the trim."""
    _, address, _, _, _, metrics_port = served

    def trims() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        found = re.search(r"^voiced_heap_trim_seconds_count (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    before = trims()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        calls = [stub.Synthesize(pb.SynthesizeRequest(text=text, speech=pb.SpeechConfig(seed=i, max_seconds=1.0)),
                                 timeout=120) for i, text in enumerate(["Your table is booked.", "See you tonight."])]
        for call in calls:  # both in flight at once: a batch of two
            assert [r.audio for r in call][-1].last
    deadline = time.monotonic() + 30
    while trims() <= before:
        assert time.monotonic() < deadline, "no heap trim reached the daemon's metrics"
        time.sleep(0.5)


def test_sigterm_lets_an_open_call_finish_then_stops_both_processes(served):
    """SIGTERM to the whole process group, as a service manager sends it, while a caller is mid-sentence:
    the daemon drains, the caller's sentence is still transcribed (the engine process outlives the signal:
    the drain's calls need it), then the daemon exits 0 and the engine process ends after it."""
    proc, address, child, log, _, _ = served
    lay = layout(["The meeting is moved to Friday morning at nine."], lead_s=0.3, tail_s=1.0)
    frames = audio_requests(session_config(FMT), wire_audio(lay.audio, FMT), FMT)
    half, sent_half, finish = len(frames) // 2, threading.Event(), threading.Event()

    def requests():
        for i, request in enumerate(frames):
            if i == half:
                sent_half.set()
                finish.wait(30)
            yield request

    result, started = {}, threading.Event()

    def call():
        with grpc.insecure_channel(address) as channel:
            events = []
            for event in pb_grpc.VoicedStub(channel).StreamingRecognize(requests(), timeout=120):
                events.append(event)
                started.set()
            result["events"] = events

    caller = threading.Thread(target=call)
    caller.start()
    # The session's first event: the daemon holds the call. The half of the requests taken from the generator
    # says only that the client buffered them: under CPU load the call could reach the server after the
    # SIGTERM, find no session to wait for, and be cancelled by the daemon's end.
    assert sent_half.wait(60) and started.wait(60)
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _health(address) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    finish.set()
    caller.join(120)
    finals = [e.transcript.text for e in of_kind(result.get("events", []), "transcript") if e.transcript.is_final]
    assert len(finals) == 1 and "friday" in finals[0].lower(), (finals, log.read_text())
    assert proc.wait(60) == 0, log.read_text()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, f"the engine process {child} outlived the daemon"
        time.sleep(0.1)
    text = log.read_text()
    assert "Traceback" not in text and "the engine process ended" not in text, text


def test_an_engine_process_that_dies_takes_the_server_out_of_service_with_a_clear_word(tmp_path_factory):
    """The engines' process killed (a driver fault, the OOM killer): gRPC health says NOT_SERVING and the
    HTTP probes 503, so a balancer moves callers on and a supervisor restarts it; a new call is refused
    UNAVAILABLE saying the server needs a restart; the daemon itself still stops cleanly."""
    with _serve(tmp_path_factory, http=True) as (proc, address, child, log, http_port, _):
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _health(address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        lay = layout(["Hello there."], tail_s=0.8)
        cfg = session_config(FMT)
        events, code, details = stream_blocking(address, audio_requests(cfg, wire_audio(lay.audio, FMT), FMT),
                                                "Converse", timeout=30)
        assert code == grpc.StatusCode.UNAVAILABLE and "engine process has stopped" in details, (code, details)
        for probe in ("healthz", "readyz"):  # a supervisor restarts it; a balancer sends callers elsewhere
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/{probe}", timeout=10)
            assert answer.value.code == 503 and b"engine process has stopped" in answer.value.read()
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
