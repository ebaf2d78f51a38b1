"""The Spark LM's fused decode attention (voiced/engines/spark/decode_attention.py) on the CPU.

The Triton kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
variable is read when the kernels are defined), in float32, against the torch arithmetic it replaces:
the attention output, the cache entries it writes, and a whole decode step of a small LM through the
GPU path against the modules' step. bf16 is checked on a GPU (tests/test_spark_attention_gpu.py): the
interpreter's bf16 matrix products are not IEEE-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from voiced.engines.spark.decode_attention import BLOCK_N, split_plan

H, KV, D = 14, 2, 64  # Spark-TTS-0.5B's layout: 14 query heads over 2 KV heads of 64


@pytest.mark.parametrize("batch", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("kv_len", [256, 1024, 4096])
def test_split_plan_covers_the_cache_in_whole_blocks(batch, kv_len):
    per, n = split_plan(batch, KV, kv_len, sms=132)
    assert per % BLOCK_N == 0 and per * n >= kv_len > per * (n - 1)
    if batch * KV >= 2 * 132:
        assert n == 1  # enough programs already: no split, no combine kernel
    else:
        assert batch * KV * n >= min(2 * 132, batch * KV * kv_len // BLOCK_N) / 2


def _child() -> dict:
    """Run in the child (TRITON_INTERPRET=1): every check's worst difference, as JSON."""
    from voiced.engines.spark import decode_attention as da
    from voiced.engines.spark.qwen2 import (
        Qwen2Config,
        Qwen2LM,
        _rms,
        decode_mask,
        layer_decode,
        layer_decode_tail,
        rope_tables,
    )

    out: dict = {"kernel": []}
    cos_t, sin_t = rope_tables(Qwen2Config(), 1024)
    g = torch.Generator().manual_seed(0)
    # (rows, kv_len, multiprocessors to fill): one program per (row, KV head), and split spans
    for b, kv_len, sms, pos in [(1, 256, 1, [255]), (3, 512, 1, [0, 200, 511]), (2, 512, 4, [255, 256]),
                                (1, 1024, 132, [700]), (4, 256, 132, [0, 63, 64, 129])]:
        kc, vc = torch.randn(4, KV, 1024, D, generator=g), torch.randn(4, KV, 1024, D, generator=g)
        qkv = torch.randn(b, (H + 2 * KV) * D, generator=g)
        positions = torch.tensor(pos)
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        cos, sin = cos_t[positions][:, None, None], sin_t[positions][:, None, None]
        ref = da.reference(qkv[:, None], cos, sin, decode_mask(positions, kv_len), k1, v1, torch.arange(b),
                           positions, (H, KV, D))[:, 0]
        got = da.triton_attention(qkv, cos_t, sin_t, k2, v2, positions, kv_len, (H, KV, D), sms=sms)
        out["kernel"].append({"case": [b, kv_len, sms], "splits": da.split_plan(b, KV, kv_len, sms)[1],
                              "out": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
                              "k_cache": (k1 - k2).abs().max().item(), "v_cache": (v1 - v2).abs().max().item()})
    # a whole decode step through the GPU path's structure (qkv GEMM, the kernel, the layer's tail with
    # the next norm) against the modules, over several steps of a growing cache
    torch.manual_seed(1)
    lm = Qwen2LM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)).eval()
    prompt = torch.randint(0, 512, (40,), generator=g)
    logits = []
    for fast in (False, True):
        lm.setup_cache(max_batch=2, max_seq=256)
        lm.prefill(prompt, 0)
        lm.prefill(prompt[:17], 1)
        if fast:
            lm.fuse_projections()
            lm._layer_fn, lm._rms_fn, lm._tail_fn = layer_decode, _rms, layer_decode_tail  # compile_decode on a GPU, uncompiled
        tokens, positions, steps = torch.tensor([5, 9]), torch.tensor([40, 17]), []
        for _ in range(6):
            steps.append(lm.decode(tokens, positions, use_graph=False))
            tokens, positions = steps[-1].argmax(-1), positions + 1
        logits.append(torch.stack(steps))
    out["step"] = {"logits": (logits[0] - logits[1]).abs().max().item(), "scale": logits[0].abs().max().item(),
                   "argmax_equal": bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))}
    return out


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tests.test_spark_attention"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_equals_the_torch_arithmetic_in_float32(interpreted):
    """Attention output within float32 rounding of the torch path, for one program per (row, KV head) and
    for spans split across programs (combined after), new positions at span edges; the caches get the
    same roped keys and values."""
    for case in interpreted["kernel"]:
        assert case["out"] <= 1e-5 * max(1.0, case["scale"]), case
        assert case["k_cache"] <= 1e-6 and case["v_cache"] == 0, case
    assert {c["splits"] > 1 for c in interpreted["kernel"]} == {True, False}


def test_decode_step_through_the_kernel_equals_the_modules(interpreted):
    """Six decode steps of a small LM (two rows at different positions) through the GPU path's
    structure give the modules' logits within float32 rounding, and the same greedy tokens."""
    step = interpreted["step"]
    assert step["logits"] <= 1e-4 * max(1.0, step["scale"]), step
    assert step["argmax_equal"], step


if __name__ == "__main__":
    print(json.dumps(_child()))
