"""One caller's turn taking under smart turn detection: the segmenter's events and the evidence go in,
the decodes it needs and the end-of-turn decision come out.

The shape is Pipecat's turn analyzers' (`append_audio` -> state, `analyze_end_of_turn`): the tracker does no
I/O and starts nothing. Its driver feeds it the segmenter's events (`started`, `paused`, `resumed`,
`ended`), asks on each frame of speech whether an interim decode is due (`interim_due`) and whether the turn
is over (`over`), and hands it the evidence as it arrives: the audio model's probability (`model_answer`),
a pause's transcript (`transcript`, `pause_words`), the interim decodes of the turn (`words`, `alone`).
Its answers (`Actions`) say which pause to work out, which to drop, which sound to decode alone. The session
(voiced.core.session) drives it live, running the decodes and the model in tasks at their real speed; the
offline replay (voiced.bench.turn_replay) drives the same class with cached evidence at fixed latencies,
so the replay's figures are this state machine's, not a copy's. The rule that sets each pause's wait is
voiced.core.turns; what is worked out about one pause is voiced.core.pauses.

A pause is found two ways. A silence (the segmenter's Paused): its transcript of the turn so far and the
audio model start at once, and speech coming back (Resumed) cancels it. Or words that stopped changing while
the VAD still hears sound (hold music right after the voice): after a pause that sound followed, the turn is
decoded every `turns.WORDS_EVERY_MS`, and once its words are unchanged over `turns.STALL_MS` more audio (and
the sound after them, decoded alone, shows no talking: `turns.talking`) that is a pause dated where the
words ended (`turns.Heard`); new words cancel it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from voiced.core import turns
from voiced.core.pauses import ALONE_LEAD_SAMPLES, ALONE_MIN_SAMPLES, Pause, heard_after, pause_evidence
from voiced.core.segmenter import RATE, Segmenter
from voiced.engines.base import Transcript


@dataclass(eq=False)
class Decode:
    """A decode of the turn that the tracker asks for: `audio` (int16) ending at stream sample `audio_end`."""

    turn_id: int
    audio: np.ndarray
    audio_end: int
    voice_end: int  # where the VAD last heard the voice in it (a stream sample)
    # (an interim decode whose words stopped) its transcript and those words, while the sound after them is
    # decoded alone (`TurnTracker.alone`)
    result: Transcript | None = None
    heard: turns.Heard | None = None


@dataclass
class Actions:
    """What the driver does after one of the tracker's answers (each None: nothing)."""

    # speech came back: nothing worked out in this pause may reach the caller (its audio model call, a reply
    # prepared in it); its transcript is cancelled too where `drop.gap`, else it goes on (`pause_words`)
    drop: Pause | None = None
    # a pause to work out: its transcript (already there where `open.result` is set) and the audio model
    open: Pause | None = None
    # the sound after words that stopped changing, to decode alone (no word timings); the answer goes to `alone`
    decode: Decode | None = None


class TurnTracker:
    """The turn-taking state of one caller (class docstring of the module). `seg` is the caller's segmenter,
    read (never pushed) by the tracker; the driver pushes the frames and passes on its events."""

    def __init__(self, seg: Segmenter, bounds: turns.Bounds, interim_every_ms: int,
                 keep_hallucinations: bool = False):
        self.seg, self.bounds = seg, bounds
        self.interim_every_ms = interim_every_ms  # config asr.interim_interval_ms
        self.keep_hallucinations = keep_hallucinations
        self.turn_id = 0
        self.pause: Pause | None = None  # the pause being worked out
        self.interim: Decode | None = None  # the interim decode in flight (with its sound decoded alone)
        self.interim_text: str | None = None  # the latest interim decode's text of this turn (the driver's)
        self._heard = turns.Heard((), 0, 0)  # the turn's words, and since when unchanged
        self._alone: tuple[str, ...] = ()  # the words of the last decode of the sound after them alone
        self._checking = False  # sound came back after a pause: the turn is decoded until it ends (`words`)
        self._sound_since = 0  # the stream sample where the current sound began (speech or not)
        self._next_interim = 0  # (the turn's speech_ms) when the next interim decode is due

    # ------------------------------------------------------------------ the segmenter's events

    def started(self, offset: int) -> None:
        """SpeechStarted at stream sample `offset`: a new turn."""
        self.turn_id += 1
        self.interim_text = None
        self._heard = turns.Heard((), 0, 0)
        self._alone = ()
        self._checking = False
        self._sound_since = offset
        self._next_interim = self._interim_every()

    def paused(self) -> Actions:
        """Paused: a short silence inside the turn opens a pause on the audio so far. After a pause the words
        found, the silence's own transcript of all the audio decides: the caller may have talked since
        (Whisper drops words said after a long gap, and then they look stopped)."""
        acts = Actions()
        if self.pause is not None and self.pause.stalled:
            acts.drop = self._cancel()
        if self.pause is None:
            self.interim = None  # the pause's transcript supersedes it
            acts.open = self.pause = Pause(self.turn_id, self.seg.current_audio(), self.seg.offset,
                                           self.seg.voiced_end, evidence=turns.Evidence(text=self.interim_text))
        return acts

    def resumed(self, offset: int) -> Actions:
        """Resumed at stream sample `offset`: sound came back, which cancels a silence's pause."""
        self._sound_since = offset
        if self.pause is not None and not self.pause.stalled:
            return Actions(drop=self._cancel())
        return Actions()

    def ended(self) -> Pause | None:
        """Utterance: the turn ended; the pause it ended in, if any (its transcript is the turn's)."""
        self.interim = None
        pause, self.pause = self.pause, None
        return pause

    def _cancel(self) -> Pause:
        pause, self.pause = self.pause, None
        if pause.stalled:
            return pause
        if (self.seg.offset - pause.voice_end) * 1000 < turns.SHORT_MS * RATE:
            pause.gap = True
            return pause
        # A pause, then sound: was that the caller, or something the VAD calls speech (hold music)? The turn
        # is decoded until the words say, first as soon as a decode can show whether they stopped.
        self._checking = True
        self._next_interim = self.seg.speech_ms + turns.STALL_MS
        return pause

    # ------------------------------------------------------------------ each frame of speech

    def interim_due(self, asked: bool) -> Decode | None:
        """The interim decode of the turn to start on this frame, if one is due: where the caller asked for
        interim results (`asked`), or after a pause that sound followed; none while a silence's pause is
        worked out. It is in flight until `interim_done`."""
        if not (asked or self._checking) or (self.pause is not None and not self.pause.stalled):
            return None
        if self.seg.speech_ms < self._next_interim or self.interim is not None:
            return None
        self._next_interim = self.seg.speech_ms + self._interim_every()
        self.interim = Decode(self.turn_id, self.seg.current_audio(), self.seg.offset, self.seg.voiced_end)
        return self.interim

    def over(self) -> bool:
        """Whether the turn is over now: the pause's evidence and the silence since the voice stopped say so
        (the driver then ends the turn, `Segmenter.end_turn`)."""
        pause = self.pause
        if pause is None or not self.seg.in_speech or pause.turn_id != self.turn_id:
            return False
        if pause.stalled and not pause.evidence.fresh:
            return False  # sound goes on: only the words can end it (their verdict is a few ms away)
        return pause.evidence.ends(self.silence_ms(pause), self.bounds)

    def silence_ms(self, pause: Pause) -> int:
        """How long the voice has been silent at `pause`."""
        return (self.seg.offset - pause.voice_end) * 1000 // RATE

    # ------------------------------------------------------------------ the evidence

    def model_answer(self, pause: Pause, p_complete: float) -> None:
        """The audio model's probability that the turn is complete at `pause`."""
        pause.evidence = replace(pause.evidence, p_complete=p_complete)

    def transcript(self, pause: Pause, result: Transcript) -> tuple[str, int, str]:
        """`pause`'s transcript of the turn so far: the text as Whisper wrote it, the wait it sets and why
        (`turns.Evidence.verdict`)."""
        pause.evidence, text = pause_evidence(pause.evidence, result, pause.speech_end_s, pause.stalled,
                                              self.keep_hallucinations)
        return (text, *pause.evidence.verdict(self.bounds))

    def pause_words(self, pause: Pause, result: Transcript) -> None:
        """A silence pause's transcript is in: its words count among the turn's decodes, even where speech
        came back (or sound the VAD calls speech: hold music right after the voice)."""
        if not pause.gap and pause.turn_id == self.turn_id and self.seg.in_speech:
            self._heard = heard_after(self._heard, result, len(pause.audio), pause.audio_end, pause.voice_end)

    def current(self, decode: Decode) -> bool:
        """Whether the interim decode `decode` still counts (its turn goes on, nothing superseded it)."""
        return self.interim is decode and decode.turn_id == self.turn_id and self.seg.in_speech

    def words(self, decode: Decode, result: Transcript) -> Actions:
        """An interim decode of the turn is in: new words cancel a pause the words found; words that
        stopped changing while the VAD still hears sound open one, once the sound after them is decoded
        alone (`Actions.decode`, then `alone`; it is skipped where shorter than 100 ms)."""
        if not self.current(decode):
            return Actions()
        self._heard = heard_after(self._heard, result, len(decode.audio), decode.audio_end, decode.voice_end)
        heard, pause = self._heard, self.pause
        if pause is not None and pause.stalled and heard.words != pause.words:
            return Actions(drop=self._cancel())  # the caller is talking again
        if pause is not None or not heard.stalled() or self.seg.silence_ms >= turns.PAUSE_MS:
            return Actions()  # (a silence is a pause of the segmenter's already)
        if (decode.audio_end - self._sound_since) * 1000 < turns.STALL_MS * RATE:
            return Actions()  # the sound that followed is too short yet to have shown a word if it was speech
        # Whisper drops words said after a gap inside one clip: the sound after the words, decoded alone,
        # says whether the caller is talking there. A long silence before that sound stays out of it: a caller
        # going on after 1.1 s, decoded from the words' end, got a no-speech probability of 0.35-0.64 and was
        # flagged as no speech in 2 of 24 clips (tiny.en, 3 sentences, 2 voices, 2 lengths, either window);
        # with 0.3 s of the silence, 0.11-0.42 and none. Music right after the voice keeps its short gap.
        decode.result, decode.heard = result, heard
        sound = max(heard.voice_end, self._sound_since - ALONE_LEAD_SAMPLES)
        tail = decode.audio[max(0, sound - (decode.audio_end - len(decode.audio))):]
        if len(tail) < ALONE_MIN_SAMPLES:
            return self.alone(decode, None)
        return Actions(decode=Decode(decode.turn_id, tail, decode.audio_end, decode.voice_end))

    def alone(self, decode: Decode, result: Transcript | None) -> Actions:
        """The sound after the stopped words of interim decode `decode`, decoded alone (None: too short, or
        no answer): where it shows the caller talking, the turn goes on; else the words' pause opens."""
        if self.interim is not decode:
            return Actions()  # superseded meanwhile (a silence's pause)
        if result is not None:
            said = turns.talking(result.text, result.is_hallucination, self._alone)
            self._alone = turns.words_of("" if result.is_hallucination else result.text)
            if said:
                return Actions()  # the next decodes of the turn go on watching
        heard = decode.heard
        if (self.pause is not None or self.turn_id != decode.turn_id or not self.seg.in_speech
                or self._heard.words != heard.words):
            return Actions()  # (what changed while the sound was decoded decides)
        self.pause = Pause(self.turn_id, decode.audio, decode.audio_end, heard.voice_end, words=heard.words,
                           stalled=True, result=decode.result)
        return Actions(open=self.pause)

    def interim_done(self, decode: Decode) -> None:
        """The driver is done with interim decode `decode` (whatever came of it): the next may start."""
        if self.interim is decode:
            self.interim = None

    def _interim_every(self) -> int:
        return min(self.interim_every_ms, turns.WORDS_EVERY_MS) if self._checking else self.interim_every_ms
