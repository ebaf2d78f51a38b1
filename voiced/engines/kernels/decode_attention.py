"""A decode step's attention for the Spark-TTS LM: rope, cache write and attention in one GPU kernel.

At one token per row, a decode step is a few hundred kernels of a few microseconds each, and their
count, not the bytes they move, sets its time (docs/BENCHMARKS.md). Written in torch, the attention
part of a layer is six of them: rope on q and k, the cache writes of k and v, the scores GEMM, the
masked softmax and the values GEMM. `triton_attention` does the same arithmetic in one kernel per
layer (two when the cache is long enough to be split across the GPU: flash-decoding, then a small
combine), reading q/k/v straight from the fused qkv projection's output and the rope factors straight
from the LM's fp32 tables at each row's position.

`reference` is that arithmetic in torch (the CPU path, and any GPU without Triton or with head
layouts the kernel does not take); it is what the compiled step ran before. Differences between the
two are rounding: the kernel keeps the softmax unnormalised until the end (online softmax) and
rounds the probabilities once, after the values product, instead of before it.

Layout: qkv `[B, (H + 2 KV) D]` (q heads, then k heads, then v heads, as `Qwen2LM.fuse_projections`
concatenates them); caches `[max_batch, KV, max_seq, D]`; row b of the step is cache row b and writes
its new k/v at `positions[b]` (rows past the live batch are a graph's padding: they write position 0
of free rows, as the torch path does).

Whisper's decoder (`whisper.fast_decoder.FastDecoder`) runs the same kernel without rope (its heads are
their own KV heads, G = 1) over its `[slots, ctx, width]` caches seen as `[slots, heads, ctx, D]`, and for its
cross-attention with `cross=True`: the queries alone, nothing written, all of the audio's positions.

`launch_overlap` decides, for these kernels and decode_linear's, whether they use programmatic
dependent launch (each one's blocks start while the kernel before it drains, then wait for it).
"""

from __future__ import annotations

import functools

import torch

# (the engine compiles with Triton only where it is found too: engine._has_triton; without it: `reference`)
from voiced.engines.triton_lang import tl, triton

BLOCK_N = 64  # cache positions per inner iteration (a multiple of 16: tl.dot's smallest tile)

def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., D]` rotated (half-rotation layout, as Qwen2/NeoX) by cos/sin in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, dims: tuple) -> torch.Tensor:
    """The torch arithmetic: qkv `[B, 1, N]`, cos/sin `[B, 1, 1, D]` (the rows' rope factors in the
    activations' dtype), mask `[B, 1, 1, kv_len]` (row b sees positions 0..positions[b]) -> `[B, 1, H*D]`."""
    n_heads, n_kv, head_dim = dims
    b = qkv.shape[0]
    q, k, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
    q = q.view(b, 1, n_heads, head_dim).transpose(1, 2)
    k = k.view(b, 1, n_kv, head_dim).transpose(1, 2)
    v = v.view(b, 1, n_kv, head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # index_put with tensors only: capturable in a CUDA graph.
    k_cache[rows, :, positions] = k[:, :, 0]
    v_cache[rows, :, positions] = v[:, :, 0]
    kv_len = mask.shape[-1]
    keys, values = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
    # GQA without copying KV: the `group` query heads of one KV head become its query rows. Written out
    # rather than SDPA: for 7 query rows per KV head the fused kernels run one block per (row, KV head).
    q = q.reshape(b, n_kv, n_heads // n_kv, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * head_dim**-0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)
    return out.reshape(b, 1, n_heads * head_dim)


def supported(dtype: torch.dtype, device: torch.device | str, dims: tuple) -> bool:
    """Whether `triton_attention` takes this layout: a CUDA GPU of compute capability 8.0 or newer (what
    the kernel was built and measured on; older ones, a T4 say, keep the torch attention), Triton
    installed, a head size tl.dot tiles (16..256, a power of two) and at most 16 query heads per KV head."""
    n_heads, n_kv, head_dim = dims
    group = n_heads // n_kv
    dev = torch.device(device)
    return (triton is not None and dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and 1 <= group <= 16)


@functools.lru_cache(maxsize=8)
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index` (the kernels size their grids to fill them)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_overlap(t: torch.Tensor) -> bool:
    """Whether the decode step's Triton kernels on t's device start while the kernel before them ends.

    A batch-1 decode step is ~170 of these kernels of 2-5 us each, one after another, and each one's
    start (its blocks placed, their first instructions run) and end (the last blocks draining) are a
    good part of that. With programmatic dependent launch (Hopper and newer) a kernel's blocks start
    while the previous kernel is still finishing and wait (griddepcontrol.wait) for it to complete, and
    its writes to be visible, before they read or write anything; every kernel of the chain waits at its
    top, so the step's order and its bits are unchanged. False for anything but a CUDA tensor on such a
    NVIDIA GPU (the CPU, Triton's interpreter, ROCm) or with a Triton that predates it."""
    if triton is None or not t.is_cuda or torch.version.hip is not None or not _hopper_or_newer(t.device.index or 0):
        return False
    return getattr(getattr(tl.extra, "cuda", None), "gdc_wait", None) is not None


def overlap_args(t: torch.Tensor) -> dict:
    """A decode kernel's launch arguments for `launch_overlap` on t's device: its PDL constant, and when
    on, Triton's launch option (off, none: a Triton that predates the option takes no such keyword)."""
    return {"PDL": True, "launch_pdl": True} if launch_overlap(t) else {"PDL": False}


# A step's rows and the token that ends them: the step's input tokens `[B]` (int64, on the kernels' device) and the
# end-of-text id. Given to a decode kernel, it does nothing when every row's token is that one (`stop_args`).
Stop = tuple[torch.Tensor, int]


def stop_args(stop: Stop | None) -> dict:
    """A decode kernel's launch arguments for `stop`: with it, every program returns at its top when all of the
    step's rows hold the ending token (`steps_ended`), so a step run past the end of every row's text (a chunk's
    steps after end-of-text, a chunk launched ahead: whisper/chunks.py) costs the kernels' launches and not their
    work; its outputs are then left as they were (nobody reads them). Without it (None) the check is compiled
    out of the kernel."""
    if stop is None:
        return {"stop_ptr": None, "stop_id": 0, "STOP": 0}
    tokens, stop_id = stop
    return {"stop_ptr": tokens, "stop_id": stop_id, "STOP": triton.next_power_of_2(tokens.shape[0])}


def split_plan(batch: int, n_kv: int, kv_len: int, sms: int) -> tuple[int, int]:
    """(positions per program, programs per (row, KV head)): enough programs to cover the GPU about twice
    (one (row, KV head) alone reads its whole cache on one multiprocessor), each a whole number of
    BLOCK_N blocks, never more programs than blocks."""
    blocks = -(-kv_len // BLOCK_N)
    want = max(1, -(-2 * sms // (batch * n_kv)))
    per = -(-blocks // min(blocks, want)) * BLOCK_N
    return per, -(-kv_len // per)


def triton_attention(qkv: torch.Tensor, rope_cos: torch.Tensor | None, rope_sin: torch.Tensor | None,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, kv_len: int, dims: tuple,
                     sms: int | None = None, out: torch.Tensor | None = None, cross: bool = False,
                     stop: Stop | None = None, split: bool = True) -> torch.Tensor:
    """`reference`'s arithmetic in one kernel (plus a combine when split): qkv `[B, N]` (contiguous),
    rope_cos/rope_sin the LM's fp32 tables `[max_seq, D]` (None: no rotation, as Whisper's decoder),
    positions `[B]` long -> `[B, H*D]` in qkv's dtype. Writes each row's roped k and its v into the caches at
    its position. `sms`: the multiprocessors to fill (default: the device's; one under Triton's CPU
    interpreter, where tests run it). `out`: where to write (a new tensor by default).

    The caches are `[rows, KV, positions, D]` views of any strides but the last (Whisper's `[slots, ctx,
    H*D]` cache is one, permuted). `cross`: cross-attention, as Whisper's decoder: `qkv` holds the queries
    alone `[B, H*D]`, nothing is written and every row attends over the first `kv_len` positions of its
    cache row (the audio's keys and values). `stop`: see `stop_args`. `split=False`: one program per (row, KV
    head) over all of its positions, never split and so never combined (Whisper's self-attention, whose text
    context is 448 positions at most: a combine kernel costs a short span more than it saves)."""
    n_heads, n_kv, head_dim = dims
    b = qkv.shape[0]
    group = n_heads // n_kv
    gp = max(16, triton.next_power_of_2(group))
    sms = sms or (sm_count(qkv.device.index or 0) if qkv.is_cuda else 1)
    per, n_splits = split_plan(b, n_kv, kv_len, sms) if split else (-(-kv_len // BLOCK_N) * BLOCK_N, 1)
    if out is None:
        out = torch.empty(b, n_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    one = n_splits == 1
    overlap = dict(overlap_args(qkv), **stop_args(stop))
    if one:
        part = ml = out  # unused
    else:
        part = torch.empty(b, n_kv, n_splits, gp, head_dim, dtype=torch.float32, device=qkv.device)
        ml = torch.empty(2, b, n_kv, n_splits, gp, dtype=torch.float32, device=qkv.device)
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the caches' last dimension must be contiguous, and their layouts alike")
    rope = rope_cos is not None
    _attend[(b, n_kv, n_splits)](
        qkv, rope_cos if rope else qkv, rope_sin if rope else qkv, k_cache, v_cache, positions, out, part, ml,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), per, n_splits,
        b * n_kv * n_splits * gp, head_dim**-0.5, kv_len,
        H=n_heads, KV=n_kv, G=group, GP=gp, D=head_dim, BLOCK=BLOCK_N, ONE_SPLIT=one, ROPE=rope, CROSS=cross,
        IEEE=qkv.dtype == torch.float32, num_warps=4, **overlap)
    if not one:
        _combine[(b, n_heads)](part, ml, out, n_splits, b * n_kv * n_splits * gp,
                               KV=n_kv, G=group, GP=gp, D=head_dim, SB=min(8, triton.next_power_of_2(n_splits)),
                               num_warps=2, **overlap)
    return out


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """At a kernel's top under programmatic launch (`launch_overlap`): wait until the kernel before
        this one has finished and its writes are visible, then let the next kernel's blocks start. In
        that order only one kernel waits ahead of the running one: released first, each kernel would
        release the next at once, and the whole layer's blocks would sit on the GPU waiting (measured:
        a slower step)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def steps_ended(stop_ptr, stop_id, rows, STOP: tl.constexpr):
        """Whether each of a step's `rows` input tokens at `stop_ptr` is `stop_id` (`stop_args`; STOP: a power of
        two >= rows), under `if STOP:` (no check at all without a stop). The tokens are the previous step's choices,
        and a kernel that is not launched programmatically (the step's embeddings: `whisper.fast_decoder.FastDecoder`) runs
        between the kernel that wrote them and the first kernel that checks them, so every kernel of the step may
        read them before its `wait_for_previous`: the load then overlaps the wait instead of following it (measured
        +12 us a batch-1 step when read after the wait). An ended step still waits before it returns,
        so the kernels finish in their order."""
        r = tl.arange(0, STOP)
        tokens = tl.load(stop_ptr + r, mask=r < rows, other=stop_id)
        return tl.max((tokens != stop_id).to(tl.int32), 0) == 0

    @triton.jit
    def _rope(base, d, D: tl.constexpr, cos, sin, DT: tl.constexpr):
        """One head's D values at `base` rotated by cos/sin (fp32, already rounded to DT), rounded to DT."""
        x = tl.load(base + d).to(tl.float32)
        r = tl.load(base + (d + D // 2) % D).to(tl.float32)
        r = tl.where(d < D // 2, -r, r)
        return (x * cos + r * sin).to(DT)

    @triton.jit
    def _attend(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, part_ptr, ml_ptr,
                stride_qkv, stride_cb, stride_ch, stride_ct, per, n_splits, l_offset, scale, kv_len,
                H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                BLOCK: tl.constexpr, ONE_SPLIT: tl.constexpr, ROPE: tl.constexpr, CROSS: tl.constexpr,
                IEEE: tl.constexpr, stop_ptr, stop_id, STOP: tl.constexpr, PDL: tl.constexpr):
        if STOP:  # (read before the wait: `steps_ended`)
            ended = steps_ended(stop_ptr, stop_id, tl.num_programs(0), STOP)
        wait_for_previous(PDL)
        if STOP:
            if ended:
                return
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        DT = qkv_ptr.dtype.element_ty
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
        live = g < G
        src = qkv_ptr + row * stride_qkv
        # this KV head's G query heads as G rows (padded to GP with zeros: tl.dot's 16-row tile)
        qh = src + (kvh * G + g)[:, None] * D
        kb = k_ptr + row.to(tl.int64) * stride_cb + kvh * stride_ch
        vb = v_ptr + row.to(tl.int64) * stride_cb + kvh * stride_ch
        lo = split * per
        if CROSS:  # the audio's keys and values: all of them, nothing new
            pos = -1
            q = tl.load(qh + d[None, :], mask=live[:, None], other=0.0)
            k_new = tl.zeros([D], DT)
            v_new = tl.zeros([D], DT)
            hi = tl.minimum(lo + per, kv_len)
        else:
            pos = tl.load(pos_ptr + row).to(tl.int32)
            if ROPE:
                # rope factors at this row's position, rounded to the activations' dtype as the torch path casts them
                cos = tl.load(cos_ptr + pos * D + d).to(DT).to(tl.float32)
                sin = tl.load(sin_ptr + pos * D + d).to(DT).to(tl.float32)
                qx = tl.load(qh + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                qr = tl.load(qh + ((d + D // 2) % D)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
                qr = tl.where((d < D // 2)[None, :], -qr, qr)
                q = (qx * cos[None, :] + qr * sin[None, :]).to(DT)
                k_new = _rope(src + (H + kvh) * D, d, D, cos, sin, DT)
            else:
                q = tl.load(qh + d[None, :], mask=live[:, None], other=0.0)
                k_new = tl.load(src + (H + kvh) * D + d)
            v_new = tl.load(src + (H + KV + kvh) * D + d)
            # the program whose span holds the new position writes it; every program that reads that
            # position takes it from registers (a store is not ordered before other threads' loads)
            mine = d < tl.where((pos >= lo) & (pos < lo + per), D, 0)
            tl.store(kb + pos * stride_ct + d, k_new, mask=mine)
            tl.store(vb + pos * stride_ct + d, v_new, mask=mine)
            hi = tl.minimum(lo + per, pos + 1)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < hi
            new = (n == pos)[:, None]
            k = tl.load(kb + n[:, None] * stride_ct + d[None, :], mask=valid[:, None], other=0.0)
            k = tl.where(new, k_new[None, :], k)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            # the scores as the torch path's batched GEMM writes them: in the activations' dtype
            s = s.to(DT).to(tl.float32) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vb + n[:, None] * stride_ct + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.where(new, v_new[None, :], v)
            if IEEE:
                pv = tl.dot(p.to(DT), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(DT), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if ONE_SPLIT:
            o = acc / l_i[:, None]
            tl.store(out_ptr + row * (H * D) + (kvh * G + g)[:, None] * D + d[None, :], o.to(DT), mask=live[:, None])
        else:
            cell = (row * KV + kvh) * n_splits + split
            # the G live rows of the GP: the padding rows are never read (Whisper: 1 row of 16)
            tl.store(part_ptr + (cell * GP + g)[:, None] * D + d[None, :], acc, mask=live[:, None])
            tl.store(ml_ptr + cell * GP + g, m_i, mask=live)
            tl.store(ml_ptr + l_offset + cell * GP + g, l_i, mask=live)

    @triton.jit
    def _combine(part_ptr, ml_ptr, out_ptr, n_splits, l_offset,
                 KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,
                 stop_ptr, stop_id, STOP: tl.constexpr, PDL: tl.constexpr):
        """One query head of one row: its splits' partial sums `[splits, D]`, rescaled online SB splits a load.
        One program a query head, not a KV head: with a program per KV head (its G heads' `[splits, 16, D]`
        tile, padded to tl.dot's 16 rows) the combine cost 5.4 us of a Spark layer in the chain at one row, more
        than the attention kernel; per query head the whole Spark step takes 0.684 ms against 0.757 and Whisper's
        0.266 against 0.301."""
        if STOP:  # (read before the wait: `steps_ended`)
            ended = steps_ended(stop_ptr, stop_id, tl.num_programs(0), STOP)
        wait_for_previous(PDL)
        if STOP:
            if ended:
                return
        row = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // G
        DT = out_ptr.dtype.element_ty
        d = tl.arange(0, D)
        sb = tl.arange(0, SB)
        first = (row * KV + kvh) * n_splits
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, n_splits, SB):
            ok = (s0 + sb) < n_splits
            cell = (first + s0 + sb) * GP + head % G  # [SB]
            ms = tl.load(ml_ptr + cell, mask=ok, other=float("-inf"))
            ls = tl.load(ml_ptr + l_offset + cell, mask=ok, other=0.0)
            ps = tl.load(part_ptr + cell[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m, tl.max(ms, 0))
            alpha = tl.exp(m - m_new)
            w = tl.exp(ms - m_new)
            total = total * alpha + tl.sum(w * ls, 0)
            acc = acc * alpha + tl.sum(w[:, None] * ps, 0)
            m = m_new
        tl.store(out_ptr + row * (KV * G * D) + head * D + d, (acc / total).to(DT))

__all__ = ["reference", "supported", "triton_attention", "split_plan", "apply_rope", "sm_count", "launch_overlap",
           "overlap_args", "Stop", "stop_args", "wait_for_previous", "steps_ended"]
