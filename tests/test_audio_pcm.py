"""PCM of any rate, width and channel count -> 16 kHz mono int16, chunk by chunk."""

from __future__ import annotations

import numpy as np
import pytest

from voiced.audio.ingest import AudioFormatError, Resampler
from voiced.audio.pcm import PcmConverter


def signal(n: int, seed: int = 0) -> np.ndarray:
    """int16 speech-like noise (a loud random walk), not a pure tone."""
    rng = np.random.default_rng(seed)
    return np.clip(np.cumsum(rng.normal(0, 900, n)), -30000, 30000).astype(np.int16)


def widen(x: np.ndarray, width: int) -> bytes:
    """int16 samples as little-endian PCM of `width` bytes, exactly (8-bit: the top byte, unsigned)."""
    v = x.astype(np.int32)
    if width == 1:
        return ((v >> 8) + 128).astype(np.uint8).tobytes()
    if width == 2:
        return x.astype("<i2").tobytes()
    if width == 3:
        v = v << 8
        return np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    return (v << 16).astype("<i4").tobytes()


def convert(conv: PcmConverter, data: bytes, chunk: int) -> np.ndarray:
    parts = [conv.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return np.concatenate(parts + [conv.flush()])


def test_16k_16bit_mono_passes_through_unchanged_whatever_the_chunking():
    x = signal(16000)
    out = convert(PcmConverter(16000, 2, 1), x.tobytes(), 333)  # odd: chunks end mid-sample
    assert np.array_equal(out, x)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_wider_samples_and_duplicated_channels_give_the_same_samples(width, channels):
    x = signal(8000, seed=width)
    data = np.frombuffer(widen(x, width), np.uint8).reshape(len(x), width)
    interleaved = np.repeat(data, channels, axis=0).tobytes()  # every channel carries the same sample
    out = convert(PcmConverter(16000, width, channels), interleaved, 1000)
    assert np.array_equal(out, x)


def test_8bit_is_unsigned_with_128_as_zero():
    x = (signal(4000).astype(np.int32) >> 8 << 8).astype(np.int16)  # what 8 bits can hold
    out = convert(PcmConverter(16000, 1, 1), widen(x, 1), 100)
    assert np.array_equal(out, x)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_chunk_by_chunk_equals_the_whole_clip_resampled_at_once(rate):
    x = signal(rate)  # one second
    whole = Resampler(rate, 16000)(x, last=True)  # what Recognize does with a raw clip
    out = convert(PcmConverter(rate, 2, 1), x.tobytes(), 2 * 441)
    assert np.array_equal(out, whole)
    assert abs(len(out) - 16000) <= 1


def test_stereo_channels_are_averaged():
    left, right = np.full(100, 1000, np.int16), np.full(100, 3000, np.int16)
    out = convert(PcmConverter(16000, 2, 2), np.stack([left, right], axis=1).tobytes(), 64)
    assert np.array_equal(out, np.full(100, 2000, np.int16))


@pytest.mark.parametrize("rate,width,channels,words", [
    (0, 2, 1, "rate 0 Hz"), (16000, 5, 1, "width 5"), (16000, 2, 0, "channels 0"),
    ("16000", 2, 1, "rate must be an integer"),
])
def test_formats_that_are_not_pcm_say_what_is_wrong(rate, width, channels, words):
    with pytest.raises(AudioFormatError, match=words):
        PcmConverter(rate, width, channels)
