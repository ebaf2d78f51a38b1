"""Caller-side audio formats: int16 PCM <-> the bytes a session sends and receives, and 20 ms frames.

The wire carries mono audio in one of three encodings (LINEAR16 little-endian, G.711 mu-law,
G.711 A-law) at 8000..48000 Hz. Everything here works on int16 numpy arrays so that the G.711 codec
and soxr can be used without copies through Python objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from . import g711
from .wavio import resample

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
FRAME_MS = 20


class Encoding(str, enum.Enum):
    LINEAR16 = "linear16"
    MULAW = "mulaw"
    ALAW = "alaw"

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self is Encoding.LINEAR16 else 1


@dataclass(frozen=True)
class AudioFormat:
    """An encoding at a sample rate, as in the proto's AudioFormat."""

    encoding: Encoding
    sample_rate: int

    def __post_init__(self) -> None:
        if not MIN_SAMPLE_RATE <= self.sample_rate <= MAX_SAMPLE_RATE:
            raise ValueError(
                f"sample rate {self.sample_rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz"
            )

    def frame_samples(self, frame_ms: int = FRAME_MS) -> int:
        # Rates like 11025 Hz do not divide into 20 ms; the frame is then rounded down and the
        # pacing uses each frame's true duration (see frame_seconds), so no drift accumulates.
        return max(1, self.sample_rate * frame_ms // 1000)

    def frame_bytes(self, frame_ms: int = FRAME_MS) -> int:
        return self.frame_samples(frame_ms) * self.encoding.bytes_per_sample

    def duration_s(self, nbytes: int) -> float:
        return nbytes / self.encoding.bytes_per_sample / self.sample_rate

    def __str__(self) -> str:
        return f"{self.encoding.value} {self.sample_rate} Hz"


def encode(pcm: np.ndarray, encoding: Encoding) -> bytes:
    """int16 samples -> wire bytes (no resampling)."""
    pcm = np.asarray(pcm, dtype=np.int16)
    if encoding is Encoding.LINEAR16:
        return pcm.astype("<i2", copy=False).tobytes()
    if encoding is Encoding.MULAW:
        return g711.mulaw_encode(pcm)
    return g711.alaw_encode(pcm)


def decode(data: bytes, encoding: Encoding) -> np.ndarray:
    """Wire bytes -> int16 samples (no resampling)."""
    if encoding is Encoding.LINEAR16:
        if len(data) % 2:
            raise ValueError(f"LINEAR16 audio must have an even number of bytes, got {len(data)}")
        return np.frombuffer(data, dtype="<i2").astype(np.int16)
    if encoding is Encoding.MULAW:
        return g711.mulaw_decode(data)
    return g711.alaw_decode(data)


def to_wire(pcm: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """int16 PCM at `sample_rate` -> bytes in `fmt` (resampled with soxr when the rates differ)."""
    return encode(resample(pcm, sample_rate, fmt.sample_rate), fmt.encoding)


def from_wire(data: bytes, fmt: AudioFormat, sample_rate: int | None = None) -> np.ndarray:
    """Bytes in `fmt` -> int16 PCM, at `sample_rate` if given (else at the format's own rate)."""
    pcm = decode(data, fmt.encoding)
    return pcm if sample_rate is None else resample(pcm, fmt.sample_rate, sample_rate)


def split_frames(data: bytes, fmt: AudioFormat, frame_ms: int = FRAME_MS) -> list[bytes]:
    """Cut wire bytes into frames of `frame_ms`; the last one may be shorter (always whole samples)."""
    size = fmt.frame_bytes(frame_ms)
    return [data[i : i + size] for i in range(0, len(data), size)]


def silence(fmt: AudioFormat, ms: int) -> bytes:
    """`ms` of digital silence in `fmt` (zero samples, encoded: 0xFF for mu-law, 0xD5 for A-law)."""
    return encode(np.zeros(fmt.sample_rate * ms // 1000, dtype=np.int16), fmt.encoding)
