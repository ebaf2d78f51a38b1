"""The GPU paths of the audio encoder and of the decoder step: the same networks as
`AudioEncoder.forward` and `TextDecoder.step`, arranged for speed.

The encoder path runs on CUDA; the decoder step on every device (on the CPU uncompiled: fewer ops
per step is what counts there):

* the self-attention's query/key/value projections are one GEMM against concatenated weights
  (N = 3 * width: one launch instead of three, better tile occupancy at batch 1), whose output
  splits into heads as views, so attention reads them in place and writes a layout that merges
  back without a copy. The modules' own query/key/value parameters become views into the fused
  tensors, so the fused layout costs no extra memory and both layouts always hold the same numbers;
* one layer is a free function of (activations, that layer's tensors[, its caches]), so an
  optional `torch.compile` of it serves every layer (fused bias + GELU, residual + layer norm) and
  is compiled once per batch-size bucket at warm-up, never while serving;
* the encoder's attention backend can be pinned (flash, cuDNN, memory-efficient) with
  `attn_backend`; the decoder step keeps `decode_attention_kernels`, as the reference step does;
* on a GPU both run as CUDA graphs, one per batch-size bucket (`CudaGraphs`): the encoder through
  `FastEncoder.run`, the decoder step (this one or the modules') through `DecoderSteps`, which owns
  the static per-row inputs a graph reads (with the engine's `chunk_graphs`, on by default, also a
  whole chunk of greedy steps and their history writes as one graph). Given the decoder (the engine's
  `cross_in_encoder`, on by default), the encoder's pass, graphed or not, also projects its features to every decoder layer's
  cross-attention keys/values (`FastEncoder.project_cross`, the modules' own Linear calls), into one
  buffer the engine copies into its cache with one call per tensor.

Results equal the reference forwards up to fp16 rounding (a different GEMM shape sums in a
different order, compiled kernels fuse differently), not bit for bit; the engine runs the graph
path and its eager path through this same code, with the same shapes, so the two agree with each
other. In float32 on the CPU the uncompiled functions match the reference to ~1e-6 (tested).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from voiced.engines.kernels import decode_attention, decode_linear
from voiced.engines.rows import to_device

from .audio import N_SAMPLES, log_mel_spectrogram
from .model import Attention, AudioEncoder, KVCache, TextDecoder, decode_attention_kernels
from .token_choice import greedy_advance

log = logging.getLogger(__name__)


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


def encoder_layer_add_norm(x: Tensor, h: Tensor, n_head: int, next_w: Tensor, next_b: Tensor, zero: Tensor,
                           ln1_w: Tensor, ln1_b: Tensor, w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor,
                           ln2_w: Tensor, ln2_b: Tensor, w_1: Tensor, b_1: Tensor, w_2: Tensor,
                           b_2: Tensor) -> Tensor:
    """`encoder_layer` with each residual add and the layer norm after it in one kernel (`decode_linear.
    add_layer_norm`, the GEMV decoder's): x [B, T, D] contiguous, h its first layer norm (ln1: the caller's, or
    the previous layer's return). x is updated in place; returns the new x layer-normed by next_w/next_b (the
    next layer's first norm, or the encoder's final one). The projections keep their bias in cuBLAS's epilogue
    and the kernel adds `zero` [D], so the residual stream is the same bits as `encoder_layer`'s; only the
    norms' float32 sums run in another order."""
    b, t, d = x.shape
    rows = x.view(b * t, d)
    q, k, v = F.linear(h, w_qkv, b_qkv).view(b, t, 3, n_head, d // n_head).unbind(2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    h = decode_linear.add_layer_norm(F.linear(o.transpose(1, 2).reshape(1, b * t, d), w_o, b_o), rows, zero,
                                     ln2_w, ln2_b, 1e-5)
    h = decode_linear.add_layer_norm(F.linear(F.gelu(F.linear(h, w_1, b_1)), w_2, b_2)[None], rows, zero,
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


# What a captured step returns: its static output tensor(s), or None when it only writes buffers.
GraphOutput = Tensor | tuple[Tensor, ...] | None


class CudaGraphs:
    """CUDA graphs of an engine's steps, one per key (a step's name and its batch bucket), captured on
    first use on the engine's `stream` into the memory `pool` all of its graphs share. Everything the
    engine runs goes on that one stream, captures included: cuBLAS keeps a workspace per stream and
    picks kernels by it, so eager steps and captured ones only run the same kernels (and give the
    same bits) on the same stream."""

    def __init__(self, stream: torch.cuda.Stream, pool) -> None:
        self.stream, self.pool = stream, pool
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, GraphOutput]] = {}

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    def capture(self, key: tuple[str, int], fn, restore: tuple[Tensor, ...] = ()) -> None:
        """Record `fn()` for `key` (also safe mid-stream): it runs twice on the capture stream first
        (compiles, if asked, and makes lazy inits happen outside capture); the buffers in `restore`,
        which those runs advance, are put back before the capture, which itself executes nothing."""
        with torch.cuda.stream(self.stream):
            saved = [t.clone() for t in restore]
            for _ in range(2):
                fn()
            for t, v in zip(restore, saved):
                t.copy_(v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn()
        self._graphs[key] = (graph, out)
        log.debug("captured the %s graph for batch %d", *key)

    def replay(self, key: tuple[str, int], fn, restore: tuple[Tensor, ...] = ()) -> GraphOutput:
        """Replay `key`'s graph (captured from `fn` first if it has none); returns its output."""
        if key not in self._graphs:
            self.capture(key, fn, restore)
        graph, out = self._graphs[key]
        graph.replay()
        return out


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


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def pinned_attention(backend: str | None) -> contextlib.AbstractContextManager:
    """Scaled dot-product attention pinned to `backend` (a key of SDPA_BACKENDS) inside the context; None
    leaves torch's choice."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])])


class FastEncoder:
    """log-mel + encoder for a batch of padded 30 s windows, GPU layout (see module doc)."""

    def __init__(self, encoder: AudioEncoder, n_mels: int, attn_backend: str | None = None,
                 compile_layers: bool = False, cross: TextDecoder | None = None, cross_rows: int = 0,
                 add_norm: bool = False):
        self.enc = encoder
        self.n_mels = n_mels
        self.n_head = encoder.blocks[0].attn.n_head
        self.attn_backend = attn_backend
        self.layers: list[tuple[Tensor, ...]] = []
        for blk in encoder.blocks:
            a = blk.attn
            w_qkv, b_qkv = fuse_qkv(a)
            self.layers.append((blk.attn_ln.weight, blk.attn_ln.bias, w_qkv, b_qkv, a.out.weight, a.out.bias,
                                blk.mlp_ln.weight, blk.mlp_ln.bias, blk.mlp[0].weight, blk.mlp[0].bias,
                                blk.mlp[2].weight, blk.mlp[2].bias))
        self.compiled = compile_layers
        self._layer = compile_static(encoder_layer) if compile_layers else encoder_layer
        # Eager layers with each residual add and the norm after it as one kernel (`encoder_layer_add_norm`;
        # Triton's, so a GPU's or its interpreter's): the norm after each layer is the next one's first, or ln_post.
        self.add_norm = add_norm and not compile_layers
        self.next_norms = [(p[0], p[1]) for p in self.layers[1:]] + [(encoder.ln_post.weight, encoder.ln_post.bias)]
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
        four host calls per layer, each of which waits to win the GIL back (issue 26)."""
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
            # its first operand's layout, so every eager layer would run on strided activations: on an H200 one
            # large-v3-turbo layer 0.212 / 6.00 ms at batch 1 / 32 so, 0.162 / 4.76 contiguous (session 26,
            # encoder_layer_bench). A compiled layer lays out its own buffers (0.178 / 4.79 from this layout).
            x = x.contiguous()
        with pinned_attention(self.attn_backend):
            if self.add_norm:
                h = F.layer_norm(x, x.shape[-1:], self.layers[0][0], self.layers[0][1], 1e-5)
                for p, (next_w, next_b) in zip(self.layers, self.next_norms):
                    h = encoder_layer_add_norm(x, h, self.n_head, next_w, next_b, self._zero, *p)
                return h
            for p in self.layers:
                x = self._layer(x, self.n_head, *p)
        return F.layer_norm(x, x.shape[-1:], enc.ln_post.weight, enc.ln_post.bias, enc.ln_post.eps)


def decoder_layer_step(x: Tensor, mask: Tensor | None, rows: Tensor, positions: Tensor, self_k: Tensor,
                       self_v: Tensor, cross_k: Tensor, cross_v: Tensor, kv_len: int, n_head: int,
                       ln1_w: Tensor, ln1_b: Tensor, w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor,
                       ln2_w: Tensor, ln2_b: Tensor, w_cq: Tensor, b_cq: Tensor, w_co: Tensor, b_co: Tensor,
                       ln3_w: Tensor, ln3_b: Tensor, w_1: Tensor, b_1: Tensor, w_2: Tensor, b_2: Tensor) -> Tensor:
    """One decoder block for one new token per row: x [B, 1, D] -> [B, 1, D] (as `TextDecoder._step`).

    self_k/self_v [slots, ctx, D] and cross_k/cross_v [slots, A, D] are this layer's caches. Row b's
    new key/value are written at (rows[b], positions[b]); row b then attends over the first kv_len
    self positions of slot b (mask: additive [B, 1, 1, kv_len], or None when every row may see all
    of them) and over all of slot b's audio positions. The cross-attention query stays its own GEMM:
    its keys/values were projected once at admission.
    """
    b, _, d = x.shape
    hd = d // n_head
    h = F.layer_norm(x, (d,), ln1_w, ln1_b, 1e-5)
    q, k, v = F.linear(h, w_qkv, b_qkv).view(b, 3, n_head, hd).unbind(1)  # [B, H, hd] views
    self_k[rows, positions] = k.reshape(b, d)
    self_v[rows, positions] = v.reshape(b, d)
    keys = self_k[:b, :kv_len].view(b, kv_len, n_head, hd).transpose(1, 2)
    values = self_v[:b, :kv_len].view(b, kv_len, n_head, hd).transpose(1, 2)
    if b <= SMALL_BATCH:
        # Written out, not SDPA: with one query per head the fused kernels run one block per (row,
        # head) over all kv_len keys (~28 µs a layer at batch 1 on an H200, the costliest kernel of
        # the step); two batched GEMMs and a softmax the compiler fuses with the mask take a few µs.
        scores = torch.matmul(q[:, :, None], keys.transpose(-1, -2)).float() * hd**-0.5  # [B, H, 1, kv_len]
        if mask is not None:
            scores = scores + mask
        o = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, H, 1, hd]
    else:  # many rows fill the GPU anyway, and the fused kernel reads the keys once (5.6 vs 9.0 ms at 256)
        o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask)  # [B, H, 1, hd]
    x = x + F.linear(o.reshape(b, 1, d), w_o, b_o)
    h = F.layer_norm(x, (d,), ln2_w, ln2_b, 1e-5)
    q = F.linear(h, w_cq, b_cq).view(b, 1, n_head, hd).transpose(1, 2)
    a = cross_k.shape[1]
    keys = cross_k[:b].view(b, a, n_head, hd).transpose(1, 2)
    values = cross_v[:b].view(b, a, n_head, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, keys, values)
    x = x + F.linear(o.reshape(b, 1, d), w_co, b_co)
    h = F.layer_norm(x, (d,), ln3_w, ln3_b, 1e-5)
    return x + F.linear(F.gelu(F.linear(h, w_1, b_1)), w_2, b_2)


# Up to this many rows a decoder step writes its self-attention out (see decoder_layer_step). The
# batch is a static shape per compiled bucket, so each bucket takes one branch, in graphs and eagerly.
SMALL_BATCH = 16


def additive_mask(positions: Tensor, kv_len: int, dtype: torch.dtype) -> Tensor:
    """[B, 1, 1, kv_len]: 0 where row b may attend (cache positions 0..positions[b]), -inf elsewhere.

    The very mask SDPA makes of a boolean one, made once per step instead of once per layer and
    attention call (a few kernels each, at a few microseconds apiece).
    """
    allowed = torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None]
    mask = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=positions.device)
    return mask.masked_fill_(allowed, 0.0)[:, None, None, :]


def step_embeddings(tokens: Tensor, positions: Tensor, emb_w: Tensor, pos_emb: Tensor, dtype: torch.dtype) -> Tensor:
    """A step's activations [B, D]: each row's token embedding plus its position's, in the cache's dtype."""
    return (F.embedding(tokens, emb_w) + pos_emb[positions]).to(dtype)


def step_inputs(tokens: Tensor, positions: Tensor, emb_w: Tensor, pos_emb: Tensor, kv_len: int, masked: bool,
                dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """What every layer of a step takes: activations [B, 1, D] (token + position embeddings), the
    additive mask (None when unmasked) and the row indices 0..B-1. A function of its own so that
    it compiles too (seven small kernels -> two)."""
    x = step_embeddings(tokens, positions, emb_w, pos_emb, dtype)[:, None, :]
    mask = additive_mask(positions, kv_len, dtype) if masked else None
    return x, mask, torch.arange(tokens.shape[0], device=tokens.device)


def gemv_supported(decoder: TextDecoder, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the GEMV step can run: the shared kernels' GPU and dtypes, and a head size they tile."""
    n_head = decoder.blocks[0].attn.n_head
    width = decoder.token_embedding.weight.shape[1]
    return (decode_linear.supported(dtype, device)
            and decode_attention.supported(dtype, device, (n_head, n_head, width // n_head)))


def _heads_view(cache: Tensor, n_head: int) -> Tensor:
    """One layer's `[slots, ctx, width]` cache as the kernel's `[slots, heads, ctx, head size]` (a view)."""
    slots, ctx, width = cache.shape
    return cache.view(slots, ctx, n_head, width // n_head).permute(0, 2, 1, 3)


class FastDecoder:
    """The text decoder's one-token step, GPU layout (see module doc); called like `TextDecoder.step`.

    Prefill (a few calls per request) keeps the modules' path; the step runs once per token.

    `gemv` (a CUDA GPU with Triton; the engine's default there, VOICED_WHISPER_GEMV_DECODER=0 turns it off):
    the step through the kernels the Spark LM's step runs (voiced.engines.kernels), about 13 a layer with
    programmatic launch between them, in place of cuBLAS's GEMMs and the compiled layer: every projection a
    GEMV reading its weight once (the output projections split along K, their partial sums reduced with the
    bias, the residual add and the next layer norm in one small kernel), the self-attention's cache write and
    attention one kernel, the cross-attention one kernel over the audio's keys and values, the head a GEMV over
    the tied embedding.
    The arithmetic is the layer's, rounded where the torch path rounds; sums run in another order.
    """

    def __init__(self, decoder: TextDecoder, compile_layers: bool = False, gemv: bool = False,
                 compile_tail: bool = False, fewer_kernels: bool = False):
        self.dec = decoder
        self.gemv = gemv
        # (the GEMV step's) the self-attention in one program per (row, head), with no combine kernel after it: the
        # text context is at most 448 positions, 7 blocks of 64, and a row attends only up to its own position; the
        # logits written in float32 by their GEMV, with no kernel to widen them (both give the same bits); and a
        # greedy step's choice made in the head's GEMV and one small kernel (`greedy_step`), in place of ~10 kernels
        # of the compiled token choice (the same tokens; log-probabilities summed in another order)
        self.fewer_kernels = fewer_kernels
        self.n_head = decoder.blocks[0].attn.n_head
        self.layers: list[tuple[Tensor, ...]] = []
        for blk in decoder.blocks:
            a, c = blk.attn, blk.cross_attn
            w_qkv, b_qkv = fuse_qkv(a)
            self.layers.append((blk.attn_ln.weight, blk.attn_ln.bias, w_qkv, b_qkv, a.out.weight, a.out.bias,
                                blk.cross_attn_ln.weight, blk.cross_attn_ln.bias, c.query.weight, c.query.bias,
                                c.out.weight, c.out.bias, blk.mlp_ln.weight, blk.mlp_ln.bias,
                                blk.mlp[0].weight, blk.mlp[0].bias, blk.mlp[2].weight, blk.mlp[2].bias))
        self.compiled = compile_layers
        # the layer norm after each layer: the next layer's first, or the decoder's final one (the GEMV step
        # applies it with the residual add that ends the layer)
        self.next_norms = [(p[0], p[1]) for p in self.layers[1:]] + [(decoder.ln.weight, decoder.ln.bias)]
        self._inputs = compile_static(step_inputs) if compile_layers else step_inputs
        # the GEMV step's embeddings (three kernels eagerly), compiled with the engine's compiled tail
        # (`DecoderSteps`); the layer norm after them stays torch's (compiled, it would round otherwise)
        self.compiled_tail = compile_tail
        self._embed = compile_static(step_embeddings) if compile_tail else step_embeddings
        self._layer = compile_static(decoder_layer_step) if compile_layers else decoder_layer_step

    def step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int, masked: bool = True,
             stop_id: int | None = None) -> Tensor:
        """tokens [B] at positions [B] for slots 0..B-1 -> logits [B, vocab] (see `TextDecoder.step`).

        `stop_id` (the GEMV step only; `DecoderSteps`'s `skip_ended`): when every row's token is this one, the
        step's kernels return at their top and the logits are left as they were (`decode_attention.stop_args`)."""
        if self.gemv and masked:
            return self._gemv_step(tokens, positions, cache, kv_len, stop_id)
        with decode_attention_kernels(tokens.is_cuda):
            dec = self.dec
            x, mask, rows = self._inputs(tokens, positions, dec.token_embedding.weight, dec.positional_embedding,
                                         kv_len, masked, cache.self_k.dtype)
            for i, p in enumerate(self.layers):
                x = self._layer(x, mask, rows, positions, cache.self_k[i], cache.self_v[i], cache.cross_k[i],
                                cache.cross_v[i], kv_len, self.n_head, *p)
            return dec._logits(x[:, 0])

    def greedy_step(self, inputs: Tensor, lp: Tensor, cache: KVCache, kv_len: int, always: Tensor, eot: int,
                    hist: Tensor | None = None, skip_ended: bool = False) -> None:
        """The GEMV step and its greedy choice with the choice in the head's GEMV (`fewer_kernels`:
        `decode_linear.greedy_head`): `token_choice.greedy_advance(step(...), always, eot, inputs, lp)` for the rows
        of `inputs` [3, B] (tokens, positions, minimum-length countdowns), in place, the logits never written;
        `hist` [B, 2]: a chunk's step of the engine's history, written too. `skip_ended`: as `step`'s `stop_id`."""
        tokens, positions = inputs[0], inputs[1]
        stop = (tokens, eot) if skip_ended else None
        h = self._gemv_hidden(tokens, positions, cache, kv_len, stop)
        decode_linear.greedy_head(h, self.dec.token_embedding.weight.to(h.dtype), always, eot, inputs, lp, hist, stop)

    def _gemv_step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                   stop_id: int | None = None) -> Tensor:
        """`step` through the GEMV kernels (see the class doc); each row attends to its positions 0..pos."""
        stop = None if stop_id is None else (tokens, stop_id)
        h = self._gemv_hidden(tokens, positions, cache, kv_len, stop)
        # `h` is the final layer norm's output: the logits are its product with the tied embedding
        head = self.dec.token_embedding.weight.to(h.dtype)
        if self.fewer_kernels:
            return decode_linear.linear(h, head, block_n=128, stop=stop, out_dtype=torch.float32)
        return decode_linear.linear(h, head, block_n=128, stop=stop).float()

    def _gemv_hidden(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                     stop: decode_attention.Stop | None) -> Tensor:
        """The GEMV step's layers: the final layer norm's output [B, D], which the head multiplies."""
        dec, n = self.dec, self.n_head
        x = self._embed(tokens, positions, dec.token_embedding.weight, dec.positional_embedding, cache.self_k.dtype)
        dims = (n, n, x.shape[1] // n)
        h = F.layer_norm(x, x.shape[-1:], self.layers[0][0], self.layers[0][1], 1e-5)
        for i, (p, (next_w, next_b)) in enumerate(zip(self.layers, self.next_norms)):
            _, _, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_cq, b_cq, w_co, b_co, ln3_w, ln3_b, w_1, b_1, w_2, b_2 = p
            self_k, self_v = _heads_view(cache.self_k[i], n), _heads_view(cache.self_v[i], n)
            cross_k, cross_v = _heads_view(cache.cross_k[i], n), _heads_view(cache.cross_v[i], n)
            o = decode_attention.triton_attention(decode_linear.linear(h, w_qkv, b_qkv, stop=stop), None, None, self_k,
                                                  self_v, positions, kv_len, dims, stop=stop,
                                                  split=not self.fewer_kernels)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(o, w_o, stop=stop), x, b_o, ln2_w, ln2_b,
                                             1e-5, stop)
            o = decode_attention.triton_attention(decode_linear.linear(h, w_cq, b_cq, stop=stop), None, None, cross_k,
                                                  cross_v, positions, cross_k.shape[2], dims, cross=True, stop=stop)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(o, w_co, stop=stop), x, b_co, ln3_w, ln3_b,
                                             1e-5, stop)
            a = decode_linear.linear(h, w_1, b_1, gelu=True, stop=stop)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(a, w_2, stop=stop), x, b_2, next_w, next_b,
                                             1e-5, stop)
        return h


def conditional_nodes_supported() -> bool:
    """Whether this torch captures CUDA graph conditional nodes (`run_if`): CUDAGraph's
    begin_capture_to_if_node (recent releases; CUDA 12.4 or newer)."""
    g = torch.cuda.CUDAGraph
    return all(hasattr(g, m) for m in ("begin_capture_to_if_node", "end_capture_to_conditional_node",
                                       "get_currently_capturing_graph"))


def run_if(pred: Tensor, fn) -> None:
    """fn() where the bool scalar `pred` is true: inside a CUDA graph capture as a conditional (IF) node, whose
    body the GPU skips when pred is false at that point of the replay; eagerly by reading pred (a host sync)."""
    if pred.is_cuda and torch.cuda.is_current_stream_capturing():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(pred)
        try:
            fn()
        finally:
            graph.end_capture_to_conditional_node()
    elif bool(pred):
        fn()


class DecoderSteps:
    """The decoder's one-token step for rows 0..b-1, from static per-row buffers on the model's device
    (token, position, minimum-length countdown, the chosen token's log-probability), by a CUDA graph
    per (step, batch bucket) when `graphs` is given, else eagerly. `decoder` is the fused step
    (`FastDecoder`) or the modules' (`TextDecoder`):

    - `plain(b)`: logits [b, vocab] out; token choice on the host (`token_choice.choose_tokens`);
    - `greedy(b)`: the step and the greedy choice on the device (`token_choice.greedy_choice`): the
      chosen tokens become the next step's inputs and positions advance, so steps can follow each
      other with no host round trip;
    - `chunk(b)`: `hist.shape[1]` (the engine's `decode_chunk`) greedy steps back to back, each followed
      by writing its chosen tokens and their log-probabilities into step k of `hist` (the engine's
      history buffer, float64 [max_batch, decode_chunk, (token, log-prob)]): the very calls, in the
      very order, of the engine's per-step loop (`WhisperEngine._greedy_chunk`), so as one CUDA graph
      it runs the kernels of decode_chunk greedy replays and their 2 x decode_chunk history writes, one
      host call instead of 3 x decode_chunk (issue 26: each call waits to win the GIL back). Its graph
      is only ever captured at warm-up (`capture`, never by `run`): its eager pre-runs advance rows by
      2 x decode_chunk positions, which from a live row near its length limit would index past the
      text context.

    With `stopping` (VOICED_WHISPER_STOPPING_CHUNKS=1, off by default, never run on a GPU: it needs a torch newer
    than 2.11, `conditional_nodes_supported`), a chunk stops on
    the device: after each step, `live` says whether the next one runs, false once a real row (`limit` > 0:
    the host writes the chunk's step limit for its rows, 0 for a bucket's padding rows) has chosen end-of-text
    or `limit` steps have run, and every step after the first is a CUDA graph conditional node on it
    (`run_if`), which the GPU skips. The chunk first marks every step of `hist` not run (token -1). So one
    launch can cover a whole utterance without running steps past its end, where a plain chunk comes back to
    the host every decode_chunk steps (~1 ms each under the profiler in session 27: docs/BENCHMARKS.md) and
    runs on past end-of-text to the chunk's end.

    With the GEMV step's `fewer_kernels` (`fused`), a greedy step's choice and bookkeeping are made in the head's
    GEMV and one pick kernel (`FastDecoder.greedy_step`), which for a chunk's step also writes its history entry.

    A row that has chosen end-of-text keeps it as its token (`greedy_advance`), and a graph's padding rows are
    given it as theirs (`WhisperEngine._load_inputs`). With `skip_ended` (the GEMV step: the engine's
    VOICED_WHISPER_SKIP_ENDED), a greedy step whose rows all hold end-of-text does none of its GEMV, attention and
    norm kernels' work (`decode_attention.stop_args`): the steps of a chunk past every row's end, and a chunk
    launched ahead of a read that ends them all (decode-ahead), cost the kernels' launches, not the step.
    """

    def __init__(self, decoder: FastDecoder | TextDecoder, cache: KVCache, n_text_ctx: int, max_batch: int,
                 device: torch.device, always: Tensor, eot: int, graphs: CudaGraphs | None = None,
                 hist: Tensor | None = None, compile_tail: bool = False, stopping: bool = False,
                 skip_ended: bool = False) -> None:
        self.decoder, self.cache, self.n_text_ctx = decoder, cache, n_text_ctx
        self.always, self.eot = always, eot
        self.hist = hist  # the engine's greedy history [max_batch, decode_chunk, 2] float64 (`chunk` writes it)
        # Token, position, minimum-length countdown and (stopping chunks) the chunk's step limit are rows of one
        # block, so the host writes all of a step's inputs with one copy (`WhisperEngine._load_inputs`).
        self.inputs = torch.zeros(4, max_batch, dtype=torch.long, device=device)
        self.tok, self.pos, self.minleft, self.limit = self.inputs.unbind(0)
        self.stopping = stopping
        gemv = isinstance(decoder, FastDecoder) and decoder.gemv
        self.skip_ended = skip_ended and gemv  # (only the GEMV step's kernels check for ended rows)
        # the GEMV step with fewer kernels chooses a greedy step's tokens in its head (`FastDecoder.greedy_step`)
        self.fused = gemv and decoder.fewer_kernels
        self.count = torch.zeros((), dtype=torch.long, device=device)  # steps run in this chunk
        self.live = torch.ones((), dtype=torch.bool, device=device)  # whether the chunk's next step runs
        self.lp = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.graphs = graphs
        # The greedy choice and its bookkeeping after each step (`token_choice.greedy_advance`); compiled with
        # the engine's compiled tail (VOICED_WHISPER_COMPILED_TAIL), in graphs and out of them alike.
        self._advance = compile_static(greedy_advance) if compile_tail else greedy_advance

    def plain(self, b: int) -> Tensor:
        """The step over the whole context with a mask (the graph and the eager path run the very same
        kernels)."""
        return self.decoder.step(self.tok[:b], self.pos[:b], self.cache, self.n_text_ctx)

    def greedy(self, b: int, kv_len: int | None = None, masked: bool = True, k: int | None = None) -> None:
        """Decoder step + greedy choice, all on the device (kv_len / masked: as `TextDecoder.step`;
        the CPU attends only as far as it must). `k`: a chunk's step, whose history the fused choice writes
        (`fused`; otherwise the caller writes it)."""
        if self.fused:
            self.decoder.greedy_step(self.inputs[:3, :b], self.lp[:b], self.cache, self.n_text_ctx, self.always,
                                     self.eot, hist=None if k is None else self.hist[:b, k], skip_ended=self.skip_ended)
            return
        stop = {"stop_id": self.eot} if self.skip_ended else {}  # (the modules' step takes no stop)
        logits = self.decoder.step(self.tok[:b], self.pos[:b], self.cache, kv_len or self.n_text_ctx, masked, **stop)
        self._advance(logits, self.always, self.eot, self.inputs[:3, :b], self.lp[:b])

    def chunk(self, b: int) -> None:
        """`hist.shape[1]` greedy steps, each followed by writing its tokens and log-probabilities into
        that step of `hist[:b]` (the engine's per-step loop, call for call); with `stopping`, the steps
        after the first each only while `live` (see the class doc)."""
        if self.stopping:
            self.count.zero_()
            self.hist[:b, :, 0].fill_(-1.0)
        for k in range(self.hist.shape[1]):
            if self.stopping and k:
                run_if(self.live, lambda k=k: self._chunk_step(b, k))
            else:
                self._chunk_step(b, k)

    def _chunk_step(self, b: int, k: int) -> None:
        self.greedy(b, k=k)
        if not self.fused:
            self.hist[:b, k, 0] = self.tok[:b]
            self.hist[:b, k, 1] = self.lp[:b]
        if self.stopping:
            self.count.add_(1)
            ended = ((self.tok[:b] == self.eot) & (self.limit[:b] > 0)).any()
            torch.logical_and(~ended, self.count < self.limit[0], out=self.live)

    def _fn(self, kind: str):
        return {"plain": self.plain, "greedy": self.greedy, "chunk": self.chunk}[kind]

    def has_graph(self, kind: str, b: int) -> bool:
        """Whether `kind`'s graph for bucket `b` has been captured."""
        return self.graphs is not None and (kind, b) in self.graphs

    def run(self, kind: str, b: int) -> Tensor | None:
        """Run the "plain", "greedy" or "chunk" step for bucket `b`: replay its graph, or eagerly. A
        "plain" or "greedy" graph missing is captured first (safe mid-stream); a "chunk" one never is
        (see the class doc): the caller checks `has_graph` first."""
        fn = self._fn(kind)
        if self.graphs is None:
            return fn(b)
        if kind == "chunk" and (kind, b) not in self.graphs:
            raise RuntimeError(f"the chunk graph of batch {b} was not captured at warm-up (never mid-stream)")
        return self.graphs.replay((kind, b), lambda: fn(b), restore=(self.tok, self.pos, self.minleft))

    def capture(self, kind: str, b: int) -> None:
        """Record one step (or, "chunk", a chunk of steps) for bucket `b` from the static buffers: the
        eager runs before the capture write the keys/values the real steps will write anyway (same
        inputs), padded rows touch only free slots, and the buffers a greedy step advances are restored
        (`lp` and `hist` are outputs, rewritten by every step). "plain" and "greedy" are also safe
        mid-stream; "chunk" only at warm-up, from rows at position 0 (its two pre-runs reach position
        2 x decode_chunk - 1)."""
        fn = self._fn(kind)
        if kind == "chunk" and 2 * self.hist.shape[1] > self.n_text_ctx:
            raise ValueError(f"a chunk of {self.hist.shape[1]} steps does not fit twice in {self.n_text_ctx} positions")
        self.graphs.capture((kind, b), lambda: fn(b), restore=(self.tok, self.pos, self.minleft))


# The prompt lengths the admission's prefill graphs cover: initial tokens that are the SOT sequence
# alone (<|startoftranscript|> [language task] [<|notimestamps|>]: 1 to 4 tokens, no text prompt). A
# text prompt (<|startofprev|> ...) makes them longer and of any length: those prefills run eagerly.
PREFILL_GRAPH_TOKENS = 4


class Prefills:
    """The admission's decoder prefill (`TextDecoder.prefill`) of initial tokens that are an SOT
    sequence, as one CUDA graph replay per (prompt length, row bucket) when `graphs` is given, else the
    same padded pass eagerly. Eagerly the prefill is ~25 PyTorch calls per decoder layer, each of which
    gives up the GIL and waits to win it back from the event loop and the TTS thread (issue 26's GIL
    profile: 40 % of the recognition thread's time at 128 callers); a replay is one call.

    The inputs are one static block on the device, [row, slot | tokens], written with one copy; a group
    of n rows runs as its bucket b >= n, the padding rows repeating the last real row (its slot and
    tokens): they compute the very same values and write them to the same cache entries, so whichever
    write lands, the cache holds what the unpadded pass would write, and no other slot is touched (a
    full engine has no free slot to pad into). The graph also takes the last position's logits and the
    no-speech probability at <|startoftranscript|> (position 0), so its static outputs are [b, vocab]
    and [b], not the [b, T, vocab] logits. Attention runs under `decode_attention_kernels` (never
    cuDNN's, which picked other kernels for captured calls than for eager ones).
    """

    def __init__(self, decoder: TextDecoder, cache: KVCache, buckets: list[int], no_speech: int,
                 graphs: CudaGraphs | None = None) -> None:
        self.decoder, self.cache, self.buckets, self.no_speech = decoder, cache, buckets, no_speech
        self.inputs = torch.zeros(buckets[-1], 1 + PREFILL_GRAPH_TOKENS, dtype=torch.long, device=cache.self_k.device)
        self.slots, self.tokens = self.inputs[:, 0], self.inputs[:, 1:]
        self.graphs = graphs

    def covers(self, length: int, sot_indexes: set[int], rows: int) -> bool:
        """Whether a group of `rows` rows whose initial tokens have this length, with <|startoftranscript|>
        at these positions, runs here: SOT sequences alone (no text prompt), in an encoder-batch bucket
        (more rows, from beams, run eagerly: warm-up meets none of them)."""
        return length <= PREFILL_GRAPH_TOKENS and sot_indexes == {0} and rows <= self.buckets[-1]

    def run(self, tokens: list[list[int]], slots: list[int]) -> tuple[Tensor, Tensor]:
        """Prefill `tokens` (one equal-length list per row, each covered) into cache `slots`; returns the
        logits of the last position [n, vocab] and the no-speech probabilities [n] (float32, views of
        the graph's static outputs: read them before the next prefill)."""
        n, t = len(slots), len(tokens[0])
        b = next(x for x in self.buckets if x >= n)
        block = [[s, *tk] for s, tk in zip(slots, tokens)]
        block += [block[-1]] * (b - n)
        # Through pinned memory (to_device): a group of another length may follow in the same admission
        # before this copy has run, so a reused host block could be overwritten under it.
        self.inputs[:b, :1 + t].copy_(to_device(block, self.inputs.device))
        if self.graphs is None:
            last, no_speech = self.forward(b, t)
        else:
            last, no_speech = self.graphs.replay((f"prefill {t}", b), lambda: self.forward(b, t))
        return last[:n], no_speech[:n]

    def forward(self, b: int, t: int) -> tuple[Tensor, Tensor]:
        """The pass a graph records: rows 0..b-1 of the static block, t tokens each."""
        with decode_attention_kernels(True):
            logits = self.decoder.prefill(self.tokens[:b, :t], self.slots[:b], self.cache)
        # Copies, not views: a graph's outputs keep their storage alive, and views would keep the
        # [b, t, vocab] logits and the [b, vocab] softmax (memory_need counts [b, vocab] + [b]).
        return logits[:, -1].clone(), logits[:, 0].softmax(dim=-1)[:, self.no_speech].clone()


# The word-timing pass's graph buckets: rows (requests finishing in one step) and token positions (the
# prompt, the text and end-of-text: a turn's few seconds of speech take 10-40).
ALIGN_GRAPH_ROWS = (1, 2, 4, 8)
ALIGN_GRAPH_TOKENS = (32, 64)


class AlignmentPasses:
    """The word timings' forced pass (`TextDecoder.alignment_hidden`) as one CUDA graph replay per (rows,
    tokens) bucket, captured at warm-up, instead of ~270 PyTorch calls, each of which waits to win the GIL
    back under load (issue 25: ~13 ms of the engine thread a request at 64 callers against ~7-10 alone).
    Other shapes run eagerly.

    The inputs are one static block [row, slot | tokens] written on the device from the pass's own index
    copy; a group of n rows runs as its bucket b >= n, the padding rows repeating the last real row (the
    pass writes nothing: they only cost their share of the work), its tokens padded with end-of-text at
    the end (the self-attention is causal: padding changes no real position). Every graph writes its
    outputs (the final activations and the heads' scores) into one pair of buffers of the largest bucket,
    of which it returns its corner: one bucket's outputs are held, not eight (`align_graph_needs`), at
    the cost of one copy each. Read them before the next replay.
    Attention runs under `decode_attention_kernels` (`alignment_hidden` takes them, graphed or not: cuDNN's
    picked other kernels for captured calls).
    """

    def __init__(self, decoder: TextDecoder, cache: KVCache, heads: list[tuple[int, int]], eot: int,
                 graphs: CudaGraphs) -> None:
        self.decoder, self.cache, self.heads, self.graphs = decoder, cache, heads, graphs
        b, t, dev = ALIGN_GRAPH_ROWS[-1], ALIGN_GRAPH_TOKENS[-1], cache.self_k.device
        self.inputs = torch.full((b, 1 + t), eot, dtype=torch.long, device=dev)
        self.inputs[:, 0] = 0
        self.hidden = torch.empty(b, t, decoder.token_embedding.weight.shape[1], dtype=cache.cross_k.dtype, device=dev)
        self.scores = torch.empty(b, len(heads), t, cache.cross_k.shape[2], dtype=torch.float32, device=dev)

    def bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        """The (rows, tokens) bucket a group runs in, None where it runs eagerly."""
        b = next((x for x in ALIGN_GRAPH_ROWS if x >= rows), None)
        t = next((x for x in ALIGN_GRAPH_TOKENS if x >= tokens), None)
        return None if b is None or t is None else (b, t)

    def _pass(self, b: int, t: int):
        def run():
            x, scores = self.decoder.alignment_hidden(self.inputs[:b, 1:1 + t], self.inputs[:b, 0], self.cache,
                                                      self.heads)
            hidden, held = self.hidden[:b, :t], self.scores[:b, :, :t]
            hidden.copy_(x)
            held.copy_(scores)
            return hidden, held
        return run

    def capture(self) -> None:
        """Every bucket's graph (the engine's warm-up), on the inputs' current values: any cache row."""
        for b in ALIGN_GRAPH_ROWS:
            for t in ALIGN_GRAPH_TOKENS:
                self.graphs.capture((f"align{t}", b), self._pass(b, t))

    def run(self, tokens: Tensor, slots: Tensor, bucket: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """tokens [n, t] (padded to the bucket's t) and slots [n] on the device -> (activations [b, t, D],
        scores [b, heads, t, A]) of the bucket's graph (captured at warm-up)."""
        b, t = bucket
        n = tokens.shape[0]
        self.inputs[:n, 0].copy_(slots)
        self.inputs[:n, 1:1 + t].copy_(tokens)
        if b > n:
            self.inputs[n:b].copy_(self.inputs[n - 1:n].expand(b - n, -1))
        return self.graphs.replay((f"align{t}", b), self._pass(b, t))
