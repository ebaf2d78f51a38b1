"""CUDA graphs of an engine's steps, one per (step, batch bucket), all on the engine's stream and pool."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

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

