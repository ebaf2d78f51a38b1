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
) -> torch.Tensor:
    """logits `[B, V]` (fp32, disallowed tokens already -inf) and per-row params -> token ids `[B]`.

    temperature <= 0 or top_k == 1 is greedy. top_k == 0 means no top-k limit (up to MAX_CANDIDATES).
    """
    b, v = logits.shape
    limit = torch.where(top_k > 0, top_k, torch.full_like(top_k, MAX_CANDIDATES)).clamp(max=min(v, MAX_CANDIDATES))
    k = int(limit.max().item())
    vals, idx = torch.topk(logits, k, dim=-1)  # sorted, largest first
    greedy = (temperature <= 0) | (top_k == 1)
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).clamp(min=1e-5)
    scaled = vals / temp[:, None]
    pos = torch.arange(k, device=logits.device)[None, :]
    scaled = scaled.masked_fill(pos >= limit[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # top-p: drop a candidate when the mass before it already reaches p (the first always survives)
    before = torch.cumsum(probs, dim=-1) - probs
    scaled = scaled.masked_fill((before >= top_p[:, None]) & (pos > 0), float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, idx))).to(scaled.dtype)
    choice = torch.argmax(scaled + gumbel, dim=-1)
    choice = torch.where(greedy, torch.zeros_like(choice), choice)
    return idx.gather(1, choice[:, None])[:, 0]
