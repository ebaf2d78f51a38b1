"""The turn tracker (voiced.core.turn_tracker) driven as the session drives it, on espeak-ng speech through
the real segmenter, with scripted evidence: each decode returns the words spoken before the end of its
audio, `latency_ms` after it was asked for. What is judged is what a caller notices: where the turn ends,
and that speech coming back keeps it going."""

from __future__ import annotations

import numpy as np
import pytest

from tests.speech import RATE, need_espeak, phrase
from voiced.audio.ingest import FRAME_SAMPLES, float_to_int16
from voiced.core import turns
from voiced.core.pauses import smart_segmentation
from voiced.core.segmenter import Paused, Resumed, Segmenter, SegmenterConfig, SpeechEnded, SpeechStarted, Utterance
from voiced.core.turn_tracker import Actions, TurnTracker
from voiced.engines.base import Transcript, Word

MEDIUM = turns.bounds("medium")


@pytest.fixture(autouse=True, scope="module")
def _espeak():
    need_espeak()


class Caller:
    """A caller saying `parts` (text, then the seconds before the next part), then `tail` (float32 audio)
    after the last; every decode ends its text with Whisper's `end_p` and `stop_p`. With `whisper_gaps`,
    decodes do what tiny.en does with a gap inside a clip (`decode`)."""

    def __init__(self, parts: list[tuple[str, float]], tail: np.ndarray | None = None, end_p: float = 0.9,
                 stop_p: float = 0.99, latency_ms: int = 30, eagerness: str = "medium", whisper_gaps: bool = False):
        chunks, self.words, pos = [np.zeros(int(0.4 * RATE), np.float32)], [], int(0.4 * RATE)
        self.part_ends: list[int] = []
        for text, gap_s in parts:
            voice = phrase(text)
            said = text.split()
            for i, w in enumerate(said):  # each word's span, evenly through its phrase; and its part
                self.words.append((w, pos + i * len(voice) // len(said), pos + (i + 1) * len(voice) // len(said),
                                   len(self.part_ends)))
            chunks += [voice, np.zeros(int(gap_s * RATE), np.float32)]
            self.part_ends.append(pos + len(voice))
            pos += len(voice) + int(gap_s * RATE)
        self.whisper_gaps = whisper_gaps
        self.voice_end_s = self.words[-1][2] / RATE
        if tail is not None:
            chunks.append(tail)
        audio = np.concatenate(chunks)
        self.pcm = float_to_int16(np.concatenate([audio, np.zeros(-len(audio) % FRAME_SAMPLES, np.float32)]))
        self.end_p, self.stop_p, self.latency = end_p, stop_p, latency_ms * RATE // 1000
        self.bounds = turns.bounds(eagerness)
        cfg = SegmenterConfig(turn_detection="smart", eagerness=eagerness)
        self.seg = Segmenter(smart_segmentation(cfg, self.bounds))
        self.tracker = TurnTracker(self.seg, self.bounds, interim_every_ms=1000)
        self.pending: list[tuple[int, int, object]] = []
        self.ends: list[float] = []  # where each turn ended (s)
        self.dropped = 0  # pauses that speech ended

    def decode(self, audio: np.ndarray, audio_end: int) -> Transcript:
        """The words spoken in `audio` (ending at stream sample `audio_end`), times from its start. With
        `whisper_gaps`, as tiny.en decodes a paused caller: the words of a part said after a gap inside the
        clip are missing until the caller has finished that part, and a clip that opens on a second of
        silence is flagged a hallucination (its no-speech probability crosses 0.6)."""
        start = audio_end - len(audio)
        said = [(w, s, e, part) for w, s, e, part in self.words if start <= s and e <= audio_end]
        flagged = False
        if self.whisper_gaps and said:
            last = said[-1][3]
            if last != said[0][3] and self.part_ends[last] > audio_end:
                said = [x for x in said if x[3] != last]
            flagged = said[0][1] - start >= RATE
        words = [Word(w, (s - start) / RATE, (e - start) / RATE, 0.95) for w, s, e, _ in said]
        return Transcript(" ".join(w.word for w in words), "en", [], 0.0, 0.0, 0.0, is_hallucination=flagged,
                          words=words, end_prob=self.end_p, stop_prob=self.stop_p)

    def later(self, now: int, fn) -> None:
        self.pending.append((now + self.latency, len(self.pending), fn))

    def act(self, acts: Actions, now: int) -> None:
        self.dropped += acts.drop is not None
        pause = acts.open
        if pause is None:
            return
        result = pause.result or self.decode(pause.audio, pause.audio_end)
        if self.bounds.audio_decides:
            self.tracker.model_answer(pause, 0.9)

        def transcript(t):
            if self.tracker.pause is pause:
                self.tracker.transcript(pause, result)
                self.maybe_end(t)
            elif pause.result is None:
                self.tracker.pause_words(pause, result)

        self.later(now, transcript)

    def interim(self, decode, now: int) -> None:
        result = self.decode(decode.audio, decode.audio_end)

        def words(t):
            acts = self.tracker.words(decode, result)
            if acts.decode is not None:  # the sound after the words, alone: no words in it
                alone = self.decode(acts.decode.audio, acts.decode.audio_end)
                self.later(t, lambda t2: self.finish(decode, self.tracker.alone(decode, alone), t2))
                return
            self.finish(decode, acts, t)

        self.later(now, words)

    def finish(self, decode, acts: Actions, t: int) -> None:
        self.tracker.interim_done(decode)
        self.act(acts, t)

    def events(self, events: list, now: int) -> None:
        for ev in events:
            if isinstance(ev, SpeechStarted):
                self.tracker.started(ev.offset)
            elif isinstance(ev, Paused):
                self.act(self.tracker.paused(), now)
            elif isinstance(ev, Resumed):
                self.act(self.tracker.resumed(ev.offset), now)
            elif isinstance(ev, SpeechEnded):
                self.ends.append(ev.offset / RATE)
            elif isinstance(ev, Utterance):
                self.tracker.ended()

    def maybe_end(self, now: int) -> None:
        if self.tracker.over():
            self.events(self.seg.end_turn(), now)

    def run(self) -> Caller:
        for n in range(len(self.pcm) // FRAME_SAMPLES):
            now = (n + 1) * FRAME_SAMPLES
            while due := sorted(p for p in self.pending if p[0] <= now):
                self.pending.remove(due[0])
                due[0][2](due[0][0])
            self.events(self.seg.push(self.pcm[n * FRAME_SAMPLES:now]), now)
            if self.seg.in_speech:
                decode = self.tracker.interim_due(asked=False)
                if decode is not None:
                    self.interim(decode, now)
                if self.tracker.pause is not None:
                    self.maybe_end(now)
        self.events(self.seg.flush(), len(self.pcm))
        return self


def _after_voice_ms(caller: Caller) -> float:
    return (caller.ends[0] - caller.voice_end_s) * 1000


def test_a_finished_sentence_ends_the_turn_at_the_verdicts_wait():
    caller = Caller([("I would like to pay my electricity bill.", 2.0)]).run()
    assert len(caller.ends) == 1
    wait = turns.Evidence(text="bill.", fresh=True, end_p=0.9, stop_p=0.99).wait_ms(MEDIUM)
    assert wait == MEDIUM.complete_ms
    # the silence the rule asks for (the VAD hears the voice a frame or two past its end), not the bound
    assert wait <= _after_voice_ms(caller) <= wait + 100, _after_voice_ms(caller)


def test_a_sentence_whisper_expects_more_of_waits_longer_and_speech_coming_back_keeps_the_turn():
    # Whisper expects more words (end-of-text unlikely): the turn waits `unsure_ms` in the pause...
    alone = Caller([("I would like a coffee.", 2.0)], end_p=0.1).run()
    assert MEDIUM.unsure_ms <= _after_voice_ms(alone) <= MEDIUM.unsure_ms + 100, _after_voice_ms(alone)
    # ... so a caller who goes on within it keeps the turn: the pause is dropped, one turn for both parts
    going_on = Caller([("I would like a coffee.", MEDIUM.unsure_ms / 1000 - 0.2), ("and a muffin please.", 2.0)],
                      end_p=0.1).run()
    assert len(going_on.ends) == 1 and going_on.dropped >= 1
    assert going_on.ends[0] > going_on.voice_end_s


def test_a_sentence_paused_where_it_cannot_end_is_one_turn_however_late_its_transcript():
    for latency_ms in (30, 700):
        caller = Caller([("Please move the meeting to", 1.2), ("next Tuesday.", 2.0)], latency_ms=latency_ms).run()
        assert len(caller.ends) == 1, (latency_ms, caller.ends)
        assert caller.ends[0] > caller.voice_end_s  # after the second part, not in the pause


def test_words_that_stop_changing_while_the_line_still_sounds_end_the_turn():
    # Hold music 150 ms after the voice, which the VAD calls speech, and a transcript slower than that gap:
    # the silence's pause is dropped before its verdict; the tracker then decodes the turn until its words
    # stop changing, and that pause, dated where the words ended, ends the turn while the music plays,
    # long before the bound.
    from voiced.bench.turn_set import hold_music

    music = 0.1 * hold_music(6.0, np.random.default_rng(3))
    caller = Caller([("Yes that is correct, thank you, goodbye.", 0.15)], tail=music, latency_ms=150).run()
    assert caller.dropped >= 1  # (after the turn, the music alone is speech to the VAD: a turn of its own)
    assert caller.voice_end_s + 0.15 < caller.ends[0] < caller.voice_end_s + MEDIUM.max_ms / 1000 - 1.5, \
        (caller.ends, caller.voice_end_s)


def test_a_caller_whose_newest_words_whisper_drops_is_not_cut_off_while_talking():
    # A paused caller: the pause's transcript ("... open after", whose stop Whisper doubts) does not end the
    # turn, and every decode of the turn drops what is said after the gap while it is being said, so the words
    # look stopped. The sound after them, decoded alone, shows the caller talking: decoded without most of the
    # 1.2 s of silence before it (else Whisper flags it as no speech, and the turn ended 2.2 s after "after",
    # in the middle of the second half).
    for latency_ms in (300, 1500):  # an idle CPU's decode, a busy one's
        caller = Caller([("Is there a pharmacy near my hotel that is open after", 1.2),
                         ("half past six in the evening please", 3.0)],
                        stop_p=0.85, latency_ms=latency_ms, whisper_gaps=True).run()
        assert caller.dropped >= 1
        assert len(caller.ends) == 1 and caller.ends[0] > caller.voice_end_s, (latency_ms, caller.ends)
