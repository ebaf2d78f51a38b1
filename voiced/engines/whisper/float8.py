"""FP8 matrix products for the GPU encoder: the opt-in ASR dtype "float8" (approximate, faster).

The encoder is where Whisper's arithmetic is: 1,500 positions a window through every layer, ~2.3 TFLOP an
utterance for large-v3-turbo, against the decoder's few GFLOP a token. In float16 its GEMMs already run near
what an H200's tensor cores sustain (~490 TFLOP/s measured for one layer, docs/BENCHMARKS.md, session 26), so
the way to more utterances a second is a narrower number: FP8 (e4m3) tensor cores do twice the float16 work
per cycle on Hopper and Ada.

The scheme is the one FP8 inference commonly serves LLMs and Whisper with ("FP8 dynamic"):

* weights: one scale per output channel (each row of W scaled so its largest magnitude is e4m3's 448),
  quantized once when the encoder is built, kept beside the float16 weights;
* activations: one scale per row (per audio position), computed from the row's own largest magnitude at
  every call, so a loud position sets no other position's resolution (the outlier problem cpu.py's int8
  mode meets with one scale per tensor);
* the product accumulates in float32 inside the tensor cores (`use_fast_accum` off) and is rescaled by
  both scales and rounded to the activations' dtype once (`torch._scaled_mm`'s row-wise scaling); the
  bias is added after.

Only the encoder's four linear layers a block (query/key/value, output, and the MLP's two) run so. The
convolutions, attention, layer norms, the decoder and its cross-attention keys/values stay float16: the
decoder step at one token is bound by launches and memory reads, not arithmetic (fast.FastDecoder).

On the CPU `emulated_linear` does the same arithmetic in float32 from the same quantized operands, so the
scheme's accuracy can be measured anywhere (`voiced eval --dtype float8`); it is slower than float32 there and
never chosen by default. (A GPU without FP8 tensor cores refuses the dtype: engine.py.)
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
# The smallest scale a row of zeros gets (its quantized values are zeros either way; no division by zero).
MIN_AMAX = 1e-12

# A weight quantized for `linear`: the float8 values [out, in] and their per-output-channel scales [1, out].
Fp8Weight = tuple[Tensor, Tensor]


def tensor_cores(device: torch.device | str) -> bool:
    """Whether `device` multiplies in FP8 itself: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper,
    Blackwell) and a torch with `_scaled_mm`. Elsewhere `emulated_linear` stands in."""
    dev = torch.device(device)
    return dev.type == "cuda" and _cuda_fp8(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _cuda_fp8(index: int) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K] float8 e4m3, scale [M, 1] float32) with x ~= q * scale, each row scaled so its
    largest magnitude becomes e4m3's largest finite value."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_weight(w: Tensor) -> Fp8Weight:
    """A linear layer's weight [out, in] as `linear` takes it: one scale per output channel."""
    q, scale = quantize_rows(w.detach())
    return q, scale.reshape(1, -1)


def weight_bytes(out_features: int, in_features: int) -> int:
    """What `quantize_weight` keeps on the device for one weight: one byte a value, four a scale."""
    return out_features * in_features + 4 * out_features


def linear_for(device: torch.device | str):
    """The `F.linear` stand-in for activations on `device`: `linear` where it has FP8 tensor cores, else
    `emulated_linear`. Chosen once, outside any compiled function (the device check is not traceable)."""
    return linear if tensor_cores(device) else emulated_linear


def linear(x: Tensor, w: Fp8Weight, b: Tensor | None) -> Tensor:
    """`F.linear(x, W, b)` through FP8 tensor cores: x [..., in] in float16/bfloat16, w from `quantize_weight`
    -> [..., out] in x's dtype (see the module doc): one `torch._scaled_mm`."""
    wq, ws = w
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=x.dtype)
    return _with_bias(y, b).view(*x.shape[:-1], wq.shape[0])


def emulated_linear(x: Tensor, w: Fp8Weight, b: Tensor | None) -> Tensor:
    """`linear`'s arithmetic where there are no FP8 tensor cores (the CPU): the same quantized operands."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = emulated_product(xq, xs, w).to(x.dtype)
    return _with_bias(y, b).view(*x.shape[:-1], w[0].shape[0])


def emulated_product(xq: Tensor, xs: Tensor, w: Fp8Weight) -> Tensor:
    """What `torch._scaled_mm` computes from the quantized operands, in float32: every float8 value is exact
    in float32, so this differs from the tensor cores' result only in the order of the sums."""
    wq, ws = w
    return (xq.float() @ wq.float().t()) * xs * ws


def _with_bias(y: Tensor, b: Tensor | None) -> Tensor:
    return y if b is None else y + b
