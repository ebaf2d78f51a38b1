"""A decode step's projections for the Spark-TTS LM (and Whisper's decoder): GEMVs that read each
weight once, at full speed.

At one to sixty-four tokens per step every projection of a layer is a matrix-vector product whose
time is the time to read its weights. cuBLAS picks kernels for these shapes that reach a fraction of
the memory's bandwidth (on an H200, measured in a CUDA graph at batch 1: the q/k/v projection 3.6 us
against a 0.4 us weight-read floor, the down projection 6.6 us against 1.8, the latter a split-K
kernel plus a separate reduction; docs/BENCHMARKS.md). A layer was four such GEMMs and four small
kernels around them (two residual-add + RMS-norm, SwiGLU, the split-K reduction). Here a layer is:

- `linear`: q/k/v with its bias, one kernel;
- `linear_add_norm`: the output projection split along K over enough programs to fill the GPU, its
  partial sums reduced in a fixed order by one small kernel that also adds the residual and computes
  the next RMS norm (replacing the compiled add + norm kernel, so the split costs no extra launch), or
  with `norm_in_projection` (VOICED_DECODE_FUSED_NORM=1, up to 16 rows) by the projection's last
  program, with no kernel of its own;
- `swiglu_linear`: gate and up in one pass, SiLU(gate) * up written directly (no `[B, 2I]` tensor and
  no separate SwiGLU kernel);
- `linear_add_norm` again for the down projection, the norm being the next layer's.

The rounding follows the torch path step for step (`qwen2.layer_decode_tail`): every GEMM's result
is rounded to the activations' dtype before it is used, the residual add and SiLU * up round as
torch's bf16 ops do, and `_rms`'s two roundings are kept. Differences against cuBLAS are the order
of the fp32 accumulation, as between any two GEMM kernels. The reductions are deterministic (the
only atomics count programs done, never sum values): a CUDA graph and an eager run of a step give the
same bits. On Hopper and newer each kernel
starts while the one before it drains and waits for its results at its top (`decode_attention.
launch_overlap`), which changes no bit either.

Whisper's decoder layer (`whisper.fast.FastDecoder`; VOICED_WHISPER_GEMV_DECODER=0 turns it off) takes the
same kernels with two variants: `linear(..., gelu=True)` (its MLP's first projection with the bias and GELU)
and `linear_add_norm` with a bias and a layer norm (the residual add of a projection with its bias, then a
layer norm with weight and bias instead of the RMS norm).

`reference_*` are the same arithmetic in torch: the CPU path, and what the tests compare against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Triton as decode_attention finds it (it comes with torch's CUDA builds, the only place these run)
from voiced.engines.switches import env_switch

from .decode_attention import _arrivals, overlap_args, sm_count, tl, triton

BLOCK_K = 128  # reduction depth per iteration: one 256-byte row segment of a bf16 weight per thread group
MAX_ROWS = 64  # the largest batch one program multiplies (the engine's largest batch bucket)


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """A CUDA GPU of compute capability 8.0 or newer (what the kernels were built and measured on; older
    ones keep cuBLAS) with Triton, in one of the activation dtypes the kernels take."""
    dev = torch.device(device)
    return (triton is not None and dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)
            and dtype in (torch.bfloat16, torch.float16, torch.float32))


def _rows_block(m: int) -> int:
    # tl.dot's smallest tile is 16 rows: a batch of 1 pads to 16 (the GPU is reading weights, not
    # multiplying, so the idle rows cost nothing measurable)
    return 16 if m <= 16 else 32 if m <= 32 else MAX_ROWS


MAX_SPLITS = 8  # the norm reads every partial of a row in one program: more splits cost it more than they give
# The residual add and norm after a split product done by the product's last program instead of a kernel of
# their own (`norm_in_projection`): off until measured on a GPU (written in session 18). Only up to this many
# rows: that one program normalises them one after another, where the kernel of their own has a program a row.
FUSED_NORM_DEFAULT = False
FUSED_NORM_ROWS = 16


SMEM_BUDGET = 192 * 1024  # at most this much of a block's shared memory for the pipeline's tiles
SMEM_RESERVE = 32 * 1024  # kept free below the device's limit for the epilogue's layout conversions


@functools.lru_cache(maxsize=8)
def _smem_limit(index: int) -> int:
    """Shared memory one block may use on this GPU (227 KiB on Hopper, 163 on A100, 99 on consumer
    Ampere/Ada), less the reserve; the pipeline budget of `_stages`."""
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return max(16 * 1024, min(SMEM_BUDGET, optin - SMEM_RESERVE))


def _smem(t: torch.Tensor) -> int:
    return _smem_limit(t.device.index or 0) if t.is_cuda else SMEM_BUDGET


def _stages(rows: int, cols: int, itemsize: int, want: int, budget: int = SMEM_BUDGET) -> int:
    """Software-pipeline depth whose tiles fit in shared memory: each stage holds a `[BLOCK_M, BLOCK_K]`
    input tile and `cols` weight rows of BLOCK_K (float32 activations need twice bf16's room). Triton
    buffers one stage fewer than this counts; the margin is kept (on the H200 the bf16 depths are the
    ones measured, and float32 at 64 rows ran out of shared memory at the unchecked depth)."""
    per_stage = (rows + cols) * BLOCK_K * itemsize
    return max(1, min(want, budget // per_stage))


def split_plan(n: int, k: int, block_n: int, sms: int) -> tuple[int, int]:
    """(K per program, programs along K) for a split-K GEMV of N outputs: about two programs per
    multiprocessor (at most MAX_SPLITS along K), each a whole number of BLOCK_K steps."""
    tiles = -(-n // block_n)
    steps = -(-k // BLOCK_K)
    want = max(1, min(steps, MAX_SPLITS, -(-2 * sms // tiles)))
    per = -(-steps // want) * BLOCK_K
    return per, -(-k // per)


def _sms(t: torch.Tensor) -> int:
    return sm_count(t.device.index or 0) if t.is_cuda else 1


# ------------------------------------------------------------------------------------------- torch

def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def reference_swiglu_linear(h: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(h, w_gate_up).chunk(2, -1)
    return F.silu(gate) * up


def reference_add_norm(x: torch.Tensor, y: torch.Tensor, ln: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y (y a projection's output, in x's dtype), and that sum RMS-normed by `ln` as `qwen2._rms`."""
    x = x + y
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x, ln * x32.to(x.dtype)


# ------------------------------------------------------------------------------------------- Triton

def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = 16,
           gelu: bool = False) -> torch.Tensor:
    """x `[M, K]` @ w `[N, K]`.T (+ bias) -> `[M, N]` in x's dtype; one program per BLOCK_N outputs.
    `gelu`: GELU (erf) of that, as `F.gelu(F.linear(x, w, bias))` rounds it (Whisper's MLP)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = _rows_block(m)
    _gemv[(-(-n // block_n), 1, -(-m // bm))](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=False, GELU=gelu, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, block_n, x.element_size(), 4, _smem(x)), **overlap_args(x))
    return out


def swiglu_linear(h: torch.Tensor, w_gate_up: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """SiLU(h @ gate.T) * (h @ up.T) -> `[M, I]`, `w_gate_up` `[2I, K]` (gate rows, then up rows)."""
    m, k = h.shape
    n = w_gate_up.shape[0] // 2
    out = torch.empty(m, n, dtype=h.dtype, device=h.device)
    bm = _rows_block(m)
    _gemv[(-(-n // block_n), 1, -(-m // bm))](
        h, w_gate_up, w_gate_up, out, m, n, k, h.stride(0),
        HAS_BIAS=False, SWIGLU=True, GELU=False, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=h.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, 2 * block_n, h.element_size(), 3, _smem(h)), **overlap_args(h))
    return out


def norm_in_projection() -> bool:
    """Whether `linear_add_norm` does the add and norm in the product's last program (up to FUSED_NORM_ROWS
    rows): VOICED_DECODE_FUSED_NORM=1 or 0 if set, else FUSED_NORM_DEFAULT."""
    return env_switch("VOICED_DECODE_FUSED_NORM", FUSED_NORM_DEFAULT)


def reference_add_layer_norm(x: torch.Tensor, y: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y (y a projection's output with its bias, in x's dtype), and that sum layer-normed (Whisper)."""
    x = x + y
    return x, F.layer_norm(x, x.shape[-1:], ln_w, ln_b, eps)


def linear_add_norm(a: torch.Tensor, w: torch.Tensor, x: torch.Tensor, ln: torch.Tensor, eps: float,
                    bias: torch.Tensor | None = None, ln_b: torch.Tensor | None = None,
                    arrivals: torch.Tensor | None = None, block_n: int = 32, sms: int | None = None) -> torch.Tensor:
    """An output projection and what follows it: x += a @ w.T (+ `bias`), the product rounded to x's dtype
    first as a GEMM writes it, in place; returns that new x normed: RMS-normed by `ln` (the Spark LM:
    `reference_add_norm`), or with `ln_b` layer-normed by `ln`, `ln_b` (Whisper, whose projections have a
    `bias`: `reference_add_layer_norm`).

    The product is split along K over enough programs to fill the GPU, each writing fp32 partial sums
    `[S, M, N]`; they are reduced in split order by one program per row of a second small kernel, or with
    `norm_in_projection`, for up to FUSED_NORM_ROWS rows, by the product's last program (`arrivals`: the
    engine's `decode_attention.arrival_counters`). Both ways run the same arithmetic (`_norm_row`): the same
    bits."""
    layer = ln_b is not None
    if layer and bias is None:
        raise ValueError("a layer norm after the projection takes the projection's bias (Whisper's layers have one)")
    m, k = a.shape
    n = w.shape[0]
    per, splits = split_plan(n, k, block_n, sms or _sms(a))
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    h = torch.empty_like(x)
    bm = _rows_block(m)
    fused = m <= FUSED_NORM_ROWS and norm_in_projection()
    counts = _arrivals(arrivals, -(-m // bm), a) if fused else parts
    overlap = overlap_args(a)
    norm_block, s_block = triton.next_power_of_2(n), triton.next_power_of_2(splits)
    _gemv_partials[(-(-n // block_n), splits, -(-m // bm))](
        a, w, parts, x, ln, h, bias if layer else ln, ln_b if layer else ln, counts, m, n, k, per, a.stride(0),
        x.stride(0), eps, NORM=fused, LAYER=layer, NORM_BLOCK=norm_block, S_BLOCK=s_block, BLOCK_M=bm,
        BLOCK_N=block_n, BLOCK_K=BLOCK_K, IEEE=a.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, block_n, a.element_size(), 3, _smem(a)), **overlap)
    if not fused:
        _add_norm[(m,)](parts, x, ln, h, splits, m, n, x.stride(0), eps, bias if layer else ln, ln_b if layer else ln,
                        LAYER=layer, BLOCK=norm_block, S_BLOCK=s_block, num_warps=8, **overlap)
    return h


if triton is not None:
    from .decode_attention import arrive_last, wait_for_previous  # Triton functions: defined only where Triton is

    @triton.jit
    def _dot_tile(x_ptr, w_rows, rm, m_ok, n_ok, lo, hi, stride_xm, NK, SWIGLU: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """x[rm, lo:hi] @ w_rows[:, lo:hi].T in fp32, and with SWIGLU the same with the up rows NK elements
        below (zeros otherwise)."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            k = k0 + rk
            k_ok = k < hi
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if SWIGLU:  # the up rows, N below the gate rows
                w2 = tl.load(w_rows + NK + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if IEEE:
                    acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(x, tl.trans(w2), acc2)
        return acc, acc2

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
              HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
              PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
        DT = x_ptr.dtype.element_ty
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        # 64-bit row offsets: the gate/up weight of a large model passes 2**31 elements
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        wait_for_previous(PDL)
        acc, acc2 = _dot_tile(x_ptr, w_rows, rm, m_ok, n_ok, 0, K, stride_xm, N * K, SWIGLU, BLOCK_M, BLOCK_N,
                              BLOCK_K, IEEE)
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:  # torch: gate and up rounded, SiLU rounded, then the product rounded
            g = y.to(DT).to(tl.float32)
            u = acc2.to(DT).to(tl.float32)
            y = (g * tl.sigmoid(g)).to(DT).to(tl.float32) * u
        if GELU:  # torch: the product (with its bias) rounded, GELU in float32, rounded
            y = y.to(DT).to(tl.float32)
            y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], y.to(DT), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gemv_partials(a_ptr, w_ptr, part_ptr, x_ptr, ln_ptr, h_ptr, bias_ptr, ln_b_ptr, count_ptr, M, N, K, k_per,
                       stride_am, stride_xm, eps, NORM: tl.constexpr, LAYER: tl.constexpr, NORM_BLOCK: tl.constexpr,
                       S_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr):
        """One (column tile, K split, row block) of a split product's fp32 partial sums; with NORM the last
        program of a row block to finish adds them into the residual `x` and norms it (`_norm_row`)."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        lo = split * k_per
        wait_for_previous(PDL)
        acc, _ = _dot_tile(a_ptr, w_rows, rm, m_ok, n_ok, lo, tl.minimum(lo + k_per, K), stride_am, 0, False,
                           BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
        tl.store(part_ptr + split * (M * N) + rm[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
        if NORM:
            if arrive_last(count_ptr + pid_m, tl.num_programs(0) * tl.num_programs(1)):
                for row in range(pid_m * BLOCK_M, tl.minimum(M, pid_m * BLOCK_M + BLOCK_M)):
                    _norm_row(part_ptr, x_ptr, ln_ptr, h_ptr, row, tl.num_programs(1), M, N, stride_xm, eps, bias_ptr,
                              ln_b_ptr, LAYER, NORM_BLOCK, S_BLOCK)

    @triton.jit
    def _add_norm(part_ptr, x_ptr, ln_ptr, h_ptr, S, M, N, stride_xm, eps, bias_ptr, ln_b_ptr, LAYER: tl.constexpr,
                  BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        _norm_row(part_ptr, x_ptr, ln_ptr, h_ptr, tl.program_id(0), S, M, N, stride_xm, eps, bias_ptr, ln_b_ptr, LAYER,
                  BLOCK, S_BLOCK)

    @triton.jit
    def _norm_row(part_ptr, x_ptr, ln_ptr, h_ptr, row, S, M, N, stride_xm, eps, bias_ptr, ln_b_ptr,
                  LAYER: tl.constexpr, BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
        """Row `row`: the S partial sums `[S, M, N]` reduced in split order (+ the bias with LAYER), rounded as
        a GEMM's output, added into the residual x in place, and that sum normed into h. The partials are
        loaded with `.cg` (from L2: in a product's last program they are other multiprocessors' writes)."""
        DT = x_ptr.dtype.element_ty
        n = tl.arange(0, BLOCK)
        n_ok = n < N
        y = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(S_BLOCK):
            # (split s's columns: all N of them when it exists, none past the last split)
            cols = n < tl.where(s < S, N, 0)
            y += tl.load(part_ptr + s * (M * N) + row * N + n, mask=cols, other=0.0, cache_modifier=".cg")
        if LAYER:  # Whisper's projections have a bias, added before the GEMM's rounding
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        y = y.to(DT).to(tl.float32)  # the projection's output, rounded as a GEMM writes it
        xb = x_ptr + row * stride_xm + n
        x = (tl.load(xb, mask=n_ok, other=0.0).to(tl.float32) + y).to(DT)
        tl.store(xb, x, mask=n_ok)
        x32 = x.to(tl.float32)
        w = tl.load(ln_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if LAYER:  # layer norm (float32, as torch's): centred, biased variance, weight and bias
            mean = tl.sum(x32, 0) / N
            c = tl.where(n_ok, x32 - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(c * c, 0) / N + eps)
            out = c * rstd * w + tl.load(ln_b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        else:  # RMS norm as `qwen2._rms`: normed and rounded, then the weight
            rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
            out = w * (x32 * rstd).to(DT).to(tl.float32)
        tl.store(h_ptr + row * stride_xm + n, out.to(DT), mask=n_ok)


__all__ = ["supported", "split_plan", "linear", "swiglu_linear", "linear_add_norm", "norm_in_projection",
           "reference_linear", "reference_swiglu_linear", "reference_add_norm", "reference_add_layer_norm"]
