"""Speech whose word boundaries are known, for measuring word timings against the truth.

Each word of a sentence is spoken on its own by espeak-ng, trimmed to where it is audible, and the
words are laid end to end with 60-200 ms of silence between them (0.3 s before and after, as a
voice-activity detector would cut an utterance), so every word's true start and end are known to
the sample. Word times are scored over the words read right: a recognised word is paired with a
true word where the two readings agree (difflib's matching blocks over the normalised words).

    python -m tests.word_truth [--sentences 30]   # the table in docs/BENCHMARKS.md

runs voiced's engine and openai-whisper's `transcribe(word_timestamps=True)` on the same real
tiny.en weights over the set and prints both scores.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 16000
LEAD_S = 0.3
GAP_S = (0.06, 0.2)
LOUD = 0.01  # |sample| above which a word is audible (as voiced.bench.speech_set trims utterances)

# Sentences of everyday requests; none of them is read by another test of word timings.
SENTENCES = [
    "Please send the invoice to our office in Chicago before Friday.",
    "My flight leaves at seven thirty tomorrow morning.",
    "Could you move the meeting to the small conference room?",
    "The weather will be cold and windy all weekend.",
    "I need two tickets for the concert on Saturday night.",
    "Turn left at the bank and walk past the old church.",
    "Her brother repairs bicycles in a shop near the station.",
    "We ordered pizza because the kitchen was closed.",
    "The doctor asked me to come back in three weeks.",
    "Remember to water the plants while we are away.",
    "This printer jams whenever someone uses thick paper.",
    "Our team finished the project two days early.",
    "Can you recommend a quiet hotel near the beach?",
    "The children built a castle out of sand and shells.",
    "He forgot his umbrella on the train again.",
    "Please check the tire pressure before the long drive.",
    "The museum opens at ten and closes at five.",
    "She plays the violin in the city orchestra.",
    "Add some salt and pepper to the soup.",
    "The library has a new collection of maps.",
    "I would like to change my delivery address.",
    "The bus was late because of heavy traffic downtown.",
    "They painted the fence white last summer.",
    "Your package will arrive on Tuesday afternoon.",
    "The garden looks beautiful after the rain.",
    "My password stopped working this morning.",
    "We should leave early to avoid the crowds.",
    "The manager approved the budget for next year.",
    "Bring a warm jacket, it gets cold at night.",
    "The cat is sleeping on the kitchen table.",
]


@dataclass
class TrueWord:
    word: str
    start: float
    end: float


@dataclass
class Utterance:
    text: str
    audio: np.ndarray  # 16 kHz float32
    words: list[TrueWord]


def normalise(word: str) -> str:
    return re.sub(r"[^a-z0-9']", "", word.lower())


def _spoken_word(word: str, voice: str, rate: int, tmp: Path) -> np.ndarray:
    from voiced.audio.wavfile import load_16k

    wav = tmp / "w.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-w", str(wav), word], check=True, capture_output=True)
    audio = load_16k(wav)
    loud = np.nonzero(np.abs(audio) > LOUD)[0]
    if not len(loud):
        raise RuntimeError(f"espeak-ng said nothing audible for {word!r}")
    return audio[loud[0]: loud[-1] + 1]


def utterance(text: str, rng: np.random.Generator, voice: str = "en-us", rate: int = 165) -> Utterance:
    """`text` word by word, each word trimmed, with random 60-200 ms gaps; the words' true times."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)")
    lead = np.zeros(int(LEAD_S * RATE), np.float32)
    parts, words, t = [lead], [], len(lead)
    with tempfile.TemporaryDirectory() as tmp:
        for i, word in enumerate(text.split()):
            if i:
                gap = np.zeros(int(rng.uniform(*GAP_S) * RATE), np.float32)
                parts.append(gap)
                t += len(gap)
            audio = _spoken_word(word.strip(".,?!"), voice, rate, Path(tmp))
            parts.append(audio)
            words.append(TrueWord(word, t / RATE, (t + len(audio)) / RATE))
            t += len(audio)
    parts.append(lead)
    return Utterance(text, np.concatenate(parts).astype(np.float32), words)


def truth_set(n: int, seed: int = 0) -> list[Utterance]:
    rng = np.random.default_rng(seed)
    return [utterance(s, rng) for s in SENTENCES[:n]]


@dataclass
class Score:
    errors: list[float]  # recognised - true (s), at each start and end of the words read right
    read_right: int  # utterances whose words all match
    utterances: int

    @property
    def median_abs_ms(self) -> float:
        return float(np.median(np.abs(self.errors))) * 1000

    @property
    def mean_signed_ms(self) -> float:
        return float(np.mean(self.errors)) * 1000

    def row(self, name: str) -> str:
        return (f"| {name} | {self.median_abs_ms:.0f} ms | {self.mean_signed_ms:+.0f} ms | "
                f"{self.read_right} / {self.utterances} | {len(self.errors) // 2} |")


def score(utterances: list[Utterance], recognised: list[list[tuple[str, float, float]]]) -> Score:
    """Errors of the recognised (word, start, end) against the truth, over the words read right."""
    errors, right = [], 0
    for utt, got in zip(utterances, recognised):
        want = [normalise(w.word) for w in utt.words]
        have = [normalise(w) for w, _, _ in got]
        right += want == have
        for block in difflib.SequenceMatcher(a=want, b=have, autojunk=False).get_matching_blocks():
            for k in range(block.size):
                truth, (_, s, e) = utt.words[block.a + k], got[block.b + k]
                errors += [s - truth.start, e - truth.end]
    return Score(errors, right, len(utterances))


# ------------------------------------------------------------------------ the two recognisers
def voiced_words(engine, audio: np.ndarray) -> list[tuple[str, float, float]]:
    from voiced.engines.base import ASROptions, ASRRequest

    r = engine.transcribe(ASRRequest(audio, ASROptions(language="en", word_timestamps=True)))
    return [(w.word, w.start_s, w.end_s) for w in r.words]


def openai_model(engine):
    """openai-whisper's own model class with the engine's weights and openai-whisper's heads for them."""
    import whisper
    import whisper.model as wm

    ref = wm.Whisper(wm.ModelDimensions(**engine.dims.as_dict()))
    ref.load_state_dict({k: v.float().contiguous() for k, v in engine.model.state_dict().items()})
    ref.set_alignment_heads(whisper._ALIGNMENT_HEADS[engine.model_name.removesuffix("-pypi")])
    return ref.eval()


def openai_words(model, audio: np.ndarray) -> list[tuple[str, float, float]]:
    """What `whisper --word_timestamps True` gives: openai-whisper's transcribe() with its defaults."""
    import torch
    import whisper

    torch.manual_seed(0)  # its temperature fallback samples: the same draws every run
    r = whisper.transcribe(model, audio, language="en", word_timestamps=True, fp16=False, verbose=None)
    return [(w["word"].strip(), w["start"], w["end"]) for s in r["segments"] for w in s["words"]]


def main(argv: list[str] | None = None) -> None:
    import argparse

    from tests.real_whisper import tiny_en_dir
    from voiced.engines.whisper.engine import WhisperEngine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=len(SENTENCES))
    args = p.parse_args(argv)
    utts = truth_set(args.sentences)
    engine = WhisperEngine.load(tiny_en_dir())
    ref = openai_model(engine)
    ours = score(utts, [voiced_words(engine, u.audio) for u in utts])
    theirs = score(utts, [openai_words(ref, u.audio) for u in utts])
    print("| | median boundary error | mean signed error | sentences read right | words scored |")
    print("| --- | --- | --- | --- | --- |")
    print(ours.row("voiced"))
    print(theirs.row("openai-whisper `transcribe()`"))


if __name__ == "__main__":
    main()
