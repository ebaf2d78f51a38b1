"""Over-talk: what a caller's burst of speech over a playing reply asks for, judged by its words.

A caller who says "stop", "no", "wait" or "hold on" over a reply wants it to stop, however short the word
(each is ~0.3 s, under `barge_in.min_speech_ms`); one who says "mm hmm", "okay" or "I see" is listening,
and the reply goes on however long the acknowledgement lasts (and it is not answered as a turn). Anything
else is judged by its length as before: other words, or no words at all (a cough, a decode Whisper made up,
a language the lists do not cover), stop the reply once the burst lasts `barge_in.min_speech_ms`.

Languages the word lists cover: English (en), German (de), Spanish (es). Every other language, and a
session whose language is not known, falls back to the length alone (`classify` says OTHER for any words).

Words in, a decision out: no I/O. The session decodes the burst through its ASR scheduler and asks here
(voiced.core.session); the conversation stops the reply (voiced.core.conversation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

# When the session decodes a burst over a reply: once the voice has paused this long (a short word has
# ended: the VAD's own pause, turns.PAUSE_MS), and while it goes on, first at FIRST_MS of talk then every
# EVERY_MS, so that a decode of most of the burst is in when it reaches the barge-in minimum (500 ms).
GAP_MS = 100
FIRST_MS = 300
EVERY_MS = 300
# Talk long enough to stop the reply waits at most this long for its words (a decoder slower than that
# answers too late to matter: the length decides). A decode of a short clip takes ~20-30 ms on a GPU and
# ~0.1-0.3 s on an idle CPU core; seconds only on a CPU shared with other work.
WORDS_WAIT_MS = 1000


class Kind(Enum):
    STOP = "stop"  # asks the agent to stop or wait
    ACK = "ack"  # an acknowledgement: the caller is listening
    OTHER = "other"  # other words: the length decides
    NONE = "none"  # no words (silence, a cough, a made-up decode): the length decides


class Action(Enum):
    STOP = "stop"  # stop the reply now
    GO_ON = "go on"  # the reply goes on (and the burst is not answered)
    WAIT = "wait"  # not yet: more speech, or the words, may still decide


def _phrases(*texts: str) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(t.split()) for t in texts)


@dataclass(frozen=True)
class Lexicon:
    """One language's phrases (lower case, as `words_of` writes them), each a tuple of words."""
    stop: frozenset[tuple[str, ...]]
    ack: frozenset[tuple[str, ...]]
    # neither: words that go with either ("please", "um") and change nothing
    neutral: frozenset[tuple[str, ...]]

    def longest(self) -> int:
        return max(len(p) for p in self.stop | self.ack | self.neutral)


LEXICONS: dict[str, Lexicon] = {
    "en": Lexicon(
        stop=_phrases("stop", "stop it", "stop talking", "no", "nope", "no no", "wait", "wait a second",
                      "wait a minute", "hold on", "hang on", "hold it", "cancel", "cancel that", "sorry",
                      "excuse me", "pardon", "pause", "enough", "quiet", "be quiet", "shut up", "hey",
                      "one moment", "one second", "one sec", "just a moment", "just a second", "just a sec",
                      "just a minute", "not now", "never mind", "nevermind", "whoa", "actually"),
        ack=_phrases("mm", "mhm", "mm hmm", "hmm", "uh huh", "mm hm", "okay", "ok", "yeah", "yes", "yep", "yup",
                     "ya", "right", "all right", "alright", "sure", "i see", "got it", "gotcha", "cool", "great",
                     "good", "fine", "nice", "perfect", "exactly", "true", "indeed", "of course", "makes sense",
                     "that makes sense", "sounds good", "fair enough", "no problem", "no worries", "thanks",
                     "thank you", "oh", "ah", "aha", "wow", "i understand", "understood", "interesting",
                     "go on", "go ahead", "uh hum", "yes please", "right right",
                     # Whisper (tiny.en) writes a spoken "uh-huh" as "Uh-uh" and "mm-hmm" as "Mm-mm"; a caller's
                     # "uh-uh" (no) is then taken for an acknowledgement too: the rarer of the two over a reply
                     "uh uh", "mm mm"),
        neutral=_phrases("please", "um", "uh", "umm", "uhm", "er", "erm", "so", "well", "oh well")),
    "de": Lexicon(
        stop=_phrases("stopp", "stop", "halt", "nein", "warte", "warten sie", "moment", "einen moment",
                      "augenblick", "moment mal", "entschuldigung", "abbrechen", "aufhören", "hören sie auf"),
        ack=_phrases("ja", "mhm", "mm", "hmm", "okay", "ok", "genau", "stimmt", "richtig", "aha", "verstehe",
                     "ich verstehe", "alles klar", "klar", "gut", "ach so", "super", "danke", "jawohl"),
        neutral=_phrases("bitte", "äh", "ähm", "also", "na")),
    "es": Lexicon(
        stop=_phrases("para", "pare", "espera", "espere", "no", "alto", "un momento", "perdón", "perdona",
                      "cancela", "cancelar", "basta", "un segundo"),
        ack=_phrases("sí", "si", "vale", "ajá", "aja", "claro", "ya", "okay", "ok", "de acuerdo", "entiendo",
                     "bueno", "mhm", "mm", "exacto", "bien", "perfecto", "gracias", "muy bien"),
        neutral=_phrases("por favor", "eh", "este", "pues")),
}

_WORD = re.compile(r"\w+(?:'\w+)*")


_HUM = re.compile(r"m+h*m*|h+m+")  # a hum as Whisper spells it, any length: "Mmmm.", "Mhm", "Hmmm"


def words_of(text: str) -> tuple[str, ...]:
    """The words of a transcript, lower case, punctuation and hyphens gone ("Mm-hmm." -> mm, hmm), every
    hum written "mm"."""
    return tuple("mm" if _HUM.fullmatch(w) else w for w in _WORD.findall(text.lower().replace("’", "'")))


def _language(language: str | None) -> str | None:
    return language.split("-")[0].split("_")[0].lower() if language else None


def covered(language: str | None) -> bool:
    """Whether the word lists know this language (else the length alone decides)."""
    return _language(language) in LEXICONS


def classify(text: str | None, language: str | None = "en") -> Kind:
    """What the words of a burst over a reply ask for.

    STOP: a stop request first ("wait, what about..."), or one among acknowledgements ("okay, stop");
    ACK: acknowledgements alone ("mm hmm", "yeah, I see"); OTHER: any other words, or a language the lists
    do not cover; NONE: no words."""
    words = words_of(text or "")
    if not words:
        return Kind.NONE
    lex = LEXICONS.get(_language(language) or "")
    if lex is None:
        return Kind.OTHER
    kinds: list[Kind | None] = []  # None: a neutral word
    i, longest = 0, lex.longest()
    while i < len(words):
        for n in range(min(longest, len(words) - i), 0, -1):  # the longest phrase first: "no problem"
            p = words[i:i + n]
            if p in lex.stop or p in lex.ack or p in lex.neutral:
                # (a phrase in two lists is read as its stop meaning; none is, today)
                kinds.append(Kind.STOP if p in lex.stop else Kind.ACK if p in lex.ack else None)
                i += n
                break
        else:
            kinds.append(Kind.OTHER)
            i += 1
    said = [k for k in kinds if k is not None]
    if not said:
        return Kind.NONE  # "um": nothing asked
    if said[0] is Kind.STOP or (Kind.STOP in said and Kind.OTHER not in said):
        return Kind.STOP
    if all(k is Kind.ACK for k in said):
        return Kind.ACK
    return Kind.OTHER


def decide(kind: Kind | None, voiced_ms: int, min_speech_ms: int, decoded_ms: int | None = None,
           waited_ms: int = 0) -> Action:
    """What to do with the reply, from the burst's words so far (`kind`; None: not decoded yet), how long
    it has lasted (to its last voiced frame) and how much of it the latest decode heard (`decoded_ms`;
    None: no decoder, the length alone). Long enough to stop it, it waits for the words of that much
    talk (an acknowledgement that outlasts the minimum goes on), for WORDS_WAIT_MS at most (`waited_ms`:
    the time since the talk reached the minimum)."""
    if kind is Kind.STOP:
        return Action.STOP
    if kind is Kind.ACK:
        return Action.GO_ON
    if voiced_ms < min_speech_ms:
        return Action.WAIT
    if decoded_ms is not None and decoded_ms < min_speech_ms and waited_ms < WORDS_WAIT_MS:
        return Action.WAIT
    return Action.STOP
