"""Qwen2 decoder-only LM for Spark-TTS, in one file, gpt-fast style: the modules, a static KV cache, and
the layers' arithmetic as pure functions.

- A static KV cache `[max_batch, kv_heads, max_seq, head_dim]` per layer, allocated once. Batch rows are
  *slots*; requests join and leave between steps. Active requests always occupy rows `0..n-1`
  (the engine compacts the cache when one leaves), so a decode step runs on a prefix of the cache and
  a CUDA graph captured for a batch bucket of `n` can be replayed without gathers.
- Grouped-query attention without `repeat_kv`: for a one-token decode step the 7 query heads that
  share a KV head are laid out as 7 "query rows" of that KV head, so SDPA reads each KV entry once.
- `layer_decode`, `layer_prefill` (and `embed_norm`, `layer_decode_tail`): one decoder layer as a pure
  function of its weights, the same arithmetic as the modules; one `torch.compile` of each serves every
  layer.

How the engine runs it (compiled layers, packed prefills, several decode steps with their sampling in one
CUDA graph) is served_lm.py and lm_graphs.py; the eager methods here are the reference they are tested
against.

The module tree and parameter names mirror `transformers`' Qwen2ForCausalLM (`model.layers.N...`),
so a Hugging Face checkpoint loads with a plain `load_state_dict`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from voiced.engines.kernels import decode_attention
from voiced.engines.kernels.decode_attention import apply_rope

from .lm_steps import bucket

log = logging.getLogger(__name__)

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
    `ServedLM.fuse_projections`): at one token per row every GEMM is a few-µs launch, so fewer is faster.
    On a GPU the compiled step replaces the attention part by one Triton kernel (voiced/engines/kernels/decode_attention.py)."""
    _, w_qkv, b_qkv, ow, ln2, w_gate_up, dw = w
    attn = decode_attention.reference(F.linear(h, w_qkv, b_qkv), cos, sin, mask, k_cache, v_cache, rows, positions,
                                      dims)
    return layer_decode_tail(x, attn, ow, ln2, w_gate_up, dw, ln_next, eps)


def layer_prefill(x, cos, sin, mask, k_cache, v_cache, slots, positions, w: tuple, eps: float, dims: tuple):
    """One decoder layer over packed prompts `x [1, N, C]` (see `ServedLM.prefill_many`), as a pure
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
    """The LM plus its static KV cache. Call `setup_cache` once before `prefill`/`decode_eager`."""

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

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One step for rows 0..B-1: `tokens [B]`, `positions [B]` -> final-normed hidden `[B, C]`."""
        x = self.model.embed_tokens(tokens[:, None])
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin, mask = self.step_factors(positions, kv_len, x.dtype)
        for layer, kc, vc in zip(self.model.layers, self.k_caches, self.v_caches):
            x = x + layer.self_attn.decode(layer.input_layernorm(x), cos, sin, kc, vc, rows, positions, kv_len, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x[:, 0])

    def step_factors(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype):
        """A decode step's rope factors `[B, 1, 1, D]` in the activations' dtype (apply_rope's casts become
        no-ops) and its mask, made once per step rather than once per layer: a decode step is ~1000 small
        kernels, and their count sets its time."""
        cos = self.rope_cos[positions][:, None, None].to(dtype)
        sin = self.rope_sin[positions][:, None, None].to(dtype)
        return cos, sin, decode_mask(positions, kv_len)

    def decode_eager(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One step for rows 0..B-1: `tokens [B]`, `positions [B]` -> logits `[B, V]` fp32."""
        return self.lm_head(self.decode_hidden(tokens, positions, kv_len)).float()

    def kv_bucket(self, max_pos: int) -> int:
        """KV prefix length attended for a step whose largest position is `max_pos`: reading 4096 cached
        positions for a 300-token request would waste bandwidth, and buckets keep the number of graphs small."""
        return min(self.max_seq, bucket(max_pos + 1, 256))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_pos: int | None = None) -> torch.Tensor:
        """One decode step for the active rows 0..B-1 -> logits `[B, V]` fp32. `max_pos` (the largest
        position, known to the caller) saves a device->host sync."""
        return self.decode_eager(tokens, positions, self.kv_bucket(int(positions.max()) if max_pos is None else max_pos))

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




def load_qwen2(llm_dir: str | Path, device: str | torch.device, dtype: torch.dtype,
               cls: type[Qwen2LM] = Qwen2LM) -> Qwen2LM:
    """Build the LM (a `cls`) from a Hugging Face `LLM/` directory (config.json + model.safetensors, possibly
    sharded)."""
    from safetensors.torch import load_file

    llm_dir = Path(llm_dir)
    cfg = Qwen2Config.from_json(llm_dir / "config.json")
    with torch.device("meta"):
        lm = cls(cfg)
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
