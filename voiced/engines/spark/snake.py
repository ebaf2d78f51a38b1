"""BiCodec's Snake activation, x + sin(alpha x)^2 / alpha, as one GPU kernel.

A vocoder decode runs 29 Snakes, over activations from 1536 channels x 8 samples a token down to 96
channels x 320. In torch each Snake is five elementwise kernels (alpha * x, sin, the square, the scale,
the add): eleven passes over the activation. Profiled on an H100 (docs/BENCHMARKS.md, session 14), those
elementwise kernels took more of a vocoder window's GPU time than all of its convolutions together.
`snake` reads x once and writes the result once: a graphed window decode went from 13.4 to 8.5 ms per
thousand tokens.

The bits are torch's. Each torch op computes in float32 and rounds its result to the activations' dtype,
so the kernel rounds after each step as they do, takes sin from libdevice (CUDA's accurate sinf, what torch's
kernel calls), not the approximate hardware sine, and lets the compiler contract no multiply and add into
one fused multiply-add (with contraction, 5 % of the values differed by an ulp). In float32 the roundings
are no-ops. tests/test_spark_snake_gpu.py checks the bits.

`Snake1d.forward` (bicodec.py) is the torch arithmetic and the CPU path. On the meta device (the memory
plan) `snake` allocates what the kernel allocates: one output.
"""

from __future__ import annotations

import os

import torch

# Triton as decode_attention finds it (it comes with torch's CUDA builds, the only place this runs)
from .decode_attention import tl, triton

BLOCK = 1024  # samples of one channel per program

# On wherever Triton is: the same bits as torch's Snake, and the vocoder 1.57x faster on an H100
# (docs/BENCHMARKS.md, session 14). The environment's VOICED_SPARK_FUSED_SNAKE=0 turns it off.
FUSED_DEFAULT = True


def fused() -> bool:
    """Whether CUDA (and meta) activations take the kernel: Triton is installed and
    VOICED_SPARK_FUSED_SNAKE (1 or 0) does not turn it off."""
    env = os.environ.get("VOICED_SPARK_FUSED_SNAKE", "").strip()
    return triton is not None and (FUSED_DEFAULT if env == "" else env == "1")


def snake(x: torch.Tensor, alpha: torch.Tensor, inverse_alpha: torch.Tensor) -> torch.Tensor:
    """x `[B, C, T]` -> x + inverse_alpha * sin(alpha * x)^2, alpha and inverse_alpha `[1, C, 1]` in x's
    dtype (`Snake1d.inverse_alpha` is 1 / (alpha + 1e-9))."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.device.type == "meta":
        return out
    b, c, t = x.shape
    # enable_fp_fusion=False: no multiply-add contracted into one rounding (torch rounds the product first)
    _snake[(b * c, triton.cdiv(t, BLOCK))](x.contiguous(), alpha, inverse_alpha, out, c, t, BLOCK=BLOCK,
                                           LIBDEVICE=x.is_cuda,  # the interpreter (CPU tests) has no libdevice
                                           enable_fp_fusion=False)
    return out


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _snake(x_ptr, alpha_ptr, inv_ptr, out_ptr, C, T, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)  # batch row * C + channel
        DT = x_ptr.dtype.element_ty
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        at = row.to(tl.int64) * T + t  # 64-bit: a long window's activations pass 2**31 elements
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + row % C).to(tl.float32)
        inv = tl.load(inv_ptr + row % C).to(tl.float32)
        s = (a * x).to(DT).to(tl.float32)  # torch: alpha * x, then sin
        if LIBDEVICE:
            s = libdevice.sin(s)
        else:
            s = tl.sin(s)
        s = s.to(DT).to(tl.float32)
        s = (s * s).to(DT).to(tl.float32)  # .pow(2)
        tl.store(out_ptr + at, (x + (inv * s).to(DT).to(tl.float32)).to(DT), mask=ok)


__all__ = ["FUSED_DEFAULT", "fused", "snake"]
