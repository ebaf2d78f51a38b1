"""One-shot speech every door shares: synthesize a text, list and add voices, decode a clip and
recognize it. Doors map their requests onto these and the results onto their protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import numpy as np

from voiced.audio.ingest import (
    FRAME_SAMPLES,
    RATE,
    AudioFormatError,
    Format,
    FrameEncoder,
    Resampler,
    decode_pcm,
    float_to_int16,
    int16_to_float,
)
from voiced.core.events import ErrorKind, SessionError, invalid
from voiced.core.segmenter import Segmenter, SegmenterConfig, Utterance
from voiced.core.spec import check_format
from voiced.engines.base import (
    ASROptions,
    ASRRequest,
    CapacityError,
    EngineError,
    Transcript,
    TTSOptions,
    TTSRequest,
    Word,
)

MAX_CLIP_S = 600  # a one-shot clip; longer audio belongs in a streaming session
WHISPER_WINDOW = 30 * RATE
PCM16K = Format("LINEAR16", RATE)


@dataclass
class SpeechChunk:
    sequence: int
    offset_ms: int  # audio before this chunk
    last: bool
    audio: bytes  # in the requested Format


def _engine_error(e: EngineError) -> SessionError:
    # A full queue is the server's state (the caller may retry); anything else is about the request.
    if isinstance(e, CapacityError):
        return SessionError(ErrorKind.OVER_CAPACITY, str(e))
    return SessionError(ErrorKind.BAD_INPUT, str(e))


async def synthesize(services, text: str, opts: TTSOptions, fmt: Format = PCM16K) -> AsyncIterator[SpeechChunk]:
    """Speaks `text`, chunk by chunk as the engine writes it. Call `services.check_ready(need_tts=True)`
    first. Raises SessionError (BAD_INPUT, OVER_CAPACITY)."""
    text = text.strip()
    if not text:
        raise invalid("text is empty; send the text to speak")
    encoder = FrameEncoder(check_format(fmt, "output_format"))
    sent = 0
    try:
        async with contextlib.aclosing(services.tts.stream(TTSRequest(text, opts))) as chunks:
            async for chunk in chunks:
                yield SpeechChunk(sequence=chunk.sequence, offset_ms=sent * 1000 // RATE, last=chunk.last,
                                  audio=encoder.encode(chunk.samples, last=chunk.last))
                sent += len(chunk.samples)
    except EngineError as e:
        raise _engine_error(e) from None


def list_voices(services) -> list:
    """The TTS engine's voices (records with .name, .kind, .description)."""
    return list(services.voices.list())


async def add_voice(services, name: str, pcm: np.ndarray, duration_s: float, transcript: str):
    """Registers a cloned voice from a recording (16 kHz int16, from `decode_clip`) and what it says."""
    name, transcript = name.strip(), transcript.strip()
    if not name:
        raise invalid("name is empty; give the voice a name")
    if not transcript:
        raise invalid("transcript is empty; send what is said in the recording")
    if duration_s < 1.0:
        raise invalid(f"the recording is {duration_s:.2f} s long; send at least 1 s (3 to 10 s is best)")
    try:
        return await asyncio.to_thread(services.voices.add, name, int16_to_float(pcm), transcript)
    except (ValueError, EngineError) as e:
        raise invalid(str(e)) from None


def decode_clip(data: bytes, fmt: Format | None, max_s: float = MAX_CLIP_S) -> tuple[np.ndarray, float]:
    """A clip (WAV bytes, or raw audio in `fmt`) -> (16 kHz int16, its duration in seconds)."""
    if not data:
        raise invalid("audio is empty; send the clip's bytes (base64 in JSON)")
    if data[:4] == b"RIFF":
        from voiced.audio.wavfile import WavError, read_wav

        try:
            samples, rate = read_wav(io.BytesIO(data))
        except WavError as e:
            raise invalid(f"audio starts like a WAV file but cannot be read: {e}") from None
        duration = len(samples) / rate
        pcm = float_to_int16(Resampler(rate, RATE)(samples, last=True))
    else:
        if fmt is None:
            raise invalid("format is required for raw audio (or send a WAV file)")
        f = check_format(fmt, "format")
        try:
            raw = decode_pcm(data, f.encoding)
        except AudioFormatError as e:
            raise invalid(str(e)) from None
        duration = len(raw) / f.sample_rate
        pcm = Resampler(f.sample_rate, RATE)(raw, last=True)
    if duration > max_s:
        raise invalid(f"the clip is {duration:.0f} s long; one-shot recognition takes up to {max_s:.0f} s, "
                      "stream longer audio in a session (StreamingRecognize over gRPC)")
    return pcm, duration


def split_clip(pcm: np.ndarray) -> list[Utterance]:
    """A clip of up to 30 s is one utterance; a longer one is cut at pauses by the segmenter."""
    if len(pcm) <= WHISPER_WINDOW:
        return [Utterance(audio=pcm, start=0, end=len(pcm))]
    seg = Segmenter(SegmenterConfig(hangover_ms=300, max_utterance_ms=29000))
    out: list[Utterance] = []
    padded = np.pad(pcm, (0, -len(pcm) % FRAME_SAMPLES))
    for frame in padded.reshape(-1, FRAME_SAMPLES):
        out += [e for e in seg.push(frame) if isinstance(e, Utterance)]
    out += [e for e in seg.flush() if isinstance(e, Utterance)]
    return out


def in_caller_time(t: Transcript, u: Utterance) -> Transcript:
    """The engine times words from the start of the audio it was given; doors get them in the
    caller's audio time (seconds from the start of the stream or clip), like the utterance's span."""
    if not t.words or not u.audio_start:
        return t
    shift = u.audio_start / RATE
    return replace(t, words=[Word(w.word, round(w.start_s + shift, 3), round(w.end_s + shift, 3), w.probability)
                             for w in t.words])


async def recognize_clip(services, pcm: np.ndarray, opts: ASROptions,
                         keep_hallucinations: bool = False) -> list[tuple[Utterance, Transcript]]:
    """Transcribes a clip from `decode_clip`, one result per utterance (in order); results flagged as
    hallucinations are left out unless `keep_hallucinations`. Raises SessionError."""
    utterances = split_clip(pcm)
    try:
        results = await asyncio.gather(*(services.asr.run(ASRRequest(int16_to_float(u.audio), opts))
                                         for u in utterances))
    except EngineError as e:
        raise _engine_error(e) from None
    return [(u, in_caller_time(r, u)) for u, r in zip(utterances, results)
            if keep_hallucinations or not r.is_hallucination]
