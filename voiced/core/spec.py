"""A session's settings: the config's defaults plus what the caller asked for, validated.

Every door builds a `SessionSpec` through `spec_for` (and the option helpers below), so every way a
caller's settings can be wrong gets the same `SessionError` (BAD_INPUT) with a message that names
the setting and what to set, whichever protocol it came through. Doors only map their fields here.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace

from voiced.audio.ingest import AudioFormatError, Format
from voiced.config import Config
from voiced.core.errors import invalid
from voiced.core.segmenter import SegmenterConfig
from voiced.engines.base import MAX_SPEED, MIN_SPEED, ASROptions, TTSOptions

MAX_BEAM = 4
MAX_TEXT_CHARS = 4000  # text to speak in one request: minutes of speech, past any tts.max_seconds
MAX_PROMPT_CHARS = 2000  # an initial prompt; Whisper keeps only its last 223 tokens anyway
TASKS = ("transcribe", "translate")
BARGE_IN_MIN_MS, BARGE_IN_MAX_MS = 20, 5000


@dataclass
class SessionSpec:
    session_id: str
    front: str  # the door it came through (metrics and logs): grpc, audiosocket, media_ws, wyoming, ...
    input: Format
    output: Format
    segmentation: SegmenterConfig
    recognize: bool  # False: speech events only
    asr: ASROptions
    interim_results: bool
    keep_hallucinations: bool
    agent: str
    system_prompt: str
    tts: TTSOptions
    barge_in: bool
    barge_in_min_speech_ms: int


def check_format(fmt: Format, what: str) -> Format:
    try:
        fmt.validate(what)
    except AudioFormatError as e:
        raise invalid(str(e)) from None
    return fmt


def _pick(value, default):
    return default if value is None else value


def segmentation_for(config: Config, *, mode: str = "auto", vad_aggressiveness: int | None = None,
                     pre_roll_ms: int | None = None, hangover_ms: int | None = None,
                     min_speech_ms: int | None = None, max_utterance_ms: int | None = None,
                     turn_detection: str | None = None, eagerness: str | None = None) -> SegmenterConfig:
    """The config's segmentation defaults with the given overrides (None: the default), validated."""
    d = config.segmentation
    seg = SegmenterConfig(
        mode=mode,
        vad_aggressiveness=_pick(vad_aggressiveness, d.vad_aggressiveness),
        pre_roll_ms=_pick(pre_roll_ms, d.pre_roll_ms),
        hangover_ms=_pick(hangover_ms, d.hangover_ms),
        min_speech_ms=_pick(min_speech_ms, d.min_speech_ms),
        max_utterance_ms=_pick(max_utterance_ms, d.max_utterance_ms),
        turn_detection=turn_detection or d.turn_detection,
        eagerness=eagerness or d.eagerness,
    )
    return _check_segmentation(seg)


def _check_segmentation(seg: SegmenterConfig) -> SegmenterConfig:
    try:
        seg.validate()
    except ValueError as e:
        raise invalid(f"segmentation: {e}") from None
    return seg


def clean_text(text: str) -> str:
    """Control characters become spaces; runs of white space one space."""
    return " ".join("".join(" " if unicodedata.category(c)[0] == "C" else c for c in text).split())


def check_text(text: str, what: str) -> str:
    """Text to speak, cleaned and checked: control characters become spaces; empty, oversize, or
    nothing speakable (only emoji, symbols, control characters) is BAD_INPUT."""
    cleaned = clean_text(text)
    if not cleaned:
        if text.strip():
            raise invalid(f"{what} has nothing to say: it holds only control characters; send words")
        raise invalid(f"{what} is empty; send the text to speak")
    if len(cleaned) > MAX_TEXT_CHARS:
        raise invalid(f"{what} is {len(cleaned)} characters; send at most {MAX_TEXT_CHARS} at a time "
                      "(split longer text)")
    if not any(unicodedata.category(c)[0] in "LN" for c in cleaned):
        raise invalid(f"{what} has nothing to say: it holds only emoji, symbols or punctuation; send words")
    return cleaned


def check_user_text(text: str, what: str) -> str:
    """Typed user text for the agent, cleaned as `check_text` cleans it; empty or oversize is BAD_INPUT.
    (An emoji is a fair question to an agent: only text to speak must hold words.)"""
    cleaned = clean_text(text)
    if not cleaned:
        raise invalid(f"{what} is empty; send what the user typed")
    if len(cleaned) > MAX_TEXT_CHARS:
        raise invalid(f"{what} is {len(cleaned)} characters; send at most {MAX_TEXT_CHARS} at a time")
    return cleaned


def check_language(language: str | None, what: str, known: Sequence[str] | None = None) -> str | None:
    """A caller's language as Whisper names it: a code or a name in any case, with or without a region
    (`en`, `EN`, `english`, `en-US`, `en_US` -> `en`); None for none (detect it). `known`: the languages
    the loaded model speaks, when the door checks against them. BAD_INPUT names `what` otherwise."""
    if not language or not language.strip():
        return None
    from voiced.engines.whisper.tokenizer import normalize_language

    code = language.strip().replace("_", "-")
    for candidate in (code, code.split("-")[0]):
        try:
            found = normalize_language(candidate)
        except ValueError:
            continue
        if known is not None and found not in known:
            break
        return found
    if known is not None:
        raise invalid(f"{what} {language!r} is not a language this model knows; it knows: {', '.join(known)}")
    raise invalid(f"{what} {language!r} is not a language Whisper knows; use a code such as en, de, fr, zh (or "
                  "leave it empty to detect)")


def _check_finite(value: float | None, name: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise invalid(f"{name} is {value}; set a finite number")
    return value


def asr_options_for(config: Config, *, language: str | None = None, task: str | None = None,
                    beam_size: int | None = None, initial_prompt: str | None = None,
                    no_speech_threshold: float | None = None, logprob_threshold: float | None = None,
                    compression_ratio_threshold: float | None = None, word_timestamps: bool = False,
                    what: str = "recognition") -> ASROptions:
    """Recognition options: the config's `[asr]` defaults with the given overrides, validated."""
    a = config.asr
    beam = _pick(beam_size, a.beam_size)
    if not 1 <= beam <= MAX_BEAM:
        raise invalid(f"{what}.beam_size {beam} is outside 1..{MAX_BEAM}")
    task = task or "transcribe"
    if task not in TASKS:
        raise invalid(f"{what}.task {task!r} is unknown; use transcribe or translate")
    if initial_prompt and len(initial_prompt) > MAX_PROMPT_CHARS:
        raise invalid(f"{what}.initial_prompt is {len(initial_prompt)} characters; send at most {MAX_PROMPT_CHARS} "
                      "(Whisper reads only its last 223 tokens)")
    for name, value in (("no_speech_threshold", no_speech_threshold), ("logprob_threshold", logprob_threshold),
                        ("compression_ratio_threshold", compression_ratio_threshold)):
        _check_finite(value, f"{what}.{name}")
    return ASROptions(
        language=check_language(language, f"{what}.language") or a.language or None,
        task=task,
        beam_size=beam,
        initial_prompt=initial_prompt or None,
        max_new_tokens=a.max_new_tokens or None,
        no_speech_threshold=_pick(no_speech_threshold, a.no_speech_threshold),
        logprob_threshold=_pick(logprob_threshold, a.logprob_threshold),
        compression_ratio_threshold=_pick(compression_ratio_threshold, a.compression_ratio_threshold),
        word_timestamps=bool(word_timestamps),
    )


def tts_options_for(config: Config, *, voice: str | None = None, seed: int | None = None,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    max_seconds: float | None = None, speed: float | None = None) -> TTSOptions:
    """Synthesis options: the config's `[tts]` defaults with the given overrides, validated.
    `max_seconds` can only lower the server's cap."""
    t = config.tts
    opts = TTSOptions(
        voice=voice or t.voice or None,
        seed=seed,
        temperature=_pick(temperature, t.temperature),
        top_k=_pick(top_k, t.top_k),
        top_p=_pick(top_p, t.top_p),
        max_seconds=min(_pick(max_seconds, t.max_seconds), t.max_seconds),
        first_chunk_tokens=t.first_chunk_tokens,
        chunk_tokens=t.chunk_tokens,
        speed=_pick(speed, 1.0),
    )
    if opts.voice is not None and not opts.voice.strip():
        raise invalid("speech.voice is blank; leave it empty for the default voice or name one")
    if not 0.0 <= opts.temperature <= 2.0:
        raise invalid(f"speech.temperature {opts.temperature} is outside 0..2")
    if not MIN_SPEED <= opts.speed <= MAX_SPEED:  # NaN too
        raise invalid(f"speech.speed {opts.speed} is outside {MIN_SPEED:g}..{MAX_SPEED:g} (1 is the voice's own pace)")
    if not opts.max_seconds > 0:  # NaN too
        raise invalid(f"speech.max_seconds {opts.max_seconds} must be positive")
    if opts.top_k < 0:
        raise invalid(f"speech.top_k {opts.top_k} must be 0 (off) or positive")
    if not 0.0 < opts.top_p <= 1.0:
        raise invalid(f"speech.top_p {opts.top_p} is outside (0, 1]")
    return opts


def spec_for(
    config: Config,
    *,
    session_id: str,
    input: Format,
    output: Format | None = None,
    front: str,
    agent: str | None = None,
    agents: Sequence[str] | None = None,
    voice: str | None = None,
    system_prompt: str | None = None,
    segmentation: SegmenterConfig | None = None,
    language: str | None = None,
    asr: ASROptions | None = None,
    tts: TTSOptions | None = None,
    recognize: bool = True,
    interim_results: bool = False,
    keep_hallucinations: bool = False,
    barge_in: bool | None = None,
    barge_in_min_speech_ms: int | None = None,
) -> SessionSpec:
    """A session's spec: the config's defaults plus these overrides (None: the default), validated.

    `agents` lists the agents the server has (`services.agents.names()`; `Services.spec` passes it);
    `asr`/`tts` come from `asr_options_for`/`tts_options_for` when a door has more to set than
    `language`/`voice`, which override them.
    """
    inp = check_format(input, "input_format")
    out = check_format(output, "output_format") if output is not None else inp
    seg = _check_segmentation(segmentation) if segmentation is not None else segmentation_for(config)

    agent = agent or config.agent.default
    if agents is not None and agent not in agents:
        raise invalid(f"agent.name {agent!r} is not available; this server has: {', '.join(agents)}")
    barge_min = _pick(barge_in_min_speech_ms, config.barge_in.min_speech_ms)
    if not BARGE_IN_MIN_MS <= barge_min <= BARGE_IN_MAX_MS:
        raise invalid(f"barge_in.min_speech_ms {barge_min} is outside {BARGE_IN_MIN_MS}..{BARGE_IN_MAX_MS}")

    asr = asr if asr is not None else asr_options_for(config)
    if language:
        asr = replace(asr, language=check_language(language, "recognition.language"))
    tts = tts if tts is not None else tts_options_for(config)
    if voice:
        tts = replace(tts, voice=voice)
    return SessionSpec(
        session_id=session_id,
        front=front,
        input=inp,
        output=out,
        segmentation=seg,
        recognize=recognize,
        asr=asr,
        interim_results=interim_results,
        keep_hallucinations=keep_hallucinations,
        agent=agent,
        system_prompt=system_prompt or config.agent.system_prompt,
        tts=tts,
        barge_in=_pick(barge_in, config.barge_in.enabled),
        barge_in_min_speech_ms=barge_min,
    )
