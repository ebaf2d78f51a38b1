"""Over-talk judged by its words (voiced.core.overtalk): what a burst over a playing reply asks for."""

from __future__ import annotations

import pytest

from voiced.core.overtalk import WORDS_WAIT_MS, Action, Kind, classify, covered, decide

MIN = 500  # barge_in.min_speech_ms's default


@pytest.mark.parametrize("text", [
    "Stop.", "No.", "Wait!", "Hold on.", "Hang on!", "Cancel.", "Sorry?", "Excuse me.", "No, no.", "Nope.",
    "Wait a second.", "Stop, please.", "Okay, stop.", "Yeah, wait.", "No, I meant Sunday.", "Wait, what about Friday?",
    "Sorry to interrupt", "Um, hold on.", "Just a second.", "Never mind.",
])
def test_a_request_to_stop_or_wait_stops_however_short(text):
    assert classify(text, "en") is Kind.STOP
    assert decide(Kind.STOP, 200, MIN) is Action.STOP


@pytest.mark.parametrize("text", [
    "Mm-hmm.", "Mm-mm.", "Uh-huh.", "Uh-uh.", "Okay.", "OK", "Yeah.", "Yes.", "Right.", "Right, right.", "I see.",
    "Got it!", "Sure.", "All right.", "No problem.", "No worries.", "That makes sense.", "Oh, okay.", "Yeah, I see.",
    "Thank you.", "Mhm.", "Uh, okay.", "MMMM.", "Hmmm, okay.",
])
def test_an_acknowledgement_lets_the_reply_go_on_however_long(text):
    assert classify(text, "en") is Kind.ACK
    assert decide(Kind.ACK, 5000, MIN) is Action.GO_ON


@pytest.mark.parametrize("text", [
    "Tell me more about the second one.", "What time?", "Okay, so what about the price?", "Yes, the blue one.",
])
def test_other_words_are_judged_by_their_length(text):
    assert classify(text, "en") is Kind.OTHER
    assert decide(Kind.OTHER, MIN - 20, MIN) is Action.WAIT
    assert decide(Kind.OTHER, MIN, MIN) is Action.STOP
    # with a decoder, the words of that much talk first (an acknowledgement may yet outlast the minimum)
    assert decide(Kind.OTHER, MIN + 100, MIN, decoded_ms=300) is Action.WAIT
    assert decide(None, MIN, MIN, decoded_ms=-1, waited_ms=WORDS_WAIT_MS) is Action.STOP  # words too late
    assert decide(Kind.OTHER, MIN + 100, MIN, decoded_ms=MIN) is Action.STOP
    assert decide(Kind.ACK, MIN + 100, MIN, decoded_ms=MIN + 100) is Action.GO_ON


@pytest.mark.parametrize("text", ["", "  ", "...", "Um.", "Uh"])
def test_no_words_leave_the_length_to_decide(text):
    assert classify(text, "en") is Kind.NONE
    assert decide(Kind.NONE, MIN - 20, MIN) is Action.WAIT
    assert decide(None, MIN, MIN) is Action.STOP  # not decoded: the length alone


@pytest.mark.parametrize("text, language, kind", [
    ("Stopp!", "de", Kind.STOP), ("Moment mal.", "de", Kind.STOP), ("Nein, warte.", "de", Kind.STOP),
    ("Ja, genau.", "de", Kind.ACK), ("Alles klar.", "de", Kind.ACK), ("Aha.", "de", Kind.ACK),
    ("Espera.", "es", Kind.STOP), ("No, para.", "es", Kind.STOP), ("Un momento, por favor.", "es", Kind.STOP),
    ("Sí, claro.", "es", Kind.ACK), ("Vale.", "es", Kind.ACK), ("De acuerdo.", "es", Kind.ACK),
    ("Stop.", "en-US", Kind.STOP), ("Okay.", "EN", Kind.ACK),
])
def test_each_covered_language_has_its_own_words(text, language, kind):
    assert covered(language)
    assert classify(text, language) is kind


def test_a_language_the_lists_do_not_cover_leaves_every_word_to_the_length():
    assert not covered("fr") and not covered(None)
    assert classify("Arrêtez !", "fr") is Kind.OTHER and classify("D'accord.", "fr") is Kind.OTHER
    assert classify("Stop.", None) is Kind.OTHER
    assert classify("", "fr") is Kind.NONE
    # an English acknowledgement is not one in German: "okay" is, "yeah" is not a German word
    assert classify("Yeah.", "de") is Kind.OTHER


def test_the_bench_replays_the_session_s_schedule():
    import numpy as np

    from voiced.bench.turn_overtalk import replay
    from voiced.core import overtalk

    word = np.ones(16000 * 350 // 1000, np.float32)  # a 350 ms word
    # heard as a stop request once the voice has paused GAP_MS; the decode lands 30 ms later
    after = replay(word, lambda clip: "Stop." if len(clip) > 16000 * 0.45 else "Sto", 30, MIN)
    assert overtalk.GAP_MS <= after <= overtalk.GAP_MS + 30 + 20
    long_ack = np.ones(16000 * 900 // 1000, np.float32)  # an acknowledgement longer than the minimum
    assert replay(long_ack, lambda clip: "Mm-hmm.", 30, MIN) is None
    # other words of that length stop it once a decode of the minimum's worth is in; none too
    assert replay(long_ack, lambda clip: "Tell me", 30, MIN) is not None
    assert replay(word, lambda clip: "", 30, MIN) is None  # short, no words: goes on
