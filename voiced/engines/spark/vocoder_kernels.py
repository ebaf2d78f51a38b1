"""The elementwise work of BiCodec's wave generator as GPU kernels: Snake, with the convolution before it
(its bias) and the convolution after it (its end mask) folded in, and the residual add.

A vocoder decode runs 29 Snakes, x + sin(alpha x)^2 / alpha, over activations from 1536 channels x 8
samples a token down to 96 channels x 320. In torch each Snake is five elementwise kernels (alpha * x,
sin, the square, the scale, the add): eleven passes over the activation. Around them torch adds each
convolution's bias in a kernel of its own (cuDNN's convolution takes none), each residual unit's input
in another, and an end-masked window (streaming.py) zeroes each time-mixing convolution's input in a
third. Those elementwise kernels take more of a window's GPU time than all of its convolutions together.
Here:

- `snake`: one read of x, one write: Snake(x + bias) with positions past a row's end written as zero,
  optionally also writing x + bias (the residual stream after a transposed convolution);
- `bias_residual`: a residual unit's output, x + (conv + bias), in one pass.

`WaveGenerator.forward` (bicodec.py) calls them on a GPU (and the meta device, where they allocate what
the kernels allocate, for the memory plan); its torch modules are the arithmetic and the CPU path.

The bits are torch's. Each torch op computes in float32 and rounds its result to the activations' dtype,
so the kernels round after each step as they do, take sin from libdevice (CUDA's accurate sinf, what
torch's kernel calls), not the approximate hardware sine, and let the compiler contract no multiply and
add into one fused multiply-add (with contraction, 5 % of a Snake's values differed by an ulp). In
float32 the roundings are no-ops. tests/test_vocoder_kernels_gpu.py checks the bits (a ROCm build takes the
kernels too, its sin unchecked against torch's).
"""

from __future__ import annotations

import importlib

import torch

# Triton as decode_attention finds it (it comes with torch's CUDA builds, the only place these run)
from voiced.engines.triton_lang import tl, triton

BLOCK = 1024  # samples of one channel per program


def enabled() -> bool:
    """Whether the wave generator takes the kernels on CUDA (and meta): wherever Triton is installed (the
    same bits as the torch modules, fewer passes over the activations)."""
    return triton is not None


def _launch(kernel, x: torch.Tensor, *args, **constants) -> None:
    b, c, t = x.shape
    # enable_fp_fusion=False: no multiply-add contracted into one rounding (torch rounds the product first)
    kernel[(b * c, triton.cdiv(t, BLOCK))](*args, c, t, BLOCK=BLOCK, enable_fp_fusion=False, **constants)


def snake(x: torch.Tensor, alpha: torch.Tensor, inverse_alpha: torch.Tensor, bias: torch.Tensor | None = None,
          keep: torch.Tensor | None = None, with_input: bool = False):
    """Snake(x + bias): x `[B, C, T]`, alpha and inverse_alpha `[1, C, 1]` in x's dtype
    (`Snake1d.inverse_alpha` is 1 / (alpha + 1e-9)), bias `[C]` (the previous convolution's, added and
    rounded first, as torch adds it after the convolution), keep `[B]` (int64: row b's output is zero from
    position keep[b] on, the next convolution's end mask). with_input: returns (x + bias, the Snake)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    h = torch.empty_like(x) if with_input else out
    if x.device.type != "meta":
        _launch(_snake, x, x, alpha, inverse_alpha, x if bias is None else bias, x if keep is None else keep, out, h,
                HAS_BIAS=bias is not None, MASKED=keep is not None, WITH_INPUT=with_input,
                LIBDEVICE=x.is_cuda)  # the interpreter (CPU tests) has no libdevice
    return (h, out) if with_input else out


def bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + (y + bias): a residual unit's input plus its last convolution's output and bias, `[B, C, T]`."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    if x.device.type != "meta":
        _launch(_bias_residual, x, x, y, bias, out)
    return out


if triton is not None:
    # looked up as decode_attention looks up Triton: a module of torch's CUDA builds, no requirement of ours
    libdevice = importlib.import_module("triton.language.extra.libdevice")

    @triton.jit
    def _snake(x_ptr, alpha_ptr, inv_ptr, bias_ptr, keep_ptr, out_ptr, h_ptr, C, T, BLOCK: tl.constexpr,
               HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, WITH_INPUT: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)  # batch row * C + channel
        DT = x_ptr.dtype.element_ty
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        at = row.to(tl.int64) * T + t  # 64-bit: a long window's activations pass 2**31 elements
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:  # torch: the convolution's output, then += bias
            x = (x + tl.load(bias_ptr + row % C).to(tl.float32)).to(DT).to(tl.float32)
            if WITH_INPUT:
                tl.store(h_ptr + at, x.to(DT), mask=ok)
        a = tl.load(alpha_ptr + row % C).to(tl.float32)
        inv = tl.load(inv_ptr + row % C).to(tl.float32)
        s = (a * x).to(DT).to(tl.float32)  # torch: alpha * x, then sin
        if LIBDEVICE:
            s = libdevice.sin(s)
        else:
            s = tl.sin(s)
        s = s.to(DT).to(tl.float32)
        s = (s * s).to(DT).to(tl.float32)  # .pow(2)
        y = (x + (inv * s).to(DT).to(tl.float32)).to(DT)
        if MASKED:  # torch: where(position < keep, y, 0) before the next convolution
            y = tl.where(t < tl.load(keep_ptr + row // C), y, 0.0).to(DT)
        tl.store(out_ptr + at, y, mask=ok)

    @triton.jit
    def _bias_residual(x_ptr, y_ptr, bias_ptr, out_ptr, C, T, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        DT = x_ptr.dtype.element_ty
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        at = row.to(tl.int64) * T + t
        y = tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32) + tl.load(bias_ptr + row % C).to(tl.float32)
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (x + y.to(DT).to(tl.float32)).to(DT), mask=ok)


__all__ = ["enabled", "snake", "bias_residual"]
