"""Audio files: uploads decoded to 16 kHz mono, and speech encoded as a stream in a file format.

FFmpeg does the codec work, through PyAV (the `av` package ships its own FFmpeg build): it reads
what tools actually upload (WAV, FLAC, Ogg Opus/Vorbis, MP3, WebM from a browser's MediaRecorder,
M4A/MP4 from phones, AAC, AIFF) and writes Ogg Opus, MP3, AAC and FLAC one chunk at a time, so a
streamed reply's first bytes leave with its first chunk. WAV and raw PCM need no codec: they are
written here. Only the container formats listed in ACCEPTED are opened at all: an upload is
untrusted input, and FFmpeg can parse far more than a caller needs.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

import numpy as np

from voiced.audio.ingest import float_to_int16

log = logging.getLogger(__name__)

# FFmpeg demuxer names (as `container.format.name` reports them) -> what users call them.
ACCEPTED = {
    "wav": "WAV",
    "flac": "FLAC",
    "ogg": "OGG (Opus, Vorbis)",
    "mp3": "MP3",
    "matroska,webm": "WebM",
    "mov,mp4,m4a,3gp,3g2,mj2": "M4A/MP4",
    "aac": "AAC",
    "aiff": "AIFF",
}
ACCEPTED_NAMES = ", ".join(dict.fromkeys(ACCEPTED.values()))


class AudioFileError(ValueError):
    """An upload that cannot be used; the message says what is accepted or what to fix."""


def decode_file(data: bytes, rate: int = 16000, max_seconds: float | None = None) -> tuple[np.ndarray, float]:
    """An audio file's bytes -> (mono int16 samples at `rate`, duration in seconds).

    Stereo is mixed down. Decoding stops with an error once the audio passes `max_seconds`, so a
    small, highly compressed file cannot expand into gigabytes of samples.
    """
    import av

    if not data:
        raise AudioFileError(f"the file is empty; send an audio file ({ACCEPTED_NAMES})")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError):
        raise AudioFileError(f"the file is not audio in a format this server reads; send {ACCEPTED_NAMES}") from None
    try:
        kind = container.format.name
        if kind not in ACCEPTED:
            raise AudioFileError(f"{container.format.long_name or kind} files are not accepted; send {ACCEPTED_NAMES}")
        if not container.streams.audio:
            raise AudioFileError("the file has no audio track")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        limit = None if max_seconds is None else int(max_seconds * rate)
        parts: list[np.ndarray] = []
        total = 0
        try:
            for frame in container.decode(stream):
                frame.pts = None  # the resampler keeps its own clock; broken timestamps do not matter
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    total += out.samples
                if limit is not None and total > limit:
                    raise AudioFileError(f"the audio is longer than {max_seconds:.0f} s; send a shorter clip")
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
                total += out.samples
        except (av.FFmpegError, ValueError) as e:
            if isinstance(e, AudioFileError):
                raise
            if not total:
                raise AudioFileError(f"the {ACCEPTED[kind]} file is damaged and cannot be decoded ({e})") from None
            # A cut-off upload (a recording stopped mid-write): keep what decoded, as FFmpeg's own tools do.
            log.info("upload: %s file damaged after %.1f s of audio; using that much (%s)", ACCEPTED[kind],
                     total / rate, e)
    finally:
        container.close()
    if not total:
        raise AudioFileError("the file holds no audio samples")
    pcm = np.concatenate(parts).astype(np.int16, copy=False)
    return pcm, len(pcm) / rate


# ---------------------------------------------------------------------------- speech out


@dataclass(frozen=True)
class SpeechFormat:
    name: str  # as OpenAI's response_format names it
    content_type: str
    container: str | None = None  # FFmpeg muxer; None: written here
    codec: str | None = None
    options: tuple[tuple[str, str], ...] = ()


SPEECH_FORMATS = {
    "mp3": SpeechFormat("mp3", "audio/mpeg", "mp3", "libmp3lame"),
    # One Ogg page per Opus packet (20 ms): the muxer's default holds a page for a second of audio.
    "opus": SpeechFormat("opus", "audio/ogg; codecs=opus", "ogg", "libopus", (("page_duration", "20000"),)),
    "aac": SpeechFormat("aac", "audio/aac", "adts", "aac"),
    "flac": SpeechFormat("flac", "audio/flac", "flac", "flac"),
    "wav": SpeechFormat("wav", "audio/wav"),
    "pcm": SpeechFormat("pcm", "audio/pcm"),
}


def wav_stream_header(rate: int, channels: int = 1, bits: int = 16) -> bytes:
    """A WAV header for audio of unknown length (sizes 0xFFFFFFFF), as streaming servers write it."""
    block = channels * bits // 8
    return (b"RIFF" + (0xFFFFFFFF).to_bytes(4, "little") + b"WAVEfmt "
            + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + channels.to_bytes(2, "little")
            + rate.to_bytes(4, "little") + (rate * block).to_bytes(4, "little") + block.to_bytes(2, "little")
            + bits.to_bytes(2, "little") + b"data" + (0xFFFFFFFF).to_bytes(4, "little"))


class _Sink:
    """A write-only, unseekable file for FFmpeg's muxer: what it writes is taken out after each chunk."""

    def __init__(self):
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class SpeechEncoder:
    """16-bit mono PCM chunks in -> the bytes of one audio file out, a piece per chunk.

    `encode(pcm)` returns what can be sent now (possibly nothing while a codec fills a frame);
    `finish()` returns the rest. The concatenation of everything returned is a complete file.
    """

    def __init__(self, fmt: SpeechFormat, rate: int):
        self.format = fmt
        self.rate = rate
        self._header = wav_stream_header(rate) if fmt.name == "wav" else b""
        self._container = self._stream = self._sink = None
        if fmt.container is not None:
            import av

            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=fmt.container, options=dict(fmt.options))
            self._stream = self._container.add_stream(fmt.codec, rate=rate, layout="mono")

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.dtype != np.int16:
            pcm = float_to_int16(pcm)
        if self._container is None:
            out, self._header = self._header + pcm.astype("<i2", copy=False).tobytes(), b""
            return out
        if not len(pcm):
            return b""
        import av

        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.reshape(1, -1)), format="s16", layout="mono")
        frame.sample_rate = self.rate
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self._container is None:
            out, self._header = self._header, b""
            return out
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        self._container = None
        return self._sink.take()

    def close(self) -> None:
        """Free the codec without finishing the file (the request went away)."""
        if self._container is not None:
            self._container.close()
            self._container = None
