"""GPU checks of BiCodec's wave-generator kernels (voiced/engines/spark/vocoder_kernels.py; skipped without
CUDA): each kernel gives the torch ops' bits in bf16 and float32, and a window decode through the kernels
gives the same audio bits as the modules, end-masked or not."""

from __future__ import annotations

import pytest
import torch

from voiced.engines.spark import vocoder_kernels as vk
from voiced.engines.spark.bicodec import Snake1d

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1536, 80 * 8), (4, 96, 176 * 320 + 3), (2, 384, 1000)])
def test_the_kernels_give_torch_s_bits(dtype, shape):
    """Activations from 1e-3 to 1e3, alphas from 0.01 to 30 (trained Snakes span about that), the lengths
    of the vocoder's windows and one that is no whole number of blocks; every variant of the Snake."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, c, t = shape
    m = Snake1d(c).to("cuda", dtype)

    def rand(*size, spread=6):
        return (torch.randn(*size, device="cuda", generator=g)
                * 10 ** (torch.rand(*size[:-1], 1, device="cuda", generator=g) * spread - spread / 2)).to(dtype)

    with torch.no_grad():
        m.alpha.copy_(10 ** (torch.rand(1, c, 1, device="cuda", generator=g) * 3.5 - 2))
        x, y, bias = rand(b, c, t), rand(b, c, t), rand(c)
        keep = torch.randint(0, t + 1, (b,), device="cuda", generator=g)
        inside = torch.arange(t, device="cuda")[None, None, :] < keep[:, None, None]
        biased = x + bias[:, None]
        h, s = vk.snake(x, m.alpha, m.inverse_alpha(), bias, keep, with_input=True)
        cases = {"plain": (vk.snake(x, m.alpha, m.inverse_alpha()), m(x)),
                 "bias": (vk.snake(x, m.alpha, m.inverse_alpha(), bias), m(biased)),
                 "masked": (s, torch.where(inside, m(biased), 0.0)), "residual stream": (h, biased),
                 "bias_residual": (vk.bias_residual(x, y, bias), x + (y + bias[:, None]))}
    for what, (got, want) in cases.items():
        assert got.dtype == dtype and got.shape == want.shape, what
        differ = (got != want).sum().item()
        assert differ == 0, (f"{what}: {differ} of {want.numel()} values differ, max |diff| "
                             f"{(got.float() - want.float()).abs().max():.3g}")


def test_a_vocoder_decode_through_the_kernels_gives_the_same_audio(tmp_path_factory, monkeypatch):
    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.engines.spark import streaming
    from voiced.engines.spark.bicodec import load_bicodec
    from voiced.engines.spark.checkpoint import resolve

    ckpt = resolve(str(cached_spark_checkpoint(tmp_path_factory)))
    codec = load_bicodec(ckpt.bicodec_dir, ckpt.root_config, "cuda", torch.bfloat16).requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, codec.config.codebook_size, (3, 96), device="cuda", generator=g)
    spk = torch.randn(3, codec.config.speaker_out_dim, device="cuda", generator=g).to(torch.bfloat16)
    assert vk.enabled()
    out = {}
    for on in ("0", "1"):  # the torch modules, the kernels
        monkeypatch.setattr(vk, "enabled", lambda on=on: on == "1")
        with torch.no_grad():
            out[on] = (streaming.decode_windows(codec, ids, spk, [96, 96, 90]).clone(),
                       streaming.decode_windows(codec, ids, spk, [96] * 3).clone())
    for modules, kernels in zip(out["0"], out["1"]):
        assert torch.equal(modules, kernels), (modules.float() - kernels.float()).abs().max()
