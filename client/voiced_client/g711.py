"""G.711 mu-law and A-law (ITU-T G.711), vectorised with numpy.

Encoding follows the standard's segment tables; decoding is a 256-entry lookup. Both directions
are exact inverses on the 256 code words, which is what a telephony bridge needs.
"""

from __future__ import annotations

import numpy as np

_MULAW_BIAS = 0x84
_MULAW_CLIP14 = 8159


def _mulaw_decode_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


MULAW_TO_PCM = _mulaw_decode_table()
ALAW_TO_PCM = _alaw_decode_table()


def mulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    return MULAW_TO_PCM[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    return ALAW_TO_PCM[np.frombuffer(data, dtype=np.uint8)]


def _segment(value: np.ndarray, first_end: int) -> np.ndarray:
    # The segment is the position of the highest set bit above the first segment's range.
    seg = np.zeros(value.shape, dtype=np.int32)
    for s in range(1, 8):
        seg = np.where(value >= (first_end << (s - 1)), s, seg)
    return seg


def mulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> mu-law bytes (the 14-bit form of ITU-T G.191, as audioop did)."""
    x = pcm.astype(np.int32) >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    # Past the top segment the code saturates (0x7F before inversion).
    mag = np.minimum(np.minimum(np.abs(x), _MULAW_CLIP14) + (_MULAW_BIAS >> 2), 0x1FFF)
    exponent = _segment(mag, 0x40)
    mantissa = (mag >> (exponent + 1)) & 0x0F
    return (((exponent << 4) | mantissa) ^ mask).astype(np.uint8).tobytes()


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> A-law bytes."""
    x = pcm.astype(np.int32)
    sign = np.where(x >= 0, 0x80, 0)
    mag = np.minimum(np.where(x < 0, -x - 1, x), 32767) >> 3  # 13-bit magnitude
    exponent = _segment(mag, 0x20)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8).tobytes()
