"""GPU checks of BiCodec's fused Snake kernel (voiced/engines/spark/snake.py; skipped without CUDA): the
kernel gives torch's Snake bit for bit in bf16 and float32, and a vocoder window decode with every Snake
fused gives the same audio bits as the torch Snakes, end-masked or not."""

from __future__ import annotations

import pytest
import torch

from voiced.engines.spark import snake
from voiced.engines.spark.bicodec import Snake1d

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def torch_snake(m: Snake1d, x: torch.Tensor) -> torch.Tensor:
    return x + m.inverse_alpha() * torch.sin(m.alpha * x).pow(2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1536, 80 * 8), (4, 96, 176 * 320 + 3), (2, 384, 1000)])
def test_the_kernel_gives_torch_s_bits(dtype, shape):
    """Activations from 1e-3 to 1e3, alphas from 0.01 to 30 (trained Snakes span about that), the lengths
    of the vocoder's windows and one that is no whole number of blocks."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, c, t = shape
    m = Snake1d(c).to("cuda", dtype)
    with torch.no_grad():
        m.alpha.copy_(10 ** (torch.rand(1, c, 1, device="cuda", generator=g) * 3.5 - 2))
        x = (torch.randn(b, c, t, device="cuda", generator=g) * 10 ** (torch.rand(b, c, 1, device="cuda", generator=g)
                                                                      * 6 - 3)).to(dtype)
        want = torch_snake(m, x)
        got = snake.snake(x, m.alpha, m.inverse_alpha())
    assert got.dtype == dtype and got.shape == x.shape
    differ = (got != want).sum().item()
    assert differ == 0, f"{differ} of {x.numel()} values differ, max |diff| {(got.float() - want.float()).abs().max():.3g}"


def test_a_vocoder_decode_with_the_kernel_gives_the_same_audio(tmp_path_factory, monkeypatch):
    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.engines.spark import streaming
    from voiced.engines.spark.bicodec import load_bicodec
    from voiced.engines.spark.checkpoint import resolve

    ckpt = resolve(str(cached_spark_checkpoint(tmp_path_factory)))
    codec = load_bicodec(ckpt.bicodec_dir, ckpt.root_config, "cuda", torch.bfloat16).requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, codec.config.codebook_size, (3, 96), device="cuda", generator=g)
    spk = torch.randn(3, codec.config.speaker_out_dim, device="cuda", generator=g).to(torch.bfloat16)
    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv("VOICED_SPARK_FUSED_SNAKE", on)
        with torch.no_grad():
            out[on] = (streaming.decode_windows(codec, ids, spk, [96, 96, 90]).clone(),
                       streaming.decode_windows(codec, ids, spk, [96] * 3).clone())
    for torch_audio, fused_audio in zip(out["0"], out["1"]):
        assert torch.equal(torch_audio, fused_audio), (torch_audio.float() - fused_audio.float()).abs().max()
