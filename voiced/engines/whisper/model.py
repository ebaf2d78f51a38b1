"""The Whisper network: audio encoder + text decoder, with static KV caches for batched decoding.

Parameter names follow OpenAI's checkpoints, so their `model_state_dict` loads as is. What differs
from the reference implementation is how the decoder keeps state, gpt-fast style:

* one preallocated cache per kind, `[layer, slot, position, width]`: self-attention keys/values for
  the text positions and cross-attention keys/values for the 1500 audio positions. A request owns
  slots (one per beam) for its lifetime; nothing is concatenated or reallocated while decoding;
* `prefill` runs a request's initial tokens for any set of slots; `step` runs one token for slots
  0..B-1 at per-row positions. Rows attend up to their own position through a mask, so requests at
  different lengths share one batch, and `step` has static shapes: it can be captured in a CUDA
  graph once per batch size;
* attention is `scaled_dot_product_attention` everywhere (flash / memory-efficient kernels on GPU).

This is the reference arrangement, which the exactness tests pin down. The engine runs the decoder
step through `fast_decoder.py` (fused QKV, per-layer functions; compiled on CUDA) on every device, and on
CUDA the encoder too: the same arithmetic up to rounding, checked against this file in tests.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def multilingual(self) -> bool:
        return self.n_vocab >= 51865

    @property
    def num_languages(self) -> int:
        # 51765 = BPE ranks (50257) + specials other than languages (1508); multilingual vocabularies
        # have one more BPE rank (50258) than GPT-2's.
        return self.n_vocab - 51765 - int(self.multilingual)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """The encoder's fixed positional embedding: sin | cos over geometric timescales."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class LayerNorm(nn.LayerNorm):
    # Normalise in float32 even when the model runs in fp16/bf16: variance in half precision loses
    # too much over widths of 1280. CUDA's kernel already accumulates half inputs in float32, so
    # there the explicit up/down casts (two extra kernels per norm, per decoder step) are skipped.
    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


def _heads(x: Tensor, n_head: int) -> Tensor:
    """[B, T, D] -> [B, H, T, D/H] as a view (SDPA accepts the strides)."""
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def decode_attention_kernels(on_cuda: bool) -> contextlib.AbstractContextManager:
    """The attention kernels of a decoder step (every implementation of it runs under this).

    On CUDA: flash (unmasked cross-attention) / memory-efficient (masked self-attention) kernels,
    never cuDNN's: cuDNN's SDPA picked different kernels for a captured step than for an eager one
    at batch 16 (logits apart by fp16 ulps, tokens parting on near-ties), and builds a plan per new
    shape on first use. A no-op on the CPU.
    """
    if not on_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


class Attention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x: Tensor) -> Tensor:
        """Full (non-causal) self-attention: the encoder's."""
        q, k, v = (_heads(p(x), self.n_head) for p in (self.query, self.key, self.value))
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
               causal: bool = False) -> Tensor:
        """q [B,Tq,D] against k/v [B,Tk,D] (e.g. views into a cache)."""
        h = self.n_head
        o = F.scaled_dot_product_attention(_heads(q, h), _heads(k, h), _heads(v, h), attn_mask=mask,
                                           is_causal=causal)
        return self.out(_merge(o))


class Block(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn = Attention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = Attention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        self.mlp = nn.Sequential(nn.Linear(n_state, 4 * n_state), nn.GELU(), nn.Linear(4 * n_state, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x: Tensor) -> Tensor:  # encoder block
        x = x + self.attn(self.attn_ln(x))
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks = nn.ModuleList([Block(n_state, n_head) for _ in range(n_layer)])
        self.ln_post = LayerNorm(n_state)

    def forward(self, mel: Tensor) -> Tensor:
        """mel [B, n_mels, 2 * A] -> audio features [B, A, n_state]: A = n_ctx (a 30 s window), or fewer (a
        window sized to the clip, clip_window.py: the first A positions' embeddings)."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        a = x.shape[1]
        if a > self.positional_embedding.shape[0] or mel.shape[-1] != 2 * a:
            raise ValueError(f"expected an even number of mel frames up to {2 * self.positional_embedding.shape[0]}, "
                             f"got {mel.shape[-1]}")
        x = (x + self.positional_embedding[:a]).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


@dataclass
class KVCache:
    """Preallocated decoder state for `slots` sequences: [layer, slot, position, width] each."""

    self_k: Tensor
    self_v: Tensor
    cross_k: Tensor
    cross_v: Tensor

    @classmethod
    def allocate(cls, dims: ModelDims, slots: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        L, D = dims.n_text_layer, dims.n_text_state
        z = lambda t: torch.zeros(L, slots, t, D, dtype=dtype, device=device)
        return cls(z(dims.n_text_ctx), z(dims.n_text_ctx), z(dims.n_audio_ctx), z(dims.n_audio_ctx))

    def window(self, positions: int) -> None:
        """Read and write only the first `positions` audio positions of every slot from now on (a window
        sized to the clip: every slot in use holds audio encoded in that window). The cross tensors become
        views of the allocated ones, whose full length stays the limit."""
        full_k, full_v = self.__dict__.setdefault("_full_cross", (self.cross_k, self.cross_v))
        if positions > full_k.shape[2]:
            raise ValueError(f"{positions} audio positions; the cache holds {full_k.shape[2]}")
        self.cross_k, self.cross_v = full_k[:, :, :positions], full_v[:, :, :positions]

    @staticmethod
    def bytes_per_slot(dims: ModelDims, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * dims.n_text_layer * dims.n_text_state * (dims.n_text_ctx + dims.n_audio_ctx) * elem

    @property
    def slots(self) -> int:
        return self.self_k.shape[1]

    def move(self, dst: Tensor, src: Tensor, self_only: bool = False) -> None:
        """Copy slots `src` onto slots `dst` (beam reordering, compaction). Reads before it writes."""
        tensors = (self.self_k, self.self_v) if self_only else (self.self_k, self.self_v, self.cross_k, self.cross_v)
        for t in tensors:
            t[:, dst] = t[:, src]


class TextDecoder(nn.Module):
    def __init__(self, n_vocab: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.zeros(n_ctx, n_state))
        self.blocks = nn.ModuleList([Block(n_state, n_head, cross_attention=True) for _ in range(n_layer)])
        self.ln = LayerNorm(n_state)
        # The tied output projection as a module of its own, when one is set (cpu.quantize_int8_).
        self.output_projection: nn.Module | None = None

    def write_cross(self, cache: KVCache, slots: Tensor, audio_features: Tensor) -> None:
        """Project audio features [n, A, D] to every layer's cross keys/values into `slots` [n]."""
        for i, block in enumerate(self.blocks):
            cache.cross_k[i].index_copy_(0, slots, block.cross_attn.key(audio_features))
            cache.cross_v[i].index_copy_(0, slots, block.cross_attn.value(audio_features))

    def _logits(self, x: Tensor) -> Tensor:
        # Output projection tied to the token embedding; logits in float32 for stable log-softmax.
        h = self.ln(x)
        if self.output_projection is not None:
            return self.output_projection(h).float()
        w = self.token_embedding.weight.to(x.dtype)
        rows = h.reshape(-1, h.shape[-1])
        if not h.is_cuda and 1 < rows.shape[0] <= 8:
            # CPU, a few rows (a prefill, a small batch): one matrix-vector product per row. A GEMM
            # this thin packs the whole weight (80 MB for tiny) before it starts: 2-3x slower.
            out = torch.bmm(rows[:, None, :], w.T.expand(rows.shape[0], -1, -1))[:, 0]
            return out.view(*h.shape[:-1], -1).float()
        return (h @ w.T).float()

    def prefill(self, tokens: Tensor, slots: Tensor, cache: KVCache) -> Tensor:
        """Run initial tokens [n, T] from position 0 for `slots` [n]; fills their self cache.

        Returns logits [n, T, vocab]. Cross keys/values must already be in the slots.
        """
        t = tokens.shape[1]
        x = (self.token_embedding(tokens) + self.positional_embedding[:t]).to(cache.self_k.dtype)
        # Consecutive slots (the usual case) read the cross cache as a view; indexing with a tensor
        # copies 1500 positions per layer (milliseconds each on a CPU). GPU: no host read.
        at: Tensor | slice = slots
        if not slots.is_cuda:
            s = slots.tolist()
            if s == list(range(s[0], s[0] + len(s))):
                at = slice(s[0], s[0] + len(s))
        for i, block in enumerate(self.blocks):
            h = block.attn_ln(x)
            q, k, v = block.attn.query(h), block.attn.key(h), block.attn.value(h)
            cache.self_k[i, slots, :t] = k
            cache.self_v[i, slots, :t] = v
            x = x + block.attn.attend(q, k, v, causal=t > 1)
            h = block.cross_attn_ln(x)
            x = x + block.cross_attn.attend(block.cross_attn.query(h), cache.cross_k[i, at], cache.cross_v[i, at])
            x = x + block.mlp(block.mlp_ln(x))
        return self._logits(x)

    def alignment_logits(self, x: Tensor, at: Tensor) -> Tensor:
        """The logits [len(at), vocab] at flat positions `at` of `alignment_hidden`'s activations [R, T, D]."""
        return self._logits(x.reshape(-1, x.shape[-1])[at])

    def alignment_hidden(self, tokens: Tensor, slots: Tensor, cache: KVCache,
                         heads: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Run whole token sequences [R, T] against the audio in cache slots `slots` [R], for word timings.

        Sequences shorter than T are padded at their end: the self-attention is causal, so padding
        changes no real position. Returns the final activations [R, T, D] (before the last layer norm)
        and the cross-attention scores (q.k / sqrt(head width), before softmax, float32)
        of `heads` ((layer, head) pairs sorted by layer, in that order) [R, len(heads), T, audio positions]. The
        slots' self-attention caches are neither read nor written.
        """
        r, t = tokens.shape
        x = (self.token_embedding(tokens) + self.positional_embedding[:t]).to(cache.cross_k.dtype)
        wanted: dict[int, list[int]] = {}
        for layer, head in heads:
            wanted.setdefault(layer, []).append(head)
        if [(a, b) for a in sorted(wanted) for b in wanted[a]] != list(heads):
            raise ValueError("alignment heads must be sorted by layer (as timing.check_heads leaves them)")
        scores = []
        # the step's attention kernels, eagerly as in a graph replay (align_graphs.AlignmentPasses): cuDNN's scores
        # differ by ulps, and a near-tie in the warping then moves a word's times
        with decode_attention_kernels(tokens.is_cuda):
            for i, block in enumerate(self.blocks):
                h = block.attn_ln(x)
                x = x + block.attn.attend(block.attn.query(h), block.attn.key(h), block.attn.value(h), causal=t > 1)
                h = block.cross_attn_ln(x)
                q = block.cross_attn.query(h)
                k, v = cache.cross_k[i, slots], cache.cross_v[i, slots]
                x = x + block.cross_attn.attend(q, k, v)
                if i in wanted:  # this layer's heads, all in one product: [R, heads, T, A]
                    n_head = block.cross_attn.n_head
                    pick = self._head_index(i, wanted[i], q.device)
                    qh = _heads(q, n_head).index_select(1, pick).float()
                    kh = _heads(k, n_head).index_select(1, pick).float()
                    scores.append(torch.matmul(qh, kh.transpose(-1, -2)) * qh.shape[-1] ** -0.5)
                x = x + block.mlp(block.mlp_ln(x))
        return x, torch.cat(scores, dim=1)

    def _head_index(self, layer: int, heads: list[int], device: torch.device) -> Tensor:
        """The head numbers `heads` of `layer` as an index on `device`, made once (indexing a GPU tensor
        with a host list copies the list from pageable memory, which waits for the stream's queued work)."""
        cache = self.__dict__.setdefault("_head_indexes", {})
        key = (layer, tuple(heads), device)
        if key not in cache:
            cache[key] = torch.tensor(heads, device=device)
        return cache[key]

    def step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int, masked: bool = True) -> Tensor:
        """One token per row for slots 0..B-1: tokens [B] at positions [B]; returns logits [B, vocab].

        Row b's key/value goes to position positions[b] of slot b, and the row attends to positions
        0..positions[b] of its slot (a mask over the first `kv_len`). `masked=False` is for when
        every row sits at position kv_len - 1. Shapes depend only on (B, kv_len) and no value is
        read back to the host, so the call can be captured in a CUDA graph.
        """
        with decode_attention_kernels(tokens.is_cuda):
            return self._step(tokens, positions, cache, kv_len, masked)

    def _step(self, tokens: Tensor, positions: Tensor, cache: KVCache, kv_len: int, masked: bool) -> Tensor:
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        mask = None
        if masked:
            mask = (torch.arange(kv_len, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
        x = (self.token_embedding(tokens) + self.positional_embedding[positions]).to(cache.self_k.dtype)
        x = x[:, None, :]
        for i, block in enumerate(self.blocks):
            h = block.attn_ln(x)
            q, k, v = block.attn.query(h), block.attn.key(h), block.attn.value(h)
            cache.self_k[i, rows, positions] = k[:, 0]
            cache.self_v[i, rows, positions] = v[:, 0]
            x = x + block.attn.attend(q, cache.self_k[i, :b, :kv_len], cache.self_v[i, :b, :kv_len], mask=mask)
            h = block.cross_attn_ln(x)
            x = x + block.cross_attn.attend(block.cross_attn.query(h), cache.cross_k[i, :b], cache.cross_v[i, :b])
            x = x + block.mlp(block.mlp_ln(x))
        return self._logits(x[:, 0])


class Whisper(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head,
                                    dims.n_audio_layer)
        self.decoder = TextDecoder(dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head,
                                   dims.n_text_layer)

    @property
    def device(self) -> torch.device:
        return self.decoder.token_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.token_embedding.weight.dtype

    def allocate_cache(self, slots: int) -> KVCache:
        return KVCache.allocate(self.dims, slots, self.dtype, self.device)
