"""WAV files in, 16 kHz mono float32 out.

`read_wav` understands RIFF/WAVE with integer PCM (8/16/24/32-bit) and IEEE float (32/64-bit),
including WAVE_FORMAT_EXTENSIBLE headers, at any rate and channel count; channels are averaged.
`to_16k` resamples with soxr (high quality), which is what Whisper and the daemon's engines eat.
"""

from __future__ import annotations

import os
import struct
import typing

import numpy as np

TARGET_RATE = 16000
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


class WavError(ValueError):
    """A file that is not a WAV we can read; the message names the file and the reason."""


def read_wav(path: str | os.PathLike | typing.BinaryIO) -> tuple[np.ndarray, int]:
    """(samples as float32 mono in [-1, 1], sample rate); `path` may also be an open binary file."""
    if hasattr(path, "read"):
        data = path.read()
        path = "<audio>"
    else:
        with open(path, "rb") as f:
            data = f.read()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError(f"{path}: not a WAV file (no RIFF/WAVE header); convert it first, e.g. "
                       f"`sox input.mp3 output.wav`")
    fmt = None
    body = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        chunk = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt = chunk
        elif cid == b"data":
            body = chunk  # streamed WAVs may claim a bigger size than the file holds: take what is there
            break
        pos += 8 + size + (size & 1)  # chunks are word aligned
    if fmt is None or body is None:
        raise WavError(f"{path}: WAV without {'fmt' if fmt is None else 'data'} chunk")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the real tag
    if channels < 1 or block_align < 1:
        raise WavError(f"{path}: bad WAV header ({channels} channels, block align {block_align})")
    body = body[: len(body) // block_align * block_align]
    width = bits // 8
    if tag == _PCM and width == 1:
        x = (np.frombuffer(body, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width == 2:
        x = np.frombuffer(body, "<i2").astype(np.float32) / 32768.0
    elif tag == _PCM and width == 3:
        b = np.frombuffer(body, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif tag == _PCM and width == 4:
        x = (np.frombuffer(body, "<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    elif tag == _FLOAT and width in (4, 8):
        x = np.frombuffer(body, "<f4" if width == 4 else "<f8").astype(np.float32)
    else:
        raise WavError(f"{path}: unsupported WAV encoding (format tag {tag}, {bits} bits); "
                       "convert it to 16-bit PCM, e.g. `sox input.wav -b 16 output.wav`")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(x, dtype=np.float32), int(rate)


def to_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    """Resample float32 mono audio to 16 kHz (a no-op copy-free pass-through at 16 kHz)."""
    samples = np.asarray(samples, dtype=np.float32)
    if rate == TARGET_RATE:
        return samples
    import soxr

    return soxr.resample(samples, rate, TARGET_RATE, quality="HQ").astype(np.float32, copy=False)


def load_16k(path: str | os.PathLike) -> np.ndarray:
    """A WAV file as 16 kHz mono float32."""
    samples, rate = read_wav(path)
    return to_16k(samples, rate)
