"""Whisper's tokenizer: byte-level BPE from a `.tiktoken` rank file plus Whisper's special tokens.

Multilingual models use `multilingual.tiktoken`, English-only (`.en`) models `gpt2.tiktoken`. The
special tokens follow the BPE ranks in a fixed order (endoftext, startoftranscript, one token per
language, translate, transcribe, startoflm, startofprev, nospeech, notimestamps, then 1501
timestamps <|0.00|> .. <|30.00|>), so every id is a function of the rank file and the number of
languages (99, or 100 from large-v3 on, which added Cantonese).

Both rank files ship inside this package (assets/, MIT, from openai-whisper), so no model needs the
internet for its tokenizer. Checkpoints that carry their own token list (CTranslate2 vocabularies,
Hugging Face tokenizer.json) are checked against these ids by `check_vocabulary`.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import tiktoken

# Language codes in token order; the first `num_languages` exist in a given model.
LANGUAGES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian", "mk": "macedonian",
    "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian", "ne": "nepali",
    "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer",
    "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan",
    "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi", "gu": "gujarati",
    "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek", "fo": "faroese",
    "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese",
    "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog",
    "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala",
    "ha": "hausa", "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}
# Names users type, mapped to codes (plus the usual aliases).
LANGUAGE_ALIASES: dict[str, str] = {
    **{name: code for code, name in LANGUAGES.items()},
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb",
    "pushto": "ps", "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si",
    "castilian": "es", "mandarin": "zh",
}

N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 20 ms steps
TIMESTAMP_SECONDS = 0.02

# BPE pre-tokenisation pattern shared by GPT-2 and Whisper.
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The rank files bundled in assets/; also where they are published (the openai/whisper repository),
# with their sha256.
ASSETS = Path(__file__).parent / "assets"
TIKTOKEN_FILES: dict[str, tuple[str, str]] = {
    "multilingual.tiktoken": (
        "https://raw.githubusercontent.com/openai/whisper/main/whisper/assets/multilingual.tiktoken",
        "b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126",
    ),
    "gpt2.tiktoken": (
        "https://raw.githubusercontent.com/openai/whisper/main/whisper/assets/gpt2.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    ),
}


class TokenizerFileNotFound(FileNotFoundError):
    pass


def normalize_language(language: str) -> str:
    """'English', 'en', 'EN' -> 'en'; raises ValueError naming the input otherwise."""
    key = language.strip().lower()
    if key in LANGUAGES:
        return key
    if key in LANGUAGE_ALIASES:
        return LANGUAGE_ALIASES[key]
    raise ValueError(f"unsupported language {language!r}; use a code such as 'en', 'de' or 'zh'")


def find_tiktoken_file(filename: str, search_dirs: list[Path] | None = None) -> Path:
    """`filename` from the first of `search_dirs` that has it, else the copy bundled in assets/."""
    dirs = [*(search_dirs or []), ASSETS]
    for d in dirs:
        p = Path(d) / filename
        if p.is_file():
            return p
    raise TokenizerFileNotFound(
        f"tokenizer file {filename} not found (looked in {', '.join(str(d) for d in dirs)}); the voiced "
        f"package is incomplete (it ships {filename} in {ASSETS}): reinstall it, or copy {filename} from "
        f"{TIKTOKEN_FILES[filename][0]} into one of those directories."
    )


@lru_cache(maxsize=8)
def _load_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_encoding(path: str | os.PathLike, num_languages: int) -> tiktoken.Encoding:
    ranks = _load_ranks(str(path))
    specials = [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *[f"<|{code}|>" for code in list(LANGUAGES)[:num_languages]],
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
        *[f"<|{i * TIMESTAMP_SECONDS:.2f}|>" for i in range(N_TIMESTAMPS)],
    ]
    special_ids = {tok: len(ranks) + i for i, tok in enumerate(specials)}
    return tiktoken.Encoding(
        name=f"{Path(path).stem}-{num_languages}",
        explicit_n_vocab=len(ranks) + len(specials),
        pat_str=_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=special_ids,
    )


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class WhisperTokenizer:
    """The encoding and the special ids decoding needs; one per model (language/task are per request)."""

    encoding: tiktoken.Encoding
    num_languages: int
    multilingual: bool
    special: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.special = {t: self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set}
        s = self.special
        self.eot = s["<|endoftext|>"]
        self.sot = s["<|startoftranscript|>"]
        self.translate = s["<|translate|>"]
        self.transcribe = s["<|transcribe|>"]
        self.sot_lm = s["<|startoflm|>"]
        self.sot_prev = s["<|startofprev|>"]
        self.no_speech = s["<|nospeech|>"]
        self.no_timestamps = s["<|notimestamps|>"]
        self.timestamp_begin = s["<|0.00|>"]
        self.language_codes: tuple[str, ...] = tuple(LANGUAGES)[: self.num_languages]
        self.language_tokens: tuple[int, ...] = tuple(self.sot + 1 + i for i in range(self.num_languages))

    @classmethod
    def load(cls, multilingual: bool, num_languages: int, search_dirs: list[Path] | None = None) -> WhisperTokenizer:
        """The tokenizer of a model with this vocabulary; `search_dirs` are looked in before the bundled files."""
        filename = "multilingual.tiktoken" if multilingual else "gpt2.tiktoken"
        path = find_tiktoken_file(filename, search_dirs)
        return cls(build_encoding(path, num_languages), num_languages, multilingual)

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def check_vocabulary(self, tokens: list[str], where: str) -> None:
        """Raise ValueError unless `tokens` (id -> token string, byte-level BPE form as in CTranslate2
        vocabularies and tokenizer.json) give every id the meaning this tokenizer gives it (a list may
        stop early: older tokenizer.json files leave out the timestamp tokens).

        A model trained with another vocabulary would decode to wrong text without any error, so the
        first id that differs is named. Special tokens may use Hugging Face's spelling
        (<|nocaptions|> for <|nospeech|>, <|iw|> for Hebrew).
        """
        if len(tokens) > self.n_vocab:
            raise ValueError(f"{where} has {len(tokens)} tokens; Whisper's tokenizer for this model has {self.n_vocab}")
        decoder = _byte_decoder()
        specials = {i: t for t, i in self.special.items()}
        aliases = {"<|nocaptions|>": "<|nospeech|>", "<|iw|>": "<|he|>"}  # older Hugging Face spellings
        for i, text in enumerate(tokens):
            if i in specials:
                if aliases.get(text, text) != specials[i]:
                    raise ValueError(f"{where}: token {i} is {text!r}, Whisper's is {specials[i]!r}; "
                                     "the model's vocabulary differs from Whisper's")
                continue
            try:
                raw = bytes(decoder[c] for c in text)
            except KeyError:
                raw = None
            if raw != self.encoding.decode_single_token_bytes(i):
                raise ValueError(f"{where}: token {i} is {text!r}, Whisper's is "
                                 f"{self.encoding.decode_single_token_bytes(i)!r}; the model's vocabulary differs "
                                 "from Whisper's")

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, tokens: list[int]) -> str:
        """Text of `tokens`, timestamp tokens left out."""
        return self.encoding.decode([t for t in tokens if t < self.timestamp_begin])

    def language_token(self, code: str) -> int:
        if code not in self.language_codes:
            raise ValueError(f"language {code!r} is not one of this model's {self.num_languages} languages")
        return self.sot + 1 + self.language_codes.index(code)

    def sot_sequence(self, language: str | None, task: str) -> list[int]:
        """<|startoftranscript|> [<|lang|> <|task|>] ; English-only models have neither."""
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self.language_token(language or "en"),
                self.transcribe if task == "transcribe" else self.translate]

    @cached_property
    def sentence_end_tokens(self) -> tuple[int, ...]:
        """Tokens after which a text stops: a full stop, a question or exclamation mark (alone, or with a
        closing quote), also as the CJK marks, and an ellipsis (the speaker trails off); not a comma, a
        dash or a colon, after which more words come."""
        out = set()
        for sym in (".", "?", "!", "?!", "!?", '."', '?"', '!"', "...", "…", "。", "？", "！"):
            for text in (sym, " " + sym):
                ids = self.encode(text)
                if len(ids) == 1:
                    out.add(ids[0])
        return tuple(sorted(out))

    @property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Tokens that only ever write speaker tags, music notes or bracketed annotations.

        Suppressing them keeps hallucinated "(music)" / "[SPEAKER]" / "♪" out of transcripts while
        ordinary punctuation stays. Symbols that take several BPE tokens are suppressed by their
        first token only when that is safe (the music-note block shares its first UTF-8 bytes).
        Hyphens and apostrophes are kept inside words but not at a word's start.
        """
        if hasattr(self, "_non_speech"):
            return self._non_speech
        singles = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        multis = ["<<", ">>", "<<<", ">>>", "--", "---", "-(", "-[", "('", '("', "((", "))", "(((", ")))", "[[", "]]", "{{", "}}", "♪♪", "♪♪♪"]
        notes = set("♩♪♫♬♭♮♯")
        out = {self.encode(" -")[0], self.encode(" '")[0]}
        for sym in singles + multis + sorted(notes):
            for text in (sym, " " + sym):
                ids = self.encode(text)
                if len(ids) == 1 or sym in notes:
                    out.add(ids[0])
        self._non_speech = tuple(sorted(out))
        return self._non_speech
