"""The sampler's top-k candidates on the GPU as two Triton kernels (`sampling.top_k_candidates`'s fast path).

torch.topk over the ~13.5k speech ids of a row is one thread block, so the sampler already takes the top k
in two rounds (the top k of each of 16 slices of a row, then the top k of those); on the GPU each round is
a radix select and a sort of its own, four kernels of ~5-15 us at batch 1 (~5 % of a decode step). Here
each round is one kernel that sorts keys in registers:

- a key is the value's bits made orderable as an integer (float order, -inf lowest) in the high 32 bits
  and the id's complement in the low 32, one int64: sorted largest first, the candidates come out by value
  and, between equal values, lower id first (torch.topk leaves that order unspecified);
- `_slice_top`: one program per (row, slice) sorts its slice's keys and writes the first k; it reads the
  head's output in its own dtype and adds the row's phase mask itself (`bias[phase[row]]`, as
  `logits.float() + bias[phase]` would: the same float32 sums), so neither a float copy of the logits
  nor the mask's gather and sum is a kernel of the step;
- `_merge_top`: one program per row sorts the slices' k keys each and writes the first k as values
  (float32, the logits' own bits) and ids.

A row's slots past the vocabulary are -inf at an id past it, below every real id of the same value, as
the torch path's padding; an id is clamped into the vocabulary at the end (such a slot is drawn only
when fewer than k ids are allowed, and its -inf keeps it from being drawn). Taken wherever they run (a
CUDA GPU with Triton); elsewhere torch.topk.
"""

from __future__ import annotations

import torch

from voiced.engines.triton_lang import tl, triton

MAX_K = 64  # the default candidate bucket (`sampling.candidate_bucket`); larger k keeps torch.topk
MAX_SLICE = 4096  # the most ids one program sorts


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def enabled(logits: torch.Tensor, k: int, segments: int) -> bool:
    """Whether `top_k` takes these logits: float32, bfloat16 or float16 on a CUDA device (or Triton's
    interpreter), k a power of two up to MAX_K, slices of k to MAX_SLICE ids."""
    width = -(-logits.shape[1] // segments)
    fits = (triton is not None and logits.dtype in FLOATS and k <= MAX_K and k & (k - 1) == 0
            and k <= width <= MAX_SLICE and logits.stride(1) == 1)
    return fits and (logits.is_cuda or interpreted())


def interpreted() -> bool:
    """Whether the kernels were defined for Triton's interpreter (TRITON_INTERPRET=1 then: the CPU tests)."""
    return triton is not None and type(_slice_top).__name__ == "InterpretedFunction"


def top_k(logits: torch.Tensor, k: int, segments: int, bias: torch.Tensor | None = None,
          phase: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `logits` `[B, V]` (any of FLOATS) as float32, plus `bias[phase[row]]`
    when given (`bias` `[n_phases, V]` float32, `phase` `[B]` int64), sorted largest first: (values
    `[B, k]`, ids `[B, k]` int64), in `segments` slices then merged (see the module doc)."""
    b, v = logits.shape
    width = -(-v // segments)
    keys = torch.empty(b, segments * k, dtype=torch.int64, device=logits.device)
    has_bias = bias is not None
    if has_bias and (bias.dtype != torch.float32 or bias.shape[1] != v or bias.stride(1) != 1 or phase is None):
        raise ValueError(f"the phase mask must be float32 [phases, {v}] with unit stride, with a phase per row")
    _slice_top[(b, segments)](logits, bias if has_bias else logits, phase if has_bias else logits, keys, v, width,
                              logits.stride(0), bias.stride(0) if has_bias else 0, K=k, HAS_BIAS=has_bias,
                              BLOCK=max(triton.next_power_of_2(width), k), num_warps=4)
    vals = torch.empty(b, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, k, dtype=torch.int64, device=logits.device)
    _merge_top[(b,)](keys, vals, ids, v, K=k, N=segments * k, BLOCK=triton.next_power_of_2(segments * k),
                     num_warps=4)
    return vals, ids


if triton is not None:

    @triton.jit
    def _key(x, ids):
        """float32 x and int ids -> int64 keys ordered as (x, then lower id first)."""
        bits = x.to(tl.int32, bitcast=True)
        # IEEE order as a signed integer: negatives' magnitude bits flipped (sign kept), positives as they are
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        return ordered * 4294967296 + (4294967295 - ids.to(tl.int64))

    @triton.jit
    def _slice_top(x_ptr, bias_ptr, phase_ptr, key_ptr, V, W, stride_x, stride_bias, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        n_parts = tl.num_programs(1)
        j = tl.arange(0, BLOCK)
        ids = part * W + j
        ok = (j < W) & (ids < V)
        x = tl.load(x_ptr + row * stride_x + ids, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            phase = tl.load(phase_ptr + row)
            x += tl.load(bias_ptr + phase * stride_bias + ids, mask=ok, other=0.0)
        # past the slice (padding to a power of two): below everything, never among a slice's first K
        keys = tl.where(j < W, _key(x, ids), -9223372036854775807 - 1)
        top = tl.sort(keys, descending=True)
        tl.store(key_ptr + (row * n_parts + part) * K + j, top, mask=j < K)

    @triton.jit
    def _merge_top(key_ptr, val_ptr, id_ptr, V, K: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        keys = tl.load(key_ptr + row * N + j, mask=j < N, other=-9223372036854775807 - 1)
        top = tl.sort(keys, descending=True)
        ordered = (top >> 32).to(tl.int32)
        bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
        ids = 4294967295 - (top & 4294967295)
        tl.store(val_ptr + row * K + j, bits.to(tl.float32, bitcast=True), mask=j < K)
        tl.store(id_ptr + row * K + j, tl.minimum(ids, V - 1), mask=j < K)
