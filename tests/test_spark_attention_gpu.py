"""GPU checks of the Spark LM's fused decode attention (voiced/engines/kernels/decode_attention.py) and
its projections' GEMV kernels (decode_linear.py):
the Triton kernel against the torch arithmetic it replaces, at Spark-TTS-0.5B's head layout (14 query
heads over 2 KV heads of 64) in bf16 and float32, and a compiled, graphed LM with the kernel against
the modules' eager steps in float32 (the engine checkpoint of test_spark_gpu.py has heads of 8, which
the kernel does not take, so its engine tests run the torch attention)."""

from __future__ import annotations

import pytest
import torch

from voiced.engines.kernels import decode_attention as da
from voiced.engines.kernels import decode_linear as dl
from voiced.engines.spark.qwen2 import Qwen2Config, decode_mask, rope_tables
from voiced.engines.spark.served_lm import ServedLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(da.triton is None, reason="needs Triton")]

H, KV, D = 14, 2, 64
MAX_SEQ = 2048


def attend(dtype, b: int, kv_len: int, positions: list[int], seed: int):
    """(kernel output, torch output in `dtype`, torch output in float64 from the same inputs, caches)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cos_t, sin_t = rope_tables(Qwen2Config(), MAX_SEQ, "cuda")
    kc = torch.randn(64, KV, MAX_SEQ, D, device="cuda", generator=g).to(dtype)
    vc = torch.randn(64, KV, MAX_SEQ, D, device="cuda", generator=g).to(dtype)
    qkv = torch.randn(b, (H + 2 * KV) * D, device="cuda", generator=g).to(dtype)
    pos = torch.tensor(positions, device="cuda")
    caches = {}
    outs = {}
    for name, dt in (("kernel", dtype), ("torch", dtype), ("f64", torch.float64)):
        k, v = kc.to(dt), vc.to(dt)
        if name == "kernel":
            o = torch.full((b, H * D), float("nan"), device="cuda", dtype=dt)  # poisoned: every value written?
            da.triton_attention(qkv, cos_t, sin_t, k, v, pos, kv_len, (H, KV, D), out=o)
        else:
            cos, sin = cos_t[pos].to(dtype)[:, None, None], sin_t[pos].to(dtype)[:, None, None]
            o = da.reference(qkv.to(dt)[:, None], cos.to(dt), sin.to(dt), decode_mask(pos, kv_len), k, v,
                             torch.arange(b, device="cuda"), pos, (H, KV, D))[:, 0]
        outs[name], caches[name] = o.double(), (k.double(), v.double())
    return outs, caches


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = [(1, 256, [255]), (1, 1024, [700]), (1, 2048, [2047]), (3, 512, [0, 257, 511]), (16, 1024, None),
         (64, 2048, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,kv_len,positions", CASES)
def test_kernel_equals_the_torch_arithmetic(dtype, b, kv_len, positions):
    """Against the float64 arithmetic of the same inputs, the kernel errs no more than torch's own path
    in the same dtype (float32: within 1e-6 relative; bf16: within bf16 rounding), writes every output,
    and leaves the caches as torch's path leaves them (v exactly; k up to the rope's rounding)."""
    if positions is None:
        positions = torch.randint(0, kv_len, (b,), generator=torch.Generator().manual_seed(b)).tolist()
    outs, caches = attend(dtype, b, kv_len, positions, seed=b + kv_len)
    assert torch.isfinite(outs["kernel"]).all()
    err_k, err_t = rel(outs["kernel"], outs["f64"]), rel(outs["torch"], outs["f64"])
    if dtype == torch.float32:
        assert err_k < 1e-6, (err_k, err_t)
    else:
        assert err_k < max(1.5 * err_t, 2e-3), (err_k, err_t)
    assert torch.equal(caches["kernel"][1], caches["torch"][1])
    rows = torch.arange(b)
    pos = torch.tensor(positions)
    k_new, k_ref = caches["kernel"][0][rows, :, pos], caches["torch"][0][rows, :, pos]
    assert rel(k_new, k_ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(caches["kernel"][0][b:], caches["torch"][0][b:])  # rows past the batch untouched


def test_compiled_graphed_lm_with_the_kernel_equals_the_eager_modules_in_float32():
    """A small LM with Spark's head size (64) and GQA: 24 greedy decode steps for two rows at different
    positions, compiled + fused attention + CUDA graphs against the modules' eager steps, float32:
    the same tokens, logits within float32 rounding."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024)
    with torch.device("cuda"):
        lm = ServedLM(cfg).eval()
        for name, p in lm.named_parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, 0, 0.02 if "embed" not in name else 0.5)
    lm.requires_grad_(False)
    prompt = torch.randint(0, 1024, (300,), device="cuda")
    runs = []
    for fast in (False, True):
        lm.setup_cache(max_batch=2, max_seq=512)
        if fast:
            lm.compile_decode()
            assert lm.fused_attention and lm.fused_linear
        lm.prefill(prompt, 0)
        lm.prefill(prompt[:40], 1)
        tokens, positions, pos_max = torch.tensor([3, 5], device="cuda"), torch.tensor([300, 40], device="cuda"), 300
        toks, logits = [], []
        for _ in range(24):
            out = lm.decode(tokens, positions, use_graph=fast, max_pos=pos_max)
            logits.append(out.clone())
            tokens = out.argmax(-1)
            toks.append(tokens.tolist())
            positions, pos_max = positions + 1, pos_max + 1
        runs.append((toks, torch.stack(logits)))
    assert runs[0][0] == runs[1][0]
    assert rel(runs[1][1].double(), runs[0][1].double()) < 1e-5


# Spark-TTS-0.5B's projections: q/k/v (bias), output, gate/up, down, and the head's speech-token slice
SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (2 * 4864, 896), "down": (896, 4864), "head": (13568, 896)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
def test_gemv_kernels_equal_the_torch_arithmetic(dtype, m):
    """Each projection kernel at Spark's shapes against the float64 arithmetic of the same inputs: no
    further from it than torch's own path in the same dtype (or within 1e-6 / 2e-3 relative), every
    output written; the K-split products reduced with the residual add and the RMS norm likewise."""
    g = torch.Generator(device="cuda").manual_seed(m)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    def check(kernel, torch_path, f64):
        assert torch.isfinite(kernel).all()
        err_k, err_t = rel(kernel.double(), f64), rel(torch_path.double(), f64)
        assert err_k < max(1.5 * err_t, 1e-6 if dtype == torch.float32 else 2e-3), (err_k, err_t)

    x = randn(m, 896)
    w, b = randn(*SHAPES["qkv"], scale=0.03), randn(SHAPES["qkv"][0], scale=0.1)
    check(dl.linear(x, w, b), dl.reference_linear(x, w, b), dl.reference_linear(x.double(), w.double(), b.double()))
    w = randn(*SHAPES["head"], scale=0.03)
    check(dl.linear(x, w, block_n=128), dl.reference_linear(x, w), dl.reference_linear(x.double(), w.double()))
    w = randn(*SHAPES["gate_up"], scale=0.03)
    check(dl.swiglu_linear(x, w), dl.reference_swiglu_linear(x, w), dl.reference_swiglu_linear(x.double(), w.double()))
    for name in ("o", "down"):
        n, k = SHAPES[name]
        a, w, resid, ln = randn(m, k), randn(n, k, scale=0.03), randn(m, n), randn(n, scale=0.2) + 1
        parts = dl.linear_partials(a, w)
        assert parts.shape[0] > 1  # split along K at these shapes
        x_k = resid.clone()
        h_k = dl.add_norm(parts, x_k, ln, 1e-6)
        x_t, h_t = dl.reference_add_norm(resid, dl.reference_linear(a, w), ln, 1e-6)
        x64, h64 = dl.reference_add_norm(resid.double(), dl.reference_linear(a.double(), w.double()), ln.double(), 1e-6)
        check(x_k, x_t, x64)
        check(h_k, h_t, h64)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs Hopper or newer")
def test_programmatic_launch_changes_no_bit_of_a_graphed_decode_step(monkeypatch):
    """Spark-TTS-0.5B's layer shapes, bf16, compiled and replayed from CUDA graphs at 1 and 16 rows:
    with the decode kernels started while the one before them ends (as served on Hopper) every logit and
    every cache entry is the same bit as with each kernel waiting for the last, over 16 steps (a kernel that
    read its input before the previous one finished would differ)."""
    cfg = Qwen2Config(num_hidden_layers=4, vocab_size=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = ServedLM(cfg).eval().to(torch.bfloat16)
    lm.requires_grad_(False)
    prompt = torch.randint(0, 4096, (300,), device="cuda")
    for rows in (1, 16):
        runs = []
        for pdl in ("0", "1"):  # each kernel waiting for the last, then as served
            if pdl == "0":
                monkeypatch.setattr(da, "launch_overlap", lambda t: False)
            else:
                monkeypatch.undo()
            lm.setup_cache(max_batch=16, max_seq=1024)
            lm.compile_decode()
            assert lm.fused_linear and da.launch_overlap(prompt) == (pdl == "1")
            for r in range(rows):
                lm.prefill(prompt[: 300 - 7 * r], r)
            tokens = torch.arange(rows, device="cuda") + 7
            positions = torch.tensor([300 - 7 * r for r in range(rows)], device="cuda")
            logits = []
            for _ in range(16):
                out = lm.decode(tokens, positions, use_graph=True, max_pos=int(positions.max()))
                logits.append(out.clone())
                tokens, positions = out.argmax(-1), positions + 1
            runs.append((torch.stack(logits), [k[:rows].clone() for k in lm.k_caches]))
        assert torch.equal(runs[0][0], runs[1][0]), rows
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), rows
