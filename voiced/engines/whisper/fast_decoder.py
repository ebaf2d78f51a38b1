"""The text decoder's one-token step arranged for speed (`FastDecoder`): the same network as
`TextDecoder.step`, called like it.

* the self-attention's query/key/value projections are one GEMM (`fusion.fuse_qkv`), whose output splits
  into heads as views, so attention reads them in place;
* on a CUDA GPU with Triton the step runs through the kernels the Spark LM's step runs
  (voiced.engines.kernels: GEMVs, attention, add + layer norm), and a greedy step chooses its token in the
  head's GEMV; elsewhere on a GPU one layer is a free function of (activations, that layer's tensors, its
  caches) compiled per batch bucket at warm-up; on the CPU the same function runs uncompiled (fewer ops per
  step is what counts there).

Results equal the reference step up to fp16 rounding (sums run in another order); in float32 on the CPU the
uncompiled function matches the reference to ~1e-6 (tested).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from voiced.engines.kernels import decode_attention, decode_linear

from .fusion import compile_static, fuse_qkv
from .model import KVCache, TextDecoder, decode_attention_kernels


class DecoderLayer(NamedTuple):
    """One decoder block's tensors as the fused step reads them: the modules' own parameters, the
    self-attention's query/key/value fused (`fuse_qkv`)."""

    ln1_w: Tensor  # the self-attention's layer norm
    ln1_b: Tensor
    w_qkv: Tensor
    b_qkv: Tensor
    w_o: Tensor
    b_o: Tensor
    ln2_w: Tensor  # the cross-attention's layer norm
    ln2_b: Tensor
    w_cq: Tensor
    b_cq: Tensor
    w_co: Tensor
    b_co: Tensor
    ln3_w: Tensor  # the MLP's layer norm
    ln3_b: Tensor
    w_1: Tensor
    b_1: Tensor
    w_2: Tensor
    b_2: Tensor

    @classmethod
    def of(cls, blk) -> DecoderLayer:
        a, c = blk.attn, blk.cross_attn
        w_qkv, b_qkv = fuse_qkv(a)
        return cls(blk.attn_ln.weight, blk.attn_ln.bias, w_qkv, b_qkv, a.out.weight, a.out.bias,
                   blk.cross_attn_ln.weight, blk.cross_attn_ln.bias, c.query.weight, c.query.bias, c.out.weight,
                   c.out.bias, blk.mlp_ln.weight, blk.mlp_ln.bias, blk.mlp[0].weight, blk.mlp[0].bias,
                   blk.mlp[2].weight, blk.mlp[2].bias)


def decoder_layer_step(x: Tensor, mask: Tensor | None, rows: Tensor, positions: Tensor,
                       cache: tuple[Tensor, Tensor, Tensor, Tensor], kv_len: int, n_head: int,
                       p: DecoderLayer) -> Tensor:
    """One decoder block for one new token per row: x [B, 1, D] -> [B, 1, D] (as `TextDecoder._step`).

    cache: this layer's self keys and values [slots, ctx, D] and cross keys and values [slots, A, D]. Row
    b's new key/value are written at (rows[b], positions[b]); row b then attends over the first kv_len
    self positions of slot b (mask: additive [B, 1, 1, kv_len], or None when every row may see all
    of them) and over all of slot b's audio positions. The cross-attention query stays its own GEMM:
    its keys/values were projected once at admission.
    """
    self_k, self_v, cross_k, cross_v = cache
    b, _, d = x.shape
    hd = d // n_head
    h = F.layer_norm(x, (d,), p.ln1_w, p.ln1_b, 1e-5)
    q, k, v = F.linear(h, p.w_qkv, p.b_qkv).view(b, 3, n_head, hd).unbind(1)  # [B, H, hd] views
    self_k[rows, positions] = k.reshape(b, d)
    self_v[rows, positions] = v.reshape(b, d)
    keys = self_k[:b, :kv_len].view(b, kv_len, n_head, hd).transpose(1, 2)
    values = self_v[:b, :kv_len].view(b, kv_len, n_head, hd).transpose(1, 2)
    if b <= SMALL_BATCH:
        # Written out, not SDPA: with one query per head the fused kernels run one block per (row,
        # head) over all kv_len keys (~28 µs a layer at batch 1, the costliest kernel of the step);
        # two batched GEMMs and a softmax the compiler fuses with the mask take a few µs.
        scores = torch.matmul(q[:, :, None], keys.transpose(-1, -2)).float() * hd**-0.5  # [B, H, 1, kv_len]
        if mask is not None:
            scores = scores + mask
        o = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [B, H, 1, hd]
    else:  # many rows fill the GPU anyway, and the fused kernel reads the keys once (5.6 vs 9.0 ms at 256)
        o = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask)  # [B, H, 1, hd]
    x = x + F.linear(o.reshape(b, 1, d), p.w_o, p.b_o)
    h = F.layer_norm(x, (d,), p.ln2_w, p.ln2_b, 1e-5)
    q = F.linear(h, p.w_cq, p.b_cq).view(b, 1, n_head, hd).transpose(1, 2)
    a = cross_k.shape[1]
    keys = cross_k[:b].view(b, a, n_head, hd).transpose(1, 2)
    values = cross_v[:b].view(b, a, n_head, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, keys, values)
    x = x + F.linear(o.reshape(b, 1, d), p.w_co, p.b_co)
    h = F.layer_norm(x, (d,), p.ln3_w, p.ln3_b, 1e-5)
    return x + F.linear(F.gelu(F.linear(h, p.w_1, p.b_1)), p.w_2, p.b_2)


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


def gemv_supported(n_head: int, width: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the GEMV step can run for a decoder of `n_head` heads over `width`: the shared kernels' GPU and
    dtypes, and a head size they tile."""
    return (decode_linear.supported(dtype, device)
            and decode_attention.supported(dtype, device, (n_head, n_head, width // n_head)))


def _heads_view(cache: Tensor, n_head: int) -> Tensor:
    """One layer's `[slots, ctx, width]` cache as the kernel's `[slots, heads, ctx, head size]` (a view)."""
    slots, ctx, width = cache.shape
    return cache.view(slots, ctx, n_head, width // n_head).permute(0, 2, 1, 3)


class FastDecoder:
    """The text decoder's one-token step, GPU layout (see module doc); called like `TextDecoder.step`.

    Prefill (a few calls per request) keeps the modules' path; the step runs once per token.

    `gemv` (where `gemv_supported`: a CUDA GPU with Triton): the step through the kernels the Spark LM's step
    runs (voiced.engines.kernels), about 13 a layer with programmatic launch between them, in place of cuBLAS's
    GEMMs and the compiled layer: a batch-1 step 0.34 ms against 0.39, since a step's time is its kernels'
    count and its weights' reads, not arithmetic. Every projection is a GEMV reading its weight once (the
    output projections split along K, their partial sums reduced with the bias, the residual add and the next
    layer norm in one small kernel), the self-attention's cache write and attention one kernel in one program
    per (row, head) (the text context is at most 448 positions, and a row attends only up to its own), the
    cross-attention one kernel over the audio's keys and values, the head a GEMV over the tied embedding that
    writes float32 logits, and a greedy step's choice is made in the head's GEMV and one small kernel
    (`greedy_step`). The arithmetic is the layer's, rounded where the torch path rounds; sums run in another
    order.
    """

    def __init__(self, decoder: TextDecoder, compile_layers: bool = False, gemv: bool = False,
                 compile_tail: bool = False):
        self.dec = decoder
        self.gemv = gemv
        self.n_head = decoder.blocks[0].attn.n_head
        self.layers = [DecoderLayer.of(blk) for blk in decoder.blocks]
        self.compiled = compile_layers
        # the layer norm after each layer: the next layer's first, or the decoder's final one (the GEMV step
        # applies it with the residual add that ends the layer)
        self.next_norms = [(p.ln1_w, p.ln1_b) for p in self.layers[1:]] + [(decoder.ln.weight, decoder.ln.bias)]
        self._inputs = compile_static(step_inputs) if compile_layers else step_inputs
        # the GEMV step's embeddings (three kernels eagerly, one compiled), compiled on a GPU as the greedy
        # choice is (`DecoderSteps`); the layer norm after them stays torch's (compiled, it would round otherwise)
        self.compiled_tail = compile_tail
        self._embed = compile_static(step_embeddings) if compile_tail else step_embeddings
        self._layer = compile_static(decoder_layer_step) if compile_layers else decoder_layer_step

    def step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int, masked: bool = True,
             stop_id: int | None = None) -> Tensor:
        """tokens [B] at positions [B] for slots 0..B-1 -> logits [B, vocab] (see `TextDecoder.step`).

        `stop_id` (the GEMV step only): when every row's token is this one, the step's kernels return at their
        top and the logits are left as they were (`decode_attention.stop_args`)."""
        if self.gemv and masked:
            return self._gemv_step(tokens, positions, cache, kv_len, stop_id)
        with decode_attention_kernels(tokens.is_cuda):
            dec = self.dec
            x, mask, rows = self._inputs(tokens, positions, dec.token_embedding.weight, dec.positional_embedding,
                                         kv_len, masked, cache.self_k.dtype)
            for i, p in enumerate(self.layers):
                layer_cache = (cache.self_k[i], cache.self_v[i], cache.cross_k[i], cache.cross_v[i])
                x = self._layer(x, mask, rows, positions, layer_cache, kv_len, self.n_head, p)
            return dec._logits(x[:, 0])

    def greedy_step(self, inputs: Tensor, lp: Tensor, cache: KVCache, kv_len: int, always: Tensor, eot: int,
                    hist: Tensor | None = None) -> None:
        """The GEMV step and its greedy choice with the choice in the head's GEMV (`decode_linear.greedy_head`,
        ~10 kernels fewer than the compiled choice): `token_choice.greedy_advance(step(...), always, eot, inputs,
        lp)` for the rows of `inputs` [3, B] (tokens, positions, minimum-length countdowns), in place, the logits
        never written; `hist` [B, 2]: a chunk's step of the engine's history, written too.

        A step whose rows all hold end-of-text does none of its kernels' work (`step`'s `stop_id`): the steps of a
        chunk past every row's end, and a chunk launched ahead of the read that ends them all, cost the kernels'
        launches (0.056 ms a step at one row against 0.27), not the step."""
        tokens, positions = inputs[0], inputs[1]
        stop = (tokens, eot)
        h = self._gemv_hidden(tokens, positions, cache, kv_len, stop)
        decode_linear.greedy_head(h, self.dec.token_embedding.weight.to(h.dtype), always, eot, inputs, lp, hist, stop)

    def _gemv_step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                   stop_id: int | None = None) -> Tensor:
        """`step` through the GEMV kernels (see the class doc); each row attends to its positions 0..pos."""
        stop = None if stop_id is None else (tokens, stop_id)
        h = self._gemv_hidden(tokens, positions, cache, kv_len, stop)
        # `h` is the final layer norm's output: the logits are its product with the tied embedding
        head = self.dec.token_embedding.weight.to(h.dtype)
        return decode_linear.linear(h, head, block_n=128, stop=stop, out_dtype=torch.float32)

    def _gemv_hidden(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int,
                     stop: decode_attention.Stop | None) -> Tensor:
        """The GEMV step's layers: the final layer norm's output [B, D], which the head multiplies."""
        dec, n = self.dec, self.n_head
        x = self._embed(tokens, positions, dec.token_embedding.weight, dec.positional_embedding, cache.self_k.dtype)
        dims = (n, n, x.shape[1] // n)
        h = F.layer_norm(x, x.shape[-1:], self.layers[0].ln1_w, self.layers[0].ln1_b, 1e-5)
        for i, (p, (next_w, next_b)) in enumerate(zip(self.layers, self.next_norms)):
            self_k, self_v = _heads_view(cache.self_k[i], n), _heads_view(cache.self_v[i], n)
            cross_k, cross_v = _heads_view(cache.cross_k[i], n), _heads_view(cache.cross_v[i], n)
            o = decode_attention.triton_attention(decode_linear.linear(h, p.w_qkv, p.b_qkv, stop=stop), None, None,
                                                  self_k, self_v, positions, kv_len, dims, stop=stop, split=False)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(o, p.w_o, stop=stop), x, p.b_o, p.ln2_w,
                                             p.ln2_b, 1e-5, stop)
            o = decode_attention.triton_attention(decode_linear.linear(h, p.w_cq, p.b_cq, stop=stop), None, None,
                                                  cross_k, cross_v, positions, cross_k.shape[2], dims, cross=True,
                                                  stop=stop)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(o, p.w_co, stop=stop), x, p.b_co, p.ln3_w,
                                             p.ln3_b, 1e-5, stop)
            a = decode_linear.linear(h, p.w_1, p.b_1, gelu=True, stop=stop)
            h = decode_linear.add_layer_norm(decode_linear.linear_partials(a, p.w_2, stop=stop), x, p.b_2, next_w,
                                             next_b, 1e-5, stop)
        return h

