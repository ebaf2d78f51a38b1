"""Caller audio in any wire format -> 16 kHz int16 mono, cut into 20 ms frames.

A caller may send chunks of any size; the decoder keeps the remainder between chunks so frames
are always exactly FRAME_SAMPLES long, and counts the caller's own samples so every offset we
report is in the caller's audio time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr
from voiced_client import g711
from voiced_client.wavio import float_to_int16

RATE = 16000
FRAME_MS = 20
FRAME_SAMPLES = RATE * FRAME_MS // 1000  # 320
MIN_RATE, MAX_RATE = 8000, 48000
ENCODINGS = ("LINEAR16", "MULAW", "ALAW")
_LINEAR16 = np.dtype("<i2")  # little-endian on the wire (parsed once: a dtype string costs on every frame)


class AudioFormatError(ValueError):
    """Audio that does not match the declared format; the message says what to fix."""


@dataclass(frozen=True)
class Format:
    encoding: str  # one of ENCODINGS
    sample_rate: int

    def validate(self, what: str = "audio format") -> None:
        if self.encoding not in ENCODINGS:
            raise AudioFormatError(
                f"{what}: unknown encoding {self.encoding!r}; use one of {', '.join(ENCODINGS)}"
            )
        if not MIN_RATE <= self.sample_rate <= MAX_RATE:
            raise AudioFormatError(
                f"{what}: sample_rate_hz {self.sample_rate} is outside {MIN_RATE}..{MAX_RATE}; "
                "set it to the rate of the audio you send (8000 for telephony, 16000 for desktop)"
            )

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == "LINEAR16" else 1


def decode_pcm(data: bytes, encoding: str) -> np.ndarray:
    """Wire bytes -> int16 samples (no resampling)."""
    if encoding == "LINEAR16":
        if len(data) % 2:
            raise AudioFormatError(
                f"LINEAR16 audio must be whole 16-bit samples, got a message of {len(data)} bytes "
                "(an odd length); send an even number of bytes in every audio message"
            )
        pcm = np.frombuffer(data, dtype=_LINEAR16)
        return pcm if pcm.dtype.isnative else pcm.astype(np.int16)
    if encoding == "MULAW":
        return g711.mulaw_decode(data)
    if encoding == "ALAW":
        return g711.alaw_decode(data)
    raise AudioFormatError(f"unknown encoding {encoding!r}")


def encode_pcm(pcm: np.ndarray, encoding: str) -> bytes:
    """int16 samples -> wire bytes (no resampling)."""
    if encoding == "LINEAR16":
        return pcm.astype("<i2", copy=False).tobytes()
    if encoding == "MULAW":
        return g711.mulaw_encode(pcm)
    if encoding == "ALAW":
        return g711.alaw_encode(pcm)
    raise AudioFormatError(f"unknown encoding {encoding!r}")


def int16_to_float(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) / 32768.0


class Resampler:
    """Streaming resampler; a no-op at equal rates (the common 16 kHz desktop case).

    It works in float32 because soxr's float path gives the same samples whatever the chunking,
    while its int16 path dithers: a streamed reply must equal the same reply converted whole.
    """

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def __call__(self, audio: np.ndarray, last: bool = False) -> np.ndarray:
        """int16 in -> int16 out; float32 in -> float32 out."""
        if self._stream is None:
            return audio
        if audio.dtype == np.int16:
            return float_to_int16(self._stream.resample_chunk(int16_to_float(audio), last=last))
        return self._stream.resample_chunk(audio.astype(np.float32, copy=False), last=last)


class FrameDecoder:
    """Feeds wire chunks, returns whole 20 ms frames of 16 kHz int16 audio."""

    def __init__(self, fmt: Format):
        fmt.validate("input_format")
        self.format = fmt
        self._resample = Resampler(fmt.sample_rate, RATE)
        self._pending = np.zeros(0, dtype=np.int16)
        self.caller_samples = 0  # samples received, at the caller's rate
        # The usual message (a desktop's or the load's): one 20 ms frame of 16 kHz LINEAR16, with nothing
        # to decode, resample or re-frame. `feed` takes it in one step (50 a second per caller, on the
        # event loop).
        plain = fmt == Format("LINEAR16", RATE) and _LINEAR16.isnative
        self._frame_bytes = 2 * FRAME_SAMPLES if plain else -1

    def feed(self, data: bytes) -> list[np.ndarray]:
        if len(data) == self._frame_bytes and not len(self._pending):
            self.caller_samples += FRAME_SAMPLES
            return [np.frombuffer(data, dtype=_LINEAR16)]
        pcm = decode_pcm(data, self.format.encoding)
        self.caller_samples += len(pcm)
        return self._frames(self._resample(pcm))

    def flush(self) -> list[np.ndarray]:
        """End of stream: drain the resampler and pad the last partial frame with silence."""
        tail = self._resample(np.zeros(0, dtype=np.int16), last=True)
        frames = self._frames(tail)
        if len(self._pending):
            frames.append(np.pad(self._pending, (0, FRAME_SAMPLES - len(self._pending))))
            self._pending = self._pending[:0]
        return frames

    def _frames(self, pcm: np.ndarray) -> list[np.ndarray]:
        if len(pcm) == FRAME_SAMPLES and not len(self._pending):
            return [pcm]  # the usual 20 ms message at 16 kHz: no copy
        if len(self._pending):
            pcm = np.concatenate([self._pending, pcm])
        n = len(pcm) // FRAME_SAMPLES
        self._pending = pcm[n * FRAME_SAMPLES :]
        return [pcm[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES] for i in range(n)]


class FrameEncoder:
    """16 kHz float32 audio from the engines -> the caller's output format, streaming."""

    def __init__(self, fmt: Format):
        fmt.validate("output_format")
        self.format = fmt
        self._resample = Resampler(RATE, fmt.sample_rate)

    def encode(self, audio: np.ndarray, last: bool = False) -> bytes:
        return encode_pcm(float_to_int16(self._resample(audio, last=last)), self.format.encoding)


def ms(samples: int, rate: int = RATE) -> int:
    """Samples -> whole milliseconds (offsets in events)."""
    return samples * 1000 // rate
