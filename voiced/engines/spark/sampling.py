"""Batched token sampling: temperature, top-k, top-p, and a seed per request.

Randomness comes from a counter-based hash of (seed, step, token id) rather than a torch.Generator per
request: one vectorised call serves the whole batch, and a request's tokens depend only on its own
seed and logits, never on which other requests happened to share the batch. With the Gumbel-max
trick, `argmax(logits / T + Gumbel)` over the surviving candidates is an exact draw from the
renormalised top-k/top-p distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voiced.engines.kernels import decode_linear

from . import topk_kernel

MASK32 = 0xFFFFFFFF
# Candidate cap when top_k is 0 (off): the mass beyond the 1024 most likely of 166000 tokens is
# negligible for speech tokens, and sorting the full vocabulary per step would dominate the step.
MAX_CANDIDATES = 1024


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int = 0


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors; values stay < 2**32 so
    products fit in int64 and CPU and CUDA agree bit for bit."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """U(0,1) per (row, candidate), a pure function of (seed, step, token id)."""
    s = _mix(seeds & MASK32) ^ _mix((seeds >> 32) & MASK32 ^ 0x9E3779B9)
    h = _mix((s + _mix(steps & MASK32)) & MASK32)[:, None]
    h = _mix((h + ids * 0x27D4EB2D) & MASK32)
    h2 = _mix(h ^ 0x165667B1)
    bits = (h >> 8) * 256 + (h2 >> 24)  # 32 random bits
    return (bits.double() + 0.5) / 2**32


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    candidates: int | None = None,
    id_offset: int = 0,
    draw=None,
) -> torch.Tensor:
    """logits `[B, V]` (fp32, disallowed tokens already -inf) and per-row params -> token ids `[B]`.

    temperature <= 0 or top_k == 1 is greedy. top_k == 0 means no top-k limit (up to MAX_CANDIDATES).
    `candidates`: a fixed number of candidates to consider (at least every row's top_k); given, the
    function never reads a value back to the host, so it can run inside a CUDA graph. The draw does
    not depend on it: candidates past a row's own limit are masked out.
    `id_offset`: `logits` covers vocabulary ids id_offset.. (a slice of the head); returned ids and the
    noise are those of the full vocabulary, so a slice draws exactly what the full logits would.
    `draw`: what draws from the candidates (`draw_candidates` by default, or a compiled copy of it).
    """
    b, v = logits.shape
    k = int(_limit(top_k, v).max().item()) if candidates is None else min(candidates, v)
    vals, idx = top_k_candidates(logits, k)  # sorted, largest first
    return (draw or draw_candidates)(vals, idx, temperature, top_k, top_p, seeds, steps, v, id_offset)


def _limit(top_k: torch.Tensor, v: int) -> torch.Tensor:
    """Each row's candidate count: its top_k, or MAX_CANDIDATES for 0 (off), at most the vocabulary."""
    return torch.where(top_k > 0, top_k, torch.full_like(top_k, MAX_CANDIDATES)).clamp(max=min(v, MAX_CANDIDATES))


def draw_candidates(vals: torch.Tensor, idx: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, v: int,
                    id_offset: int = 0) -> torch.Tensor:
    """The draw of `sample` from a row's k candidates (values `[B, k]` sorted largest first, their ids in
    a vocabulary of `v` from `id_offset`): temperature, the row's own top-k and top-p, Gumbel noise."""
    k = vals.shape[1]
    limit = _limit(top_k, v)
    if id_offset:
        idx = idx + id_offset
    greedy = (temperature <= 0) | (top_k == 1)
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).clamp(min=1e-5)
    scaled = vals / temp[:, None]
    pos = torch.arange(k, device=vals.device)[None, :]
    scaled = scaled.masked_fill(pos >= limit[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # top-p: drop a candidate when the mass before it already reaches p (the first always survives)
    before = torch.cumsum(probs, dim=-1) - probs
    scaled = scaled.masked_fill((before >= top_p[:, None]) & (pos > 0), float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, idx))).to(scaled.dtype)
    choice = torch.argmax(scaled + gumbel, dim=-1)
    choice = torch.where(greedy, torch.zeros_like(choice), choice)
    return idx.gather(1, choice[:, None])[:, 0]


def top_k_candidates(logits: torch.Tensor, k: int, segments: int = 16, bias: torch.Tensor | None = None,
                     phase: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits.float() + bias[phase], k)` (sorted; the sum only when `bias` is given), in two
    rounds when rows are long: the top k of each of `segments` slices of a row, then the top k of those. On
    a GPU one long row is one thread block (~70 µs for the 13.5k speech ids, the costliest kernel
    of a batch-1 decode step); the first round spreads it over `segments` blocks. The same candidates come
    out, in the same order (between equal values, which torch.topk leaves unordered, lower ids first on the
    kernels' path). On a CUDA GPU each round is one Triton kernel (`topk_kernel`), which also reads the
    logits in their own dtype and adds the mask itself."""
    b, v = logits.shape
    two_rounds = v >= 4 * segments * k
    if two_rounds and topk_kernel.enabled(logits, k, segments):
        return topk_kernel.top_k(logits, k, segments, bias, phase)
    logits = logits.float() if bias is None else logits.float() + bias[phase]
    if not two_rounds:
        return torch.topk(logits, k, dim=-1)
    width = -(-v // segments)
    padded = torch.nn.functional.pad(logits, (0, width * segments - v), value=float("-inf"))
    vals, idx = padded.view(b, segments, width).topk(k, dim=-1)
    idx = idx + torch.arange(0, width * segments, width, device=logits.device)[None, :, None]
    vals, pick = vals.view(b, -1).topk(k, dim=-1)
    # a padding slot wins only when fewer than k ids are allowed; any in-range id serves (its -inf
    # value keeps it from being drawn)
    return vals, idx.view(b, -1).gather(1, pick).clamp_(max=v - 1)


def draw_step(vals: torch.Tensor, idx: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, v: int, id_offset: int,
              switch: tuple[int, int, int, int, int], out: torch.Tensor | None = None,
              last_position: int | None = None) -> torch.Tensor:
    """A decode step's draw and what it advances, in place: `ints` `[7, n]` and `floats` `[2, n]` are the
    rows' sampler state (lm_graphs.StepState's fields in its INT_FIELDS and FLOAT_FIELDS order). Draws each row's
    token from its candidates (`draw_candidates`), feeds it back (tokens), counts the step, and moves a row
    from phase `switch[0]` to `switch[1]` once it has `switch[4]` tokens of ids [switch[2], switch[3]) (a
    controllable voice's globals, then its semantic tokens; the host applies the same rule). With
    `last_position`, the positions advance too, clamped there (a row at the cache's end keeps rewriting its
    last entry; the host ends it there); with `out`, the tokens are written into it as well. One function, so
    that compiled it is a couple of kernels in a decode step instead of ~20 small ones."""
    tokens, positions, steps, phase, n_global, seeds, top_k = ints.unbind(0)
    temperature, top_p = floats.unbind(0)
    tok = draw_candidates(vals, idx, temperature, top_k, top_p, seeds, steps, v, id_offset)
    from_phase, to_phase, g_lo, g_hi, n_needed = switch
    in_from = phase == from_phase
    n_global.add_((in_from & (tok >= g_lo) & (tok < g_hi)).long())
    phase.copy_(torch.where(in_from & (n_global >= n_needed), to_phase, phase))
    steps.add_(1)
    tokens.copy_(tok)
    if last_position is not None:
        positions.copy_((positions + 1).clamp(max=last_position))
    if out is not None:
        out.copy_(tok)
    return tok


_compiled_draw_step = None


def compiled_draw_step():
    """`draw_step` through torch.compile: its ~40 small per-step ops (the hash, the top-p scan, the
    bookkeeping) fuse into a few kernels; the candidates are taken before it (`top_k_candidates`: torch.topk
    or the Triton kernels, which the compiled graph does not hold). Compiled once per process, on first use
    (the engine's warm-up), and specialised per row count: torch (2.11-2.13) refines the count to a constant
    even with dynamic=True (the in-place updates of views of `ints`, and sizes equal to the state's 7 and 2
    fields), so it serves only the decode steps' batch buckets."""
    global _compiled_draw_step
    if _compiled_draw_step is None:
        _compiled_draw_step = torch.compile(draw_step, dynamic=None)
    return _compiled_draw_step


def candidate_bucket(top_k: list[int], vocab: int) -> int:
    """The fixed candidate count a batch with these top_k values samples with: a power of two >= 64
    (few distinct CUDA graphs), at least every limit, at most MAX_CANDIDATES and the vocabulary."""
    need = max((k if k > 0 else MAX_CANDIDATES) for k in top_k) if top_k else 1
    need = min(need, MAX_CANDIDATES)
    k = 64
    while k < need:
        k *= 2
    return min(k, MAX_CANDIDATES, vocab)


class PhaseSampler:
    """The sampling that runs inside the decode graph: head over a vocabulary slice, phase mask,
    temperature/top-k/top-p with the counter-based noise, then the phase update.

    - Only ids [lo, hi) are ever allowed (Spark-TTS's global/semantic tokens and a few markers, ~13.5k
      of 166k), so the head multiplies by that slice of the tied embedding: ~8 % of the head's bytes,
      and the head is ~30 % of all weight bytes read per step.
    - `bias [n_phases, hi-lo]` is 0 where a phase allows a token, -inf elsewhere.
    - Phase `from_phase` becomes `to_phase` once a row has `n_needed` tokens of [g_lo, g_hi) (a
      controllable voice switches from writing its 32 global tokens to semantic tokens); the host
      applies the same rule when it reads the tokens back.
    """

    def __init__(self, lo: int, hi: int, bias: torch.Tensor, candidates: int, *, from_phase: int, to_phase: int,
                 g_lo: int, g_hi: int, n_needed: int) -> None:
        self.lo, self.hi, self.bias, self.candidates = lo, hi, bias, candidates
        self.switch = (from_phase, to_phase, g_lo, g_hi, n_needed)
        self.graph_key = ("phase", lo, hi, candidates, id(bias))

    def logits(self, lm, h: torch.Tensor) -> torch.Tensor:
        """The head over the slice, in the LM's dtype (`top_k_candidates` takes it as float32)."""
        w = lm.lm_head.weight[self.lo : self.hi]
        if lm.fused_linear:  # the GEMV kernel reads the slice near the memory's speed (cuBLAS: ~half)
            return decode_linear.linear(h.contiguous(), w, block_n=128)
        return torch.nn.functional.linear(h, w)

    def __call__(self, lm, h: torch.Tensor, st, rows: slice | torch.Tensor, out: torch.Tensor | None = None,
                 last_position: int | None = None) -> torch.Tensor:
        """Sample for `h [n, C]` (final-normed hidden of `st`'s rows `rows`); advances those rows'
        tokens, steps, phase and global count (and positions, to `last_position`, and writes the tokens
        into `out`: see `draw_step`); returns the ids `[n]`. `rows`: a slice (the decode steps; updated
        in place through views), or an index tensor (the first tokens of prompts prefilled together,
        whose rows need not be consecutive: gathered, then written back)."""
        ints, floats = st.columns(rows)
        vals, idx = top_k_candidates(self.logits(lm, h), min(self.candidates, self.hi - self.lo), bias=self.bias,
                                     phase=ints[st.INT_FIELDS.index("phase")])
        # Compiled for the decode steps only (`out` is theirs): their row counts are the few batch buckets,
        # each compiled once at warm-up. The first tokens come in any count of rows, and torch.compile
        # makes one graph per count (see `compiled_draw_step`): 64 counts cost a GPU start-up minutes, for
        # a draw that runs once per prefill step, beside a prefill pass that costs far more.
        draw = compiled_draw_step() if lm.compiled and out is not None else draw_step
        tok = draw(vals, idx, ints, floats, self.hi - self.lo, self.lo, self.switch, out, last_position)
        if not isinstance(rows, slice):
            st.store_ints(rows, ints)
        return tok
