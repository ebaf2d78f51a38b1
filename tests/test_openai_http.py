"""OpenAI's audio API on the HTTP door, driven by clients we did not write: the official `openai` SDK
and curl. A real daemon with tiny random Whisper and Spark-TTS checkpoints; espeak-ng speech."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import subprocess

import pytest

from tests.daemon_harness import FAULT_TEXT, engine_fault
from tests.http_harness import INPUT_CHARS, REPLY_S, UPLOAD_LIMIT, base_url, make_models, start_http_daemon
from tests.openai_models import strict
from tests.speech import layout, write_wav
from voiced.audio.files import decode_file

openai = pytest.importorskip("openai")
sf = pytest.importorskip("soundfile")

PHRASES = ["The quick brown fox jumps over the lazy dog.", "Please call me back tomorrow morning."]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon(make_models(tmp_path_factory), tmp_path_factory.mktemp("voices"))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    lay = layout(PHRASES, gap_s=0.8, tail_s=0.5)
    return lay.audio, write_wav(tmp_path_factory.mktemp("clip") / "clip.wav", lay.audio)


def client(daemon, **kw):
    return openai.AsyncOpenAI(base_url=base_url(daemon) + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0,
                              **kw)


def run(go, daemon=None):
    """Runs `go(client)` (or the coroutine `go`) on a fresh loop, closing the client after."""
    if daemon is None:
        return asyncio.run(go)

    async def main():
        async with client(daemon) as c:
            return await go(c)

    return asyncio.run(main())


def timed_text(daemon, wav: bytes) -> str:
    """The clip's words as every response format of the HTTP API says them (one decode, with timestamps)."""
    async def go(c):
        return await c.audio.transcriptions.create(file=("clip.wav", wav, "audio/wav"), model="whisper-1",
                                                   response_format="verbose_json")

    return run(go, daemon).text


def test_probes_answer_as_kubernetes_expects(daemon):
    import urllib.request

    for path, body in (("/healthz", {"status": "ok"}), ("/readyz", {"status": "ready"})):
        with urllib.request.urlopen(base_url(daemon) + path) as r:
            assert r.status == 200 and json.loads(r.read()) == body


def test_transcription_in_every_response_format_says_the_same_words(daemon, clip):
    _, wav = clip
    data = wav.read_bytes()

    async def go(c):
        f = ("clip.wav", data, "audio/wav")
        out = {"json": await c.audio.transcriptions.create(file=f, model="whisper-1")}
        for fmt in ("text", "srt", "vtt"):
            out[fmt] = await c.audio.transcriptions.create(file=f, model="whisper-1", response_format=fmt)
        out["verbose_json"] = await c.audio.transcriptions.create(
            file=f, model="whisper-1", response_format="verbose_json", timestamp_granularities=["segment"])
        out["translation"] = await c.audio.translations.create(file=f, model="whisper-1")
        out["translation_verbose"] = await c.audio.translations.create(file=f, model="whisper-1",
                                                                      response_format="verbose_json")
        return out

    out = run(go, daemon)
    v = out["verbose_json"]
    # Every format is one decode (with timestamps): the same words in each, whatever the weights say.
    expected = v.text
    assert expected, "random Whisper weights gave no text; the comparison would prove nothing"
    assert out["json"].text == expected
    assert out["text"].strip() == expected
    assert v.language == "english" and v.duration == pytest.approx(len(clip[0]) / 16000, 0.01)
    assert v.segments and all(s.start <= s.end for s in v.segments)
    assert v.text.split() == " ".join(s.text for s in v.segments).split()
    assert v.segments[-1].end <= v.duration + 0.01
    cues = [block.split("\n") for block in out["srt"].strip().split("\n\n")]
    assert [c[0] for c in cues] == [str(i) for i in range(1, len(v.segments) + 1)]
    assert [c[2] for c in cues] == [s.text for s in v.segments]
    assert out["vtt"].startswith("WEBVTT\n\n") and out["vtt"].count(" --> ") == len(v.segments)
    assert out["translation"].text  # the same model asked to translate: some text, its own
    assert out["translation"].text == out["translation_verbose"].text


def test_streamed_transcription_sends_deltas_then_done(daemon, clip):
    from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent

    data = clip[1].read_bytes()

    async def go(c):
        stream = await c.audio.transcriptions.create(
            file=("clip.wav", data, "audio/wav"), model="whisper-1", stream=True)
        return [e async for e in stream]

    events = run(go, daemon)
    deltas, done = events[:-1], events[-1]
    assert deltas and all(isinstance(e, TranscriptionTextDeltaEvent) for e in deltas)
    assert isinstance(done, TranscriptionTextDoneEvent)
    for e in events:
        strict(type(e), e.model_dump(exclude_unset=True))
    assert "".join(e.delta for e in deltas) == done.text == timed_text(daemon, data)


@pytest.mark.parametrize("fmt, subtype", [("FLAC", "PCM_16"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")])
def test_compressed_uploads_are_transcribed(daemon, clip, fmt, subtype):
    buf = io.BytesIO()
    sf.write(buf, clip[0], 16000, format=fmt, subtype=subtype)

    async def go(c):
        return await c.audio.transcriptions.create(
            file=(f"clip.{fmt.lower()}", buf.getvalue(), "application/octet-stream"), model="whisper-1")

    v = run(go, daemon)
    assert v.usage.type == "duration" and v.usage.seconds == pytest.approx(len(clip[0]) / 16000, abs=0.08)
    if fmt == "FLAC":  # lossless: the same samples, so the same words as the WAV
        assert v.text == timed_text(daemon, clip[1].read_bytes())


def test_word_timestamps_time_the_words_of_the_transcript(daemon, clip):
    """timestamp_granularities=["word"]: every word of the text, in order, within the clip (the times
    themselves are openai-whisper's, tests/test_whisper_words.py proves that; with random weights the
    segment timestamps the model writes are noise, so words are not checked against them)."""
    data = clip[1].read_bytes()

    async def go(c):
        return await c.audio.transcriptions.create(
            file=("clip.wav", data, "audio/wav"), model="whisper-1",
            response_format="verbose_json", timestamp_granularities=["word", "segment"])

    v = run(go, daemon)
    assert v.words, "random Whisper weights gave no words; the test would prove nothing"
    assert " ".join(w.word for w in v.words).split() == v.text.split()
    assert all(0 <= w.start <= w.end <= v.duration + 0.01 for w in v.words)
    assert all(a.start <= b.start for a, b in zip(v.words, v.words[1:]))



def _decode(name: str, data: bytes, tmp_path) -> float:
    """Seconds of audio in `data`, read by a decoder other than ours where one reads the format."""
    path = tmp_path / f"speech.{name}"
    path.write_bytes(data)
    if name == "pcm":
        return len(data) / 2 / 24000
    if name in ("wav", "mp3", "opus"):
        y, rate = sf.read(str(path))
        assert rate == 24000
        return len(y) / rate
    if name == "flac":
        subprocess.run(["sox", str(path), str(tmp_path / "flac.wav")], check=True, capture_output=True)
        return sf.info(str(tmp_path / "flac.wav")).duration
    return decode_file(data, rate=24000)[1]  # aac: no other decoder here


@pytest.mark.parametrize("name", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_speech_streams_in_every_format(daemon, name, tmp_path):
    async def go(c):
        async with c.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input="Hello there, nice to meet you.", response_format=name) as r:
            pieces = [p async for p in r.iter_bytes()]
            return r.headers["content-type"], pieces

    ctype, pieces = run(go, daemon)
    assert ctype.startswith({"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                             "wav": "audio/wav", "pcm": "audio/pcm"}[name])
    seconds = _decode(name, b"".join(pieces), tmp_path)
    assert 0.1 < seconds <= REPLY_S + 0.15


def test_speech_takes_http_max_input_chars_past_the_cores_one_request(daemon, tmp_path):
    """4,096 characters (OpenAI's limit and http.max_input_chars' default) are more than the core's 4,000 a
    request: the door speaks them in pieces, one stream; 4,097 are refused naming the 4,096."""
    from voiced.core.spec import MAX_TEXT_CHARS
    from voiced.doors.openai_http import _pieces

    text = ("Hello there, this is one sentence. " * 120)[:4096]
    assert len(_pieces(text, MAX_TEXT_CHARS)) == 2 and " ".join(_pieces(text, MAX_TEXT_CHARS)).split() == text.split()
    http = daemon.services.config.http
    old, http.max_input_chars = http.max_input_chars, 4096

    async def go(c):
        async with c.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input=text, response_format="wav") as r:
            audio = b"".join([p async for p in r.iter_bytes()])
        with pytest.raises(openai.BadRequestError) as e:
            await c.audio.speech.create(model="tts-1", voice="alloy", input=text + "x")
        return audio, e.value

    try:
        audio, refused = run(go, daemon)
    finally:
        http.max_input_chars = old
    assert 2 * 0.1 < _decode("wav", audio, tmp_path) <= 2 * REPLY_S + 0.3  # both pieces spoken
    assert "up to 4096 per request" in str(refused)


@pytest.mark.parametrize("name", ["wav", "mp3"])
def test_speech_as_server_sent_events(daemon, name, tmp_path):
    from openai._streaming import SSEDecoder

    async def go(c):
        async with c.audio.speech.with_streaming_response.create(
                model="tts-1", voice="female", input="Hello there.", response_format=name, stream_format="sse") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            return [json.loads(sse.data) async for sse in SSEDecoder().aiter_bytes(r.iter_bytes())]

    events = run(go, daemon)
    assert [e["type"] for e in events] == ["speech.audio.delta"] * (len(events) - 1) + ["speech.audio.done"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert 0.1 < _decode(name, audio, tmp_path) <= REPLY_S + 0.15


def test_models_and_voices(daemon):
    async def go(c):
        models = [m async for m in c.models.list()]
        one = await c.models.retrieve(models[0].id)
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("gpt-9")
        voices = await c.get("/audio/voices", cast_to=object)
        # the names a request may give are models GET finds too, as OpenAI's own are
        aliases = [(await c.models.retrieve(name)) for name in ("whisper-1", "tts-1")]
        return models, one, voices, aliases

    models, one, voices, aliases = run(go, daemon)
    assert [(m.id, m.kind) for m in aliases] == [("whisper-1", "transcription"), ("tts-1", "speech")]
    from openai.types import Model

    for m in models:
        strict(Model, {k: v for k, v in m.model_dump().items() if k != "kind"})
    assert [m.id for m in models] == [daemon.services.asr.engine.model_name, daemon.services.tts.engine.model_name]
    assert one.id == models[0].id
    names = {v["name"]: v for v in voices["data"]}
    assert names["female"]["kind"] == "preset" and "pitch" in names["female"]["description"]


# ---------------------------------------------------------------------------- curl, as the README shows it


def test_curl_multipart_upload_and_streamed_speech(daemon, clip, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    url = base_url(daemon)
    out = subprocess.run(["curl", "-sS", "--fail-with-body", f"{url}/v1/audio/transcriptions",
                          "-F", f"file=@{clip[1]}", "-F", "model=whisper-1"], capture_output=True, check=True)
    assert json.loads(out.stdout)["text"] == timed_text(daemon, clip[1].read_bytes())
    speech = tmp_path / "hello.mp3"
    subprocess.run(["curl", "-sS", "--fail-with-body", "--no-buffer", f"{url}/v1/audio/speech",
                    "-H", "Content-Type: application/json", "-o", str(speech),
                    "-d", json.dumps({"model": "tts-1", "voice": "alloy", "input": "Hello there."})],
                   capture_output=True, check=True)
    y, rate = sf.read(str(speech))
    assert rate == 24000 and 0.1 < len(y) / rate <= REPLY_S + 0.15


# ---------------------------------------------------------------------------- bad input


def _post(daemon, path: str, *, data: bytes = b"", headers=None):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url(daemon) + path, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _multipart(fields: dict[str, str], file: tuple[str, bytes] | None) -> tuple[bytes, dict]:
    boundary = "voicedtestboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if file:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + file[1] + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), {
        "Content-Type": f"multipart/form-data; boundary={boundary}"}


def _speech(**body):
    return json.dumps({"model": "tts-1", "voice": "alloy", "input": "Hi.", **body}).encode()


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("case, status, param, words", [
    ("no file", 400, "file", "`file` field is missing"),
    ("not audio", 400, "file", "WAV, FLAC, OGG"),
    ("no model", 400, "model", "model is required"),
    ("unknown model", 404, "model", "does not exist"),
    ("bad format", 400, "response_format", "json, text, srt, vtt, verbose_json"),
    ("granularity without verbose_json", 400, "timestamp_granularities", "verbose_json"),
    ("bad language", 400, "language", "not a language Whisper knows"),
    ("bad temperature", 400, "temperature", "from 0 to 1"),
    ("json body", 415, None, "multipart/form-data"),
    ("over the limit", 413, "file", "http.max_upload_bytes"),
    ("speech: form body", 415, None, "application/json"),
    ("speech: bad json", 400, None, "not valid JSON"),
    ("speech: unknown voice", 404, "voice", "unknown voice"),
    ("speech: unknown model", 404, "model", "does not exist"),
    ("speech: unknown format", 400, "response_format", "mp3, opus, aac, flac, wav, pcm"),
    ("speech: no input", 400, "input", "input is required"),
    ("speech: over the limit", 400, "input", "http.max_input_chars"),
    ("speech: bad speed", 400, "speed", "0.25 to 4.0"),
    ("speech: bad stream_format", 400, "stream_format", "audio or sse"),
    ("no route", 404, None, "no route POST /v1/audio/nothing"),
])
def test_bad_requests_get_openai_errors_and_never_a_500(daemon, clip, case, status, param, words):
    wav = clip[1].read_bytes()
    ok = {"model": "whisper-1"}
    path = "/v1/audio/transcriptions"
    if case == "no file":
        body, headers = _multipart(ok, None)
    elif case == "not audio":
        body, headers = _multipart(ok, ("notes.txt", b"just some text\n" * 100))
    elif case == "no model":
        body, headers = _multipart({}, ("a.wav", wav))
    elif case == "unknown model":
        body, headers = _multipart({"model": "gpt-9"}, ("a.wav", wav))
    elif case == "bad format":
        body, headers = _multipart({**ok, "response_format": "docx"}, ("a.wav", wav))
    elif case == "granularity without verbose_json":
        body, headers = _multipart({**ok, "timestamp_granularities[]": "segment"}, ("a.wav", wav))
    elif case == "bad language":
        body, headers = _multipart({**ok, "language": "klingon"}, ("a.wav", wav))
    elif case == "bad temperature":
        body, headers = _multipart({**ok, "temperature": "hot"}, ("a.wav", wav))
    elif case == "json body":
        body, headers = json.dumps({"model": "whisper-1"}).encode(), JSON
    elif case == "over the limit":
        body, headers = _multipart(ok, ("big.wav", wav[:44] + bytes(UPLOAD_LIMIT)))
    elif case == "no route":
        path, body, headers = "/v1/audio/nothing", b"", {}
    else:
        path = "/v1/audio/speech"
        body, headers = {
            "speech: form body": (b"input=hi", {"Content-Type": "application/x-www-form-urlencoded"}),
            "speech: bad json": (b"{not json", JSON),
            "speech: unknown voice": (_speech(voice="nobody"), JSON),
            "speech: unknown model": (_speech(model="tts-9"), JSON),
            "speech: unknown format": (_speech(response_format="ogg"), JSON),
            "speech: no input": (_speech(input=""), JSON),
            "speech: over the limit": (_speech(input="x" * (INPUT_CHARS + 1)), JSON),
            "speech: bad speed": (_speech(speed=9), JSON),
            "speech: bad stream_format": (_speech(stream_format="chunks"), JSON),
        }[case]
    got, answer = _post(daemon, path, data=body, headers=headers)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert "Traceback" not in error["message"]


def test_failed_requests_leave_nothing_behind(daemon, clip):
    for _ in range(3):
        _post(daemon, "/v1/audio/speech", data=_speech(voice="nobody"), headers=JSON)
        _post(daemon, "/v1/audio/transcriptions", data=_multipart({"model": "x"}, ("a.txt", b"x"))[0],
              headers=_multipart({}, None)[1])
    assert daemon.session_tasks() == [] and daemon.services.active_sessions == 0
    assert daemon.services.asr.pending == 0 and daemon.services.tts.pending == 0


@pytest.mark.parametrize("path, fields", [
    ("/v1/audio/transcriptions", {"model": "whisper-1"}),
    ("/v1/audio/transcriptions", {"model": "whisper-1", "stream": "true"}),
    ("/v1/audio/translations", {"model": "whisper-1", "response_format": "text"}),
    ("/v1/audio/speech", {"stream_format": "audio"}),
    ("/v1/audio/speech", {"stream_format": "sse"}),
])
def test_an_engine_fault_is_the_servers_error_without_its_text(daemon, clip, path, fields):
    if path.endswith("speech"):
        engine, body, headers = daemon.services.tts.engine, _speech(**fields), JSON
    else:
        engine, (body, headers) = daemon.services.asr.engine, _multipart(fields, ("a.wav", clip[1].read_bytes()))
    with engine_fault(engine):
        status, answer = _post(daemon, path, data=body, headers=headers)
    assert status == 500, answer
    assert answer == {"error": {"message": "internal error; the server log has the details", "type": "server_error",
                                "param": None, "code": "internal"}}
    assert FAULT_TEXT not in json.dumps(answer)
    assert daemon.services.asr.pending == 0 and daemon.services.tts.pending == 0


# ---------------------------------------------------------------------------- auth and TLS


def test_the_token_is_required_except_for_probes_and_the_page(tmp_path):
    from tests.http_harness import http_config
    from voiced.daemon import running

    config = http_config(auth_token="s3cret")
    config.tts.enabled = False

    async def go():
        async with running(config) as d:
            url = f"http://{d.services.doors['http']}"
            import aiohttp

            async with aiohttp.ClientSession() as http:
                for path in ("/healthz", "/readyz", "/", "/app.js"):
                    async with http.get(url + path) as r:
                        assert r.status == 200, path
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                    async with http.get(url + "/v1/models", headers=headers) as r:
                        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as c:
                assert [m async for m in c.models.list()] == []  # no models loaded here, but let in
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as c:
                with pytest.raises(openai.AuthenticationError):
                    await c.models.list()

    asyncio.run(go())


def test_tls_from_the_servers_cert_and_key(tmp_path):
    import ssl

    from tests.http_harness import http_config
    from voiced.daemon import running

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    config = http_config(tls_cert=str(cert), tls_key=str(key))
    config.tts.enabled = False

    async def go():
        async with running(config) as d:
            url = f"https://{d.services.doors['http']}"
            import aiohttp

            ctx = ssl.create_default_context(cafile=str(cert))
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/readyz", ssl=ctx) as r:
                    assert r.status == 200
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await http.get(url + "/readyz")  # not trusted without the cert

    asyncio.run(go())


def test_readyz_is_503_while_the_models_load(tmp_path):
    import threading
    import urllib.error
    import urllib.request

    from tests.http_harness import http_config
    from voiced.core.services import Engines
    from voiced.daemon import Daemon, start_in_thread

    config = http_config()
    config.tts.enabled = False
    release = threading.Event()
    daemon = Daemon(config, load=lambda: release.wait(60) and Engines())
    started: dict = {}
    thread = threading.Thread(target=lambda: started.update(loop=start_in_thread(daemon, timeout=90)[1]))
    thread.start()
    try:
        while "http" not in daemon.services.doors:  # the doors open before the models load
            release.wait(0.02)
        url = f"http://{daemon.services.doors['http']}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/readyz")
        assert e.value.code == 503 and json.loads(e.value.read()) == {"status": "loading"}
        with urllib.request.urlopen(url + "/healthz") as r:
            assert r.status == 200
        status, answer = _post_url(url + "/v1/audio/speech", _speech(), JSON)
        assert status == 503 and "loading" in answer["error"]["message"]
    finally:
        release.set()
        thread.join(90)
    loop = started["loop"]
    try:
        with urllib.request.urlopen(url + "/readyz") as r:
            assert r.status == 200
    finally:
        asyncio.run_coroutine_threadsafe(daemon.drain_and_stop(grace=0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def _post_url(url, data, headers):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers, method="POST")) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())



def test_a_listener_leaving_mid_speech_leaves_nothing_behind(daemon):
    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.post(base_url(daemon) + "/v1/audio/speech", json={
                    "model": "tts-1", "voice": "alloy", "input": "A long story. " * 20, "response_format": "pcm"}) as r:
                assert r.status == 200
                assert await r.content.readany()  # the first chunk, then hang up
                r.close()  # drops the connection with the body unread

    asyncio.run(go())

    async def settled():
        for _ in range(1000):
            if daemon.services.tts.pending == 0:
                return 0
            await asyncio.sleep(0.01)
        return daemon.services.tts.pending

    assert daemon.call(settled) == 0
