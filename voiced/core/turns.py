"""End-of-turn detection: has the caller finished, or only paused?

Fixed silence (`turn_detection = "silence"`) makes every caller wait `hangover_ms` for a reply and still
cuts off anyone who pauses longer mid-sentence (LiveKit's eot-bench: a silence-only detector cuts off
21.7 % of real callers' pauses at 600 ms). `turn_detection = "smart"` decides at each short pause, from
four signals, because none decides well alone (an audio model hears a falling voice before many pauses;
Whisper puts a full stop on half a sentence):

- the words (`unfinished`): a text ending where an English sentence cannot (an article, preposition,
  conjunction, auxiliary, possessive, filler, trailing comma, a number being read out) is not finished,
  whatever punctuation Whisper put after it;
- the decoder: Whisper's probability of end-of-text after the text (`end_p`: ~0.3-0.5 after half a
  sentence without punctuation) and of a sentence end right after the last word (`stop_p`), and its
  probability of the last word itself (`doubted`: a word made up at the pause's edge);
- the audio: Smart Turn v3's probability that the turn is complete, asked only where it can change the
  wait (`Bounds.audio_decides`, low eagerness);
- the silence so far: each verdict (`Evidence.verdict`, one of VERDICTS) sets how much silence ends the
  turn (`Bounds`), and `max_ms` always does.

A doubt waits `doubt_ms`, long enough for a pause mid-sentence (2.2 s at medium). A line that keeps
sounding after the voice (hold music) gives no silence; there the words show where the caller stopped
(`Heard.stalled`, `talking`).

Nothing here does I/O: the session (voiced.core.session) feeds it the evidence and asks, on each frame of a
pause, whether the turn is over. The table of verdicts and how each threshold was chosen, with the sets
it was measured on: docs/notes/2026-12-07-end-of-turn-rule.md.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PAUSE_MS = 100  # silence at which the pause's transcript and the audio model start
SHORT_MS = 200  # the shortest silence that ends a turn (Pipecat's VAD stop is 0.2 s)
MODEL_SILENCE_MS = 200  # the silence the audio model hears after the voice
WORDS_EVERY_MS = 400  # decode this often while the VAD hears sound (the words show when it stopped)
STALL_MS = 300  # words unchanged over this much more audio: the caller has stopped talking
COMPLETE_P = 0.5  # Smart Turn's own threshold
END_P = 0.5  # Whisper's end-of-text probability at which the decoder says the text is over (more likely than not)
# Whisper fills a pause with a likely word ("a table for you.") that it is unsure of and that its own
# timing puts where the caller had already stopped: such a last word is judged without it too.
DOUBTFUL_P = 0.5
ALIGN_SLACK_S = 0.1  # word times come from cross-attention: this close to the end of speech is "at it"
LAST_P = 0.7  # a last word Whisper gives less than this may be one it made up at the pause: a doubt
HEARD_S = 1.0  # a last word that began this long before the voice stopped was heard, not made up (None: off)
# Whisper less sure than this that the sentence stops right after its last word (a full stop, question
# mark or ellipsis next, not more words) doubts the end it wrote: chosen on dev seeds 0-2 (0.95 held the
# median dev caller 0.5 s), checked on 3-11 (docs/BENCHMARKS.md).
STOP_P = 0.92


@dataclass(frozen=True)
class Bounds:
    complete_ms: int  # silence that ends a finished turn
    audio_ms: int  # ... a finished turn only the audio model doubts
    unsure_ms: int  # ... a finished turn after which Whisper expects more words, or one with no words
    doubt_ms: int  # ... words that look finished but whose last word Whisper doubts; a number read out
    max_ms: int  # silence that always ends a turn

    @property
    def audio_decides(self) -> bool:
        """Whether the audio model's verdict can change when a turn ends: only where its "incomplete"
        holds finished words longer than they wait anyway (low eagerness). Elsewhere it is not asked."""
        return self.audio_ms > self.complete_ms


EAGERNESS = {
    "low": Bounds(complete_ms=500, audio_ms=1500, unsure_ms=1500, doubt_ms=3200, max_ms=8000),
    "medium": Bounds(complete_ms=SHORT_MS, audio_ms=SHORT_MS, unsure_ms=600, doubt_ms=2200, max_ms=4000),
    "high": Bounds(complete_ms=SHORT_MS, audio_ms=SHORT_MS, unsure_ms=400, doubt_ms=1200, max_ms=2000),
}


def bounds(eagerness: str) -> Bounds:
    try:
        return EAGERNESS[eagerness]
    except KeyError:
        raise ValueError(f"eagerness {eagerness!r}: use low, medium or high") from None


# Closed-class English words after which a sentence cannot end (open-class words, nouns, verbs,
# adjectives, can always end one). Listed whole, by class; where a class also ends real sentences,
# the exception is the rule's, not a word's:
# - wh-words end questions ("Can you tell me why?"), and so do prepositions stranded by one ("Where are
#   you from?", "Who did you go with?"): a question that asks no wh-word does not end on a preposition
#   (Whisper puts a question mark on anything that opens with an auxiliary: "Can I pay with?"; "after" is
#   not listed: it also ends sentences as an adverb, "I will call you after.");
# - bare auxiliaries, subject pronouns and "to" end short answers ("Yes, I do.", "So do I.",
#   "I'd love to."): only in a text longer than three words, or one that opens with an auxiliary
#   (a question still waiting for its verb or object: "Can I have").
ARTICLES = {"a", "an", "the"}
POSSESSIVES = {"my", "your", "our", "their", "its", "whose", "every", "very"}  # never without a noun after
CONJUNCTIONS = {"and", "or", "but", "nor", "because", "although", "unless", "whereas", "if", "whether", "than",
                "plus", "cause", "cuz"}
FILLERS = {"um", "uh", "umm", "uhm", "uhh", "er", "erm", "ah", "hmm", "mm", "em"}
CONTRACTIONS = {  # a contracted verb cannot end a sentence ("Yes, it is." but never "Yes, it's.")
    "i'm", "you're", "we're", "they're", "he's", "she's", "it's", "i'll", "you'll", "we'll", "they'll",
    "he'll", "she'll", "it'll", "i'd", "you'd", "we'd", "they'd", "he'd", "she'd", "i've", "you've",
    "we've", "they've", "there's", "that's", "what's", "where's", "who's", "here's", "let's", "gonna",
    "wanna", "gotta",
}
PREPOSITIONS = {
    "to", "for", "of", "with", "at", "from", "into", "onto", "about", "between", "among", "amongst", "during",
    "toward", "towards", "upon", "via", "per", "like", "across", "against", "despite", "except", "until",
    "till", "in", "on", "regarding", "concerning", "versus", "within", "throughout", "beneath", "unlike",
}
WH_WORDS = {"when", "where", "which", "who", "whom", "how", "why", "what"}
AUXILIARIES = {
    "am", "is", "are", "was", "were", "be", "been", "being", "have", "has", "had", "do", "does", "did",
    "will", "would", "shall", "should", "can", "could", "may", "might", "must", "ought",
}
SUBJECTS = {"i", "we", "they", "he", "she"}
NUMBER_WORDS = {
    "zero", "oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "double",
    "triple",
}
ALWAYS_OPEN = ARTICLES | POSSESSIVES | CONJUNCTIONS | FILLERS | CONTRACTIONS
SHORT_ANSWER_WORDS = 3

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
_TRAILING_PUNCT = re.compile(r"[\s.!?\"')\]]+$")


def _is_number(word: str) -> bool:
    return word.isdigit() or word in NUMBER_WORDS


TIME_WORDS = {"at", "after", "before", "until", "till", "by", "from", "around", "about", "since", "past"}


def _clock_time(words: list[str]) -> bool:
    """The last word is a time of day written as digits after a word that asks for one ("at 730",
    "after 1115"): H:MM or HH:MM without the colon."""
    last = words[-1]
    if len(words) < 2 or words[-2] not in TIME_WORDS or len(last) not in (3, 4):
        return False
    hours, minutes = int(last[:-2]), int(last[-2:])
    return 0 <= hours <= 23 and minutes < 60


@functools.lru_cache(maxsize=64)  # a pause asks for the same few texts on every 20 ms frame it lasts
def unfinished(text: str) -> bool:
    """Whether the words end where an English sentence cannot (see the word classes above): a
    function word, a filler, a trailing comma/dash/ellipsis, or a number being read out."""
    return _open_ending(text) is not None


@functools.lru_cache(maxsize=64)
def reading_number(text: str) -> bool:
    """Whether the words are unfinished only as a number being read out (which may also be the end of
    the sentence: "... the code is four five seven two")."""
    return _open_ending(text) == "number"


def _open_ending(text: str) -> str | None:
    """Why the words cannot end a sentence: "words" (a function word, a filler, trailing punctuation
    that goes on), "number" (a number being read out), or None (they can end one)."""
    stripped = text.strip().replace("’", "'")
    body = _TRAILING_PUNCT.sub("", stripped.lower())
    if not body:
        return None
    if stripped.endswith(("...", "…")) or body[-1] in ",;:-–—":
        return "words"
    words = _WORD.findall(body)
    if not words:
        return None
    last, question = words[-1], stripped.endswith("?")
    if last in ALWAYS_OPEN:
        return "words"
    if last in WH_WORDS and not question:
        return "words"
    if last in PREPOSITIONS and not (question and WH_WORDS.intersection(words[:-1])):
        return "words"
    if last in AUXILIARIES | SUBJECTS | {"to"} and (len(words) > SHORT_ANSWER_WORDS or words[0] in AUXILIARIES):
        return "words"
    # A number being read out: a run of digits ("4572", "45-72"), or numbers after numbers ("four
    # five", "4, 5"); a single number ("a table for two") ends a sentence, and so does a clock time
    # ("at 730": Whisper writes "seven thirty" so).
    if last.isdigit() and len(last) >= 3:
        return None if _clock_time(words) else "number"
    if _is_number(last) and len(words) >= 2 and _is_number(words[-2]):
        return "number"
    return None


def words_of(text: str) -> tuple[str, ...]:
    """The words of a transcript, for comparing two decodes (case and punctuation ignored)."""
    return tuple(_WORD.findall(text.lower().replace("’", "'")))


@dataclass(frozen=True)
class Heard:
    """The words of the turn as the latest decode has them, and since when they have not changed."""

    words: tuple[str, ...]
    since: int  # the audio end (a stream sample) of the first decode that had these words
    voice_end: int  # where the voice stopped saying them, as far as known (a stream sample)
    latest: int = 0  # the audio end of the latest decode with them

    def heard(self, words: tuple[str, ...], audio_end: int, voice_end: int) -> Heard:
        """After one more decode of the turn (decodes may return out of order: the older is ignored)."""
        if audio_end <= self.latest:
            return self
        if words != self.words:
            return Heard(words, audio_end, voice_end, audio_end)
        return Heard(self.words, self.since, min(self.voice_end, voice_end), audio_end)

    def stalled(self, rate: int = 16000) -> bool:
        """The transcript stopped growing: the same words over STALL_MS more audio (and some words:
        a line that sounds before anyone speaks is not a turn)."""
        return bool(self.words) and (self.latest - self.since) * 1000 >= STALL_MS * rate


def talking(text: str, hallucination: bool, before: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The words a decode of the sound after the turn's words found there, where they show the caller
    talking: some words that Whisper's own filters (no-speech probability, log-probability, repetition)
    do not call a hallucination, and not the same words as the previous such decode (`before`): a
    talking caller's sound yields new words as it grows, where music gives Whisper the same word ("you")
    again and again. () where they do not."""
    words = () if hallucination else words_of(text)
    return words if words and words != before else ()


def doubted(words: list, speech_end_s: float) -> bool:
    """Whether Whisper doubts the last word (voiced.engines.base.Word) as one it may have made up at
    the pause: its probability is under LAST_P (and, where HEARD_S is set, it began less than HEARD_S
    before the voice stopped, `speech_end_s`, in the same clip's seconds)."""
    if not words or words[-1].probability >= LAST_P:
        return False
    return HEARD_S is None or words[-1].start_s > speech_end_s - HEARD_S


def judged_text(text: str, words: list, speech_end_s: float, english: bool = True) -> str:
    """The text the rule judges: `text`, or, when its last word (voiced.engines.base.Word) is doubtful
    (under DOUBTFUL_P) and starts where the voice had already stopped (`speech_end_s`, in the same
    clip's seconds), and the words before it are unfinished (English only: the word lists are English),
    those words. A doubt only keeps a turn open."""
    if not english:
        return text
    if words and words[-1].probability < DOUBTFUL_P and words[-1].start_s >= speech_end_s - ALIGN_SLACK_S:
        before = " ".join(w.word for w in words[:-1])
        if unfinished(before):
            return before
    return text


# `Evidence.verdict`'s names for what set the wait (docs/notes/2026-12-07-end-of-turn-rule.md tables them)
VERDICTS = ("no text", "stale text", "unfinished", "number", "no words", "sounding", "audio pending", "complete",
            "audio doubts", "more words", "doubted word", "doubted stop")


@dataclass(frozen=True)
class Evidence:
    """What is known about the turn at a pause; each part None until it arrives."""

    p_complete: float | None = None  # the audio model's probability that the turn is complete
    text: str | None = None  # the transcript of the turn so far
    fresh: bool = False  # `text` covers the audio up to this pause (else: an earlier interim decode)
    doubtful: bool = False  # Whisper doubts the last word, as one it may have made up (`doubted`)
    end_p: float | None = None  # Whisper's probability of end-of-text after `text` (None: not known)
    sounding: bool = False  # a pause the words found: the line still sounds (the VAD calls it speech)
    stop_p: float | None = None  # Whisper's probability of a sentence end right after the last word (None: not known)
    # The text is English, where the word rule (`unfinished`) reads it. Its lists are English words: a German
    # sentence ends on "will" or "was", which in English cannot end one; elsewhere the other signals decide.
    english: bool = True

    def wait_ms(self, b: Bounds) -> int:
        """The silence after which this turn ends (`verdict`)."""
        return self.verdict(b)[0]

    def verdict(self, b: Bounds) -> tuple[int, str]:
        """That wait, and what set it (one of VERDICTS): the bench counts what held
        the turns that ended late (voiced.bench.turn_replay), which no figure of the wait itself says
        (a doubted word and a number read out both wait `doubt_ms`)."""
        if self.text is None:
            return b.max_ms, "no text"
        if not self.fresh:
            return b.max_ms, "stale text"  # a stale text may lack the last words: it only keeps a turn open
        if self.english and unfinished(self.text):
            # a number read out may be the end of the sentence: long enough for a pause between digits
            return (b.doubt_ms, "number") if reading_number(self.text) else (b.max_ms, "unfinished")
        if not self.text.strip():
            return b.unsure_ms, "no words"  # a cough, a noise: no reason to hold the line long
        if self.sounding and self.end_p is not None and not self._decoder_says_over():
            # No silence, only words that stopped changing, and Whisper expects more of them: the sound
            # is likelier the caller's next word, not yet decoded, than music (new words end this pause)
            return b.max_ms, "sounding"
        if self.p_complete is None and b.audio_decides:
            return b.max_ms, "audio pending"  # the audio model's answer is a few ms away; wait for it
        wait, why = b.complete_ms, "complete"
        if not self._audio_says_complete() and b.audio_ms > wait:
            wait, why = b.audio_ms, "audio doubts"
        if self.end_p is not None and not self._decoder_says_over() and b.unsure_ms > wait:
            wait, why = b.unsure_ms, "more words"
        if self.doubtful or self._stop_doubted():
            return max(wait, b.doubt_ms), "doubted word" if self.doubtful else "doubted stop"
        return wait, why

    def _stop_doubted(self) -> bool:
        return self.stop_p is not None and self.stop_p < STOP_P

    def _audio_says_complete(self) -> bool:
        return self.p_complete is not None and self.p_complete >= COMPLETE_P

    def _decoder_says_over(self) -> bool:
        return self.end_p is not None and self.end_p >= END_P

    def ends(self, silence_ms: int, b: Bounds) -> bool:
        return silence_ms >= self.wait_ms(b)
