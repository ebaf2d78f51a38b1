"""One-shot speech every door shares: synthesize a text, list and add voices, decode a clip and
recognize it. Doors map their requests onto these and the results onto their protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Mapping
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
from voiced.core.errors import ErrorKind, SessionError, engine_error, invalid
from voiced.core.segmenter import Segmenter, SegmenterConfig, Utterance
from voiced.core.spec import check_format, check_text
from voiced.engines.base import (
    ASROptions,
    ASRRequest,
    EngineError,
    Transcript,
    TTSOptions,
    TTSRequest,
    Word,
)

MAX_CLIP_S = 600  # a one-shot clip; longer audio belongs in a streaming session
MIN_VOICE_SPEECH_S = 0.5  # speech a recording must hold to clone a voice from it
MIN_WAV_RATE, MAX_WAV_RATE = 1000, 384000  # what a WAV may say; it is resampled to 16 kHz
WHISPER_WINDOW = 30 * RATE
PCM16K = Format("LINEAR16", RATE)


@dataclass
class SpeechChunk:
    sequence: int
    offset_ms: int  # audio before this chunk
    last: bool
    audio: bytes  # in the requested Format


async def synthesize(services, text: str, opts: TTSOptions, fmt: Format = PCM16K) -> AsyncIterator[SpeechChunk]:
    """Speaks `text`, chunk by chunk as the engine writes it. Call `services.check_ready(need_tts=True)`
    first. Raises SessionError (BAD_INPUT, OVER_CAPACITY)."""
    text = check_text(text, "text")
    check_voice(services, opts.voice, "speech.voice")
    encoder = FrameEncoder(check_format(fmt, "output_format"))
    sent = 0
    try:
        async with contextlib.aclosing(services.tts.stream(TTSRequest(text, opts))) as chunks:
            async for chunk in chunks:
                yield SpeechChunk(sequence=chunk.sequence, offset_ms=sent * 1000 // RATE, last=chunk.last,
                                  audio=encoder.encode(chunk.samples, last=chunk.last))
                sent += len(chunk.samples)
    except EngineError as e:
        raise engine_error(e) from None


def check_voice(services, name: str | None, what: str) -> None:
    """NOT_FOUND for a voice the server does not have (None: the default voice, always there)."""
    has = getattr(services.voices, "has", None)
    if name and has is not None and not has(name):
        names = ", ".join(v.name for v in list_voices(services))
        raise SessionError(ErrorKind.NOT_FOUND, f"{what} {name!r} is not a voice of this server; it has: {names} "
                                                "(or gender:pitch:speed, e.g. female:high:moderate); add one "
                                                "from a recording with AddVoice")


# A speaking rate -> the preset voices' speed label (the highest rate each label covers).
SPEED_LEVELS = ((0.6, "very_low"), (0.85, "low"), (1.15, "moderate"), (1.6, "high"), (4.0, "very_high"))


async def resolve_voice(services, name: str | None, speed: float = 1.0,
                        aliases: Mapping[str, str] | None = None) -> str | None:
    """A caller's voice (None: the server's default) as the engine names it. `aliases` maps a protocol's
    own voice names onto the server's (a voice of the server by that name comes first); `speed` other
    than 1 picks a preset's speed label (cloned voices speak at their recording's pace; a voice that
    resolves `any_speed` takes it as TTSOptions.speed, which the door sets). Raises
    NOT_FOUND for a voice the server does not have, BAD_INPUT for a speed a cloned voice cannot take."""
    aliases = aliases or {}
    name = (name or "").strip() or services.config.tts.voice or None
    has = getattr(services.voices, "has", None)
    if speed == 1.0 and name and has is not None and has(name):
        # A voice of the server by its own name, as gRPC's check takes it: no trip to a thread (which,
        # under load, waits for the GIL while the engine thread steps) before the request reaches the engine.
        return name

    def resolve(n):
        try:
            return services.voices.resolve(n)
        except EngineError:
            return None

    resolved = await asyncio.to_thread(resolve, name)
    if resolved is None and name in aliases:
        resolved = await asyncio.to_thread(resolve, aliases[name])
    if resolved is None:
        known = [v.name for v in await asyncio.to_thread(list_voices, services)]
        also = f" (and {', '.join(aliases)}, mapped onto those)" if aliases else ""
        raise SessionError(ErrorKind.NOT_FOUND, f"unknown voice {name!r}; this server has {', '.join(known)}{also}")
    if speed == 1.0 or getattr(resolved, "any_speed", False):
        return resolved.name
    if resolved.kind != "preset":
        raise invalid(f"speed applies to the preset voices; the cloned voice {resolved.name!r} speaks at the pace "
                      "of its recording")
    level = next(label for top, label in SPEED_LEVELS if speed <= top)
    return f"{resolved.gender}:{resolved.pitch}:{level}"


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
    problem = speech_problem(pcm)
    if problem:
        raise invalid(f"the recording {problem}; send 3 to 10 s of one person speaking")
    try:
        return await asyncio.to_thread(services.voices.add, name, int16_to_float(pcm), transcript)
    except (ValueError, EngineError) as e:
        raise invalid(str(e)) from None


def speech_problem(pcm: np.ndarray) -> str | None:
    """Why a recording (16 kHz int16) is no voice to clone, or None when it holds speech.

    Speech: at least MIN_VOICE_SPEECH_S of frames that webrtcvad calls speech and that are not
    noise-like (spectral flatness below 0.3: white noise is near 0.56, voiced speech near 0.01), and
    a level that rises and falls with syllables (frame levels spread over at least 6 dB; steady
    noise or a tone stays within 3 dB, speech spreads over 20 dB)."""
    import webrtcvad

    frames = pcm[: len(pcm) // FRAME_SAMPLES * FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES)
    if len(frames) == 0 or int(np.abs(pcm.astype(np.int32)).max()) < 33:  # below -60 dBFS
        return "is silent"
    x = frames.astype(np.float64)
    rms = np.sqrt(np.mean(x**2, axis=1))
    power = np.abs(np.fft.rfft(x * np.hanning(FRAME_SAMPLES), axis=1)) ** 2 + 1e-10
    flatness = np.exp(np.mean(np.log(power), axis=1)) / np.mean(power, axis=1)
    vad = webrtcvad.Vad(3)
    speech = sum(1 for f, r, fl in zip(frames, rms, flatness)
                 if r > 100 and fl < 0.3 and vad.is_speech(f.tobytes(), RATE))
    level_spread = float(np.std(20 * np.log10(rms + 1.0)))
    if speech * FRAME_SAMPLES / RATE < MIN_VOICE_SPEECH_S or level_spread < 6.0:
        return "holds no speech (it sounds like noise or a steady tone)"
    return None


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
        if not MIN_WAV_RATE <= rate <= MAX_WAV_RATE:
            raise invalid(f"the WAV header says {rate} Hz; send audio sampled at {MIN_WAV_RATE}..{MAX_WAV_RATE} Hz")
        duration = _check_duration(len(samples), rate, max_s)
        pcm = float_to_int16(Resampler(rate, RATE)(samples, last=True))
    else:
        if fmt is None:
            raise invalid("format is required for raw audio (or send a WAV file)")
        f = check_format(fmt, "format")
        try:
            raw = decode_pcm(data, f.encoding)
        except AudioFormatError as e:
            raise invalid(str(e)) from None
        duration = _check_duration(len(raw), f.sample_rate, max_s)
        pcm = Resampler(f.sample_rate, RATE)(raw, last=True)
    if len(pcm) == 0:
        raise invalid("the clip holds no audio samples; send at least one 20 ms frame")
    return pcm, duration


def _check_duration(samples: int, rate: int, max_s: float) -> float:
    duration = samples / rate
    if samples == 0:
        raise invalid("the clip holds no audio samples; send at least one 20 ms frame")
    if duration > max_s:
        raise invalid(f"the clip is {duration:.0f} s long; one-shot recognition takes up to {max_s:.0f} s, "
                      "stream longer audio in a session (StreamingRecognize over gRPC)")
    return duration


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
    async with contextlib.aclosing(recognize_clip_stream(services, pcm, opts, keep_hallucinations)) as results:
        return [r async for r in results]


async def recognize_clip_stream(services, pcm: np.ndarray, opts: ASROptions, keep_hallucinations: bool = False
                                ) -> AsyncIterator[tuple[Utterance, Transcript]]:
    """`recognize_clip` one utterance at a time, each as soon as it and those before it are ready: every
    utterance goes to the engine at once (they share its batches), results leave in order. Raises
    SessionError at the first that fails; closing the iterator early cancels what is left."""
    utterances = split_clip(pcm)
    jobs = [asyncio.ensure_future(services.asr.run(ASRRequest(int16_to_float(u.audio), opts))) for u in utterances]
    try:
        for u, job in zip(utterances, jobs):
            try:
                result = await job
            except EngineError as e:
                raise engine_error(e) from None
            if keep_hallucinations or not result.is_hallucination:
                yield u, in_caller_time(result, u)
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
