"""What the session and the offline replay (voiced.bench.turn_replay) both work out about a pause inside a
turn under smart turn detection: the pause's state, the options of its decodes, the audio model's clip, and
the evidence its transcript gives the end-of-turn rule (voiced.core.turns). Pure functions of their inputs:
the replay runs these, not copies, so its figures are the session's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from voiced.audio.ingest import int16_to_float
from voiced.core import segmenter, turns
from voiced.core.segmenter import SegmenterConfig
from voiced.engines.base import ASROptions, Transcript


@dataclass(eq=False)
class Pause:
    """A short pause inside a turn (smart turn detection): what is being worked out about it. (Compared and
    hashed by identity: a driver keys its own records of a pause by it.)"""

    turn_id: int
    audio: np.ndarray  # the turn so far
    audio_end: int  # the stream sample where `audio` ends
    voice_end: int  # the stream sample where the voice stopped (the silence is counted from there)
    words: tuple[str, ...] = ()  # (stalled) the words that stopped changing
    stalled: bool = False  # found by the words (the VAD still hears sound), not by a silence
    result: Transcript | None = None  # (stalled) the decode that found it: its transcript is known already
    gap: bool = False  # speech came back within turns.SHORT_MS: a gap between words, its transcript is not wanted
    evidence: turns.Evidence = turns.Evidence()
    # The driver's (voiced.core.turn_tracker): its handles on the work (the session: an asyncio future of the
    # final transcript if the turn ends here, the task gathering the evidence) and how long that work took.
    transcript: Any = None
    detect: Any = None
    opened: float = 0.0  # monotonic time the pause was noticed
    decode_s: float | None = None  # how long its transcript took (0: it was there already)
    model_s: float | None = None  # how long the audio model took

    @property
    def speech_end_s(self) -> float:
        """Where in `audio` the voice stopped."""
        return (self.voice_end - (self.audio_end - len(self.audio))) / segmenter.RATE


# A decode of a turn cannot need more tokens than its audio can say: English speech runs at ~3-6 tokens a
# second (fast speech, numbers and punctuation ~10), so this many a second of audio, never fewer than
# DECODE_TOKENS_MIN, never truncates a caller's words, and stops a hallucinated loop ("namba namba ...",
# seen on a GPU at a pause) after a few dozen tokens instead of at the model's limit (224 for Whisper):
# that loop made one pause's decode take 272 ms where ~20 were expected.
DECODE_TOKENS_PER_S = 16
DECODE_TOKENS_MIN = 32
ALONE_MIN_SAMPLES = segmenter.RATE // 10  # the sound after stopped words is decoded alone from 100 ms of it
ALONE_LEAD_SAMPLES = 3 * segmenter.RATE // 10  # ... and at most 300 ms of the silence before it


def decode_token_cap(samples: int, configured: int | None) -> int | None:
    """`max_new_tokens` for a decode of `samples` of audio: the audio's bound, or `configured` (the
    config's, None: the model's limit) where that is lower."""
    cap = max(DECODE_TOKENS_MIN, -(-samples * DECODE_TOKENS_PER_S // segmenter.RATE))
    return cap if configured is None else min(cap, configured)


def recognition_options(opts: ASROptions, samples: int, priority: int, final: bool = True,
                        words: bool = False) -> ASROptions:
    """The options of one of the session's decodes (the replay, voiced.bench.turn_replay, uses them too):
    `samples` of audio, at `priority`; `final`: the turn's transcript (else an interim one); `words`:
    the end-of-turn rule reads the last word's probability and time, so word timings are on."""
    if words and not opts.word_timestamps:
        opts = replace(opts, word_timestamps=True)
    if opts.priority != priority or (opts.word_timestamps and not final and not words):
        # Interim results are replaced within a second: no word timings for them (unless the
        # end-of-turn rule reads them).
        opts = replace(opts, priority=priority, word_timestamps=words or (opts.word_timestamps and final))
    cap = decode_token_cap(samples, opts.max_new_tokens)
    return opts if cap == opts.max_new_tokens else replace(opts, max_new_tokens=cap)


def smart_segmentation(seg: SegmenterConfig, bounds: turns.Bounds) -> SegmenterConfig:
    """Smart turn detection's segmenter: it reports the short pause; its hangover is the upper bound."""
    return replace(seg, pause_ms=turns.PAUSE_MS, hangover_ms=bounds.max_ms)


def model_clip(audio: np.ndarray, audio_end: int, voice_end: int) -> np.ndarray:
    """What the audio model hears of a pause: the turn (`audio`, int16, ending at stream sample
    `audio_end`) up to the voice's end, then MODEL_SILENCE_MS of silence (whatever the line played after
    it: noise, tones, music)."""
    keep = min(len(audio), max(0, voice_end - (audio_end - len(audio))))
    clip = np.zeros(keep + turns.MODEL_SILENCE_MS * segmenter.RATE // 1000, dtype=np.float32)
    clip[:keep] = int16_to_float(audio[:keep])
    return clip


def heard_after(heard: turns.Heard, result: Transcript, samples: int, audio_end: int,
                voice_end: int) -> turns.Heard:
    """The turn's words after one more decode of it (`samples` of audio ending at `audio_end`)."""
    text = "" if result.is_hallucination else result.text
    if result.words:  # the last word's end (cross-attention times: give it a little slack)
        said = audio_end - samples + int((result.words[-1].end_s + turns.ALIGN_SLACK_S) * segmenter.RATE)
        voice_end = min(voice_end, max(said, 0))
    return heard.heard(turns.words_of(text), audio_end, voice_end)


def pause_evidence(evidence: turns.Evidence, result: Transcript, speech_end_s: float, stalled: bool,
                   keep_hallucinations: bool = False) -> tuple[turns.Evidence, str]:
    """The evidence once a pause's transcript is in (and the text as Whisper wrote it)."""
    text = "" if result.is_hallucination and not keep_hallucinations else result.text
    english = result.language == "en"
    judged = turns.judged_text(text, result.words, speech_end_s, english)
    return replace(evidence, text=judged, fresh=True, sounding=stalled, english=english,
                   doubtful=bool(text.strip()) and turns.doubted(result.words, speech_end_s),
                   # Whisper's end-of-text follows its whole text, not the words judged without their last one
                   end_p=result.end_prob if judged == text else None,
                   stop_p=result.stop_prob if judged == text else None), text
