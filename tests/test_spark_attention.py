"""The Spark LM's fused decode attention (voiced/engines/kernels/decode_attention.py) and projections
(decode_linear.py) on the CPU.

The Triton kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
variable is read when the kernels are defined), in float32, against the torch arithmetic it replaces:
the attention output, the cache entries it writes, and a whole decode step of a small LM through the
GPU path against the modules' step. bf16 is checked on a GPU (tests/test_spark_attention_gpu.py): the
interpreter's bf16 matrix products are not IEEE-exact.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.triton_interpreter import run_interpreted
from voiced.engines.kernels.decode_attention import BLOCK_N, split_plan

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
    from voiced.engines.kernels import decode_attention as da
    from voiced.engines.spark.qwen2 import (
        Qwen2Config,
        decode_mask,
        embed_norm,
        layer_decode,
        layer_decode_tail,
        rope_tables,
    )
    from voiced.engines.spark.served_lm import ServedLM

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
    # the projections' GEMV kernels (decode_linear) against their torch arithmetic: rows padded to a
    # 16-row tile and past it, outputs and K not multiples of the tiles, K split over programs
    from voiced.engines.kernels import decode_linear as dl

    out["linear"] = []
    for m in (1, 3, 17, 40):
        x = torch.randn(m, 320, generator=g)
        w, bias = torch.randn(90, 320, generator=g), torch.randn(90, generator=g)
        w_gu = torch.randn(2 * 72, 320, generator=g)
        resid, ln = torch.randn(m, 90, generator=g), torch.rand(90, generator=g) + 0.5
        ref_x, ref_h = dl.reference_add_norm(resid, dl.reference_linear(x, w), ln, 1e-6)
        ref_lin, ref_glu = dl.reference_linear(x, w, bias), dl.reference_swiglu_linear(x, w_gu)
        # differences relative to the largest value (float32 accumulation order)
        row = {"m": m, "linear": ((dl.linear(x, w, bias) - ref_lin).abs().max() / ref_lin.abs().max()).item(),
               "swiglu": ((dl.swiglu_linear(x, w_gu) - ref_glu).abs().max() / ref_glu.abs().max()).item()}
        for sms in (1, 8):
            parts = dl.linear_partials(x, w, sms=sms)
            got_x = resid.clone()
            got_h = dl.add_norm(parts, got_x, ln, 1e-6)
            row[f"splits_{sms}"] = parts.shape[0]
            row[f"add_norm_x_{sms}"] = ((got_x - ref_x).abs().max() / ref_x.abs().max()).item()
            row[f"add_norm_h_{sms}"] = ((got_h - ref_h).abs().max() / ref_h.abs().max()).item()
        out["linear"].append(row)
    # a whole decode step through the GPU path's structure (qkv GEMM, the kernel, the layer's tail with
    # the next norm) against the modules, over several steps of a growing cache
    torch.manual_seed(1)
    lm = ServedLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)).eval()
    prompt = torch.randint(0, 512, (40,), generator=g)
    logits = []
    for fast, gemv in ((False, False), (True, False), (True, True)):
        lm.setup_cache(max_batch=2, max_seq=256)
        lm.prefill(prompt, 0)
        lm.prefill(prompt[:17], 1)
        if fast:
            lm.fuse_projections()
            lm._layer_fn, lm._embed_fn, lm._tail_fn = layer_decode, embed_norm, layer_decode_tail  # compile_decode on a GPU, uncompiled
            lm._gemv = gemv
        tokens, positions, steps = torch.tensor([5, 9]), torch.tensor([40, 17]), []
        for _ in range(6):
            steps.append(lm.decode(tokens, positions, use_graph=False))
            tokens, positions = steps[-1].argmax(-1), positions + 1
        logits.append(torch.stack(steps))
    out["step"] = {"logits": (logits[0] - logits[1]).abs().max().item(), "scale": logits[0].abs().max().item(),
                   "argmax_equal": bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))}
    out["step_gemv"] = {"logits": (logits[0] - logits[2]).abs().max().item(), "scale": logits[0].abs().max().item(),
                        "argmax_equal": bool(torch.equal(logits[0].argmax(-1), logits[2].argmax(-1)))}
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_spark_attention", timeout=900)


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
    structure give the modules' logits within float32 rounding, and the same greedy tokens; also with
    every projection through the GEMV kernels."""
    for key in ("step", "step_gemv"):
        step = interpreted[key]
        assert step["logits"] <= 1e-4 * max(1.0, step["scale"]), (key, step)
        assert step["argmax_equal"], (key, step)


def test_gemv_kernels_equal_the_torch_arithmetic_in_float32(interpreted):
    """The projections' kernels: q/k/v with bias, gate/up with SiLU * up, and a K-split product whose
    partial sums are reduced with the residual add and the RMS norm, for 1 to 40 rows (one 16-row tile
    and more), within float32 rounding of torch; with K split over several programs too."""
    for row in interpreted["linear"]:
        for key, value in row.items():
            if key.startswith(("linear", "swiglu", "add_norm")):
                assert value <= 1e-5, (key, row)
        assert row["splits_1"] == 1 and row["splits_8"] > 1, row


if __name__ == "__main__":
    print(json.dumps(_child()))


def test_programmatic_launch_is_never_asked_for_off_an_nvidia_gpu():
    """The CPU path (and Triton's interpreter, which runs these kernels here) never gets the launch
    option or the kernels' wait instruction."""
    from voiced.engines.kernels import decode_attention as da

    assert da.launch_overlap(torch.zeros(2)) is False
    assert da.overlap_args(torch.zeros(2)) == {"PDL": False}  # no launch option either


def test_the_engine_imports_where_triton_is_not_installed():
    """The run-only install (`make run`) has CPU torch and no Triton: the Spark engine and its kernel
    modules must import there and take the torch path (a Triton-only name imported at module level
    once stopped `voiced serve` from loading the TTS)."""
    code = (
        "import importlib.abc, sys\n"
        "class NoTriton(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton in this install')\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import torch\n"
        "from voiced.engines.kernels import decode_attention, decode_linear\n"
        "from voiced.engines.spark import engine, qwen2\n"
        "assert decode_attention.triton is None\n"
        "assert not decode_linear.supported(torch.bfloat16, 'cpu')\n"
        "assert decode_attention.launch_overlap(torch.zeros(1)) is False\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
