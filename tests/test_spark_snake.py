"""BiCodec's fused Snake kernel (voiced/engines/spark/snake.py) on the CPU, under Triton's interpreter
(TRITON_INTERPRET=1, in a child process: the variable is read when the kernel is defined), in float32
against the torch arithmetic it replaces: one Snake over shapes whose length is not a whole number of
the kernel's blocks, with a different alpha per channel, and a whole BiCodec window decode with every
Snake through the kernel. The bits in bf16 are checked on a GPU (tests/test_spark_snake_gpu.py): the
interpreter has no libdevice and rounds bf16 its own way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from voiced.engines.spark import snake
from voiced.engines.spark.bicodec import Snake1d


def _child() -> dict:
    """Run in the child: the worst difference of each check, as JSON."""
    import tempfile
    from pathlib import Path

    from tests.spark_fixtures import BICODEC_YAML, ROOT_YAML
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig

    out: dict = {"snake": []}
    torch.manual_seed(0)
    for b, c, t in ((1, 3, 5), (2, 6, snake.BLOCK + 77), (3, 4, 3 * snake.BLOCK)):
        m = Snake1d(c)
        with torch.no_grad():
            m.alpha.copy_(torch.rand(1, c, 1) * 3 + 0.05)
        x = torch.randn(b, c, t) * 4
        want = x + m.inverse_alpha() * torch.sin(m.alpha * x).pow(2)
        got = snake.snake(x, m.alpha.detach(), m.inverse_alpha())
        out["snake"].append({"shape": [b, c, t], "diff": (got - want).abs().max().item(),
                             "scale": want.abs().max().item()})
    with tempfile.TemporaryDirectory() as tmp:  # the test checkpoint's BiCodec config
        (Path(tmp) / "bicodec.yaml").write_text(BICODEC_YAML.format(w2v=16, latent=32))
        (Path(tmp) / "root.yaml").write_text(ROOT_YAML)
        codec = BiCodec(BiCodecConfig.from_yaml(Path(tmp) / "bicodec.yaml", Path(tmp) / "root.yaml")).eval()
    for m in codec.modules():
        if isinstance(m, Snake1d):
            with torch.no_grad():
                m.alpha.uniform_(0.5, 1.5)
    ids = torch.randint(0, codec.config.codebook_size, (2, 24))
    spk = torch.randn(2, codec.config.speaker_out_dim)
    with torch.no_grad():
        want = codec.decode(ids, spk)
        for m in codec.modules():  # the CPU path never takes the kernel: route every Snake through it here
            if isinstance(m, Snake1d):
                m.forward = lambda x, m=m: snake.snake(x, m.alpha, m.inverse_alpha())
        got = codec.decode(ids, spk)
    out["decode"] = {"diff": (got - want).abs().max().item(), "scale": want.abs().max().item()}
    return out


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tests.test_spark_snake"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_equals_the_torch_snake_in_float32(interpreted):
    for case in interpreted["snake"]:
        assert case["diff"] <= 2e-6 * max(1.0, case["scale"]), case


def test_a_decode_through_the_kernel_equals_the_torch_decode(interpreted):
    d = interpreted["decode"]
    assert d["diff"] <= 1e-5 * max(1.0, d["scale"]), d


def test_the_cpu_never_takes_the_kernel(monkeypatch):
    """Even with the kernel asked for, a CPU tensor runs the torch arithmetic (Triton compiles for GPUs)."""
    monkeypatch.setenv("VOICED_SPARK_FUSED_SNAKE", "1")
    called = []
    monkeypatch.setattr(snake, "snake", lambda *a: called.append(a))
    m = Snake1d(4)
    x = torch.randn(1, 4, 10)
    assert torch.equal(m(x), x + m.inverse_alpha() * torch.sin(m.alpha * x).pow(2)) and not called


def test_the_memory_plan_sees_one_output_per_fused_snake(monkeypatch):
    """On the meta device (the memory plan's vocoder rows) a fused Snake allocates only its output, as the
    kernel does, so the plan follows the setting."""
    from voiced.memory_plan import peak_live_bytes

    m = Snake1d(8).to("meta")
    x = torch.empty(4, 8, 1000, device="meta")
    m.inverse_alpha()  # made once and kept, as before any captured decode
    peaks = {}
    for on in ("1", "0"):
        monkeypatch.setenv("VOICED_SPARK_FUSED_SNAKE", on)
        peaks[on] = peak_live_bytes(lambda: m(x))
    assert peaks["1"] == x.numel() * 4 < peaks["0"], peaks


if __name__ == "__main__":
    print(json.dumps(_child()))
