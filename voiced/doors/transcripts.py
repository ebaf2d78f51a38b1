"""The response formats of OpenAI's transcription API: json, text, srt, vtt and verbose_json.

A clip is recognised as one or more utterances (a long clip is cut at pauses); each gives a
Transcript whose segments carry times from the start of that utterance. `timed_segments` lays
them on the clip's own time line, and each builder renders them the way OpenAI's API does, so a
subtitle tool or an SDK parses our answer as it parses theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from voiced.engines.base import Transcript

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
CONTENT_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


@dataclass
class Recognized:
    """One utterance of the clip and what was heard in it."""

    start: float  # seconds from the start of the clip
    end: float
    transcript: Transcript


@dataclass
class TimedSegment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = field(default_factory=list)
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    seek: int = 0  # the utterance's start in 10 ms frames, as Whisper's sliding window reports it


def timed_segments(results: list[Recognized]) -> list[TimedSegment]:
    out: list[TimedSegment] = []
    for r in results:
        t = r.transcript
        seek = round(r.start * 100)
        pieces = [(s.start, s.end, s.text, s.tokens) for s in t.segments if s.text.strip()]
        if not pieces and t.text.strip():
            # No timestamp tokens came back: the utterance is the segment.
            pieces = [(0.0, r.end - r.start, t.text, t.tokens)]
        for start, end, text, tokens in pieces:
            # Whisper may write a timestamp past the utterance's audio (its window runs on in silence): a
            # segment keeps to the utterance, and never ends before it starts.
            end = round(min(r.start + end, r.end), 3)
            out.append(TimedSegment(
                id=len(out), start=min(round(r.start + start, 3), end), end=end,
                text=text.strip(), tokens=list(tokens), avg_logprob=t.avg_logprob,
                compression_ratio=t.compression_ratio, no_speech_prob=t.no_speech_prob, seek=seek))
    return out


def full_text(results: list[Recognized]) -> str:
    return " ".join(r.transcript.text.strip() for r in results if r.transcript.text.strip())


def language_of(results: list[Recognized], requested: str | None) -> str:
    """verbose_json names the language in words ("english"), as Whisper's API does."""
    from voiced.engines.whisper.tokenizer import LANGUAGES

    code = requested or next((r.transcript.language for r in results if r.transcript.language), "")
    return LANGUAGES.get(code, code)


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[TimedSegment]) -> str:
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: list[TimedSegment]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n\n" for s in segments)


def verbose_json(results: list[Recognized], *, task: str, duration: float, language: str | None,
                 granularities: tuple[str, ...] = ("segment",)) -> dict:
    body: dict = {
        "task": task,
        "language": language_of(results, language),
        "duration": round(duration, 3),
        "text": full_text(results),
    }
    if "segment" in granularities or not granularities:
        body["segments"] = [{
            "id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text, "tokens": s.tokens,
            "temperature": 0.0, "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
            "no_speech_prob": s.no_speech_prob,
        } for s in timed_segments(results)]
    if "word" in granularities:
        # The core hands words over in the clip's time already (voiced.core.speech.in_caller_time).
        body["words"] = [{"word": w.word, "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
                         for r in results for w in (r.transcript.words or [])]
    body["usage"] = {"type": "duration", "seconds": round(duration, 3)}
    return body


def render(results: list[Recognized], response_format: str, *, task: str, duration: float,
           language: str | None, granularities: tuple[str, ...] = ("segment",)) -> tuple[str, str]:
    """(body, content type) of the response in `response_format`."""
    if response_format == "text":
        body = full_text(results) + "\n"
    elif response_format == "srt":
        body = srt(timed_segments(results))
    elif response_format == "vtt":
        body = vtt(timed_segments(results))
    elif response_format == "verbose_json":
        body = json.dumps(verbose_json(results, task=task, duration=duration, language=language,
                                       granularities=granularities), ensure_ascii=False)
    else:
        obj: dict = {"text": full_text(results)}
        if task == "transcribe":
            obj["usage"] = {"type": "duration", "seconds": round(duration, 3)}
        body = json.dumps(obj, ensure_ascii=False)
    return body, CONTENT_TYPES[response_format]
