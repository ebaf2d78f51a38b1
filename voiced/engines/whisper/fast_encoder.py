"""The audio encoder on a GPU (`FastEncoder`): the same network as `AudioEncoder.forward`, arranged for speed.

* the self-attention's query/key/value projections are one GEMM (`fusion.fuse_qkv`);
* one layer is a free function of (activations, that layer's tensors), so in float32 one `torch.compile` of it
  serves every layer, compiled per batch bucket at warm-up; in half precision the layers run eagerly on
  contiguous activations, each residual add and the layer norm after it one kernel where the decode kernels
  run (`encoder_layer_add_norm`);
* it runs as one CUDA graph per batch bucket (`cuda_graphs.CudaGraphs`), and its pass also projects the
  features to every decoder layer's cross-attention keys/values (`FastEncoder.project_cross`), into one buffer
  the engine copies into its cache with one call per tensor.

Results equal the reference forward up to fp16 rounding (a different GEMM shape sums in another order);
the engine runs the graph path and its eager path through this same code, with the same shapes, so the
two agree with each other bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from voiced.engines.kernels import decode_linear

from .audio import N_SAMPLES, log_mel_spectrogram
from .cuda_graphs import CudaGraphs
from .fusion import compile_static, fuse_qkv
from .model import Attention, AudioEncoder, TextDecoder


class EncoderLayer(NamedTuple):
    """One encoder block's tensors as the fast encoder reads them: the modules' own parameters, the
    self-attention's query/key/value fused (`fuse_qkv`)."""

    ln1_w: Tensor  # the self-attention's layer norm
    ln1_b: Tensor
    w_qkv: Tensor
    b_qkv: Tensor
    w_o: Tensor
    b_o: Tensor
    ln2_w: Tensor  # the MLP's layer norm
    ln2_b: Tensor
    w_1: Tensor
    b_1: Tensor
    w_2: Tensor
    b_2: Tensor

    @classmethod
    def of(cls, blk) -> EncoderLayer:
        w_qkv, b_qkv = fuse_qkv(blk.attn)
        return cls(blk.attn_ln.weight, blk.attn_ln.bias, w_qkv, b_qkv, blk.attn.out.weight, blk.attn.out.bias,
                   blk.mlp_ln.weight, blk.mlp_ln.bias, blk.mlp[0].weight, blk.mlp[0].bias, blk.mlp[2].weight,
                   blk.mlp[2].bias)


def encoder_layer(x: Tensor, n_head: int, p: EncoderLayer) -> Tensor:
    """One encoder block (pre-norm self-attention, then pre-norm GELU MLP) on x [B, T, D]."""
    b, t, d = x.shape
    h = F.layer_norm(x, (d,), p.ln1_w, p.ln1_b, 1e-5)
    qkv = F.linear(h, p.w_qkv, p.b_qkv).view(b, t, 3, n_head, d // n_head)
    q, k, v = qkv.unbind(2)  # [B, T, H, hd] views
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    x = x + F.linear(o.transpose(1, 2).reshape(b, t, d), p.w_o, p.b_o)
    h = F.layer_norm(x, (d,), p.ln2_w, p.ln2_b, 1e-5)
    return x + F.linear(F.gelu(F.linear(h, p.w_1, p.b_1)), p.w_2, p.b_2)


def encoder_layer_add_norm(x: Tensor, h: Tensor, n_head: int, next_w: Tensor, next_b: Tensor, zero: Tensor,
                           p: EncoderLayer) -> Tensor:
    """`encoder_layer` with each residual add and the layer norm after it in one kernel (`decode_linear.
    add_layer_norm`, the GEMV decoder's): x [B, T, D] contiguous, h its first layer norm (ln1: the caller's, or
    the previous layer's return). x is updated in place; returns the new x layer-normed by next_w/next_b (the
    next layer's first norm, or the encoder's final one). The projections keep their bias in cuBLAS's epilogue
    and the kernel adds `zero` [D], so the residual stream is the same bits as `encoder_layer`'s; only the
    norms' float32 sums run in another order."""
    b, t, d = x.shape
    rows = x.view(b * t, d)
    q, k, v = F.linear(h, p.w_qkv, p.b_qkv).view(b, t, 3, n_head, d // n_head).unbind(2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    h = decode_linear.add_layer_norm(F.linear(o.transpose(1, 2).reshape(1, b * t, d), p.w_o, p.b_o), rows, zero,
                                     p.ln2_w, p.ln2_b, 1e-5)
    h = decode_linear.add_layer_norm(F.linear(F.gelu(F.linear(h, p.w_1, p.b_1)), p.w_2, p.b_2)[None], rows, zero,
                                     next_w, next_b, 1e-5)
    return h.view(b, t, d)


@contextlib.contextmanager
def full_float32_convolutions(on: bool = True):
    """float32 on a GPU is asked for to get the reference's numbers, but cuDNN runs float32
    convolutions in TF32 (a 10-bit mantissa) unless told not to, which is enough to change tokens
    of a model with sharp attention. The flag is process-wide, so it is restored on the way out."""
    cudnn = torch.backends.cudnn
    before = cudnn.allow_tf32
    if on:
        cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32 = before


def encoder_pieces(n: int, buckets: list[int]) -> list[int]:
    """Split an admission of n utterances into bucket-sized encoder runs: round up to the next
    bucket when that pads by at most a quarter, else take the largest bucket that fits."""
    out = []
    while n > 0:
        up = next((b for b in buckets if b >= n), buckets[-1])
        if up <= n * 1.25 or up == buckets[0]:
            out.append(up)
            n -= min(up, n)
        else:
            down = max(b for b in buckets if b <= n)
            out.append(down)
            n -= down
    return out


class FastEncoder:
    """log-mel + encoder for a batch of padded 30 s windows, GPU layout (see module doc)."""

    def __init__(self, encoder: AudioEncoder, n_mels: int, compile_layers: bool = False,
                 cross: TextDecoder | None = None, cross_rows: int = 0, add_norm: bool = False):
        self.enc = encoder
        self.n_mels = n_mels
        self.n_head = encoder.blocks[0].attn.n_head
        self.layers = [EncoderLayer.of(blk) for blk in encoder.blocks]
        self.compiled = compile_layers
        self._layer = compile_static(encoder_layer) if compile_layers else encoder_layer
        # Eager layers with each residual add and the norm after it as one kernel (`encoder_layer_add_norm`;
        # Triton's, so a GPU's or its interpreter's): the norm after each layer is the next one's first, or ln_post.
        self.add_norm = add_norm and not compile_layers
        self.next_norms = [(p.ln1_w, p.ln1_b) for p in self.layers[1:]] + [(encoder.ln_post.weight, encoder.ln_post.bias)]
        self._zero = torch.zeros(encoder.ln_post.weight.shape, device=encoder.ln_post.weight.device)
        self.graphs: CudaGraphs | None = None  # set by the engine: `run` replays a graph per batch bucket
        self._inputs: dict[int, Tensor] = {}  # the graphs' static audio input, per batch bucket
        # The decoder's cross-attention key/value projections, run after the encoder in the same pass (in the
        # same graph), into `cross_out` [k | v, layer, row, A, D]: one buffer of `cross_rows` rows (the largest
        # bucket) that every bucket writes a prefix of. Runs are queued one after another on one stream and
        # the engine copies the rows into its cache before it queues the next, so one buffer serves them all.
        self.cross: list[Attention] = [blk.cross_attn for blk in cross.blocks] if cross is not None else []
        self.cross_out: Tensor | None = None
        if self.cross:
            w = self.cross[0].key.weight
            self.cross_out = torch.zeros(2, len(self.cross), cross_rows, encoder.positional_embedding.shape[0],
                                         w.shape[0], dtype=w.dtype, device=w.device)

    def run(self, audio: Tensor, b: int, dtype: torch.dtype) -> Tensor:
        """Features [b, A, D] of audio [b, N_SAMPLES] (padded windows), by graph or eagerly; with `cross`,
        also every decoder layer's cross keys/values of them into `cross_out[:, :, :b]` (`encode`)."""
        if self.graphs is None:
            return self.encode(audio, dtype)
        if ("encoder", b) not in self.graphs:
            self.capture(b, dtype)
        self._inputs[b].copy_(audio)
        return self.graphs.replay(("encoder", b), None)

    def capture(self, b: int, dtype: torch.dtype) -> None:
        """Record the encoder for batch bucket b (its input a static buffer `run` copies into)."""
        with torch.cuda.stream(self.graphs.stream):
            inp = self._inputs[b] = torch.zeros(b, N_SAMPLES, device=self.enc.conv1.weight.device)
        self.graphs.capture(("encoder", b), lambda: self.encode(inp, dtype))

    @torch.inference_mode()
    def encode(self, audio: Tensor, dtype: torch.dtype) -> Tensor:
        """The pass `run` records: features of audio [b, N_SAMPLES] and, with `cross`, their cross keys/values."""
        features = self(audio, dtype)
        if self.cross:
            self.project_cross(features)
        return features

    def project_cross(self, features: Tensor) -> None:
        """Every decoder layer's cross keys/values of features [b, A, D] into `cross_out[:, :, :b]`: the very
        Linear calls of `TextDecoder.write_cross` (so the same cuBLAS GEMMs, the same bits), each result
        copied into the buffer (exact). Inside the encoder's graph they are one replay with it instead of
        four host calls per layer, each of which waits to win the GIL back under load."""
        b = features.shape[0]
        k_out, v_out = self.cross_out[0, :, :b], self.cross_out[1, :, :b]
        for i, attn in enumerate(self.cross):
            k_out[i].copy_(attn.key(features))
            v_out[i].copy_(attn.value(features))

    @torch.inference_mode()
    def __call__(self, audio: Tensor, dtype: torch.dtype) -> Tensor:
        """audio [B, 480000] float32 (padded windows) -> features [B, n_ctx, D] in `dtype`."""
        enc = self.enc
        mel = log_mel_spectrogram(audio, self.n_mels).to(dtype)
        with full_float32_convolutions(dtype == torch.float32):
            x = F.gelu(enc.conv1(mel))
            x = F.gelu(enc.conv2(x)).transpose(1, 2)
        x = (x + enc.positional_embedding).to(dtype)
        if not self.compiled:
            # The convolutions' output transposed is a view ([B, D, T] in memory), and an eager residual add keeps
            # its first operand's layout, so every eager layer would run on strided activations, ~25 % slower than
            # on contiguous ones. A compiled layer lays out its own buffers.
            x = x.contiguous()
        if self.add_norm:
            h = F.layer_norm(x, x.shape[-1:], self.layers[0].ln1_w, self.layers[0].ln1_b, 1e-5)
            for p, (next_w, next_b) in zip(self.layers, self.next_norms):
                h = encoder_layer_add_norm(x, h, self.n_head, next_w, next_b, self._zero, p)
            return h
        for p in self.layers:
            x = self._layer(x, self.n_head, p)
        return F.layer_norm(x, x.shape[-1:], enc.ln_post.weight, enc.ln_post.bias, enc.ln_post.eps)

