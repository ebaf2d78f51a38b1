"""Uploads in every format tools send are decoded; speech is encoded as a stream that other decoders
(libsndfile, sox, Python's wave) read back. Fixtures are made by tools other than the decoder under
test: espeak-ng and sox, and libsndfile (soundfile) for MP3 and Ogg Opus."""

from __future__ import annotations

import io
import subprocess
import wave

import numpy as np
import pytest

from tests.speech import phrase, write_wav
from voiced.audio.files import SPEECH_FORMATS, AudioFileError, SpeechEncoder, decode_file

sf = pytest.importorskip("soundfile", reason="soundfile (libsndfile) makes the MP3 and Opus fixtures")


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    audio = phrase("The quick brown fox jumps over the lazy dog.")
    path = write_wav(tmp_path_factory.mktemp("a") / "fox.wav", audio)
    return audio, path


def _sox(src, dst, *args, effects=()):
    subprocess.run(["sox", str(src), *args, str(dst), *effects], check=True, capture_output=True)
    return dst.read_bytes()


def _similar(a: np.ndarray, b: np.ndarray) -> float:
    n = min(len(a), len(b))
    a, b = a[:n].astype(np.float64), b[:n].astype(np.float64)
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-9))


@pytest.mark.parametrize("kind", ["wav", "wav48k_stereo", "flac", "ogg_vorbis", "aiff", "mp3", "ogg_opus"])
def test_uploads_decode_to_the_same_16k_speech(speech, tmp_path, kind):
    audio, wav = speech
    if kind == "wav":
        data = wav.read_bytes()
    elif kind == "wav48k_stereo":
        data = _sox(wav, tmp_path / "x.wav", "-r", "48000", "-c", "2")
    elif kind == "flac":
        data = _sox(wav, tmp_path / "x.flac")
    elif kind == "ogg_vorbis":
        data = _sox(wav, tmp_path / "x.ogg")
    elif kind == "aiff":
        data = _sox(wav, tmp_path / "x.aiff")
    else:
        buf = io.BytesIO()
        fmt, sub = ("MP3", "MPEG_LAYER_III") if kind == "mp3" else ("OGG", "OPUS")
        sf.write(buf, audio, 16000, format=fmt, subtype=sub)
        data = buf.getvalue()
    pcm, duration = decode_file(data)
    assert pcm.dtype == np.int16
    assert abs(duration - len(audio) / 16000) < 0.08  # codec priming/padding only
    lossless = kind in ("wav", "flac", "aiff")
    if lossless:
        assert _similar(pcm, audio * 32768) > 0.999
    else:
        # Lossy codecs shift the start by their delay: compare spectra over time, not samples.
        def env(x):
            x = x.astype(np.float64)[: len(x) // 320 * 320].reshape(-1, 320)
            return np.sqrt((x ** 2).mean(axis=1))
        assert _similar(env(pcm)[5:-5], env(audio * 32768)[5:-5]) > 0.8


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"this is a text file, not audio\n" * 50, "not audio"),
    (b"\x89PNG\r\n\x1a\n" + bytes(200), "not accepted"),
])
def test_what_is_not_audio_gets_an_error_naming_what_is_accepted(data, words):
    with pytest.raises(AudioFileError, match=words) as e:
        decode_file(data)
    if words != "empty":
        assert "WAV" in str(e.value) and "MP3" in str(e.value) and "FLAC" in str(e.value)


def test_a_format_ffmpeg_reads_but_we_do_not_accept_is_refused(speech, tmp_path):
    data = _sox(speech[1], tmp_path / "x.au")  # Sun .au: FFmpeg reads it, uploads have no business using it
    with pytest.raises(AudioFileError, match="not accepted; send WAV"):
        decode_file(data)


def test_decoding_stops_at_the_length_limit(tmp_path, speech):
    data = _sox(speech[1], tmp_path / "long.flac", effects=("repeat", "20"))
    with pytest.raises(AudioFileError, match="longer than 10 s"):
        decode_file(data, max_seconds=10)


def test_a_truncated_file_is_decoded_as_far_as_it_goes(speech, tmp_path):
    data = _sox(speech[1], tmp_path / "x.flac")
    pcm, duration = decode_file(data[: len(data) // 2])
    assert 0 < duration < len(speech[0]) / 16000


def _chunks(audio16k: np.ndarray, rate: int) -> list[np.ndarray]:
    import soxr

    x = (soxr.resample(audio16k, 16000, rate) * 32767).astype(np.int16)
    step = rate // 5  # 200 ms, the size of a first TTS chunk
    return [x[i : i + step] for i in range(0, len(x), step)]


@pytest.mark.parametrize("name", sorted(SPEECH_FORMATS))
def test_speech_streams_in_every_format_and_other_decoders_read_it(speech, tmp_path, name):
    audio, _ = speech
    chunks = _chunks(audio, 24000)
    enc = SpeechEncoder(SPEECH_FORMATS[name], 24000)
    pieces = [enc.encode(c) for c in chunks]
    pieces.append(enc.finish())
    assert pieces[0], f"{name}: the first chunk must give bytes to send at once"
    data = b"".join(pieces)
    expected = sum(len(c) for c in chunks) / 24000
    path = tmp_path / f"out.{name}"
    path.write_bytes(data)
    if name == "pcm":
        got = len(data) / 2 / 24000
    elif name == "wav":
        with wave.open(str(path)) as w:  # sizes say "unknown": the reader reads to the end
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            got = len(w.readframes(10**9)) / 2 / 24000
    elif name in ("flac", "aac"):
        out = tmp_path / "back.wav"
        if name == "aac":
            got = decode_file(data, rate=24000)[1]
        else:
            subprocess.run(["sox", str(path), str(out)], check=True, capture_output=True)
            got = sf.info(str(out)).duration
    else:
        y, rate = sf.read(str(path))
        got = len(y) / rate
    assert abs(got - expected) < 0.1, (name, got, expected)


def test_an_abandoned_encoder_frees_its_codec():
    enc = SpeechEncoder(SPEECH_FORMATS["mp3"], 24000)
    enc.encode(np.zeros(4800, np.int16))
    enc.close()
    enc.close()
