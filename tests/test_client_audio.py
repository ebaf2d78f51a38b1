"""voiced_client.wavio and voiced_client.audio: WAV round trips, wire formats, 20 ms framing."""

from __future__ import annotations

import sys
import wave
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))  # before `pip install ./client`

from voiced_client import g711
from voiced_client.audio import (
    AudioFormat,
    Encoding,
    decode,
    encode,
    from_wire,
    silence,
    split_frames,
    to_wire,
)
from voiced_client.wavio import WavError, read_wav, resample, write_wav


def tone(rate: int, seconds: float = 0.5, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2, 6])
def test_wav_round_trip(tmp_path, rate, width, channels):
    mono = tone(rate)
    # Identical channels mix down to the same signal; the precision is that of the sample width.
    data = np.repeat(mono[:, None], channels, axis=1)
    path = tmp_path / "x.wav"
    write_wav(path, data, rate, sample_width=width)
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (channels, width, rate)
    back, back_rate = read_wav(path, np.float32)
    assert back_rate == rate and back.dtype == np.float32 and back.shape == mono.shape
    tolerance = {1: 1 / 128, 2: 1 / 32768, 3: 1 / 2**23, 4: 1 / 2**31}[width]
    assert np.max(np.abs(back - mono)) <= tolerance + 1e-7
    as_int16, _ = read_wav(path, np.int16)
    assert as_int16.dtype == np.int16
    assert np.max(np.abs(as_int16.astype(int) - np.rint(mono * 32768).astype(int))) <= max(
        1, 32768 * tolerance
    )


def test_int16_round_trip_is_exact(tmp_path):
    pcm = np.random.default_rng(0).integers(-32768, 32768, 16000, dtype=np.int16)
    write_wav(tmp_path / "a.wav", pcm, 16000)
    back, rate = read_wav(tmp_path / "a.wav")
    assert rate == 16000 and np.array_equal(back, pcm)


def test_stereo_mixes_to_mono(tmp_path):
    left = np.full(100, 0.5, dtype=np.float32)
    right = np.full(100, -0.25, dtype=np.float32)
    write_wav(tmp_path / "s.wav", np.stack([left, right], axis=1), 8000)
    mono, _ = read_wav(tmp_path / "s.wav", np.float32)
    assert np.allclose(mono, 0.125, atol=1e-4)


def test_24bit_negative_values_sign_extend(tmp_path):
    x = np.array([-1.0, -0.5, -1 / 2**23, 0.0, 0.5], dtype=np.float64)
    write_wav(tmp_path / "n.wav", x, 16000, sample_width=3)
    back, _ = read_wav(tmp_path / "n.wav", np.float32)
    assert np.allclose(back, x, atol=1e-6)


def test_not_a_wav_says_how_to_convert(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    with pytest.raises(WavError, match="sox"):
        read_wav(bad)


def test_resample_keeps_dtype_and_length():
    pcm = (tone(16000, 1.0) * 32767).astype(np.int16)
    down = resample(pcm, 16000, 8000)
    assert down.dtype == np.int16 and len(down) == 8000
    up = resample(tone(8000, 1.0), 8000, 48000)
    assert up.dtype == np.float32 and len(up) == 48000
    assert resample(pcm, 16000, 16000) is pcm


@pytest.mark.parametrize("encoding", list(Encoding))
def test_encode_decode(encoding):
    pcm = np.random.default_rng(1).integers(-32768, 32768, 1000, dtype=np.int16)
    data = encode(pcm, encoding)
    assert len(data) == len(pcm) * encoding.bytes_per_sample
    back = decode(data, encoding)
    if encoding is Encoding.LINEAR16:
        assert np.array_equal(back, pcm)
        assert data[:2] == int(pcm[0]).to_bytes(2, "little", signed=True)  # little-endian on the wire
    else:
        # G.711 is lossy once; re-encoding what it decoded is exact.
        assert encode(back, encoding) == data
        ref = g711.mulaw_decode(data) if encoding is Encoding.MULAW else g711.alaw_decode(data)
        assert np.array_equal(back, ref)


def test_odd_linear16_is_refused():
    with pytest.raises(ValueError, match="even"):
        decode(b"\x00\x01\x02", Encoding.LINEAR16)


@pytest.mark.parametrize(
    "fmt, frame_bytes",
    [
        (AudioFormat(Encoding.LINEAR16, 16000), 640),  # DESIGN §4: 640 B at 16 kHz
        (AudioFormat(Encoding.MULAW, 8000), 160),
        (AudioFormat(Encoding.ALAW, 8000), 160),
        (AudioFormat(Encoding.LINEAR16, 48000), 1920),
        (AudioFormat(Encoding.LINEAR16, 11025), 440),  # 220 samples: 20 ms rounded down
    ],
)
def test_frames(fmt, frame_bytes):
    assert fmt.frame_bytes() == frame_bytes
    data = bytes(range(256)) * 50  # 12800 bytes
    frames = split_frames(data, fmt)
    assert b"".join(frames) == data
    assert all(len(f) == frame_bytes for f in frames[:-1])
    assert 0 < len(frames[-1]) <= frame_bytes and len(frames[-1]) % fmt.encoding.bytes_per_sample == 0


def test_rate_outside_range_is_refused():
    with pytest.raises(ValueError, match="8000..48000"):
        AudioFormat(Encoding.LINEAR16, 96000)


@pytest.mark.parametrize("encoding", list(Encoding))
@pytest.mark.parametrize("rate", [8000, 16000, 48000])
def test_to_wire_and_back(encoding, rate):
    pcm = (tone(16000, 1.0, freq=300) * 32767).astype(np.int16)
    fmt = AudioFormat(encoding, rate)
    data = to_wire(pcm, 16000, fmt)
    assert len(data) == rate * encoding.bytes_per_sample  # one second
    back = from_wire(data, fmt, 16000)
    assert len(back) == 16000
    # A 300 Hz tone survives resampling and G.711: correlation with the original stays high.
    a, b = pcm[800:-800].astype(float), back[800:-800].astype(float)
    assert np.corrcoef(a, b)[0, 1] > 0.99


def test_silence_encodings():
    assert silence(AudioFormat(Encoding.LINEAR16, 16000), 20) == b"\x00" * 640
    assert silence(AudioFormat(Encoding.MULAW, 8000), 20) == b"\xff" * 160
    assert silence(AudioFormat(Encoding.ALAW, 8000), 20) == b"\xd5" * 160


def test_client_imports_without_the_daemon_or_torch(tmp_path):
    # A desktop install has only the client: nothing in it may import `voiced` or torch.
    import subprocess

    code = (
        "import sys, voiced_client.cli, voiced_client.session, voiced_client.load, voiced_client.ptt;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('voiced', 'torch', 'sounddevice')];"
        "assert not bad, bad"
    )
    client_dir = Path(__file__).resolve().parents[1] / "client"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(client_dir)}, check=True)


def test_g711_wav_round_trip_and_float_wav(tmp_path):
    from voiced_client import g711
    from voiced_client.wavio import write_g711_wav

    pcm = (np.sin(np.arange(800) / 5) * 12000).astype(np.int16)
    for enc, codec in (("MULAW", g711.mulaw_encode), ("ALAW", g711.alaw_encode)):
        path = tmp_path / f"{enc}.wav"
        write_g711_wav(path, codec(pcm), 8000, enc)
        back, rate = read_wav(path)
        assert rate == 8000 and np.abs(back.astype(int) - pcm).max() < 400  # G.711 step size at this level
        import shutil
        import subprocess

        if shutil.which("sox"):  # a real tool reads what we wrote
            info = subprocess.run(["sox", "--i", "-e", str(path)], capture_output=True, text=True).stdout
            assert ("u-law" if enc == "MULAW" else "A-law") in info
