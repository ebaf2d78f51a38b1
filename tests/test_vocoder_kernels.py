"""BiCodec's wave-generator kernels (voiced/engines/spark/vocoder_kernels.py) on the CPU, under Triton's
interpreter (TRITON_INTERPRET=1, in a child process: the variable is read when the kernels are defined),
in float32 against the torch arithmetic they replace: a Snake with and without the previous conv's bias,
the next conv's end mask and the residual stream written; the residual add; and a whole end-masked window
decode through `WaveGenerator.forward_kernels` against the modules with streaming's hooks. The bits in
bf16 are checked on a GPU (tests/test_vocoder_kernels_gpu.py): the interpreter has no libdevice and
rounds bf16 its own way.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.triton_interpreter import run_interpreted
from voiced.engines.spark import vocoder_kernels as vk
from voiced.engines.spark.bicodec import Snake1d


def tiny_codec():
    """The test checkpoint's BiCodec (random weights, Snake frequencies around 1)."""
    import tempfile
    from pathlib import Path

    from tests.spark_fixtures import BICODEC_YAML, ROOT_YAML
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bicodec.yaml").write_text(BICODEC_YAML.format(w2v=16, latent=32))
        (Path(tmp) / "root.yaml").write_text(ROOT_YAML)
        codec = BiCodec(BiCodecConfig.from_yaml(Path(tmp) / "bicodec.yaml", Path(tmp) / "root.yaml")).eval()
    with torch.no_grad():
        for m in codec.modules():
            if isinstance(m, Snake1d):
                m.alpha.uniform_(0.5, 1.5)
    return codec.requires_grad_(False)


def _child() -> dict:
    """Run in the child: the worst difference of each check, as JSON."""
    from voiced.engines.spark import streaming

    out: dict = {"snake": []}
    torch.manual_seed(0)
    for b, c, t in ((1, 3, 5), (2, 6, vk.BLOCK + 77), (3, 4, 3 * vk.BLOCK)):
        m = Snake1d(c)
        with torch.no_grad():
            m.alpha.copy_(torch.rand(1, c, 1) * 3 + 0.05)
        x, bias = torch.randn(b, c, t) * 4, torch.randn(c)
        keep = torch.randint(0, t + 1, (b,))
        masked = torch.arange(t)[None, None, :] < keep[:, None, None]
        want = m(x + bias[:, None])
        got = {"plain": (vk.snake(x, m.alpha.detach(), m.inverse_alpha()), m(x)),
               "bias": (vk.snake(x, m.alpha.detach(), m.inverse_alpha(), bias), want),
               "masked": (vk.snake(x, m.alpha.detach(), m.inverse_alpha(), bias, keep), torch.where(masked, want, 0.0))}
        h, s = vk.snake(x, m.alpha.detach(), m.inverse_alpha(), bias, keep, with_input=True)
        got["with_input"] = (torch.cat([h, s]), torch.cat([x + bias[:, None], torch.where(masked, want, 0.0)]))
        y = torch.randn(b, c, t)
        got["bias_residual"] = (vk.bias_residual(x, y, bias), x + (y + bias[:, None]))
        for what, (a, ref) in got.items():
            out["snake"].append({"what": what, "shape": [b, c, t], "diff": (a - ref).abs().max().item(),
                                 "scale": ref.abs().max().item()})
    codec = tiny_codec()
    ids = torch.randint(0, codec.config.codebook_size, (2, 24))
    spk = torch.randn(2, codec.config.speaker_out_dim)
    out["decode"] = []
    for valid in ([24, 24], [24, 17]):
        want = streaming.decode_windows(codec, ids, spk, valid)  # the modules, end-masked by the hooks
        codec.decoder.forward = lambda x, ends=None: codec.decoder.forward_kernels(x, ends)  # the CPU never would
        try:
            got = streaming.decode_windows(codec, ids, spk, valid)
        finally:
            del codec.decoder.forward
        out["decode"].append({"valid": valid, "diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                              "tail": got[1, 17 * 320:].abs().max().item() if valid[1] < 24 else None})
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_vocoder_kernels", timeout=600)


def test_kernels_equal_the_torch_arithmetic_in_float32(interpreted):
    for case in interpreted["snake"]:
        assert case["diff"] <= 2e-6 * max(1.0, case["scale"]), case
    assert {c["what"] for c in interpreted["snake"]} == {"plain", "bias", "masked", "with_input", "bias_residual"}


def test_an_end_masked_window_through_the_kernels_equals_the_modules(interpreted):
    for case in interpreted["decode"]:
        assert case["diff"] <= 1e-5 * max(1.0, case["scale"]), case


def test_the_cpu_never_takes_the_kernels(monkeypatch):
    """Even where Triton is installed, CPU activations run the modules (Triton compiles for GPUs)."""
    monkeypatch.setattr(vk, "enabled", lambda: True)
    codec = tiny_codec()
    monkeypatch.setattr(type(codec.decoder), "forward_kernels", lambda *a: pytest.fail("took the kernels on the CPU"))
    x = torch.randn(1, codec.config.latent_dim, 6)
    assert torch.equal(codec.decoder(x), codec.decoder.model(x))


def test_the_memory_plan_follows_the_kernels(monkeypatch):
    """On the meta device (the memory plan's vocoder rows) the kernels' path allocates what the kernels
    do (fewer intermediates alive at once than the modules' ops), so the plan follows the path that runs."""
    from voiced.memory_plan import peak_live_bytes

    codec = tiny_codec().to("meta")
    for m in codec.modules():
        if isinstance(m, Snake1d):
            m.inverse_alpha()  # made once and kept, as before any captured decode
    x = torch.empty(4, codec.config.latent_dim, 64, device="meta")
    peaks = {}
    for on in ("1", "0"):
        monkeypatch.setattr(vk, "enabled", lambda on=on: on == "1")
        peaks[on] = peak_live_bytes(lambda: codec.decoder(x))
    assert peaks["1"] < peaks["0"], peaks


if __name__ == "__main__":
    print(json.dumps(_child()))
