"""The word timings' forced decoder pass as one CUDA graph replay per (rows, tokens) bucket
(`AlignmentPasses`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .cuda_graphs import CudaGraphs
from .model import KVCache, TextDecoder

# The word-timing pass's graph buckets: rows (requests finishing in one step) and token positions (the
# prompt, the text and end-of-text: a turn's few seconds of speech take 10-40).
ALIGN_GRAPH_ROWS = (1, 2, 4, 8)
ALIGN_GRAPH_TOKENS = (32, 64)


class AlignmentPasses:
    """The word timings' forced pass (`TextDecoder.alignment_hidden`) as one CUDA graph replay per (rows,
    tokens) bucket, captured at warm-up, instead of ~270 PyTorch calls, each of which waits to win the GIL
    back under load (~13 ms of the engine thread a request at 64 callers against ~7-10 alone).
    Other shapes run eagerly.

    The inputs are one static block [row, slot | tokens] written on the device from the pass's own index
    copy; a group of n rows runs as its bucket b >= n, the padding rows repeating the last real row (the
    pass writes nothing: they only cost their share of the work), its tokens padded with end-of-text at
    the end (the self-attention is causal: padding changes no real position). Every graph writes its
    outputs (the final activations and the heads' scores) into one pair of buffers of the largest bucket,
    of which it returns its corner: one bucket's outputs are held, not eight (`memory.align_graph_needs`), at
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
