"""WAV files in and out (stdlib `wave`) and resampling (soxr).

Reading accepts 8/16/24/32-bit integer PCM with any number of channels and returns mono, because a
voice session is mono: channels are averaged. Floating-point and WAVE_FORMAT_EXTENSIBLE files are
refused with a `sox` command that converts them (Python's `wave` before 3.12 cannot read them).
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import soxr


class WavError(ValueError):
    """A WAV file that cannot be read, with what to do about it."""


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    """Interleaved PCM bytes -> float32 in [-1, 1)."""
    if width == 1:  # 8-bit WAV is unsigned with 128 as zero
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        value = np.where(value & 0x800000, value - (1 << 24), value)  # sign-extend 24 -> 32 bits
        return value.astype(np.float32) / float(1 << 23)
    if width == 4:
        return (np.frombuffer(raw, dtype="<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    raise WavError(f"unsupported sample width {width * 8} bits")


def float_to_int16(x: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> int16, rounded and clipped."""
    return np.clip(np.rint(np.asarray(x, dtype=np.float64) * 32768.0), -32768, 32767).astype(np.int16)


def read_wav(path: str | Path, dtype: type = np.int16) -> tuple[np.ndarray, int]:
    """Read a WAV file as mono samples: (samples, sample_rate). dtype: np.int16 or np.float32."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except wave.Error as e:
        raise WavError(
            f"{path}: not a WAV file of integer PCM ({e}); convert it with "
            f"`sox {path} -b 16 -e signed-integer out.wav`"
        ) from e
    except EOFError as e:
        raise WavError(f"{path}: truncated WAV header") from e
    # A truncated data chunk can end mid-frame; keep whole frames only.
    raw = raw[: len(raw) - len(raw) % (channels * width)]
    if width == 2 and channels == 1 and np.dtype(dtype) == np.int16:
        return np.frombuffer(raw, dtype="<i2").astype(np.int16), rate  # the common case, exact
    x = _pcm_to_float(raw, width).reshape(-1, channels)
    mono = x[:, 0] if channels == 1 else x.mean(axis=1, dtype=np.float32)
    if np.dtype(dtype) == np.float32:
        return mono.astype(np.float32), rate
    if np.dtype(dtype) == np.int16:
        return float_to_int16(mono), rate
    raise ValueError(f"dtype must be np.int16 or np.float32, not {dtype}")


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int, sample_width: int = 2) -> None:
    """Write samples (int16, or float in [-1, 1]; shape (n,) or (n, channels)) as integer PCM."""
    x = np.asarray(samples)
    channels = 1 if x.ndim == 1 else x.shape[1]
    if x.dtype == np.int16 and sample_width == 2:
        raw = x.astype("<i2", copy=False).tobytes()
    else:
        f = x.astype(np.float64) / 32768.0 if x.dtype == np.int16 else x.astype(np.float64)
        f = np.clip(f, -1.0, 1.0)
        if sample_width == 1:
            raw = np.clip(np.rint(f * 128.0) + 128, 0, 255).astype(np.uint8).tobytes()
        elif sample_width == 2:
            raw = float_to_int16(f).astype("<i2").tobytes()
        elif sample_width == 3:
            v = np.clip(np.rint(f * (1 << 23)), -(1 << 23), (1 << 23) - 1).astype(np.int32).ravel()
            raw = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
        elif sample_width == 4:
            raw = np.clip(np.rint(f * (1 << 31)), -(1 << 31), (1 << 31) - 1).astype("<i4").tobytes()
        else:
            raise ValueError(f"sample_width must be 1..4 bytes, not {sample_width}")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(sample_width)
        w.setframerate(int(sample_rate))
        w.writeframes(raw)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample a whole mono clip with soxr (VHQ); int16 stays int16, float32 stays float32."""
    if from_rate == to_rate or len(samples) == 0:
        return samples
    if samples.dtype == np.int16:
        # Through float: soxr's own int16 output adds random dither, so the same input would give
        # different bytes on every call, and tests compare the wire bytes exactly.
        y = soxr.resample(samples.astype(np.float32) / 32768.0, from_rate, to_rate, quality="VHQ")
        return float_to_int16(y)
    return soxr.resample(samples, from_rate, to_rate, quality="VHQ")
