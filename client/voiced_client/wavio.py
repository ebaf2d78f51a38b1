"""WAV files in and out, and resampling (soxr): the one WAV module of the project.

Reading parses the RIFF chunks itself, so it takes what users actually have: integer PCM
(8/16/24/32-bit), IEEE float (32/64-bit), G.711 mu-law and A-law (telephony recordings), plain or
WAVE_FORMAT_EXTENSIBLE headers, any rate, any channel count (averaged to mono: a voice session is
mono), from a path or an open binary file. Writing makes integer PCM, or G.711 for phones.
"""

from __future__ import annotations

import os
import struct
import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soxr

from . import g711

_PCM, _FLOAT, _ALAW, _MULAW, _EXTENSIBLE = 1, 3, 6, 7, 0xFFFE
G711_TAGS = {"MULAW": _MULAW, "ALAW": _ALAW}


class WavError(ValueError):
    """A WAV file that cannot be read, with what to do about it."""


def pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    """Interleaved integer PCM bytes (1-4 bytes a sample, little-endian) -> float32 in [-1, 1)."""
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


def read_wav(source: str | os.PathLike | BinaryIO, dtype: type = np.int16) -> tuple[np.ndarray, int]:
    """Read a WAV as mono samples: (samples, sample_rate). dtype: np.int16 or np.float32."""
    name = getattr(source, "name", None) or (str(source) if not hasattr(source, "read") else "<audio>")
    if hasattr(source, "read"):
        data = source.read()
    else:
        with open(source, "rb") as f:
            data = f.read()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError(f"{name}: not a WAV file (no RIFF/WAVE header); convert it first, e.g. "
                       "`sox input.mp3 -r 16000 -b 16 output.wav`")
    fmt = body = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if cid == b"fmt ":
            fmt = data[pos + 8 : pos + 8 + size]
        elif cid == b"data":
            body = data[pos + 8 : pos + 8 + size]  # a streamed WAV may claim more than it holds
            break
        pos += 8 + size + (size & 1)  # chunks are word aligned
    if fmt is None or body is None or len(fmt) < 16:
        raise WavError(f"{name}: truncated or damaged WAV (no {'fmt' if fmt is None else 'data'} chunk); "
                       f"re-export it, e.g. `sox {name} -b 16 -e signed-integer out.wav`")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the real tag
    if channels < 1 or block_align < 1:
        raise WavError(f"{name}: bad WAV header ({channels} channels, block align {block_align}); "
                       "re-export it as mono 16-bit PCM")
    if rate < 1:
        raise WavError(f"{name}: bad WAV header (sample rate {rate} Hz); re-export it with its real rate, "
                       "e.g. 16000")
    width = bits // 8
    if bits % 8 == 0 and tag in (_PCM, _FLOAT, _MULAW, _ALAW) and block_align != channels * width:
        raise WavError(f"{name}: bad WAV header (block align {block_align} for {channels} channels of {bits} "
                       f"bits, which take {channels * width}); re-export it as mono 16-bit PCM")
    body = body[: len(body) // block_align * block_align]  # whole frames only
    if tag == _PCM and width == 2 and channels == 1 and np.dtype(dtype) == np.int16:
        return np.frombuffer(body, dtype="<i2").astype(np.int16), int(rate)  # the common case, exact
    if tag == _PCM and 1 <= width <= 4:
        x = pcm_to_float(body, width)
    elif tag == _FLOAT and width in (4, 8):
        x = np.frombuffer(body, "<f4" if width == 4 else "<f8").astype(np.float32)
    elif tag in (_MULAW, _ALAW) and width == 1:
        x = (g711.mulaw_decode(body) if tag == _MULAW else g711.alaw_decode(body)).astype(np.float32) / 32768.0
    else:
        raise WavError(f"{name}: unsupported WAV encoding (format tag {tag}, {bits} bits); convert it to 16-bit "
                       f"PCM, e.g. `sox {name} -b 16 -e signed-integer out.wav`")
    x = x.reshape(-1, channels)
    mono = x[:, 0] if channels == 1 else x.mean(axis=1, dtype=np.float32)
    if np.dtype(dtype) == np.float32:
        return np.ascontiguousarray(mono, dtype=np.float32), int(rate)
    if np.dtype(dtype) == np.int16:
        return float_to_int16(mono), int(rate)
    raise ValueError(f"dtype must be np.int16 or np.float32, not {dtype}")


def write_g711_wav(path: str | Path, data: bytes, sample_rate: int, encoding: str) -> None:
    """Write already-encoded G.711 bytes ("MULAW" or "ALAW") as a mono WAV that telephony tools play."""
    tag = G711_TAGS[encoding]
    # A non-PCM format chunk carries cbSize (0) and is followed by a fact chunk with the frame count.
    fmt = struct.pack("<HHIIHHH", tag, 1, sample_rate, sample_rate, 1, 8, 0)
    fact = struct.pack("<I", len(data))
    pad = b"\0" if len(data) & 1 else b""
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
            + b"data" + struct.pack("<I", len(data)) + data + pad)
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


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
