"""A decode step's projections for the Spark-TTS LM (and Whisper's decoder): GEMVs that read each
weight once, at full speed.

At one to sixty-four tokens per step every projection of a layer is a matrix-vector product whose
time is the time to read its weights. cuBLAS picks kernels for these shapes that reach a fraction of
the memory's bandwidth (in a CUDA graph at batch 1: the q/k/v projection 3.6 us against a 0.4 us
weight-read floor, the down projection 6.6 us against 1.8, the latter a split-K kernel plus a separate
reduction), and a layer through them is four such GEMMs and four small kernels around them (two
residual-add + RMS-norm, SwiGLU, the split-K reduction). Here a layer is:

- `linear`: q/k/v with its bias, one kernel;
- `linear_partials` + `add_norm`: the output projection split along K over enough programs to fill
  the GPU, its partial sums reduced in a fixed order by one small kernel that also adds the residual
  and computes the next RMS norm (replacing the compiled add + norm kernel, so the split costs no
  extra launch);
- `swiglu_linear`: gate and up in one pass, SiLU(gate) * up written directly (no `[B, 2I]` tensor and
  no separate SwiGLU kernel);
- `linear_partials` + `add_norm` again for the down projection, the norm being the next layer's.

The rounding follows the torch path step for step (`qwen2.layer_decode_tail`): every GEMM's result
is rounded to the activations' dtype before it is used, the residual add and SiLU * up round as
torch's bf16 ops do, and `_rms`'s two roundings are kept. Differences against cuBLAS are the order
of the fp32 accumulation, as between any two GEMM kernels. The reductions are deterministic (no
atomics): a CUDA graph and an eager run of a step give the same bits. On Hopper and newer each kernel
starts while the one before it drains and waits for its results at its top (`decode_attention.
launch_overlap`), which changes no bit either.

Whisper's decoder layer (`whisper.fast_decoder.FastDecoder`, on a GPU where the kernels run) takes the
same kernels with two variants: `linear(..., gelu=True)` (its MLP's first projection with the bias and GELU)
and `add_layer_norm` (the residual add of a projection with its bias, then a layer norm with weight and
bias instead of the RMS norm). Its greedy steps also take `greedy_head` (the head's GEMV whose epilogue keeps
each block's share of the token choice, and one kernel that picks), and a `stop` that makes every kernel of a
step whose rows have all ended return at its top (`decode_attention.stop_args`).

`reference_*` are the same arithmetic in torch: the CPU path, and what the tests compare against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Triton as decode_attention finds it (it comes with torch's CUDA builds, the only place these run)
from .decode_attention import Stop, overlap_args, sm_count, stop_args, tl, triton

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


# `_gemv`'s arguments for its greedy epilogue (`greedy_head`), off
NO_GREEDY = {"GREEDY": False, "always_ptr": None, "minleft_ptr": None, "eot": 0}

MAX_SPLITS = 8  # `add_norm` reads every partial of a row in one program: more splits cost it more than they give


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
    buffers one stage fewer than this counts; the margin is kept (float32 at 64 rows runs out of shared
    memory at the unchecked depth)."""
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
           gelu: bool = False, stop: Stop | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x `[M, K]` @ w `[N, K]`.T (+ bias) -> `[M, N]` in x's dtype; one program per BLOCK_N outputs.
    `gelu`: GELU (erf) of that, as `F.gelu(F.linear(x, w, bias))` rounds it (Whisper's MLP). `stop`: nothing done
    once the step's rows have all ended (`decode_attention.stop_args`). `out_dtype` (float32): the result rounded
    to x's dtype as always, then stored wider: `linear(...).float()`'s values with no kernel of its own."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    bm = _rows_block(m)
    _gemv[(-(-n // block_n), 1, -(-m // bm))](
        x, w, bias if bias is not None else w, out, m, n, k, k, x.stride(0), 0,
        HAS_BIAS=bias is not None, SWIGLU=False, PARTIAL=False, GELU=gelu, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, block_n, x.element_size(), 4, _smem(x)), **overlap_args(x), **NO_GREEDY, **stop_args(stop))
    return out


def swiglu_linear(h: torch.Tensor, w_gate_up: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """SiLU(h @ gate.T) * (h @ up.T) -> `[M, I]`, `w_gate_up` `[2I, K]` (gate rows, then up rows)."""
    m, k = h.shape
    n = w_gate_up.shape[0] // 2
    out = torch.empty(m, n, dtype=h.dtype, device=h.device)
    bm = _rows_block(m)
    _gemv[(-(-n // block_n), 1, -(-m // bm))](
        h, w_gate_up, w_gate_up, out, m, n, k, k, h.stride(0), 0,
        HAS_BIAS=False, SWIGLU=True, PARTIAL=False, GELU=False, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=h.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, 2 * block_n, h.element_size(), 3, _smem(h)), **overlap_args(h), **NO_GREEDY, **stop_args(None))
    return out


def linear_partials(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, sms: int | None = None,
                    stop: Stop | None = None) -> torch.Tensor:
    """x @ w.T split along K: fp32 partial sums `[S, M, N]` for `add_norm` to reduce (`stop`: as `linear`)."""
    m, k = x.shape
    n = w.shape[0]
    per, splits = split_plan(n, k, block_n, sms or _sms(x))
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    bm = _rows_block(m)
    _gemv[(-(-n // block_n), splits, -(-m // bm))](
        x, w, w, out, m, n, k, per, x.stride(0), m * n,
        HAS_BIAS=False, SWIGLU=False, PARTIAL=True, GELU=False, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=_stages(bm, block_n, x.element_size(), 3, _smem(x)), **overlap_args(x), **NO_GREEDY, **stop_args(stop))
    return out


def greedy_head(h: torch.Tensor, w: torch.Tensor, always: torch.Tensor, eot: int, inputs: torch.Tensor,
                lp: torch.Tensor, hist: torch.Tensor | None = None, stop: Stop | None = None,
                block_n: int = 128) -> None:
    """A greedy decode step's choice straight from its hidden states h `[M, K]` and the head w `[vocab, K]`, the
    logits never written: `token_choice.greedy_advance(h @ w.T rounded to h's dtype then widened, always, eot,
    inputs, lp)`, in place. Each program of the GEMV keeps, per row, its block's largest logit after the
    suppression (the `always` mask `[vocab]` bool, and end-of-text while the row's countdown `inputs[2]` is
    positive), that logit's first index and the sum of its block's exp(logit - largest); one program per row
    then combines them, takes the first index of the largest, the log-probability -log(sum) (the same arithmetic
    as log_softmax at the arg-max, summed in another order) and updates `inputs` `[3, M]` (tokens: a row whose
    token is end-of-text keeps it; positions +1; countdowns -1) and `lp` `[M]`. `hist` `[M, 2]` float64 (a
    chunk's step of the engine's history): the new token and its log-probability written there too. Replaces the
    widening, the suppression, the arg-max, the log-softmax and the history's writes: 8-10 kernels a step.
    `stop`: the GEMV does nothing once every row has ended (its choices are then for no one)."""
    m, k = h.shape
    n = w.shape[0]
    programs = -(-n // block_n)
    part = torch.empty(3, m, programs, dtype=torch.float32, device=h.device)
    bm = _rows_block(m)
    _gemv[(programs, 1, -(-m // bm))](
        h, w, w, part, m, n, k, k, h.stride(0), 0,
        HAS_BIAS=False, SWIGLU=False, PARTIAL=False, GELU=False, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        IEEE=h.dtype == torch.float32, num_warps=4, num_stages=_stages(bm, block_n, h.element_size(), 4, _smem(h)),
        GREEDY=True, always_ptr=always, minleft_ptr=inputs[2], eot=eot, **overlap_args(h), **stop_args(stop))
    _greedy_pick[(m,)](part, inputs, inputs.stride(0), lp, hist if hist is not None else lp,
                       hist.stride(0) if hist is not None else 0, m, programs, eot, HIST=hist is not None,
                       P_BLOCK=triton.next_power_of_2(programs), num_warps=4, **overlap_args(h))


def reference_add_layer_norm(x: torch.Tensor, y: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y (y a projection's output with its bias, in x's dtype), and that sum layer-normed (Whisper)."""
    x = x + y
    return x, F.layer_norm(x, x.shape[-1:], ln_w, ln_b, eps)


def add_layer_norm(partials: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, ln_w: torch.Tensor,
                   ln_b: torch.Tensor, eps: float, stop: Stop | None = None) -> torch.Tensor:
    """`add_norm` for Whisper's layers: x += (the sum of `partials` + `bias`, rounded to x's dtype as a GEMM
    with its bias writes it), in place; returns that new x layer-normed by `ln_w`, `ln_b`
    (`reference_add_layer_norm`'s arithmetic; `stop`: as `linear`)."""
    s, m, n = partials.shape
    h = torch.empty_like(x)
    _add_norm[(m,)](partials, x, ln_w, h, s, m, n, x.stride(0), eps, bias, ln_b, LAYER=True,
                    BLOCK=triton.next_power_of_2(n), S_BLOCK=triton.next_power_of_2(s), num_warps=8, **overlap_args(x),
                    **stop_args(stop))
    return h


def add_norm(partials: torch.Tensor, x: torch.Tensor, ln: torch.Tensor, eps: float) -> torch.Tensor:
    """x += the sum of `partials` `[S, M, N]` (rounded to x's dtype first, as a GEMM's output), in
    place; returns that new x RMS-normed by `ln` (`reference_add_norm`'s arithmetic)."""
    s, m, n = partials.shape
    h = torch.empty_like(x)
    _add_norm[(m,)](partials, x, ln, h, s, m, n, x.stride(0), eps, ln, ln, LAYER=False,
                    BLOCK=triton.next_power_of_2(n), S_BLOCK=triton.next_power_of_2(s), num_warps=8, **overlap_args(x),
                    **stop_args(None))
    return h


if triton is not None:
    from .decode_attention import steps_ended, wait_for_previous  # Triton functions: defined only where Triton is

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per, stride_xm, stride_os,
              HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PARTIAL: tl.constexpr, GELU: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
              GREEDY: tl.constexpr, always_ptr, minleft_ptr, eot,
              stop_ptr, stop_id, STOP: tl.constexpr, PDL: tl.constexpr):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        pid_m = tl.program_id(2)
        DT = x_ptr.dtype.element_ty
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        # 64-bit row offsets: the gate/up weight of a large model passes 2**31 elements
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        lo = split * k_per
        hi = tl.minimum(lo + k_per, K)
        if STOP:  # (read before the wait: `steps_ended`)
            ended = steps_ended(stop_ptr, stop_id, M, STOP)
        wait_for_previous(PDL)
        if STOP:
            if ended:
                return
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
                w2 = tl.load(w_rows + N * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                if IEEE:
                    acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(x, tl.trans(w2), acc2)
        ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + split * stride_os + rm[:, None] * N + rn[None, :], acc, mask=ok)
        elif GREEDY:  # `greedy_head`: this block's share of each row's choice, from its logits as the GEMV rounds them
            y = acc.to(DT).to(tl.float32)
            off = (tl.load(always_ptr + rn, mask=n_ok, other=1) != 0)[None, :] | ~n_ok[None, :]
            left = tl.load(minleft_ptr + rm, mask=m_ok, other=0)
            off = off | ((rn == eot)[None, :] & (left > 0)[:, None])
            y = tl.where(off, float("-inf"), y)
            top = tl.max(y, 1)
            at = pid_n * BLOCK_N + tl.argmax(y, 1)  # the first of equal maxima, as torch's argmax
            total = tl.sum(tl.where(off, 0.0, tl.exp(y - top[:, None])), 1)
            cell = out_ptr + rm * tl.num_programs(0) + pid_n  # [3, M, programs]: top, its index, the sum
            plane = M * tl.num_programs(0)
            tl.store(cell, top, mask=m_ok)
            tl.store(cell + plane, at.to(tl.float32), mask=m_ok)  # (exact: a vocabulary is far below 2**24)
            tl.store(cell + 2 * plane, total, mask=m_ok)
        else:
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
            # rounded to the activations' dtype, then stored as out's (wider for `out_dtype`: exact)
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], y.to(DT).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_norm(part_ptr, x_ptr, ln_ptr, h_ptr, S, M, N, stride_xm, eps, bias_ptr, ln_b_ptr, LAYER: tl.constexpr,
                  BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, stop_ptr, stop_id, STOP: tl.constexpr,
                  PDL: tl.constexpr):
        if STOP:  # (read before the wait: `steps_ended`)
            ended = steps_ended(stop_ptr, stop_id, M, STOP)
        wait_for_previous(PDL)
        if STOP:
            if ended:
                return
        row = tl.program_id(0)
        DT = x_ptr.dtype.element_ty
        n = tl.arange(0, BLOCK)
        s = tl.arange(0, S_BLOCK)
        n_ok = n < N
        p = tl.load(part_ptr + s[:, None] * (M * N) + row * N + n[None, :], mask=(s < S)[:, None] & n_ok[None, :],
                    other=0.0)
        y = tl.sum(p, 0)
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


    @triton.jit
    def _greedy_pick(part_ptr, inputs_ptr, stride_in, lp_ptr, hist_ptr, stride_hist, M, P, eot, HIST: tl.constexpr,
                     P_BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row of `greedy_head`: its blocks' maxima, their indices and sums `[3, M, P]` combined (the largest
        maximum, the first index that holds it, the sum rescaled to it), then `token_choice.greedy_advance`'s
        bookkeeping and, for a chunk's step, its history entry."""
        wait_for_previous(PDL)
        row = tl.program_id(0)
        p = tl.arange(0, P_BLOCK)
        ok = p < P
        base = part_ptr + row * P + p
        tops = tl.load(base, mask=ok, other=float("-inf"))
        at = tl.load(base + M * P, mask=ok, other=3.0e38)
        sums = tl.load(base + 2 * M * P, mask=ok, other=0.0)
        top = tl.max(tops, 0)
        choice = tl.min(tl.where(tops == top, at, 3.0e38), 0).to(tl.int64)
        total = tl.sum(tl.where(tops == float("-inf"), 0.0, sums * tl.exp(tops - top)), 0)
        lp = -tl.log(total)  # log_softmax at the chosen (largest) logit: its own term is exp(0)
        tok = tl.load(inputs_ptr + row)
        tok = tl.where(tok == eot, tok, choice)  # a row that has ended keeps end-of-text
        tl.store(inputs_ptr + row, tok)
        tl.store(inputs_ptr + stride_in + row, tl.load(inputs_ptr + stride_in + row) + 1)
        tl.store(inputs_ptr + 2 * stride_in + row, tl.load(inputs_ptr + 2 * stride_in + row) - 1)
        tl.store(lp_ptr + row, lp)
        if HIST:
            tl.store(hist_ptr + row * stride_hist, tok.to(tl.float64))
            tl.store(hist_ptr + row * stride_hist + 1, lp.to(tl.float64))


__all__ = ["supported", "split_plan", "linear", "greedy_head", "swiglu_linear", "linear_partials", "add_norm", "add_layer_norm",
           "reference_linear", "reference_swiglu_linear", "reference_add_norm", "reference_add_layer_norm"]
