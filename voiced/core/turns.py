"""End-of-turn detection: has the caller finished, or only paused?

Fixed silence (`turn_detection = "silence"`: `hangover_ms` of it ends the turn) makes every caller
wait that long for a reply, and still cuts off anyone who pauses longer mid-sentence ("a table for
... four people"). `turn_detection = "smart"` decides at each short pause from four things, because
none of them decides well alone (issue 25: on espeak-ng speech an audio model hears a falling voice
before every pause, and Whisper puts a full stop on half a sentence):

- the words: the transcript of the turn so far. A text that ends on a word that cannot end an
  English sentence (an article, preposition, conjunction, auxiliary or modal verb, possessive or
  determiner, "to"), on a filler (um, uh), on a trailing comma or dash, or on a number being
  dictated, is not finished, whatever punctuation Whisper put after it;
- the audio: Smart Turn v3's probability that the turn is complete (voiced.engines.smart_turn);
- the decoder: the probability Whisper gives end-of-text right after the transcript
  (`Transcript.end_prob`, from the word-timing pass the rule already asks for). After a full stop or
  a question mark it is ~0.97-0.99 whether or not the caller is done (it adds nothing there), but
  where Whisper wrote no final punctuation it says whether Whisper expects more words: ~0.3-0.5
  after half a sentence, higher after a whole one. From the same pass, the probability it gives the
  sentence stopping right after the last word (`Transcript.stop_prob`: a full stop, question or
  exclamation mark, ellipsis or end-of-text next, against more words or a comma): where Whisper ended
  half a sentence with a full stop or question mark, it was often less sure of that stop than after a
  whole sentence (below);
- the silence so far: each verdict sets how much silence ends the turn, and `max_ms` of silence
  always ends it.

| verdict                                                  | silence that ends the turn          |
|----------------------------------------------------------|-------------------------------------|
| nothing known yet (the transcript is not ready)           | `max_ms`                            |
| the words are not finished                               | `max_ms`                            |
| ... but only as a number read out                        | `doubt_ms`                          |
| the words are finished and Whisper is sure of the last   | `complete_ms` (the short pause)     |
|     word and of the end (end-of-text)                    |                                     |
| ... and the audio model alone hears an unfinished turn   | `audio_ms` (medium, high: the short |
|                                                          |     pause; low: `unsure_ms`)        |
| the words are finished, the decoder expects more words;  | `unsure_ms`                         |
|     no words                                             |                                     |
| the words look finished but Whisper doubts the last one, | `doubt_ms`                          |
|     or that the sentence stops after it                  |                                     |

A number read out ("... ends in four five | seven two") is the one unfinished ending that also ends
sentences: no rule on the words knows whether more digits come, so it waits `doubt_ms` (at medium
2.2 s, long enough for the pause between two groups of digits) whatever the audio and the decoder
say: on the bench's espeak-ng callers neither told a finished reading from a paused one (Smart Turn
0.01-0.97 on both), and the bound (4 s) that every reading they did not both call finished waited held
the p90 of most sets at 4 s; no paused reading in them waited more than 2 s between its groups.

Eagerness sets the five (OpenAI's semantic_vad waits at most 8 / 4 / 2 s at low / medium / high).
People pause mid-sentence for up to about 2 s, so at medium an unfinished text waits 4 s, and a text
whose last word Whisper doubts waits that 2 s and the time to hear the voice come back (the
segmenter's RESUME_MS and the VAD's onset): 2.2 s. Such a word is often one Whisper made up from the
end of half a sentence ("I will care, Kevin." for "I will cancel the"; "I would like to book a table
for it." for "... a table for | two people"), and a full stop after it says nothing. Whisper doubts
it (`doubted`) where it gives it less than LAST_P (0.7) and it began less than HEARD_S (1 s) before
the voice stopped: a word made up at a pause gets the sliver of sound at the pause's edge, where a word
Whisper heard and spelled unsure of (a long number, a name, espeak-ng's odd vowels) sits on a second or
more of the caller's sound. Both are trades, measured in session 10 (the offline replay, 30 ms decode,
espeak-ng sets of 24 callers, dev seeds 0-2 and held-out 3-4; docs/BENCHMARKS.md): with real tiny.en,
LAST_P 0.5 cut off 10 of 36 pausing dev callers, 0.6 7, 0.7 6 at the same median (216 ms); 0.75 and
0.8 cut off 4 but held the median dev caller 370-580 ms, most finished espeak-ng sentences' last words
being given 0.7-1.0. With base (multilingual), HEARD_S 0.5 (session 9's) cut off 12 of 36 pausing dev
callers; no exemption cut off 5 of 36 and 5 of 24 but held the pooled held-out median at 2.1 s; 1 s
cut off 5 and 5 with pooled medians of 216 / 219 ms (base gives many of espeak-ng's last words 0.3-0.7:
its own medians on seeds 1 and 3 still sit at 2.2 s).

A pausing caller whose first half Whisper writes as a whole sentence with a last word it is sure of
("They can repair them." for "They can repair the | contract"; "... that is open after?" for "... open
after | half past six") is cut off by everything above; what tells such a stop from a real one is how
sure Whisper is of the stop itself: at 10 of the 25 pauses that cut callers off on the bench's seeds
0-11 it gave the sentence ending after the last word 0.23-0.91, after 145 of the 153 real ends that
ended a turn at once 0.92 or more (median 0.97; a voice that carries on sounds unfinished to Whisper
too, even where its words could end). Under STOP_P (0.92) the end is a doubt and waits `doubt_ms`. Session 11 (offline replay, real tiny.en, 30 ms decode, docs/BENCHMARKS.md): pausing
callers cut off 6 -> 4 of 36 on the dev seeds 0-2 it was chosen on, 19 -> 11 of 108 on seeds 3-11, 22 ->
12 of 96 and 19 -> 13 of 96 on two fresh sets (12-19, 20-27) made before it and never looked at caller by
caller, no caller newly cut off and the p50 / p90 unchanged; the cost is a whole sentence whose stop
Whisper doubts (1-2 callers in 24 on some sets) waiting `doubt_ms`. STOP_P 0.95 held the median dev
caller 0.5 s; 0.85 kept no dev caller whole.

The audio model (Smart Turn v3) is asked at every pause at low eagerness only: at medium and high its
"incomplete" alone no longer holds finished words Whisper is sure of (`audio_ms`), so its answer could
not change when a turn ends and it is not run there (`Bounds.audio_decides`; on a 2-core CPU it took
~14 % of a core at 4 callers, docs/BENCHMARKS.md, session 11): on espeak-ng
callers it called most finished sentences incomplete (p 0.01-0.3) and agreed with half sentences
("Could you tell my accountant that?": 0.69) as often, so its vote cost every such finished caller
400 ms (the old end-of-turn p50, ~610 ms) and kept 1 of 60 pausing callers (dev and held-out seeds,
tiny.en) from being cut off. At low eagerness it still holds them (`audio_ms` = `unsure_ms`).

The words are read with their probabilities and times: a doubtful last word placed after the voice
stopped does not make unfinished words finished (`judged_text`). Text from an earlier (interim)
decode is used while the fresh one is not ready, but only to keep a turn open: a stale transcript may lack the last words, so it can never end a turn early.

When the pause begins: the session starts the transcript (the slow part: ~20 ms on a GPU, a few
hundred on a CPU) after `PAUSE_MS` of silence, before the shortest wait (`complete_ms`) is up, so
that on a GPU the verdict is ready when that wait ends and on a CPU it comes the instant the decode
returns. The audio model hears the turn up to the voice's end with `MODEL_SILENCE_MS` of digital
silence after it, whatever the line plays after the voice (noise, tones, music: it was trained on
turns followed by silence).

A line that keeps sounding after the voice (hold music; anything the VAD keeps calling speech) never
gives a pause, or only a short one before it starts. There the words decide when the caller stopped:
after a pause that sound followed, the session decodes the turn every `WORDS_EVERY_MS`, and once the
words have not changed over `STALL_MS` more audio (`Heard.stalled`) and the sound has lasted that long
(a caller who has just resumed has no new word yet), the caller stopped talking where those words
ended: that is a pause, judged as any other, its silence counted from there; new words cancel it.
Whisper drops words a caller said after a gap inside one clip (seen on espeak-ng callers after keypad
tones, on a noisy line, and after a long pause: "I will check them." while the caller went on "invoice and
find the contract"), so before such a pause opens, the sound after the words is decoded alone: where
Whisper finds words in it that its filters do not call a hallucination, and not the same words as the
last time it was decoded alone (a talking caller's sound yields new words as it grows; music gives
Whisper its usual "you" again and again), the caller is talking and no pause opens (`talking`); the
decodes every WORDS_EVERY_MS go on deciding. On the bench's sets (seeds 0 and 1, real tiny.en, every
such pause's sound decoded alone) Whisper found words in the sound of 13 of 14 callers who were talking
there, and in that of 1 of 6 callers on hold music after their last word ("you", flagged a
hallucination in the other 5), whose pause then opens one decode (WORDS_EVERY_MS) later. There,
with no silence to go on, Whisper's end-of-text must agree: where it expects more words the sound is
taken for the caller's next word (seen live: "I am calling because the payment", end-of-text 0.21, the
same in two decodes while the caller said "failed"), and only new words or the bound end the pause.

Nothing here does I/O: the session feeds it the evidence and asks, on each frame of a pause, whether
the turn is over (`Evidence.wait_ms` is a lookup).
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
# Whisper's probabilities fall with the line, for every word: through a phone line (8 kHz mu-law, line
# noise) it gives the words it hears a median of 0.2-0.7 where a clean line gets 0.8-1.0, so under the
# thresholds above every phone caller's last word and stop were doubts, and waited `doubt_ms` (2.2 s).
# A doubt is a word, or a stop, less sure than this caller's other words by the clean line's margin:
# LAST_P and STOP_P hold where Whisper gives the turn's other words SURE_P or more, and scale down with
# their median below it (`sureness`).
SURE_P = 0.9


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


def sureness(words: list) -> float:
    """How sure Whisper is of this caller's words on this line, as a share of a clean line's: the median
    probability of the words before the last (voiced.engines.base.Word) over SURE_P, at most 1 (1 where
    there are none). The doubts' thresholds scale by it."""
    probs = sorted(w.probability for w in words[:-1])
    if not probs:
        return 1.0
    mid = len(probs) // 2
    median = probs[mid] if len(probs) % 2 else (probs[mid - 1] + probs[mid]) / 2
    return min(1.0, median / SURE_P)


def doubted(words: list, speech_end_s: float) -> bool:
    """Whether Whisper doubts the last word (voiced.engines.base.Word) as one it may have made up at
    the pause: its probability is under LAST_P scaled by the line (`sureness`), and, where HEARD_S is
    set, it began less than HEARD_S before the voice stopped (`speech_end_s`, in the same clip's seconds)."""
    if not words or words[-1].probability >= LAST_P * sureness(words):
        return False
    return HEARD_S is None or words[-1].start_s > speech_end_s - HEARD_S


def judged_text(text: str, words: list, speech_end_s: float) -> str:
    """The text the rule judges: `text`, or, when its last word (voiced.engines.base.Word) is doubtful
    (under DOUBTFUL_P) and starts where the voice had already stopped (`speech_end_s`, in the same
    clip's seconds), and the words before it are unfinished, those words. A doubt only keeps a turn open."""
    if words and words[-1].probability < DOUBTFUL_P and words[-1].start_s >= speech_end_s - ALIGN_SLACK_S:
        before = " ".join(w.word for w in words[:-1])
        if unfinished(before):
            return before
    return text


# `Evidence.verdict`'s names for the rows of the table above
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
    sure: float = 1.0  # how sure Whisper is of the turn's other words, of a clean line's (`sureness`): scales STOP_P

    def wait_ms(self, b: Bounds) -> int:
        """The silence after which this turn ends (module docstring's table)."""
        return self.verdict(b)[0]

    def verdict(self, b: Bounds) -> tuple[int, str]:
        """That wait, and which row of the table set it (one of VERDICTS): the bench counts what held
        the turns that ended late (voiced.bench.turn_replay), which no figure of the wait itself says
        (a doubted word and a number read out both wait `doubt_ms`)."""
        if self.text is None:
            return b.max_ms, "no text"
        if not self.fresh:
            return b.max_ms, "stale text"  # a stale text may lack the last words: it only keeps a turn open
        if unfinished(self.text):
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
        return self.stop_p is not None and self.stop_p < STOP_P * self.sure

    def _audio_says_complete(self) -> bool:
        return self.p_complete is not None and self.p_complete >= COMPLETE_P

    def _decoder_says_over(self) -> bool:
        return self.end_p is not None and self.end_p >= END_P

    def ends(self, silence_ms: int, b: Bounds) -> bool:
        return silence_ms >= self.wait_ms(b)
