"""Interleaved integer PCM of any rate, sample width and channel count -> 16 kHz mono int16, streaming.

For callers that describe their audio by (rate, width, channels) instead of an encoding, as the
Wyoming protocol does: 8-bit unsigned, 16/24/32-bit signed little-endian, any number of channels
(averaged: a voice session is mono), any rate (resampled with the daemon's own streaming resampler,
so a clip converted chunk by chunk equals the same clip converted whole).
"""

from __future__ import annotations

import numpy as np
from voiced_client.wavio import float_to_int16, pcm_to_float

from voiced.audio.ingest import RATE, AudioFormatError, Resampler

MIN_PCM_RATE, MAX_PCM_RATE = 1000, 384000
MAX_CHANNELS = 32


def check_pcm_format(rate: int, width: int, channels: int, what: str = "audio") -> None:
    """Raises AudioFormatError naming what to fix."""
    for name, value in (("rate", rate), ("width", width), ("channels", channels)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise AudioFormatError(f"{what}: {name} must be an integer, got {value!r}")
    if not MIN_PCM_RATE <= rate <= MAX_PCM_RATE:
        raise AudioFormatError(f"{what}: rate {rate} Hz is outside {MIN_PCM_RATE}..{MAX_PCM_RATE}")
    if width not in (1, 2, 3, 4):
        raise AudioFormatError(f"{what}: width {width} is not a PCM sample width; use 1, 2, 3 or 4 bytes")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioFormatError(f"{what}: channels {channels} is outside 1..{MAX_CHANNELS}")


class PcmConverter:
    """Feed PCM bytes in one (rate, width, channels); get 16 kHz (or `out_rate`) mono int16 back."""

    def __init__(self, rate: int, width: int, channels: int, out_rate: int = RATE):
        check_pcm_format(rate, width, channels)
        self.rate, self.width, self.channels = rate, width, channels
        self._frame_bytes = width * channels
        self._resample = Resampler(rate, out_rate)
        self._partial = b""  # a chunk may end inside a sample frame; the rest comes with the next one
        self.samples_in = 0  # sample frames received, at the caller's rate

    def same_format(self, rate: int, width: int, channels: int) -> bool:
        return (rate, width, channels) == (self.rate, self.width, self.channels)

    def feed(self, data: bytes) -> np.ndarray:
        if self._partial:
            data = self._partial + data
        whole = len(data) - len(data) % self._frame_bytes
        self._partial = data[whole:]
        self.samples_in += whole // self._frame_bytes
        if self.width == 2 and self.channels == 1:
            # The common case (Home Assistant sends 16 kHz 16-bit mono): no float round trip.
            return self._resample(np.frombuffer(data[:whole], dtype="<i2").astype(np.int16, copy=False))
        return self._from_float(self._mono(data[:whole]))

    def flush(self) -> np.ndarray:
        """End of the stream: what the resampler still holds (a trailing partial frame is dropped)."""
        self._partial = b""
        return self._from_float(np.zeros(0, dtype=np.float32), last=True)

    def _mono(self, data: bytes) -> np.ndarray:
        x = pcm_to_float(data, self.width)
        if self.channels == 1:
            return x
        return x.reshape(-1, self.channels).mean(axis=1, dtype=np.float32)

    def _from_float(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        return float_to_int16(self._resample(x, last=last))
