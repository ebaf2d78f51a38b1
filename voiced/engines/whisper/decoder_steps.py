"""The decoder's one-token steps for rows 0..b-1 of the engine's caches (`DecoderSteps`), from static per-row
inputs on the device, by CUDA graph or eagerly."""

from __future__ import annotations

import torch
from torch import Tensor

from .cuda_graphs import CudaGraphs
from .fast_decoder import FastDecoder
from .fusion import compile_static
from .model import KVCache, TextDecoder
from .token_choice import greedy_advance


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
      very order, of the engine's per-step loop (`WhisperEngine._run_chunk`), so as one CUDA graph
      it runs the kernels of decode_chunk greedy replays and their 2 x decode_chunk history writes, one
      host call instead of 3 x decode_chunk, each of which waits to win the GIL back under load. Its graph
      is only ever captured at warm-up (`capture`, never by `run`): its eager pre-runs advance rows by
      2 x decode_chunk positions, which from a live row near its length limit would index past the
      text context.

    With the GEMV step (`fused`), a greedy step's choice and bookkeeping are made in the head's GEMV and one
    pick kernel (`FastDecoder.greedy_step`), which for a chunk's step also writes its history entry, and a step
    whose rows all hold end-of-text does none of its kernels' work. A row that has chosen end-of-text keeps it
    as its token (`greedy_advance`), and a graph's padding rows are given it as theirs
    (`WhisperEngine._load_inputs`).
    """

    def __init__(self, decoder: FastDecoder | TextDecoder, cache: KVCache, n_text_ctx: int, max_batch: int,
                 device: torch.device, always: Tensor, eot: int, graphs: CudaGraphs | None = None,
                 hist: Tensor | None = None, compile_tail: bool = False) -> None:
        self.decoder, self.cache, self.n_text_ctx = decoder, cache, n_text_ctx
        self.always, self.eot = always, eot
        self.hist = hist  # the engine's greedy history [max_batch, decode_chunk, 2] float64 (`chunk` writes it)
        # Token, position and minimum-length countdown are rows of one block, so the host writes all of a
        # step's inputs with one copy (`WhisperEngine._load_inputs`).
        self.inputs = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self.tok, self.pos, self.minleft = self.inputs.unbind(0)
        # the GEMV step chooses a greedy step's tokens in its head (`FastDecoder.greedy_step`)
        self.fused = isinstance(decoder, FastDecoder) and decoder.gemv
        self.lp = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.graphs = graphs
        # The greedy choice and its bookkeeping after each step (`token_choice.greedy_advance`, ~12 small kernels
        # eagerly), compiled on a GPU into a few (in graphs and out of them alike): the same tokens, the
        # log-probabilities within their last bits.
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
            self.decoder.greedy_step(self.inputs[:, :b], self.lp[:b], self.cache, self.n_text_ctx, self.always,
                                     self.eot, hist=None if k is None else self.hist[:b, k])
            return
        logits = self.decoder.step(self.tok[:b], self.pos[:b], self.cache, kv_len or self.n_text_ctx, masked)
        self._advance(logits, self.always, self.eot, self.inputs[:, :b], self.lp[:b])

    def chunk(self, b: int) -> None:
        """`hist.shape[1]` greedy steps, each followed by writing its tokens and log-probabilities into
        that step of `hist[:b]` (the engine's per-step loop, call for call)."""
        for k in range(self.hist.shape[1]):
            self.greedy(b, k=k)
            if not self.fused:
                self.hist[:b, k, 0] = self.tok[:b]
                self.hist[:b, k, 1] = self.lp[:b]

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

