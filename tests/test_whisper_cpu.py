"""The CPU arrangements (voiced/engines/whisper/cpu.py): the column-major output projection, the
few-row logits path, and the opt-in int8 mode."""

from __future__ import annotations

import json

import pytest
import torch

from tests.whisper_fixtures import make_openai_checkpoint, speech
from voiced.cli import main as voiced_main
from voiced.engines.base import ASROptions, ASRRequest, EngineError
from voiced.engines.whisper.cpu import OutlierRowsLinear, int8_available
from voiced.engines.whisper.engine import WhisperEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_openai_checkpoint(tmp_path_factory.mktemp("ckpt"), multilingual=False, seed=4, eot_boost=3.0)


def test_the_cpu_layout_changes_no_value(ckpt):
    from tests.whisper_fixtures import openai_reference_model

    engine = WhisperEngine.load(ckpt)
    dec = engine.model.decoder
    w = dec.token_embedding.weight
    assert w.stride() == (1, w.shape[0])  # stored transposed
    assert torch.equal(w, openai_reference_model(ckpt).decoder.token_embedding.weight)
    x = torch.randn(3, 5, w.shape[1])
    with torch.inference_mode():
        want = dec.ln(x) @ w.contiguous().T
        for rows in (x[:1, :1], x[:1, :2], x[:1], x):  # one row (GEMV), a few (one per row), many (GEMM)
            got = dec._logits(rows)
            assert got.shape == (*rows.shape[:-1], w.shape[0])
            torch.testing.assert_close(got, want[: rows.shape[0], : rows.shape[1]], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_available(), reason="no x86/fbgemm quantized kernels in this torch")
def test_int8_quantizes_the_many_row_products_and_still_transcribes(ckpt, tmp_path, capsys):
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    f32 = WhisperEngine.load(ckpt)
    q = WhisperEngine.load(ckpt, dtype="int8")
    assert q.int8 and not f32.int8 and q.decoder_path == "fused"
    m = q.model
    assert all(isinstance(b.attn.query, QLinear) and isinstance(b.mlp[0], QLinear) for b in m.encoder.blocks)
    assert all(isinstance(b.cross_attn.key, QLinear) and isinstance(b.cross_attn.value, QLinear)
               for b in m.decoder.blocks)
    assert isinstance(m.decoder.output_projection, QLinear)
    assert all(isinstance(b.mlp[2], OutlierRowsLinear) for b in m.encoder.blocks)
    # the per-token decoder layers stay float32 (one row: int8 would be slower)
    assert all(isinstance(b.attn.query, torch.nn.Linear) and isinstance(b.mlp[0], torch.nn.Linear)
               for b in m.decoder.blocks)
    audio = speech("Hello world. This is a test of the speech recognizer.", tmp_path)
    # approximate, not arbitrary: encoder features and logits near float32's (~13 % and ~1.6 % apart
    # on the real tiny.en; `voiced eval` measures what that costs in WER)
    from voiced.engines.whisper.audio import window_features

    mel = window_features(audio, 80)[None]
    h = torch.randn(2, f32.dims.n_text_state)
    with torch.inference_mode():
        x, y = f32.model.encoder(mel), m.encoder(mel)
        l32, l8 = f32.model.decoder._logits(h), m.decoder._logits(h)
    assert 0 < ((x - y).norm() / x.norm()).item() < 0.3
    assert 0 < ((l32 - l8).norm() / l32.norm()).item() < 0.05
    from voiced_client.wavio import write_wav

    from voiced.audio.wavfile import load_16k

    wav = tmp_path / "a.wav"
    write_wav(wav, audio, 16000)
    b = q.transcribe(ASRRequest(load_16k(wav), ASROptions(language="en", max_new_tokens=30, word_timestamps=True)))
    assert len(b.tokens) > 0 and len(b.words) > 0
    assert voiced_main(["transcribe", str(wav), "--model", str(ckpt), "--dtype", "int8", "--max-new-tokens", "30",
                        "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == b.tokens


def test_int8_is_refused_off_the_cpu(ckpt):
    with pytest.raises(EngineError, match="int8 is a CPU mode"):
        WhisperEngine.load(ckpt, device="cuda", dtype="int8")
    with pytest.raises(EngineError, match="unknown dtype 'int4'"):
        WhisperEngine.load(ckpt, dtype="int4")


@pytest.mark.skipif(not int8_available(), reason="no x86/fbgemm quantized kernels in this torch")
def test_outlier_rows_keep_their_own_precision_and_spoil_no_other_row():
    # GELU-like activations whose last rows are ~100x the rest, as at the end of Whisper's window
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(256, 64)
    x = torch.nn.functional.gelu(torch.randn(300, 256, generator=g))
    x[-20:] *= 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear: per_channel_dynamic_qconfig})[0]
    split = OutlierRowsLinear(q)
    with torch.inference_mode():
        want = lin(x)
        err = lambda y: ((y - want)[:-20].norm() / want[:-20].norm()).item()  # noqa: E731
        whole, ours = err(q(x)), err(split(x))
        assert ours < 0.02 < whole  # one scale for all: the ordinary rows lose their resolution
        top = split(x)[-20:]  # outliers: float32 activations against the (int8) weights
        assert ((top - want[-20:]).norm() / want[-20:].norm()).item() < 0.02
        torch.testing.assert_close(split(x[:5]), q(x[:5]))  # no outliers: the int8 product as is
