"""The Qwen2 LM as the engine serves it (`ServedLM`): the model of qwen2.py plus what makes it fast.

- `compile_decode`: decode steps through `layer_decode` and packed prefills through `layer_prefill`
  over fused projections, `torch.compile`d; on a GPU each layer's attention is one Triton kernel
  (decode_attention) and its projections decode_linear's GEMV kernels (`_decode_fast`): about 6 kernels a
  layer instead of 15.
- `run_steps`: several decode steps *and their sampling* in one CUDA graph (lm_graphs.StepsGraph), so a
  replay runs n steps with no host round trip; the host reads the n tokens per row back once. Host
  overhead per step, not GPU math, bounds a 0.5B model at small batch, so this is where the time is.
- `prefill_many`: every prompt admitted in one step runs as one packed sequence (a block-diagonal causal
  mask), one pass of ~400 kernels instead of one pass per request; on a GPU that pass is one CUDA graph per
  padded length (up to `prefill_graph_tokens`), its inputs one host->device copy.
- Every graph of the LM (decode steps and prefills) allocates from one memory pool: they replay one at a
  time on one stream, so the pool holds the largest graph's activations, not the sum of all of them.

Without `compile_decode`, or with `use_graph=False`, the same steps run the modules eagerly: the reference
the served path is tested against.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from voiced.engines.kernels import decode_attention, decode_linear

from .lm_graphs import DecodeGraph, PrefillGraph, PrefillIO, StepsGraph, StepState
from .lm_steps import PREFILL_STEP_TOKENS, bucket, prefill_capacity
from .qwen2 import (
    Qwen2Config,
    Qwen2LM,
    embed_norm,
    layer_decode,
    layer_decode_tail,
    layer_prefill,
    load_qwen2,
    packed_mask,
)


class ServedLM(Qwen2LM):
    """The LM, its KV cache and its serving state: step state, prefill buffers, compiled layers, graphs.
    Call `setup_cache` once before `prefill_many`/`run_steps`."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__(cfg)
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._step_graphs: dict[tuple, StepsGraph] = {}
        self._prefill_graphs: dict[int, PrefillGraph] = {}
        # Packed prefills up to this many tokens (every pack the engine makes) run as CUDA graphs; a longer one
        # (a lone long prompt) runs ungraphed: the graphs' shared pool holds the activations of the longest
        # graphed length.
        self.prefill_graph_tokens = PREFILL_STEP_TOKENS
        self._prefill_io: PrefillIO | None = None
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
        for the life of the process: a fresh stream per graph would hold one workspace per graph (up to
        1 GiB), memory the plan cannot foresee and nothing uses."""
        if self._capture is None:
            self._capture = torch.cuda.Stream(device=self.lm_head.weight.device)
        return self._capture

    def graph_pool(self):
        """The one memory pool every graph of this LM (`StepsGraph`, `PrefillGraph`) allocates from.
        Sharing is safe because the graphs replay one at a time on one stream and none leaves a tensor
        in the pool that outlives its replay (their outputs are buffers allocated before capture); the
        pool then holds the largest graph's activations once, instead of one private pool per graph."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ------------------------------------------------------------------ cache

    def setup_cache(self, max_batch: int, max_seq: int) -> None:
        super().setup_cache(max_batch, max_seq)
        p = self.lm_head.weight
        self._graphs.clear()
        self._step_graphs.clear()
        self._prefill_graphs.clear()
        self.state = StepState.empty(max_batch, p.device)
        self._prefill_io = PrefillIO(prefill_capacity(max_seq, self.prefill_graph_tokens), max_batch,
                                     self.config.hidden_size, p.dtype, p.device)

    # ---------------------------------------------------------------- forward

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
            io = PrefillIO(n, len(prompts), self.config.hidden_size, self.lm_head.weight.dtype, dev)
            use_graph = False
        io.fill(prompts, lengths, slots, n, self.max_seq)
        if use_graph and dev.type == "cuda" and n <= self.prefill_graph_tokens:
            graph = self._prefill_graphs.get(n)
            if graph is None:  # captured from these very inputs (see PrefillGraph)
                graph = self._prefill_graphs[n] = PrefillGraph(self, io, n)
            graph.graph.replay()
        else:
            self.prefill_body(io, n)
        return self.model.norm(io.out[: len(prompts)])

    def prefill_body(self, io: PrefillIO, n: int) -> None:
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
        """One step for rows 0..B-1: `tokens [B]`, `positions [B]` -> final-normed hidden `[B, C]`, through the
        compiled layers once `compile_decode` has run, else the modules."""
        if self._layer_fn is None:
            return super().decode_hidden(tokens, positions, kv_len)
        cfg = self.config
        x, h = self._embed_fn(tokens, self.model.embed_tokens.weight, self._layer_weights[0][0], cfg.rms_norm_eps)
        if self._tail_fn is not None:
            return self._decode_fast(x, h, positions, kv_len)[:, 0]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin, mask = self.step_factors(positions, kv_len, x.dtype)
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

    def compile_decode(self, compile: bool = True) -> None:
        """Run decode steps through `layer_decode` and packed prefill through `layer_prefill`, over
        fused projections, `torch.compile`d unless `compile=False` (fewer, fused kernels; the CUDA
        graphs captured afterwards hold the compiled kernels; the samplers compile too, see
        sampling.PhaseSampler). Compiled, on a GPU where the kernels run (`decode_attention.supported`,
        `decode_linear.supported`), each layer's attention is one Triton kernel and its projections
        decode_linear's GEMV kernels (`_decode_fast`). Compiles on first use of each shape class, which the
        engine's warm-up makes happen before serving."""
        self.fuse_projections()
        # every (batch bucket, kv bucket) and every packed prompt length is a shape: dynamic rather than
        # recompiled per shape
        self._layer_fn = torch.compile(layer_decode, dynamic=True) if compile else layer_decode
        self._prefill_fn = torch.compile(layer_prefill, dynamic=True) if compile else layer_prefill
        self._embed_fn = torch.compile(embed_norm, dynamic=True) if compile else embed_norm
        cfg, p = self.config, self.lm_head.weight
        fused = compile and decode_attention.supported(p.dtype, p.device, (cfg.num_attention_heads,
                                                                           cfg.num_key_value_heads, cfg.head_dim))
        self._tail_fn = torch.compile(layer_decode_tail, dynamic=True) if fused else None
        self._gemv = fused and decode_linear.supported(p.dtype, p.device)
        self._graphs.clear()
        self._step_graphs.clear()
        self._prefill_graphs.clear()

    @property
    def fused_attention(self) -> bool:
        return self._tail_fn is not None

    @property
    def fused_linear(self) -> bool:
        return self._gemv

    def steps_body(self, pick, batch: int, n_steps: int, kv_len: int, out: torch.Tensor) -> None:
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
            self.steps_body(pick, batch, n_steps, kv_len, out)
            return out
        bb = min(self.max_batch, bucket(batch, 1))
        key = (bb, kv_len, n_steps, pick.graph_key)
        graph = self._step_graphs.get(key)
        if graph is None:
            graph = self._step_graphs[key] = StepsGraph(self, pick, bb, n_steps, kv_len)
        graph.graph.replay()
        return graph.out[:batch]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, max_pos: int | None = None,
               use_graph: bool | None = None) -> torch.Tensor:
        """`Qwen2LM.decode`, replayed from a CUDA graph of the step on a GPU unless `use_graph` is False."""
        b = tokens.shape[0]
        kv_len = self.kv_bucket(int(positions.max().item()) if max_pos is None else max_pos)
        if use_graph is None:
            use_graph = tokens.is_cuda
        if not use_graph or not tokens.is_cuda:  # graphs are a CUDA feature; CPU runs eager
            return self.decode_eager(tokens, positions, kv_len)
        bb = min(self.max_batch, bucket(b, 1))
        key = (bb, kv_len)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = DecodeGraph(self, bb, kv_len)
        return graph.run(tokens, positions)[:b]


def load_served_lm(llm_dir: str | Path, device: str | torch.device, dtype: torch.dtype) -> ServedLM:
    """`load_qwen2` into a ServedLM."""
    return load_qwen2(llm_dir, device, dtype, cls=ServedLM)


__all__ = ["ServedLM", "load_served_lm"]
