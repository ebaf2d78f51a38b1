"""What the fast encoder and decoder step share: one GEMM for an attention's query/key/value projections,
and `torch.compile` with static shapes (one specialisation per batch bucket, all made at warm-up)."""

from __future__ import annotations

import torch
from torch import Tensor

from .model import Attention


def fuse_qkv(attn: Attention) -> tuple[Tensor, Tensor]:
    """An attention's query/key/value weights as one [3D, D] tensor and their biases as one [3D]
    (zeros for the key, which has no bias in Whisper), for one GEMM that makes q, k and v.

    The module's own query/key/value parameters are then made views into these (same values, so
    its reference forward is unchanged), which keeps one copy of the weights in memory, and a later
    `load_state_dict` writes through to the fused tensors. Calling it again on the same module
    returns the same tensors; after the module has been moved (`.to`), it fuses anew.
    """
    q, k, v = attn.query, attn.key, attn.value
    d = q.weight.shape[0]
    fused = getattr(attn, "_fused_qkv", None)
    if fused is not None:
        w, b = fused
        views = (q.weight, k.weight, v.weight, q.bias, v.bias)
        starts = (w.data_ptr(), w[d].data_ptr(), w[2 * d].data_ptr(), b.data_ptr(), b[2 * d].data_ptr())
        if all(p.data_ptr() == s for p, s in zip(views, starts)):
            return w, b
    # Normal tensors even when called under inference mode: parameters that became inference
    # tensors could no longer be written outside it (load_state_dict).
    with torch.inference_mode(False), torch.no_grad():
        w = torch.cat([q.weight, k.weight, v.weight])
        b = torch.cat([q.bias, torch.zeros_like(q.bias), v.bias])
        q.weight.data, k.weight.data, v.weight.data = w[:d], w[d:2 * d], w[2 * d:]
        q.bias.data, v.bias.data = b[:d], b[2 * d:]
    attn._fused_qkv = (w, b)
    return w, b


def compile_static(fn):
    """`torch.compile` with static shapes: one specialisation per shape (batch-size bucket), all
    made at warm-up. Dynamo's default recompile limit (8) is below the number of buckets."""
    from torch import _dynamo

    cfg = _dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 64))
    return torch.compile(fn, dynamic=False, fullgraph=True)

