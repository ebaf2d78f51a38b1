"""The opt-in ASR dtype float8 (voiced/engines/whisper/float8.py) on the CPU, where it is emulated: the
quantization's scales, what per-row scales buy, the engine's wiring, its refusal where it cannot run, and the
memory it adds to the plan. Its words on real speech: tests/test_whisper_real.py; the tensor cores' products
against the emulation: tests/test_whisper_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.whisper_fixtures import make_openai_checkpoint, speech
from voiced.cli import main as voiced_main
from voiced.engines.base import ASROptions, ASRRequest, EngineError
from voiced.engines.whisper import float8
from voiced.engines.whisper.engine import WhisperEngine, memory_need


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_openai_checkpoint(tmp_path_factory.mktemp("ckpt"), multilingual=False, seed=4, eot_boost=3.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_each_row_is_scaled_to_the_e4m3_range_and_rounds_within_its_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows six decades apart
    x[5] = 0.0
    q, scale = float8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (64, 1)
    back = q.float() * scale
    top = q.float().abs().amax(dim=1)
    assert torch.equal(top[torch.arange(64) != 5], torch.full((63,), 448.0))  # every row uses the whole range
    assert torch.equal(back[5], torch.zeros(256)) and torch.isfinite(scale).all()  # a silent row stays zero
    # e4m3 keeps 3 mantissa bits: a value at least 2**-6 of its row's largest rounds within 2**-4 of itself
    big = x.abs() >= x.abs().amax(dim=1, keepdim=True) * 2**-6
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-30)[big].all()


def test_the_product_is_close_to_the_float_product_and_a_loud_row_spoils_no_other():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 512, generator=g) / 512**0.5, torch.randn(96, generator=g)
    x = F.gelu(torch.randn(300, 512, generator=g))
    wq = float8.quantize_weight(w)
    assert wq[0].shape == (96, 512) and wq[1].shape == (1, 96)
    quiet = rel(float8.emulated_linear(x, wq, b)[:-20], F.linear(x, w, b)[:-20])
    assert 0 < quiet < 0.05  # approximate (three mantissa bits), not arbitrary
    x[-20:] *= 1e5  # a few loud positions, as at the end of a Whisper window (there ~1e3)
    y, want = float8.emulated_linear(x, wq, b), F.linear(x, w, b)
    assert rel(y[:-20], want[:-20]) == pytest.approx(quiet, rel=1e-6)  # scales are per row: the rest untouched
    assert rel(y[-20:], want[-20:]) < 0.05
    # one scale for the whole tensor, for contrast: five decades below the loudest, the quiet rows fall under
    # e4m3's smallest numbers
    s = x.abs().amax() / float8.E4M3_MAX
    whole = ((x / s).to(torch.float8_e4m3fn).float() * s) @ (wq[0].float() * wq[1].T).T + b
    assert rel(whole[:-20], want[:-20]) > 5 * quiet
    # batched input keeps its leading dimensions
    torch.testing.assert_close(float8.emulated_linear(x.view(3, 100, 512), wq, None), (y - b).view(3, 100, 96))


def test_float8_runs_the_encoder_products_quantized_and_transcribes(ckpt, tmp_path, capsys):
    f32 = WhisperEngine.load(ckpt)
    f8 = WhisperEngine.load(ckpt, dtype="float8")
    assert f32.fast_encoder is None and not f32.fp8_encoder
    assert f8.fp8_encoder and f8.fast_encoder.fp8 and f8.dtype == torch.float32  # emulated on the CPU
    qkv = f8.fast_encoder.layers[0][2]
    assert isinstance(qkv, tuple) and qkv[0].dtype == torch.float8_e4m3fn
    from voiced.engines.whisper.audio import N_SAMPLES, pad_or_trim

    audio = speech("Hello world. This is a test of the speech recognizer.", tmp_path)
    x = pad_or_trim(torch.from_numpy(audio))[None]
    assert x.shape == (1, N_SAMPLES)
    with torch.inference_mode():
        from voiced.engines.whisper.audio import log_mel_spectrogram

        want = f32.model.encoder(log_mel_spectrogram(x, f32.dims.n_mels))
        got = f8.fast_encoder(x, torch.float32)
    assert 0 < rel(got, want) < 0.5  # approximate features (random weights compound it; the real tiny.en: ~6 %)
    from voiced_client.wavio import write_wav

    from voiced.audio.wavfile import load_16k

    wav = tmp_path / "a.wav"
    write_wav(wav, audio, 16000)
    r = f8.transcribe(ASRRequest(load_16k(wav), ASROptions(language="en", max_new_tokens=20)))
    assert len(r.tokens) > 0
    assert voiced_main(["transcribe", str(wav), "--model", str(ckpt), "--dtype", "float8", "--max-new-tokens", "20",
                        "--language", "en", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == r.tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU this machine has not")
def test_float8_on_a_missing_gpu_is_refused_with_what_to_do(ckpt):
    with pytest.raises(EngineError, match="torch sees no CUDA GPU"):
        WhisperEngine.load(ckpt, device="cuda", dtype="float8")
    with pytest.raises(EngineError, match="float8 \\(GPU\\)"):
        WhisperEngine.load(ckpt, dtype="float4")


def test_the_memory_plan_counts_the_quantized_weights(ckpt):
    e = WhisperEngine.load(ckpt)
    kw = dict(cuda=True, max_encoder_batch=4)
    plain = memory_need(e.dims, torch.float16, 1000, 8, **kw)
    fp8 = memory_need(e.dims, torch.float16, 1000, 8, fp8_encoder=True, **kw)
    added = [n for n in fp8.items if n.what not in {m.what for m in plain.items}]
    f8 = WhisperEngine.load(ckpt, dtype="float8")
    held = sum(t.numel() * t.element_size() for layer in f8.fast_encoder.layers for p in layer
               if isinstance(p, tuple) for t in p)
    assert len(added) == 1 and added[0].bytes == held > 0
