"""Speech segmentation: 20 ms frames in, speech events and whole utterances out.

AUTO mode runs webrtcvad on each frame. Speech starts once voiced frames add up to
`min_speech_ms` without a gap longer than `max_gap_ms` (so a cough or a click never starts a
turn), and the start is dated at the first of those voiced frames. Speech ends after `hangover_ms`
of unvoiced frames. The utterance sent to recognition keeps `pre_roll_ms` before the start (first
words are not clipped) and the hangover after the last voiced frame (last words are not dropped).
Speech longer than `max_utterance_ms` is split into back-to-back utterances, since Whisper sees at
most 30 s at a time.

With `pause_ms` set (smart turn detection, voiced.core.turns) the segmenter also reports a short
pause: `Paused` once unvoiced frames reach `pause_ms` while in speech, and `Resumed` on the next voiced
frame after it. It stays in speech through the pause; the turn ends when whoever decides it calls
`end_turn()` (as `talk_end()` ends a push-to-talk span), or at `hangover_ms` of silence, which is then
the upper bound. Two cheap rules keep a line's own sounds from holding a pause open there (a turn
that ends on a noisy line, or with keypad tones after it): inside speech a frame is voiced only when
it is also well above the line's noise floor (the quietest frame of the last `FLOOR_FRAMES`; stationary
noise that webrtcvad calls speech sits at that floor), and after silence speech comes back only once
voiced frames add up to `RESUME_MS` (a tone's edge, a click, a burst of noise is one or two frames).

PUSH_TO_TALK mode ignores the VAD: utterances are exactly the spans between `talk_start()` and
`talk_end()`.

All offsets are in samples at 16 kHz from the first frame of the stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import webrtcvad

from voiced.audio import dtmf
from voiced.audio.ingest import FRAME_MS, FRAME_SAMPLES, RATE

MAX_WINDOW_MS = 30000  # Whisper's window
# webrtcvad keeps saying "speech" for 100-200 ms after a voice stops (its own smoothing), which would
# date every end of speech late. Frames whose peak-to-peak swing is under about -45 dBFS are silence
# whatever it says. (Peak-to-peak: two reductions with no temporary array, on every voiced frame.)
SILENCE_SWING = 0.006 * 32768


# A silence this long inside speech separates two bursts of talk ("okay ... yeah"): barge-in measures
# each burst on its own (Silero VAD's default minimum silence, which LiveKit's interruption uses).
BURST_GAP_MS = 550
# Smart turn detection (pause_ms > 0) only, inside speech:
FLOOR_FRAMES = 100  # the noise floor is the quietest 20 ms frame of the last 2 s
FLOOR_RATIO = 8.0  # ... and a voiced frame must carry 9 dB more energy than it
RESUME_MS = 60  # voiced frames (gaps up to max_gap_ms between them) that end a silence


def _voice(frame: np.ndarray) -> bool:
    """Whether a frame webrtcvad calls speech may be a voice: loud enough, and no keypad tone (webrtcvad
    calls those speech too: voiced.audio.dtmf). The tone check reuses the loudness check's extremes."""
    # (argmax/argmin and an index: a reduction, ndarray.max or np.maximum.reduce, sets up numpy's general
    # iterator and costs half as much again, on every frame webrtcvad calls speech.)
    top, bottom = int(frame[frame.argmax()]), int(frame[frame.argmin()])
    if top - bottom <= SILENCE_SWING:
        return False
    return dtmf.key(frame, RATE, float(max(top, -bottom))) is None


@dataclass
class SegmenterConfig:
    mode: str = "auto"  # "auto" | "push_to_talk"
    vad_aggressiveness: int = 2
    pre_roll_ms: int = 300
    hangover_ms: int = 500
    min_speech_ms: int = 100
    max_utterance_ms: int = MAX_WINDOW_MS
    max_gap_ms: int = 60  # unvoiced frames tolerated inside the start trigger
    keep_audio: bool = True  # False: events only (no transcription), nothing is buffered
    # How a turn ends in AUTO mode (voiced.core.turns): "silence" (hangover_ms of it) or "smart" (the
    # end-of-turn detector decides at each short pause, within the eagerness's bound).
    turn_detection: str = "silence"
    eagerness: str = "medium"  # smart: low | medium | high
    pause_ms: int = 0  # > 0: report Paused/Resumed after this much silence in speech (set by the session)

    def validate(self) -> None:
        if self.mode not in ("auto", "push_to_talk"):
            raise ValueError(f"segmentation mode {self.mode!r}: use auto or push_to_talk")
        if self.turn_detection not in ("silence", "smart"):
            raise ValueError(f"turn_detection {self.turn_detection!r}: use smart or silence")
        if self.eagerness not in ("low", "medium", "high"):
            raise ValueError(f"eagerness {self.eagerness!r}: use low, medium or high")
        if not 0 <= self.vad_aggressiveness <= 3:
            raise ValueError(f"vad_aggressiveness {self.vad_aggressiveness} is outside 0..3")
        for name, lo, hi in (
            ("pre_roll_ms", 0, 2000),
            # With pause_ms (smart), hangover_ms is the detector's upper bound: up to low eagerness's 8 s.
            ("hangover_ms", FRAME_MS, 10000 if self.pause_ms else 5000),
            ("min_speech_ms", FRAME_MS, 5000),
            ("max_utterance_ms", 1000, MAX_WINDOW_MS),
        ):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"{name} {value} is outside {lo}..{hi}")
        if self.pre_roll_ms + self.min_speech_ms >= self.max_utterance_ms:
            raise ValueError("max_utterance_ms must be longer than pre_roll_ms + min_speech_ms")


@dataclass
class SpeechStarted:
    offset: int  # sample where speech (or the push-to-talk span) starts


@dataclass
class SpeechEnded:
    offset: int  # sample where the end was decided (last voiced frame + hangover in AUTO)


@dataclass
class Paused:
    offset: int  # sample where the short pause was noticed (pause_ms after the last voiced frame)


@dataclass
class Resumed:
    offset: int  # sample where speech came back after a Paused


@dataclass
class Utterance:
    audio: np.ndarray  # int16 at 16 kHz, pre-roll and trailing padding included
    start: int  # first sample of speech (without pre-roll)
    end: int  # sample where the utterance ends

    @property
    def audio_start(self) -> int:
        """The stream sample where `audio` begins (its frames are contiguous and end at `end`)."""
        return self.end - len(self.audio)


def frames_for(ms: int) -> int:
    return max(1, -(-ms // FRAME_MS))


class Segmenter:
    def __init__(self, config: SegmenterConfig):
        config.validate()
        self.config = config
        self._vad = webrtcvad.Vad(config.vad_aggressiveness)
        self._pre_roll: deque[np.ndarray] = deque(maxlen=frames_for(config.pre_roll_ms) if config.pre_roll_ms else 1)
        self._frames: list[np.ndarray] = []  # the utterance being collected
        self._count = 0  # its length in frames (also when the audio is not kept)
        self._frame_index = 0  # frames seen so far
        self.in_speech = False
        self.speech_start = 0  # sample of the current speech's start
        # AUTO start trigger
        self._candidate: int | None = None  # frame index of the first voiced frame
        self._candidate_frames: list[np.ndarray] = []
        self._voiced_count = 0
        self._last_voiced = -1
        # AUTO end trigger
        self._silence_run = 0
        self._paused = False  # Paused reported, no voiced frame since
        self._last_voiced_end = 0  # sample after the current speech's last voiced frame
        self._burst_start = 0  # sample where the current burst of talk began (voiced_ms)
        # smart: the noise floor (a monotonic deque of (frame index, energy): its head is the window's
        # minimum) and the voiced frames that may end a silence
        self._floor: deque[tuple[int, float]] = deque()
        self._resume = 0  # voiced frames counted since the silence began
        self._resume_from = 0  # sample where they began
        self._resume_gap = 0  # unvoiced frames since the last of them
        self._max_frames = frames_for(config.max_utterance_ms)

    @property
    def offset(self) -> int:
        """Samples consumed so far."""
        return self._frame_index * FRAME_SAMPLES

    # ------------------------------------------------------------------ push to talk

    def talk_start(self) -> list:
        if self.in_speech:
            return []
        self.in_speech = True
        self.speech_start = self.offset
        self._frames = []
        self._count = 0
        return [SpeechStarted(self.offset)]

    def talk_end(self) -> list:
        if not self.in_speech:
            return []
        return self._finish(self.offset)

    def end_turn(self) -> list:
        """End the speech in progress here (the end-of-turn detector decided), as talk_end does."""
        return self.talk_end()

    # ------------------------------------------------------------------ frames

    def push(self, frame: np.ndarray) -> list:
        """One 20 ms frame (FRAME_SAMPLES int16) -> zero or more events / utterances."""
        if self.config.mode == "push_to_talk":
            out = []
            if self.in_speech:
                self._collect(frame)
                if self._count >= self._max_frames:
                    out = self._split(self.offset + FRAME_SAMPLES)
            self._frame_index += 1
            return out
        voiced = self._vad.is_speech(frame.tobytes(), RATE) and _voice(frame)
        index = self._frame_index
        self._frame_index += 1
        if self.config.pause_ms:
            voiced = self._above_floor(frame, index) and voiced
        if self.in_speech:
            return self._in_speech(frame, voiced)
        return self._in_silence(frame, voiced, index)

    def flush(self) -> list:
        """End of stream: close an utterance in progress."""
        if self.in_speech:
            return self._finish(self.offset)
        return []

    def _above_floor(self, frame: np.ndarray, index: int) -> bool:
        """Track the noise floor with this frame; whether the frame stands out of it (always before
        speech starts: the start trigger is the same in both modes)."""
        x = frame.astype(np.float32)
        energy = float(np.dot(x, x))
        floor = self._floor
        while floor and floor[-1][1] >= energy:
            floor.pop()
        floor.append((index, energy))
        if floor[0][0] <= index - FLOOR_FRAMES:
            floor.popleft()
        return not self.in_speech or energy > FLOOR_RATIO * floor[0][1]

    def _in_silence(self, frame: np.ndarray, voiced: bool, index: int) -> list:
        if voiced:
            if self._candidate is None:
                self._candidate = index
                self._candidate_frames = []
                self._voiced_count = 0
            self._voiced_count += 1
            self._last_voiced = index
        if self._candidate is not None:
            if not voiced and (index - self._last_voiced) * FRAME_MS > self.config.max_gap_ms:
                # The burst was too short: return its frames to the pre-roll and forget it.
                self._pre_roll.extend(self._candidate_frames)
                self._pre_roll.append(frame)
                self._candidate = None
                return []
            self._candidate_frames.append(frame)
            if self._voiced_count * FRAME_MS >= self.config.min_speech_ms:
                return self._start()
            return []
        self._pre_roll.append(frame)
        return []

    def _start(self) -> list:
        self.in_speech = True
        self.speech_start = self._candidate * FRAME_SAMPLES
        pre_roll = list(self._pre_roll)[-frames_for(self.config.pre_roll_ms) :] if self.config.pre_roll_ms else []
        self._frames = pre_roll + self._candidate_frames if self.config.keep_audio else []
        self._count = len(pre_roll) + len(self._candidate_frames)
        self._pre_roll.clear()
        self._candidate = None
        self._candidate_frames = []
        self._silence_run = 0
        self._last_voiced_end = (self._last_voiced + 1) * FRAME_SAMPLES
        self._burst_start = self.speech_start
        return [SpeechStarted(self.speech_start)]

    def _in_speech(self, frame: np.ndarray, voiced: bool) -> list:
        self._collect(frame)
        out = []
        if self.config.pause_ms and self._silence_run:
            voiced = self._resuming(voiced)
        if voiced:
            if self._silence_run * FRAME_MS >= BURST_GAP_MS:
                self._burst_start = self.offset - FRAME_SAMPLES
            self._silence_run = 0
            self._last_voiced_end = self.offset
            if self._paused:
                self._paused = False
                out.append(Resumed(self._resume_from))  # _paused is set only with pause_ms
        else:
            self._silence_run += 1
            if self.config.pause_ms and not self._paused and self._silence_run * FRAME_MS >= self.config.pause_ms:
                self._paused = True
                out.append(Paused(self.offset))
        if self._silence_run * FRAME_MS >= self.config.hangover_ms:
            return out + self._finish(self.offset)
        if self._count >= self._max_frames:
            return out + self._split(self.offset)
        return out

    def _resuming(self, voiced: bool) -> bool:
        """After silence inside speech (smart): whether speech is back, i.e. voiced frames have added up
        to RESUME_MS with gaps no longer than max_gap_ms; until then they count as silence."""
        if not voiced:
            if self._resume:
                self._resume_gap += 1
                if self._resume_gap * FRAME_MS > self.config.max_gap_ms:
                    self._resume = 0
            return False
        if not self._resume:
            self._resume_from = self.offset - FRAME_SAMPLES
        self._resume += 1
        self._resume_gap = 0
        if self._resume * FRAME_MS < RESUME_MS:
            return False
        self._resume = 0
        return True

    def _finish(self, end: int) -> list:
        audio = np.concatenate(self._frames) if self._frames else np.zeros(0, dtype=np.int16)
        utterance = Utterance(audio=audio, start=self.speech_start, end=end)
        self.in_speech = False
        self._frames = []
        self._count = 0
        self._silence_run = 0
        self._paused = False
        self._resume = 0
        self._pre_roll.clear()
        return [SpeechEnded(end), utterance]

    def _split(self, at: int) -> list:
        # Speech goes on past the window: close this utterance and open the next one right here.
        out = self._finish(at)
        self.in_speech = True
        self.speech_start = at
        out.append(SpeechStarted(at))
        return out

    def _collect(self, frame: np.ndarray) -> None:
        if self.config.keep_audio:
            self._frames.append(frame)
        self._count += 1

    def current_audio(self) -> np.ndarray:
        """The utterance collected so far (for interim results)."""
        return np.concatenate(self._frames) if self._frames else np.zeros(0, dtype=np.int16)

    @property
    def speech_ms(self) -> int:
        """How long the current speech has lasted (0 when silent), its trailing silence included."""
        return (self.offset - self.speech_start) * 1000 // RATE if self.in_speech else 0

    @property
    def voiced_ms(self) -> int:
        """How long the caller has been talking in the current burst (0 when silent): from its first
        voiced frame to its last, short gaps inside included, trailing silence not; a silence of
        BURST_GAP_MS starts a new burst. Barge-in reads this, so a short "mm-hmm" or a cough, or a few of
        them seconds apart, never count as long speech."""
        if not self.in_speech:
            return 0
        if self.config.mode == "push_to_talk":
            return self.speech_ms  # no VAD: the span is what the caller held the button for
        return max(0, self._last_voiced_end - self._burst_start) * 1000 // RATE

    @property
    def voiced_end(self) -> int:
        """The sample after the current speech's last voiced frame."""
        return self._last_voiced_end

    @property
    def silence_ms(self) -> int:
        """The silence so far inside the current speech (since its last voiced frame)."""
        return self._silence_run * FRAME_MS if self.in_speech else 0
