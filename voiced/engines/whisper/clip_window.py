"""The encoder's window sized to the clip (`asr.window = "auto"` on a CPU, the daemon's default:
`WhisperRuntime.clip_window`).

Whisper hears every clip in a 30 s window, the speech and then silence. On a CPU the encoder is most of a
decode (base on two cores, 3 s of speech: 0.73 of 1.0 s), and its work grows with the window, not the speech.
A clip of up to 18 s is heard in a 20 s window instead, its first positions' embeddings: a turn's decode
takes 0.72 s instead of 1.02 with base, 0.35 instead of 0.50 with tiny.en, with the same word error rate. Whisper was
trained on 30 s windows only, and shorter windows change what it says (docs/BENCHMARKS.md, Whisper on a CPU):

- the end-of-turn rule (voiced.core.turns) reads Whisper's stop and end-of-text probabilities, which a 10 s
  window moves: tiny.en's stop probability no longer tells a finished caller from a paused one (AUC 0.51
  against 0.69 in 30 s, on the Piper set), and finished callers doubted rise from 4 % to 38 %. 20 s keeps
  them (AUC 0.72, 8 %), 15 s does not quite (0.63, 12 %);
- under ~10 s it starts to repeat itself or not stop (base on 3.5 s clips in a 6 s window: WER 210 %);
  at any length a decode now and then does not stop (tiny.en in 10 s: 2 of 48 natural-voice turns): one
  whose text repeats itself or that runs past what speech could say (`repeating`) is decoded again in 30 s.

It is the daemon's window on a CPU (`asr.window = "auto"`): there a pause's decode that outlasts the gap between two
sentences merges them into one turn, and the 20 s window splits 2 of 12 two-sentence callers that 30 s merges
(base, docs/BENCHMARKS.md). `voiced transcribe` and `voiced eval` keep 30 s unless told (`--window auto`): the same
word error rate is not the same words, and their results match openai-whisper's.
"""

from __future__ import annotations

from .audio import N_SAMPLES, SAMPLE_RATE

WINDOW_MIN_S = 20  # (see above)
WINDOW_STEP_S = 10  # windows of 20 or 30 s
WINDOW_MARGIN_S = 2  # of silence after the clip, at least
# A decode gets at most this many tokens (speech comes at 2-6 a second, a number read out at up to ~10): more
# means it is repeating itself.
TOKENS_PER_S, TOKENS_MIN = 12, 24
REPEATING_RATIO = 2.4  # openai-whisper's test for a looping decode (its compression_ratio_threshold's default)


def window_samples(n_samples: int) -> int:
    """The samples of the shortest window of WINDOW_STEP_S steps, at least WINDOW_MIN_S, that holds `n_samples`
    of audio and WINDOW_MARGIN_S of silence after it; at most the model's 30 s."""
    steps = -(-(n_samples + WINDOW_MARGIN_S * SAMPLE_RATE) // (WINDOW_STEP_S * SAMPLE_RATE))
    return min(N_SAMPLES, max(WINDOW_MIN_S, steps * WINDOW_STEP_S) * SAMPLE_RATE)


def window_tokens(n_samples: int) -> int:
    """The most tokens a decode of `n_samples` of audio in its clip's window may take."""
    return TOKENS_MIN + TOKENS_PER_S * -(-n_samples // SAMPLE_RATE)


def clip_plan(n_samples: int, sample_len: int) -> tuple[int, int | None, int]:
    """A request's (window, token bound, tokens it may take) for `n_samples` of audio and its own limit of
    `sample_len` tokens; the bound is None where its own limit is the lower."""
    bound = window_tokens(n_samples)
    return window_samples(n_samples), (bound if bound < sample_len else None), min(bound, sample_len)


def repeating(compression_ratio: float, tokens: int, bound: int | None) -> bool:
    """Whether a decode in a clip's window looped: its text repeats itself, or it took `bound` tokens, the
    window's (`window_tokens`; None where the request's own limit is lower)."""
    return compression_ratio > REPEATING_RATIO or (bound is not None and tokens >= bound)
