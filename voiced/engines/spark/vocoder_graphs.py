"""CUDA graphs of BiCodec's window decode, one per (batch bucket, padded window length).

Why: one vocoder call is ~400 small kernels. Launched from Python, each costs the TTS thread host time
whatever the batch: 6-16 ms a call at 64-128 callers on an H200 (docs/BENCHMARKS.md, issue 26's
profile), the largest host cost of a TTS step. Replaying a graph launches them all in one call.

Every shape a vocoder turn decodes is one that warm-up runs (`vocoder_schedule.window_shapes`), so
graphs are captured there and serving never captures. One graph serves the plain and the end-masked
decode of its shape: it always applies the end mask, from a static `valid` buffer; a row whose window
does not end its utterance has valid == length, where the mask keeps every sample
(`torch.where(True, x, 0)` is x, exactly). The graphs share one memory pool.

Off by default (`SparkTTSEngine(vocoder_graphs=True)`, VOICED_SPARK_VOCODER_GRAPHS=1, `voiced bench e2e
--vocoder-graphs`). Measured on an H200 (docs/BENCHMARKS.md, issue 26): replay equals the eager decode bit
for bit, and the TTS's first chunk at 128 callers fell from 607 to 170 ms p50; but the 91 captures held
~1 GiB, far more than `held_bytes` (inputs, outputs and one step's activations) plans for, so the
memory plan under-counts them until what each capture keeps is measured and planned.
"""

from __future__ import annotations

import torch

from .bicodec import HOP, BiCodec


class _Graph:
    def __init__(self, codec: BiCodec, b: int, length: int, pool) -> None:
        from .streaming import _install_end_masks

        dev = next(codec.parameters()).device
        dtype = next(codec.parameters()).dtype
        self.ids = torch.zeros(b, length, dtype=torch.long, device=dev)
        self.spk = torch.zeros(b, codec.config.speaker_out_dim, dtype=dtype, device=dev)
        self.valid = torch.full((b,), length, dtype=torch.long, device=dev)
        self.host_valid = torch.full((b,), length, dtype=torch.long, pin_memory=True)
        self.length = length
        _install_end_masks(codec)

        def run() -> torch.Tensor:
            codec._window_valid = (self.valid, length, {})
            try:
                return codec.decode(self.ids, self.spk)
            finally:
                codec._window_valid = None

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # first-use work (cuDNN plans) outside the capture
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()

    def replay(self, ids: torch.Tensor, spk: torch.Tensor, valid: list[int]) -> torch.Tensor:
        self.ids.copy_(ids)
        self.spk.copy_(spk)
        # From pinned memory without a sync: the caller reads the output back (a sync) before the
        # next replay can overwrite the host buffer.
        self.host_valid.copy_(torch.tensor(valid, dtype=torch.long))
        self.valid.copy_(self.host_valid, non_blocking=True)
        self.graph.replay()
        return self.out


class VocoderGraphs:
    """The captured window decodes of one codec, by (batch, padded length)."""

    def __init__(self, codec: BiCodec) -> None:
        self.codec = codec
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def capture(self, b: int, length: int) -> None:
        if (b, length) not in self.graphs:
            self.graphs[(b, length)] = _Graph(self.codec, b, length, self.pool)

    def decode(self, ids: torch.Tensor, spk: torch.Tensor, valid: list[int]) -> torch.Tensor | None:
        """The graphed decode of these windows, or None for a shape warm-up did not capture."""
        g = self.graphs.get((ids.shape[0], ids.shape[1]))
        return None if g is None else g.replay(ids, spk, valid)


def held_bytes(shapes: list[tuple[int, int]], speaker_dim: int, itemsize: int) -> int:
    """The graphs' inputs and output of each of these (batch, length) shapes. A lower bound: on an H200 the
    captures held ~4x more (module docstring)."""
    return sum(b * length * 8 + b * speaker_dim * itemsize + b * 16 + b * length * HOP * itemsize
               for b, length in shapes)
