"""Text to the phonemes a Piper voice reads, with espeak-ng run as a program of its own.

Piper voices are trained on espeak-ng's IPA: piper-tts (GPL-3.0-or-later) links espeak-ng into a
Python extension and asks it, clause by clause, for the clause's phonemes, the punctuation that ended
it and whether that ended a sentence. voiced is Apache-2.0, so it does not link espeak-ng (GPL-3.0):
it runs the `espeak-ng` program (`espeak-ng -q --ipa --stdin -v VOICE`), which prints one line of
phonemes per clause, and finds the punctuation that ended each clause itself, by the rule espeak-ng
cuts clauses with (readclause.c; `clause_ends`). From there on it is Piper's:

- language-switch flags such as `(fr)` are dropped from the phonemes;
- the clause's punctuation (one of `. ? ! , : ;`) is appended, and a space after `, : ;`;
- the text is decomposed to Unicode NFD, one phoneme per code point (accents become their own);
- clauses are grouped into sentences (a sentence's phonemes are synthesized together);
- ids: `^` (BOS), `_` (pad), then each phoneme's ids followed by a pad, then `$` (EOS).

Against piper-tts 1.8.0 (tests/test_piper_phonemes.py) the ids are equal, sentence for sentence, with
two differences, both espeak-ng's and neither ours:
- the espeak-ng *version*: Debian 12's 1.51 says "four" /foːɹ/ where piper's bundled 2026 build says
  /fɔːɹ/; given the same data directory (`data_dir`) the words agree;
- piper-tts 1.8.0 prints a linking glide `ʲ` after an /i/-like vowel before another vowel
  ("be on" -> biːʲ ɑːn). espeak-ng's phoneme data marks that glide "don't show in ipa"; the build
  piper 1.8.0 bundles ignores the mark (espeak-ng's own fix: "dictionary: restore prevPh conditions
  in phoneme mnemonic output", July 2026). The published voices were trained before that bug (2023),
  without the glide, so the glide is left out here, as espeak-ng's data says.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from voiced.engines.base import EngineError

log = logging.getLogger(__name__)

PAD, BOS, EOS = "_", "^", "$"
PROGRAM = "espeak-ng"
# What espeak-ng's clause types print as in Piper (the terminators piper-tts names); None: the clause
# type has no terminator of its own (a paragraph break, an ellipsis, the end of the text).
_SENTENCE_END = {".": True, "?": True, "!": True, ",": False, ":": False, ";": False}
# Unicode punctuation espeak-ng ends clauses at, as the ASCII terminator it counts as, and whether a
# space must follow (ideographic marks need none).
_PUNCT = {".": ".", "?": "?", "!": "!", ",": ",", ":": ":", ";": ";",
          "。": ".", "？": "?", "！": "!", "，": ",", "：": ":", "；": ";", "、": ",", "।": ".", "؟": "?", "،": ",",
          "\u2013": ";", "\u2014": ";"}  # en and em dashes: espeak-ng's "extended dash", a semicolon
_NO_SPACE_NEEDED = set("。？！，：；、")
_ELLIPSIS = "\u2026"
_BRACKETS = set("()[]{}<>\"'`\u00ab\u00bb\u300a\u300b") | {chr(c) for c in range(0x2014, 0x2020)}
_LANG_FLAG = re.compile(r"\([^)]+\)")


@dataclass(frozen=True)
class ClauseEnd:
    terminator: str  # ".", "?", "!", ",", ":", ";" or "" (none of its own)
    sentence: bool  # the clause ends a sentence


def clause_ends(text: str) -> list[ClauseEnd]:
    """How espeak-ng ends each clause of `text` (readclause.c's rule for its default options).

    A clause ends at `. ? ! , : ;` followed by a space, a bracket or quote, or the end of the text; a
    run of `?`/`!` (and any punctuation after it) counts as its first mark; a `.` before a lower-case
    word is an abbreviation's, not an end; punctuation before any letter or digit ends nothing. Three
    or more dots are an ellipsis: a clause end without a terminator, inside the sentence. A blank line
    ends a sentence, and punctuation just before it loses its terminator. The rest of the text after
    the last end is one more clause that ends the sentence."""
    out: list[ClauseEnd] = []
    n, i, any_alnum = len(text), 0, False
    while i < n:
        c = text[i]
        if c.isalnum():
            any_alnum = True
            i += 1
            continue
        if c == "\n":
            j, newlines = i + 1, 0
            while j < n and text[j].isspace():
                newlines += text[j] == "\n"
                j += 1
            if newlines and j < n:
                out.append(ClauseEnd("", True))  # a paragraph
                any_alnum = False
            i = j
            continue
        ellipsis = c == _ELLIPSIS or text.startswith("...", i)
        if ellipsis:
            while i + 1 < n and text[i + 1] == "." and c == ".":
                i += 1
            mark = _ELLIPSIS
        elif c in _PUNCT:
            mark = _PUNCT[c]
            if mark in "?!":
                while i + 1 < n and (text[i + 1] in _PUNCT or text[i + 1] == _ELLIPSIS):
                    i += 1
        else:
            i += 1
            continue
        after = text[i + 1] if i + 1 < n else ""
        if not (ellipsis or c in _NO_SPACE_NEEDED or after == "" or after.isspace() or after in _BRACKETS
                or after == "?"):
            i += 1
            continue
        j, newlines = i + 1, 0
        while j < n and text[j].isspace():
            newlines += text[j] == "\n"
            j += 1
        following = text[j] if j < n else ""
        abbreviation = newlines == 0 and (following.islower() or text.startswith("'s", j))
        if not any_alnum or (mark == "." and abbreviation):
            i += 1
            continue
        if newlines > 1 or ellipsis:
            out.append(ClauseEnd("", newlines > 1))
        else:
            out.append(ClauseEnd(mark, _SENTENCE_END[mark]))
        any_alnum = False
        i = j
    if any_alnum or not out:
        out.append(ClauseEnd("", True))
    return out


def espeak_program() -> str:
    """The espeak-ng program's path; an EngineError naming the install command where it is missing."""
    path = shutil.which(PROGRAM)
    if path is None:
        raise EngineError("Piper voices need the espeak-ng program (it turns text into phonemes); install it: "
                          "`apt-get install espeak-ng` (Debian/Ubuntu), `brew install espeak-ng` (macOS), "
                          "`dnf install espeak-ng` (Fedora)")
    return path


def espeak_lines(text: str, voice: str, data_dir: str | Path | None = None) -> list[str]:
    """espeak-ng's IPA for `text`, one line per clause, as the program prints it."""
    cmd = [espeak_program(), "-q", "--ipa", "--stdin", "-v", voice]
    if data_dir is not None:
        cmd.append(f"--path={Path(data_dir).parent if Path(data_dir).name == 'espeak-ng-data' else data_dir}")
    process = _spares.take(cmd)
    try:
        out, err = process.communicate(text.encode("utf-8"), timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise EngineError(f"espeak-ng took over 30 s for voice {voice!r}; send a shorter text") from None
    finally:
        _spares.refill(cmd)  # after this text's phonemes: starting one costs the CPU this text needed
    if process.returncode != 0:
        raise EngineError(f"espeak-ng failed for voice {voice!r} (exit {process.returncode}): "
                          f"{err.decode('utf-8', 'replace').strip()[:200]}")
    return out.decode("utf-8").splitlines()


class _Spares:
    """One espeak-ng started ahead for each command, waiting on its input: starting the program is most of
    what phonemizing a reply costs (~30 ms of ~40 on a loaded 2-core machine), so a reply's text goes to
    one already started and the next is started for the reply after it."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, ...], subprocess.Popen] = {}
        self._lock = threading.Lock()  # the synthesis thread and the doors' threads phonemize

    def take(self, cmd: list[str]) -> subprocess.Popen:
        """The one waiting for `cmd` (started now where none is)."""
        with self._lock:
            process = self._waiting.pop(tuple(cmd), None)
        return process if process is not None and process.poll() is None else _start(cmd)

    def refill(self, cmd: list[str]) -> None:
        with self._lock:
            if tuple(cmd) not in self._waiting:
                self._waiting[tuple(cmd)] = _start(cmd)


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_spares = _Spares()


def phonemize(text: str, voice: str, data_dir: str | Path | None = None) -> list[list[str]]:
    """`text` as a Piper voice with espeak voice `voice` reads it: one list of phonemes per sentence."""
    text = text.strip()
    if not text:
        return []
    lines = espeak_lines(text, voice, data_dir)
    ends = clause_ends(text)
    if len(lines) != len(ends):
        # espeak-ng cut the text where the rule above did not (a clause of ~700 characters without
        # punctuation is cut in two): the phonemes are still right, only a pause or a sentence's
        # intonation may be; every line then ends its sentence and the rule's last terminator ends the text.
        log.debug("espeak-ng made %d clauses of %r where %d were expected", len(lines), text[:80], len(ends))
        ends = [ClauseEnd("", True)] * (len(lines) - 1) + [ends[-1]] if lines else []
    sentences: list[list[str]] = []
    current: list[str] = []
    for line, end in zip(lines, ends):
        phonemes = _LANG_FLAG.sub("", line) + end.terminator
        if end.terminator in (",", ":", ";"):
            phonemes += " "
        current.extend(unicodedata.normalize("NFD", phonemes))
        if end.sentence:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    return [s for s in sentences if s]


def split_clauses(phonemes: list[str]) -> list[list[str]]:
    """A sentence's phonemes cut after each clause inside it (after `, : ;` and the space that follows)."""
    out: list[list[str]] = []
    start = 0
    for i in range(1, len(phonemes)):
        if phonemes[i] == " " and phonemes[i - 1] in (",", ":", ";") and i + 1 < len(phonemes):
            out.append(phonemes[start:i + 1])
            start = i + 1
    out.append(phonemes[start:])
    return out


def merge_vowel_clusters(phonemes: list[str], clusters: set[tuple[str, ...]]) -> list[str]:
    """Adjacent phonemes a voice reads as one (its config's `vowel_clusters`), longest first."""
    if not clusters:
        return phonemes
    longest = max(len(c) for c in clusters)
    out: list[str] = []
    i = 0
    while i < len(phonemes):
        for size in range(min(longest, len(phonemes) - i), 1, -1):
            if tuple(phonemes[i:i + size]) in clusters:
                out.append("".join(phonemes[i:i + size]))
                i += size
                break
        else:
            out.append(phonemes[i])
            i += 1
    return out


def phoneme_ids(phonemes: list[str], id_map: dict[str, list[int]]) -> list[int]:
    """A sentence's ids: BOS, pad, each phoneme's ids and a pad, EOS. A phoneme the voice has no id for is
    skipped (logged once per sentence), as Piper does."""
    ids = [*id_map[BOS], *id_map[PAD]]
    unknown = []
    for p in phonemes:
        if p not in id_map:
            unknown.append(p)
            continue
        ids += id_map[p]
        ids += id_map[PAD]
    ids += id_map[EOS]
    if unknown:
        log.debug("phonemes the voice has no id for, skipped: %s", "".join(sorted(set(unknown))))
    return ids
