"""Qwen2 decoder-only LM for Spark-TTS, in one file, gpt-fast style.

The choices that make it fast, each visible below:

- A static KV cache `[max_batch, kv_heads, max_seq, head_dim]` per layer, allocated once. Batch rows are
  *slots*; requests join and leave between steps. Active requests always occupy rows `0..n-1`
  (the engine compacts the cache when one leaves), so a decode step runs on a prefix of the cache and
  a CUDA graph captured for a batch bucket of `n` can be replayed without gathers.
- Grouped-query attention without `repeat_kv`: for a one-token decode step the 7 query heads that
  share a KV head are laid out as 7 "query rows" of that KV head, so SDPA reads each KV entry once.
- One CUDA graph per (batch bucket, KV-length bucket) for the decode step; the eager path is the same
  code and is what runs on CPU, during prefill, and when graphs are disabled.
- `run_steps`: several decode steps *and their sampling* in one graph. The sampled token of step i is
  the input of step i+1 on the device, so a replay runs n steps with no host round trip; the host reads
  the n tokens per row back once (tokens after an end are discarded there). Host overhead per step,
  not GPU math, is what bounds a 0.5B model at small batch, so this is where the time is.
- `prefill_many`: every prompt admitted in one step runs as one packed sequence (a block-diagonal
  causal mask), one pass of ~400 kernels instead of one pass per request; on a GPU that pass is one
  CUDA graph per padded length (up to `prefill_graph_tokens`), its inputs one host->device copy.
- Every graph of the LM (decode steps and prefills) allocates from one memory pool: they replay one at a
  time on one stream, so the pool holds the largest graph's activations, not the sum of all of them.

The module tree and parameter names mirror `transformers`' Qwen2ForCausalLM (`model.layers.N...`),
so a Hugging Face checkpoint loads with a plain `load_state_dict`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from voiced.engines.kernels import decode_attention, decode_linear
from voiced.engines.kernels.decode_attention import apply_rope

log = logging.getLogger(__name__)

# See Qwen2LM.prefill_graph_tokens: the engine packs at most this many tokens (PREFILL_STEP_TOKENS).
PREFILL_GRAPH_TOKENS = 1024


@dataclass
class Qwen2Config:
    vocab_size: int = 166000
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen2Config:
        raw = json.loads(Path(path).read_text())
        # transformers 5 moved rope_theta under rope_parameters; accept both layouts.
        theta = raw.get("rope_theta")
        if theta is None:
            theta = (raw.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        if raw.get("rope_scaling"):
            raise ValueError(f"{path}: rope_scaling {raw['rope_scaling']!r} is not supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rope_theta=float(theta),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", True),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            head_dim=raw.get("head_dim"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference, then cast back before the gain (bf16 parity).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(cfg: Qwen2Config, max_seq: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_seq, head_dim]` in fp32 (half-rotation layout, as Qwen2/NeoX)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    t = torch.arange(max_seq, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.group = self.n_heads // self.n_kv
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def prefill(self, x, cos, sin, k_cache, v_cache, slot: int, start: int) -> torch.Tensor:
        """One request's prompt `x [1, T, C]` at positions start..start+T-1 of cache row `slot`."""
        _, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        end = start + t
        k_cache[slot : slot + 1, :, start:end] = k
        v_cache[slot : slot + 1, :, start:end] = v
        keys = k_cache[slot : slot + 1, :, :end].repeat_interleave(self.group, dim=1)
        values = v_cache[slot : slot + 1, :, :end].repeat_interleave(self.group, dim=1)
        # Causal over the new tokens, full view of anything already cached before `start`.
        mask = torch.arange(end, device=x.device)[None, :] <= (start + torch.arange(t, device=x.device))[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, t, -1))

    def prefill_packed(self, x, cos, sin, k_cache, v_cache, slots: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Several prompts packed into `x [1, N, C]`, each starting at position 0 of its own cache row:
        token i goes to (slots[i], positions[i]); `mask [N, N]` allows same-prompt causal pairs only."""
        _, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        k_cache[slots, :, positions] = k[0].transpose(0, 1)
        v_cache[slots, :, positions] = v[0].transpose(0, 1)
        # Every prompt starts at 0, so its keys are exactly the packed keys: no cache read needed.
        keys = k.repeat_interleave(self.group, dim=1)
        values = v.repeat_interleave(self.group, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(1, n, -1))

    def decode(self, x, cos, sin, k_cache, v_cache, rows: torch.Tensor, positions: torch.Tensor, kv_len: int,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: `x [B, 1, C]` for cache rows `0..B-1` at `positions [B]`; `mask` (the same
        for every layer) may be passed in so a step builds it once instead of once per layer."""
        b = x.shape[0]
        q, k, v = self._qkv(x, cos, sin)
        # index_put with tensors only: capturable in a CUDA graph.
        k_cache[rows, :, positions] = k[:, :, 0]
        v_cache[rows, :, positions] = v[:, :, 0]
        keys, values = k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len]
        # GQA without copying KV: the `group` query heads of one KV head become its query rows.
        q = q.reshape(b, self.n_kv, self.group, self.head_dim)
        if mask is None:
            mask = decode_mask(positions, kv_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.reshape(b, 1, self.n_heads * self.head_dim))


def packed_mask(seg: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`[N, N]` for packed prompts: token i sees token j of its own prompt (`seg`) at an earlier or equal
    position. The diagonal always: padding positions clamped at the cache's end repeat, and each
    padding token must still see itself (for every other token the diagonal is already allowed)."""
    # Built in place: two [N, N] booleans at most at once (the expression form held four: 64 MiB at the
    # 4096-token prefill, over the memory plan's estimate of that step's transient).
    mask = pos[None, :] <= pos[:, None]
    mask.diagonal().fill_(True)
    return mask.logical_and_(seg[:, None] == seg[None, :])


def decode_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`[B, 1, 1, kv_len]`: row b attends to cache positions 0..positions[b]."""
    return (torch.arange(kv_len, device=positions.device)[None, :] <= positions[:, None])[:, None, None, :]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def embed_norm(tokens: torch.Tensor, emb_w: torch.Tensor, ln: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's input: the tokens' embeddings `[B, 1, C]` and the first layer's input norm of them
    (compiled: one kernel, the gather inside the norm's)."""
    x = F.embedding(tokens[:, None], emb_w)
    return x, _rms(x, ln, eps)


def layer_decode_tail(x, attn, ow, ln2, w_gate_up, dw, ln_next, eps: float):
    """A decoder layer after its attention (`attn [B, 1, H*D]`): output projection, residual, MLP,
    residual, and then the NEXT layer's input norm (`ln_next`; the final norm after the last layer),
    so that each residual add and the norm after it are one fused kernel when compiled. Returns the
    residual stream and the normed input of what comes next."""
    x = x + F.linear(attn, ow)
    h = _rms(x, ln2, eps)
    gate, up = F.linear(h, w_gate_up).chunk(2, -1)
    x = x + F.linear(F.silu(gate) * up, dw)
    return x, _rms(x, ln_next, eps)


def layer_decode(x, h, cos, sin, mask, k_cache, v_cache, rows, positions, w: tuple, eps: float, dims: tuple,
                 ln_next):
    """One decoder layer of a decode step as a pure function of its weights `w` (the same arithmetic as
    the modules' forward), from the residual stream `x` and its normed input `h` to the next layer's
    (see `layer_decode_tail`). Being a free function, one `torch.compile` of it serves all 24 layers: a
    small graph that compiles in seconds. `w` holds q/k/v as one matrix and gate/up as one (see
    `Qwen2LM.fuse_projections`): at one token per row every GEMM is a few-µs launch, so fewer is faster.
    On a GPU the compiled step replaces the attention part by one Triton kernel (voiced/engines/kernels/decode_attention.py)."""
    _, w_qkv, b_qkv, ow, ln2, w_gate_up, dw = w
    attn = decode_attention.reference(F.linear(h, w_qkv, b_qkv), cos, sin, mask, k_cache, v_cache, rows, positions,
                                      dims)
    return layer_decode_tail(x, attn, ow, ln2, w_gate_up, dw, ln_next, eps)


def layer_prefill(x, cos, sin, mask, k_cache, v_cache, slots, positions, w: tuple, eps: float, dims: tuple):
    """One decoder layer over packed prompts `x [1, N, C]` (see `Qwen2LM.prefill_many`), as a pure
    function of the fused weights like `layer_decode`. Compiled, it turns a prompt's ~1000 small eager
    ops (host-bound: ~20 ms for one prompt, 5 of them GPU work) into a few fused kernels."""
    ln1, w_qkv, b_qkv, ow, ln2, w_gate_up, dw = w
    n_heads, n_kv, head_dim = dims
    n = x.shape[1]
    h = _rms(x, ln1, eps)
    q, k, v = F.linear(h, w_qkv, b_qkv).split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
    q = q.view(1, n, n_heads, head_dim).transpose(1, 2)
    k = k.view(1, n, n_kv, head_dim).transpose(1, 2)
    v = v.view(1, n, n_kv, head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[slots, :, positions] = k[0].transpose(0, 1)
    v_cache[slots, :, positions] = v[0].transpose(0, 1)
    group = n_heads // n_kv
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                         attn_mask=mask)
    x = x + F.linear(out.transpose(1, 2).reshape(1, n, n_heads * head_dim), ow)
    h = _rms(x, ln2, eps)
    gate, up = F.linear(h, w_gate_up).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, dw)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Qwen2Body(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2LM(nn.Module):
    """The LM plus its KV cache. Call `setup_cache` once before `prefill`/`decode`."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_batch = 0
        self.max_seq = 0
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._step_graphs: dict[tuple, _StepsGraph] = {}
        self._prefill_graphs: dict[int, _PrefillGraph] = {}
        # Packed prefills up to this many tokens run as CUDA graphs; a longer one (a lone long prompt)
        # runs ungraphed: the graphs' shared pool holds the activations of the longest graphed length.
        self.prefill_graph_tokens = PREFILL_GRAPH_TOKENS
        self._prefill_io: _PrefillIO | None = None
        self._pool = None  # graph_pool()
        self.state: StepState | None = None
        self._layer_fn = None  # compile_decode() sets layer_decode, compiled
        self._prefill_fn = None  # and layer_prefill
        self._tail_fn = None  # compile_decode(): the compiled layer after its Triton attention (GPU)
        self._embed_fn = None  # and a step's embedding with the first layer's input norm (both fused paths)
        self._gemv = False  # compile_decode(): _decode_fast's projections through decode_linear's kernels
        self._layer_weights: list[tuple] = []
        self._capture: torch.cuda.Stream | None = None

    def capture_stream(self) -> torch.cuda.Stream:
        """The one side stream every graph of this LM is warmed up and captured on. PyTorch gives each
        (thread, stream) pair that runs cuBLAS a workspace of its own (32 MiB on Hopper) and keeps it
        for the life of the process: a fresh stream per graph held one workspace per graph (15-32 of
        them, up to 1 GiB), memory the plan cannot foresee and nothing used."""
        if self._capture is None:
            self._capture = torch.cuda.Stream(device=self.lm_head.weight.device)
        return self._capture

    def graph_pool(self):
        """The one memory pool every graph of this LM (`_StepsGraph`, `_PrefillGraph`) allocates from.
        Sharing is safe because the graphs replay one at a time on one stream and none leaves a tensor
        in the pool that outlives its replay (their outputs are buffers allocated before capture); the
        pool then holds the largest graph's activations once, instead of one private pool per graph."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ------------------------------------------------------------------ cache

    def setup_cache(self, max_batch: int, max_seq: int) -> None:
        cfg = self.config
        p = self.lm_head.weight
        shape = (cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, max_seq, cfg.head_dim)
        # Every layer's cache is a view of one block per K and V, so moving a row (`move_slot`) is one
        # copy for all layers instead of one per layer.
        self._k_all = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self._v_all = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.k_caches, self.v_caches = list(self._k_all.unbind(0)), list(self._v_all.unbind(0))
        cos, sin = rope_tables(cfg, max_seq, p.device)
        self.rope_cos, self.rope_sin = cos, sin
        self.max_batch, self.max_seq = max_batch, max_seq
        self._graphs.clear()
        self._step_graphs.clear()
        self._prefill_graphs.clear()
        self.state = StepState.empty(max_batch, p.device)
        self._prefill_io = _PrefillIO(prefill_capacity(max_seq, self.prefill_graph_tokens), max_batch, cfg.hidden_size,
                                      p.dtype, p.device)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy one request's cached keys/values to another row (used to keep active rows compact)."""
        if src == dst or length <= 0:
            return
        self._k_all[:, dst, :, :length] = self._k_all[:, src, :, :length]
        self._v_all[:, dst, :, :length] = self._v_all[:, src, :, :length]

    # ---------------------------------------------------------------- forward

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, slot: int, start: int = 0) -> torch.Tensor:
        """Run a prompt `tokens [T]` into cache row `slot` at positions start..; returns last logits `[V]` fp32."""
        t = tokens.shape[0]
        if start + t > self.max_seq:
            raise ValueError(f"prompt of {start + t} tokens exceeds the KV cache length {self.max_seq}")
        x = self.model.embed_tokens(tokens[None])
        cos = self.rope_cos[start : start + t][None, None]
        sin = self.rope_sin[start : start + t][None, None]
        for layer, kc, vc in zip(self.model.layers, self.k_caches, self.v_caches):
            x = x + layer.self_attn.prefill(layer.input_layernorm(x), cos, sin, kc, vc, slot, start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[:, -1])[0]

    @torch.no_grad()
    def prefill_many(self, prompts: list, slots: list[int], pad_to: int = 1,
                     use_graph: bool | None = None) -> torch.Tensor:
        """Prompts (each a list of ids or a `[T_i]` tensor, on the host or the LM's device) into cache rows
        `slots` at positions 0..T_i-1, as one packed pass. Returns each prompt's final-normed last
        hidden state `[n, C]` (feed to a head).

        pad_to: pack to a multiple of this many tokens (fewer distinct shapes: a GPU meets only lengths
        its warm-up ran). The padding is one more "prompt" that attends only to itself; it is written
        into the last prompt's row just past that prompt, where the first decode steps overwrite it
        before anything reads it (a step writes its position before attending to it).
        use_graph: replay a CUDA graph of the pass (captured on the first pass of each padded length up
        to `prefill_graph_tokens`); None means on a CUDA device. The graph computes what the ungraphed
        pass computes, with the same kernels."""
        if not prompts or len(prompts) != len(slots):
            raise ValueError("prefill_many needs one slot per prompt and at least one prompt")
        lengths = [int(len(p)) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("an empty prompt cannot be prefilled")
        if max(lengths) > self.max_seq:
            raise ValueError(f"prompt of {max(lengths)} tokens exceeds the KV cache length {self.max_seq}")
        dev = self.lm_head.weight.device
        total = sum(lengths)
        n = total + (-total % max(1, pad_to))
        if use_graph is None:
            use_graph = dev.type == "cuda"
        io = self._prefill_io
        if io is None or n > io.cap or len(prompts) > io.rows:  # more than the engine ever packs: one-off buffers
            io = _PrefillIO(n, len(prompts), self.config.hidden_size, self.lm_head.weight.dtype, dev)
            use_graph = False
        io.fill(prompts, lengths, slots, n, self.max_seq)
        if use_graph and dev.type == "cuda" and n <= self.prefill_graph_tokens:
            graph = self._prefill_graphs.get(n)
            if graph is None:  # captured from these very inputs (see _PrefillGraph)
                graph = self._prefill_graphs[n] = _PrefillGraph(self, io, n)
            graph.graph.replay()
        else:
            self._prefill_body(io, n)
        return self.model.norm(io.out[: len(prompts)])

    def _prefill_body(self, io: _PrefillIO, n: int) -> None:
        """The packed pass over `io`'s first n tokens, up to `io.out` (each prompt's last hidden state,
        before the final norm). Runs eagerly and under graph capture alike."""
        tokens, seg, pos, slots, last = io.views(n)
        x = self.model.embed_tokens(tokens[None])
        cos, sin = self.rope_cos[pos][None, None], self.rope_sin[pos][None, None]
        mask = packed_mask(seg, pos)
        if self._prefill_fn is None:
            for layer, kc, vc in zip(self.model.layers, self.k_caches, self.v_caches):
                x = x + layer.self_attn.prefill_packed(layer.input_layernorm(x), cos, sin, kc, vc, slots, pos, mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        else:
            x = self._fused_layers(self._prefill_fn, x, cos, sin, mask, slots, pos)
        io.out.copy_(x[0, last])

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One step for rows 0..B-1: `tokens [B]`, `positions [B]` -> final-normed hidden `[B, C]`."""
        if self._layer_fn is None:
            x = self.model.embed_tokens(tokens[:, None])
        else:
            cfg = self.config
            x, h = self._embed_fn(tokens, self.model.embed_tokens.weight, self._layer_weights[0][0], cfg.rms_norm_eps)
            if self._tail_fn is not None:
                return self._decode_fast(x, h, positions, kv_len)[:, 0]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        # Per step, not per layer: the mask and the rope factors in the activations' dtype (apply_rope's
        # casts become no-ops). A decode step is ~1000 small kernels, and their count sets its time.
        cos = self.rope_cos[positions][:, None, None].to(x.dtype)
        sin = self.rope_sin[positions][:, None, None].to(x.dtype)
        mask = decode_mask(positions, kv_len)
        if self._layer_fn is None:
            for layer, kc, vc in zip(self.model.layers, self.k_caches, self.v_caches):
                x = x + layer.self_attn.decode(layer.input_layernorm(x), cos, sin, kc, vc, rows, positions, kv_len, mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return self.model.norm(x[:, 0])
        dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        for i, (w, kc, vc) in enumerate(zip(self._layer_weights, self.k_caches, self.v_caches)):
            x, h = self._layer_fn(x, h, cos, sin, mask, kc, vc, rows, positions, w, cfg.rms_norm_eps, dims,
                                  self._next_norm(i))
        return h[:, 0]

    def _next_norm(self, i: int) -> torch.Tensor:
        """The norm weight applied after layer i: the next layer's input norm, or the final norm."""
        w = self._layer_weights
        return w[i + 1][0] if i + 1 < len(w) else self.model.norm.weight

    def _decode_fast(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """The GPU step from the embeddings `x` and their first norm `h`: per layer the qkv GEMM, one Triton
        kernel for rope + cache write + attention (decode_attention.triton_attention, which reads the rope
        tables at `positions` itself: no per-step mask or rope gathers), and the compiled rest of the layer
        with the next norm fused in. About 9 kernels a layer instead of 15."""
        cfg = self.config
        b, eps = x.shape[0], cfg.rms_norm_eps
        dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        if self._gemv:
            return self._decode_gemv(x.view(b, -1), h.view(b, -1), positions, kv_len, dims).view(b, 1, -1)
        for i, (w, kc, vc) in enumerate(zip(self._layer_weights, self.k_caches, self.v_caches)):
            _, w_qkv, b_qkv, ow, ln2, w_gate_up, dw = w
            qkv = F.linear(h, w_qkv, b_qkv).view(b, -1)
            attn = decode_attention.triton_attention(qkv, self.rope_cos, self.rope_sin, kc, vc, positions, kv_len, dims)
            x, h = self._tail_fn(x, attn.view(b, 1, -1), ow, ln2, w_gate_up, dw, self._next_norm(i), eps)
        return h

    def _decode_gemv(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, kv_len: int,
                     dims: tuple) -> torch.Tensor:
        """`_decode_fast` with every projection through decode_linear (6 kernels a layer, 7 when the
        attention splits, each reading its weights near the memory's speed). `x [B, C]`, the residual
        stream, is updated in place; returns the final-normed hidden `[B, C]`."""
        eps = self.config.rms_norm_eps
        for i, (w, kc, vc) in enumerate(zip(self._layer_weights, self.k_caches, self.v_caches)):
            _, w_qkv, b_qkv, ow, ln2, w_gate_up, dw = w
            qkv = decode_linear.linear(h, w_qkv, b_qkv)
            attn = decode_attention.triton_attention(qkv, self.rope_cos, self.rope_sin, kc, vc, positions, kv_len, dims)
            h = decode_linear.add_norm(decode_linear.linear_partials(attn, ow), x, ln2, eps)
            a = decode_linear.swiglu_linear(h, w_gate_up)
            h = decode_linear.add_norm(decode_linear.linear_partials(a, dw), x, self._next_norm(i), eps)
        return h

    def _fused_layers(self, fn, x, cos, sin, mask, rows, positions) -> torch.Tensor:
        """Every layer through `fn` (layer_prefill, maybe compiled) over the fused weights."""
        cfg = self.config
        dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        for w, kc, vc in zip(self._layer_weights, self.k_caches, self.v_caches):
            x = fn(x, cos, sin, mask, kc, vc, rows, positions, w, cfg.rms_norm_eps, dims)
        return x

    def fuse_projections(self) -> None:
        """Store each layer's q/k/v weights (and biases) as one tensor and gate/up as one, for
        `layer_decode`. The modules' parameters become views into them: no second copy of the weights,
        and a checkpoint loaded afterwards still lands in the fused tensors."""

        def fuse(*params: nn.Parameter) -> tuple[torch.Tensor, list[nn.Parameter]]:
            whole = torch.cat([p.detach() for p in params])
            parts = whole.split([p.shape[0] for p in params])
            return whole, [nn.Parameter(t, requires_grad=False) for t in parts]

        self._layer_weights = []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            w_qkv, (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) = fuse(a.q_proj.weight, a.k_proj.weight,
                                                                             a.v_proj.weight)
            b_qkv, (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias) = fuse(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
            w_gate_up, (m.gate_proj.weight, m.up_proj.weight) = fuse(m.gate_proj.weight, m.up_proj.weight)
            self._layer_weights.append((layer.input_layernorm.weight, w_qkv, b_qkv, a.o_proj.weight,
                                        layer.post_attention_layernorm.weight, w_gate_up, m.down_proj.weight))

    @property
    def compiled(self) -> bool:
        return self._layer_fn is not None and self._layer_fn is not layer_decode

    def compile_decode(self, compile: bool = True, fused_attention: bool | None = None,
                       fused_linear: bool | None = None, **kwargs) -> None:
        """Run decode steps through `layer_decode` and packed prefill through `layer_prefill`, over
        fused projections, `torch.compile`d unless `compile=False` (fewer, fused kernels; the CUDA
        graphs captured afterwards hold the compiled kernels; the samplers compile too, see
        sampling.PhaseSampler). Compiles on first use of each shape class, which the engine's warm-up
        makes happen before serving.

        fused_attention: on a CUDA device, compiled, run each layer's attention as one Triton kernel
        (`_decode_fast`); None means wherever `decode_attention.supported` says it can.
        fused_linear: with the fused attention, run the projections through decode_linear's GEMV
        kernels (`_decode_gemv`); None means wherever they run."""
        self.fuse_projections()
        # every (batch bucket, kv bucket) and every packed prompt length is a shape; mark them dynamic
        # rather than recompile per shape
        kwargs.setdefault("dynamic", True)
        self._layer_fn = torch.compile(layer_decode, **kwargs) if compile else layer_decode
        self._prefill_fn = torch.compile(layer_prefill, **kwargs) if compile else layer_prefill
        cfg, p = self.config, self.lm_head.weight
        can = compile and decode_attention.supported(p.dtype, p.device, (cfg.num_attention_heads,
                                                                         cfg.num_key_value_heads, cfg.head_dim))
        if fused_attention and not can:
            raise ValueError("fused_attention needs a compiled LM on a CUDA device with Triton and a head size of "
                             "16..256 (a power of two)")
        self._embed_fn = torch.compile(embed_norm, **kwargs) if compile else embed_norm
        self._tail_fn = torch.compile(layer_decode_tail, **kwargs) if can and fused_attention is not False else None
        gemv = self._tail_fn is not None and decode_linear.supported(p.dtype, p.device)
        if fused_linear and not gemv:
            raise ValueError("fused_linear needs the fused attention (a compiled LM on a CUDA device with Triton)")
        self._gemv = gemv and fused_linear is not False
        self._graphs.clear()
        self._step_graphs.clear()
        self._prefill_graphs.clear()

    @property
    def fused_attention(self) -> bool:
        return self._tail_fn is not None

    @property
    def fused_linear(self) -> bool:
        return self._gemv

    def decode_eager(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One step for rows 0..B-1: `tokens [B]`, `positions [B]` -> logits `[B, V]` fp32."""
        return self.lm_head(self.decode_hidden(tokens, positions, kv_len)).float()

    def kv_bucket(self, max_pos: int) -> int:
        """KV prefix length attended for a step whose largest position is `max_pos`."""
        return min(self.max_seq, _bucket(max_pos + 1, 256))

    def _steps_body(self, pick, batch: int, n_steps: int, kv_len: int, out: torch.Tensor) -> None:
        """`n_steps` decode+sample steps on rows 0..batch-1 of `self.state`, tokens into `out[:batch, i]`.
        The same code runs eagerly and under graph capture, so both give the same tokens."""
        st = self.state
        tokens, positions = st.tokens[:batch], st.positions[:batch]
        top = self.max_seq - 1
        for i in range(n_steps):
            h = self.decode_hidden(tokens, positions, kv_len)
            # the sampler writes the tokens into `out` and advances tokens, steps, phase and positions
            pick(self, h, st, slice(0, batch), out=out[:batch, i], last_position=top)

    @torch.no_grad()
    def run_steps(self, pick, batch: int, n_steps: int, max_pos: int, use_graph: bool | None = None) -> torch.Tensor:
        """Run `n_steps` decode steps with in-graph sampling `pick` (see sampling.PhaseSampler) for the
        active rows 0..batch-1, whose inputs the caller put in `self.state`. Returns the sampled tokens
        `[batch, n_steps]` on the device (no sync); `max_pos` is the largest position at the start."""
        kv_len = self.kv_bucket(max_pos + n_steps - 1)
        dev = self.lm_head.weight.device
        if use_graph is None:
            use_graph = dev.type == "cuda"
        if not use_graph or dev.type != "cuda":
            out = torch.empty(batch, n_steps, dtype=torch.long, device=dev)
            self._steps_body(pick, batch, n_steps, kv_len, out)
            return out
        bb = min(self.max_batch, _bucket(batch, 1))
        key = (bb, kv_len, n_steps, pick.graph_key)
        graph = self._step_graphs.get(key)
        if graph is None:
            graph = self._step_graphs[key] = _StepsGraph(self, pick, bb, n_steps, kv_len)
        graph.graph.replay()
        return graph.out[:batch]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, use_graph: bool | None = None,
               max_pos: int | None = None) -> torch.Tensor:
        """One decode step for the active rows 0..B-1. Uses a CUDA graph on GPU unless told not to.
        `max_pos` (the largest position, known to the caller) saves a device->host sync per step."""
        b = tokens.shape[0]
        # Attend over a bucketed prefix of the cache: reading 4096 cached positions for a
        # 300-token request would waste bandwidth, and buckets keep the number of graphs small.
        need = (int(positions.max().item()) if max_pos is None else max_pos) + 1
        kv_len = min(self.max_seq, _bucket(need, 256))
        if use_graph is None:
            use_graph = tokens.is_cuda
        if not use_graph or not tokens.is_cuda:  # graphs are a CUDA feature; CPU runs eager
            return self.decode_eager(tokens, positions, kv_len)
        bb = min(self.max_batch, _bucket(b, 1))
        key = (bb, kv_len)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _DecodeGraph(self, bb, kv_len)
        return graph.run(tokens, positions)[:b]

    @torch.no_grad()
    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position of `tokens [B, T]` with no cache (a reference path for tests)."""
        b, t = tokens.shape
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_tables(self.config, t, tokens.device)
        cos, sin = cos[None, None], sin[None, None]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        for layer in self.model.layers:
            attn = layer.self_attn
            q, k, v = attn._qkv(layer.input_layernorm(x), cos, sin)
            k = k.repeat_interleave(attn.group, dim=1)
            v = v.repeat_interleave(attn.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x)


def padded_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prefill_capacity(max_seq: int, graph_tokens: int) -> int:
    """Packed tokens a `_PrefillIO` holds: the longest prompt padded to a 64-token bucket, or the
    longest graphed pack."""
    return padded_to(max(max_seq, graph_tokens) + 64, 64)


def prefill_io_bytes(cfg: Qwen2Config, max_batch: int, max_seq: int, graph_tokens: int, itemsize: int) -> int:
    """Device bytes of `setup_cache`'s `_PrefillIO` (ids, segments, positions, slots; last tokens; output)."""
    return (4 * prefill_capacity(max_seq, graph_tokens) + max_batch) * 8 + max_batch * cfg.hidden_size * itemsize


def _bucket(n: int, base: int) -> int:
    """Smallest base * 2**k >= n."""
    b = base
    while b < n:
        b *= 2
    return b


class _DecodeGraph:
    """A CUDA graph of one decode step for a fixed (batch, kv_len); rows beyond the live batch are
    padding whose writes land in free cache rows at position 0 (overwritten by the next prefill)."""

    def __init__(self, lm: Qwen2LM, batch: int, kv_len: int) -> None:
        dev = lm.lm_head.weight.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        # The warm-up runs really execute and write K/V at position 0 of rows 0..batch-1, which may
        # belong to live requests (graphs are captured lazily): save those entries and put them back.
        saved = [(k[:batch, :, 0].clone(), v[:batch, :, 0].clone()) for k, v in zip(lm.k_caches, lm.v_caches)]
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels/allocator outside the graph
                lm.decode_eager(self.tokens, self.positions, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.logits = lm.decode_eager(self.tokens, self.positions, kv_len)
        for (k, v), (ks, vs) in zip(zip(lm.k_caches, lm.v_caches), saved):
            k[:batch, :, 0].copy_(ks)
            v[:batch, :, 0].copy_(vs)
        log.debug("captured decode graph batch=%d kv_len=%d", batch, kv_len)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        self.tokens.zero_()
        self.positions.zero_()
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        self.graph.replay()
        return self.logits


@dataclass
class StepState:
    """Per-row decode inputs and sampler state on the device, `[max_batch]` each. The host is the
    source of truth: it writes these before each `run_steps` (one copy) and the steps advance them."""

    tokens: torch.Tensor  # long: the token each row feeds next
    positions: torch.Tensor  # long: the cache position it is written at
    steps: torch.Tensor  # long: tokens sampled so far (the sampler's counter)
    phase: torch.Tensor  # long: which logit mask applies (sampling.PhaseSampler)
    n_global: torch.Tensor  # long: global tokens produced so far (controllable voices)
    seeds: torch.Tensor  # long
    top_k: torch.Tensor  # long
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32

    INT_FIELDS = ("tokens", "positions", "steps", "phase", "n_global", "seeds", "top_k")
    FLOAT_FIELDS = ("temperature", "top_p")

    @classmethod
    def empty(cls, n: int, device) -> StepState:
        # Two backing blocks, so the host fills the whole state with two copies.
        ints = torch.zeros(len(cls.INT_FIELDS), n, dtype=torch.long, device=device)
        floats = torch.zeros(len(cls.FLOAT_FIELDS), n, dtype=torch.float32, device=device)
        st = cls(*ints.unbind(0), *floats.unbind(0))
        st._ints, st._floats = ints, floats
        return st

    def load(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Copy host-built `[7, n]` long and `[2, n]` float blocks (field order as above) in."""
        self._ints.copy_(ints, non_blocking=True)
        self._floats.copy_(floats, non_blocking=True)

    def columns(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[7, n]` long and `[2, n]` float blocks of `rows`: views for a slice (a sampler updates them
        in place), copies for an index tensor (written back with `store_ints`)."""
        return self._ints[:, rows], self._floats[:, rows]

    def store_ints(self, rows: torch.Tensor, ints: torch.Tensor) -> None:
        self._ints[:, rows] = ints


class _StepsGraph:
    """A CUDA graph of `n_steps` decode+sample steps for a fixed (batch bucket, kv_len, sampler)."""

    def __init__(self, lm: Qwen2LM, pick, batch: int, n_steps: int, kv_len: int) -> None:
        dev = lm.lm_head.weight.device
        st = lm.state
        self.out = torch.zeros(lm.max_batch, n_steps, dtype=torch.long, device=dev)
        # Capture runs the body for real (warm-up and capture): keep the state and the cache entries
        # it touches (positions 0..n_steps-1 of rows 0..batch-1, from a zeroed state) and restore them.
        state_saved = (st._ints.clone(), st._floats.clone())
        kv_saved = [(k[:batch, :, :n_steps].clone(), v[:batch, :, :n_steps].clone()) for k, v in zip(lm.k_caches, lm.v_caches)]
        st._ints.zero_()
        st.top_k.fill_(1)
        st.temperature.fill_(1.0)
        st.top_p.fill_(1.0)
        blank = (st._ints.clone(), st._floats.clone())
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                st.load(*blank)
                lm._steps_body(pick, batch, n_steps, kv_len, self.out)
        torch.cuda.current_stream().wait_stream(stream)
        st.load(*blank)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, pool=lm.graph_pool()):
            lm._steps_body(pick, batch, n_steps, kv_len, self.out)
        st.load(*state_saved)
        for (k, v), (ks, vs) in zip(zip(lm.k_caches, lm.v_caches), kv_saved):
            k[:batch, :, :n_steps].copy_(ks)
            v[:batch, :, :n_steps].copy_(vs)
        log.debug("captured %d-step decode graph batch=%d kv_len=%d", n_steps, batch, kv_len)


class _PrefillIO:
    """A packed prefill's inputs and output, at fixed addresses so that graphs can replay on them: one
    pinned host block and its device copy `[tokens | segment | position | slot]` (`cap` each) then
    `last` (`rows`: the index of each prompt's last token), and the output `[rows, C]`. The host fills
    the block and sends it in one copy."""

    def __init__(self, cap: int, rows: int, hidden: int, dtype: torch.dtype, device) -> None:
        device = torch.device(device)
        cuda = device.type == "cuda"
        self.cap, self.rows = cap, rows
        self.host = torch.zeros(4 * cap + rows, dtype=torch.long, pin_memory=cuda)
        self.dev = torch.zeros_like(self.host, device=device) if cuda else self.host
        self.out = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # the host block may be rewritten only once the copy out of it has run
        self.sent = torch.cuda.Event() if cuda else None
        self._sent_once = False

    def views(self, n: int):
        """(tokens, segments, positions, slots) of the first n packed tokens, and `last`, on the device."""
        c, d = self.cap, self.dev
        return d[:n], d[c : c + n], d[2 * c : 2 * c + n], d[3 * c : 3 * c + n], d[4 * c :]

    def fill(self, prompts: list, lengths: list[int], slots: list[int], n: int, max_seq: int) -> None:
        if self.sent is not None and self._sent_once:
            self.sent.synchronize()  # normally long done: the previous prefill's step has synced since
        c, h = self.cap, self.host.numpy()
        tokens, seg, pos, slot = h[:n], h[c : c + n], h[2 * c : 2 * c + n], h[3 * c : 3 * c + n]
        on_device = []
        o = 0
        for i, (p, t, s) in enumerate(zip(prompts, lengths, slots)):
            if isinstance(p, torch.Tensor):
                if p.device.type == "cpu":
                    tokens[o : o + t] = p.numpy()
                else:
                    on_device.append((o, p))
            else:
                tokens[o : o + t] = p
            seg[o : o + t] = i
            pos[o : o + t] = np.arange(t)
            slot[o : o + t] = s
            o += t
        if o < n:  # padding: one more segment after the last prompt, in its row, positions clamped
            tokens[o:n] = 0
            seg[o:n] = len(prompts)
            pos[o:n] = np.minimum(lengths[-1] + np.arange(n - o), max_seq - 1)
            slot[o:n] = slots[-1]
        last = h[4 * c :]
        last[:] = 0
        last[: len(lengths)] = np.cumsum(lengths) - 1
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self.sent.record()
            self._sent_once = True
        for o, p in on_device:
            self.dev[o : o + p.shape[0]].copy_(p)


class _PrefillGraph:
    """A CUDA graph of one packed prefill of n tokens (embedding, mask, rope factors, every layer, the
    prompts' last hidden states into `io.out`), replayed on whatever `io` holds. Capture runs the pass
    for real first (kernels, cuBLAS plans, compiled code warmed outside the graph), on the inputs the
    caller has just put in `io`: it writes exactly what the replay that follows writes, so rows of
    requests in flight are never touched, whenever a length is first met."""

    def __init__(self, lm: Qwen2LM, io: _PrefillIO, n: int) -> None:
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                lm._prefill_body(io, n)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, pool=lm.graph_pool()):
            lm._prefill_body(io, n)
        log.debug("captured prefill graph of %d tokens", n)


def load_qwen2(llm_dir: str | Path, device: str | torch.device, dtype: torch.dtype) -> Qwen2LM:
    """Build the LM from a Hugging Face `LLM/` directory (config.json + model.safetensors, possibly sharded)."""
    from safetensors.torch import load_file

    llm_dir = Path(llm_dir)
    cfg = Qwen2Config.from_json(llm_dir / "config.json")
    with torch.device("meta"):
        lm = Qwen2LM(cfg)
    state: dict[str, torch.Tensor] = {}
    files = sorted(llm_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{llm_dir}: no model.safetensors")
    for f in files:
        state.update(load_file(f))
    # Names as saved by transformers; tied checkpoints omit lm_head.weight.
    expected = set(lm.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{llm_dir}: checkpoint does not match Qwen2 (missing {missing[:8]}, unexpected {unexpected[:8]})")
    lm.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
    lm = lm.to(device=device, dtype=dtype)
    lm.eval()
    n = sum(p.numel() for p in lm.parameters())
    log.info("loaded Qwen2 LM from %s: %.1fM parameters, %s on %s", llm_dir, n / 1e6, dtype, device)
    return lm


__all__ = ["Qwen2Config", "Qwen2LM", "load_qwen2", "rope_tables"]
