"""Features and WAV input: our filterbank and log-mel against openai-whisper's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import speech

whisper = pytest.importorskip("whisper")

from voiced.audio.wavfile import WavError, load_16k, read_wav, to_16k
from voiced.engines.whisper.audio import log_mel_spectrogram, mel_filterbank, window_features


@pytest.fixture(scope="module")
def voice(tmp_path_factory):
    return speech("Testing one two three. The features must match the reference.", tmp_path_factory.mktemp("a"))


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_equals_bundled_mel_filters(n_mels):
    ref = np.load(Path(whisper.__file__).parent / "assets" / "mel_filters.npz")[f"mel_{n_mels}"]
    ours = mel_filterbank(n_mels)
    assert ours.shape == ref.shape == (n_mels, 201)
    assert np.abs(ours - ref).max() < 1e-6


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_equals_reference(voice, n_mels):
    # The raw utterance (not padded) and the padded 30 s window the engine feeds the encoder.
    ref = whisper.log_mel_spectrogram(torch.from_numpy(voice), n_mels)
    ours = log_mel_spectrogram(voice, n_mels)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    ref_window = whisper.log_mel_spectrogram(whisper.pad_or_trim(torch.from_numpy(voice)), n_mels)
    ours_window = window_features(voice, n_mels)
    assert ours_window.shape == (n_mels, 3000)
    assert (ours_window - ref_window).abs().max().item() < 1e-4


def test_batched_log_mel_is_per_item(voice):
    # The max-8 floor is per spectrogram: a loud and a quiet clip batched must equal each alone.
    quiet = 0.01 * voice
    batch = log_mel_spectrogram(np.stack([voice, quiet]), 80)
    assert torch.allclose(batch[0], log_mel_spectrogram(voice, 80), atol=1e-5)
    assert torch.allclose(batch[1], log_mel_spectrogram(quiet, 80), atol=1e-5)


def test_read_wav_any_rate_and_channels(tmp_path, voice):
    src = tmp_path / "src.wav"
    import wave

    with wave.open(str(src), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(voice, -1, 1) * 32767).astype("<i2").tobytes())
    x, rate = read_wav(src)
    assert rate == 16000 and x.dtype == np.float32 and np.abs(x - voice).max() < 1e-4
    for args, name in [(["-r", "44100", "-c", "2"], "stereo44k.wav"), (["-r", "8000", "-b", "24"], "b24.wav"),
                       (["-r", "48000", "-e", "floating-point", "-b", "32"], "float.wav")]:
        out = tmp_path / name
        subprocess.run(["sox", str(src), *args, str(out)], check=True)
        y = load_16k(out)
        assert y.dtype == np.float32 and y.ndim == 1
        assert abs(len(y) - len(voice)) <= 16, name
        if "8000" not in args:  # full band survives: the waveform comes back close to the original
            n = min(len(y), len(voice))
            assert np.corrcoef(y[:n], voice[:n])[0, 1] > 0.99, name


def test_read_wav_rejects_non_wav(tmp_path):
    bad = tmp_path / "x.wav"
    bad.write_bytes(b"ID3 not a wav file at all")
    with pytest.raises(WavError, match="not a WAV"):
        read_wav(bad)


def test_to_16k_passthrough_and_length():
    x = np.random.default_rng(0).standard_normal(22050).astype(np.float32)
    assert to_16k(x, 16000) is x
    assert len(to_16k(x, 22050)) == 16000
