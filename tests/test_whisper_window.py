"""The encoder's window sized to the clip (voiced/engines/whisper/clip_window.py, `window="auto"` on a CPU): each
request of up to 18 s is heard in a 20 s window, a longer one in 30 s, requests of different windows never share
the cache's rows, and a decode that loops in its window is done again in 30 s."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import make_openai_checkpoint

from voiced.config import Config, ConfigError
from voiced.engines.base import ASROptions, ASRRequest, EngineError, finish
from voiced.engines.whisper import engine as engine_module
from voiced.engines.whisper.clip_window import repeating, window_samples, window_tokens
from voiced.engines.whisper.engine import WhisperEngine
from voiced.engines.whisper.model import ModelDims
from voiced.engines.whisper.options import WhisperRuntime

RATE = 16000


def test_the_window_holds_the_clip_and_two_seconds_and_is_20_or_30_s():
    assert [window_samples(int(s * RATE)) // RATE for s in (0.2, 3, 8.5, 17.9, 18.1, 28, 30)] == \
        [20, 20, 20, 20, 30, 30, 30]
    assert window_tokens(3 * RATE) == 24 + 36 and window_tokens(int(2.5 * RATE)) == 24 + 36
    assert repeating(2.5, 10, None) and repeating(1.2, 60, 60) and not repeating(1.2, 59, 60)
    assert not repeating(1.2, 224, None)  # the request's own limit reached: not a loop


def _audio(seconds: float, seed: int) -> np.ndarray:
    return (0.05 * np.random.default_rng(seed).standard_normal(int(seconds * RATE))).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_openai_checkpoint(tmp_path_factory.mktemp("window"), seed=5, eot_boost=2.0)


def _run(engine: WhisperEngine, requests: dict[int, np.ndarray], opts: ASROptions) -> dict[int, list[int]]:
    for rid, audio in requests.items():
        engine.submit(rid, ASRRequest(audio, opts))
    out = {}
    while engine.has_work():
        for o in finish(engine._step()):
            assert o.error is None, o.error
            if o.final:
                out[o.request_id] = o.value.tokens
    return out


def test_a_cpu_engine_hears_each_clip_in_its_window_and_full_keeps_30_s(checkpoint):
    auto, full = WhisperEngine.load(checkpoint, max_batch=4, window="auto"), WhisperEngine.load(checkpoint, max_batch=4)
    assert auto.runtime.clip_window and not full.runtime.clip_window
    opts = ASROptions(language="en", max_new_tokens=8)
    auto.transcribe(ASRRequest(_audio(3, 0), opts))
    assert auto.cache.cross_k.shape[2] == 1000  # 20 s of 20 ms positions
    auto.transcribe(ASRRequest(_audio(19, 1), opts))
    assert auto.cache.cross_k.shape[2] == 1500
    full.transcribe(ASRRequest(_audio(3, 0), opts))
    assert full.cache.cross_k.shape[2] == 1500
    with pytest.raises(EngineError, match="window 'wide'"):
        WhisperEngine.load(checkpoint, window="wide")


def test_clips_of_different_windows_queued_together_each_decode_as_alone(checkpoint):
    """A 25 s clip between short ones: each gets the tokens it gets alone (its own window, its rows never
    reading another window's audio positions), and none is left behind."""
    engine = WhisperEngine.load(checkpoint, max_batch=4, window="auto")
    opts = ASROptions(language="en", max_new_tokens=12)
    clips = {1: _audio(3, 2), 2: _audio(25, 3), 3: _audio(2, 4), 4: _audio(12, 5), 5: _audio(4, 6)}
    alone = {rid: _run(engine, {rid: a}, opts)[rid] for rid, a in clips.items()}
    assert _run(engine, clips, opts) == alone


def test_a_decode_that_loops_in_its_window_is_decoded_again_in_30_s(checkpoint, monkeypatch):
    opts = ASROptions(language="en", max_new_tokens=12)
    audio = _audio(3, 7)
    expected = WhisperEngine.load(checkpoint, max_batch=2, window="full").transcribe(ASRRequest(audio, opts))
    engine = WhisperEngine.load(checkpoint, max_batch=2, window="auto")
    calls = []

    def loops_once(ratio: float, tokens: int, bound: int | None) -> bool:
        calls.append(tokens)
        return len(calls) == 1

    monkeypatch.setattr(engine_module, "repeating", loops_once)
    got = engine.transcribe(ASRRequest(audio, opts))
    assert len(calls) == 1  # the 30 s decode is not judged again
    assert got.tokens == expected.tokens and got.text == expected.text
    assert engine.cache.cross_k.shape[2] == 1500


def test_the_window_is_a_setting_with_a_clear_error_and_the_daemon_sizes_it_on_a_cpu_only(monkeypatch):
    from voiced.engines.whisper import options

    # (resolving for a GPU asks its kernels whether they run there: not here)
    monkeypatch.setattr(options, "gemv_supported", lambda *a: False)
    monkeypatch.setattr(options.decode_linear, "supported", lambda *a: False)
    c = Config()
    assert c.asr.window == "auto"
    dims = ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=2, n_audio_layer=1, n_vocab=51864,
                     n_text_ctx=448, n_text_state=64, n_text_head=2, n_text_layer=1)
    resolve = functools.partial(WhisperRuntime.resolve, dims, torch.float16)
    assert resolve("cpu", window="auto").clip_window and not resolve("cuda", window="auto").clip_window
    assert not resolve("cpu", window="full").clip_window
    c.asr.window = "wide"
    with pytest.raises(ConfigError, match="asr.window is 'wide'; use auto or full"):
        c.validate()
