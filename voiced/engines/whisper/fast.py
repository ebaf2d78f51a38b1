"""The audio encoder's GPU path: the same network as `AudioEncoder.forward`, arranged for speed.

Used only on CUDA (the CPU keeps the reference forward, which the exactness tests pin down):

* the self-attention's query/key/value projections are one GEMM against concatenated weights
  (N = 3 * width: one launch instead of three, better tile occupancy at batch 1), whose output
  splits into heads as views, so attention reads them in place and writes a layout that merges
  back without a copy;
* one encoder layer is a free function of (activations, that layer's tensors), so an optional
  `torch.compile` of it serves all 32 layers (fused bias + GELU, residual + layer norm) and is
  compiled once per batch-size bucket at warm-up, never while serving;
* the attention backend can be pinned (flash, cuDNN, memory-efficient) with `attn_backend`.

Results equal the reference forward up to fp16 rounding (a different GEMM shape sums in a
different order), not bit for bit; the engine runs the graph path and its eager path through this
same code, with the same shapes, so the two agree with each other.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from .audio import log_mel_spectrogram
from .model import AudioEncoder

log = logging.getLogger(__name__)


def encoder_layer(x: Tensor, n_head: int, ln1_w: Tensor, ln1_b: Tensor, w_qkv: Tensor, b_qkv: Tensor,
                  w_o: Tensor, b_o: Tensor, ln2_w: Tensor, ln2_b: Tensor, w_1: Tensor, b_1: Tensor,
                  w_2: Tensor, b_2: Tensor) -> Tensor:
    """One encoder block (pre-norm self-attention, then pre-norm GELU MLP) on x [B, T, D]."""
    b, t, d = x.shape
    h = F.layer_norm(x, (d,), ln1_w, ln1_b, 1e-5)
    qkv = F.linear(h, w_qkv, b_qkv).view(b, t, 3, n_head, d // n_head)
    q, k, v = qkv.unbind(2)  # [B, T, H, hd] views
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    x = x + F.linear(o.transpose(1, 2).reshape(b, t, d), w_o, b_o)
    h = F.layer_norm(x, (d,), ln2_w, ln2_b, 1e-5)
    return x + F.linear(F.gelu(F.linear(h, w_1, b_1)), w_2, b_2)


_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}


class FastEncoder:
    """log-mel + encoder for a batch of padded 30 s windows, GPU layout (see module doc)."""

    def __init__(self, encoder: AudioEncoder, n_mels: int, attn_backend: str | None = None,
                 compile_layers: bool = False):
        self.enc = encoder
        self.n_mels = n_mels
        self.n_head = encoder.blocks[0].attn.n_head
        self.attn_backend = attn_backend
        self.layers: list[tuple[Tensor, ...]] = []
        for blk in encoder.blocks:
            a = blk.attn
            w_qkv = torch.cat([a.query.weight, a.key.weight, a.value.weight]).contiguous()
            b_qkv = torch.cat([a.query.bias, torch.zeros_like(a.query.bias), a.value.bias]).contiguous()
            self.layers.append((blk.attn_ln.weight, blk.attn_ln.bias, w_qkv, b_qkv, a.out.weight, a.out.bias,
                                blk.mlp_ln.weight, blk.mlp_ln.bias, blk.mlp[0].weight, blk.mlp[0].bias,
                                blk.mlp[2].weight, blk.mlp[2].bias))
        self._layer = encoder_layer
        self.compiled = False
        if compile_layers:
            # Static shapes: one specialisation per batch-size bucket, all made at warm-up.
            from torch import _dynamo

            cfg = _dynamo.config
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, knob):
                    setattr(cfg, knob, max(getattr(cfg, knob), 64))
            self._layer = torch.compile(encoder_layer, dynamic=False, fullgraph=True)
            self.compiled = True

    def _sdpa_ctx(self) -> contextlib.AbstractContextManager:
        if self.attn_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, _BACKENDS[self.attn_backend])])

    @torch.inference_mode()
    def __call__(self, audio: Tensor, dtype: torch.dtype) -> Tensor:
        """audio [B, 480000] float32 (padded windows) -> features [B, n_ctx, D] in `dtype`."""
        enc = self.enc
        mel = log_mel_spectrogram(audio, self.n_mels).to(dtype)
        x = F.gelu(enc.conv1(mel))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)
        x = (x + enc.positional_embedding).to(dtype)
        with self._sdpa_ctx():
            for p in self.layers:
                x = self._layer(x, self.n_head, *p)
        return F.layer_norm(x, x.shape[-1:], enc.ln_post.weight, enc.ln_post.bias, enc.ln_post.eps)
