"""Chunks of greedy decoder steps in flight: what the engine launched and where their results land on the host.

A chunk's steps choose their tokens on the device and write them, with their log-probabilities, into the
engine's history buffer; the host reads the history back once per chunk. With decode-ahead
(`WhisperRuntime.decode_ahead`, on a GPU) the engine launches the next chunk of the same rows, from the inputs the
previous chunk left on the device, before it reads the previous one back: the GPU runs the next chunk while
the host applies the tokens and reports the finished, where it would otherwise wait for them at every chunk
boundary; and an admission's first chunk goes in behind its token choice, before the host reads the first
tokens. So at most two chunks are in flight, and each one's history is copied out of the device buffer (which
the next chunk overwrites) into a host buffer of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass
class Chunk:
    """A launched chunk: the requests of its rows (reqs[i] at row i), its steps, its rows' lowest and highest
    position at its first step (the CPU's exact context length), its batch bucket, its history on the host
    (valid once `landed` has passed) and the engine's row layout when it was launched (`WhisperEngine._layout`,
    which changes whenever a request takes rows or gives them up)."""

    reqs: list[Any]
    steps: int
    lo: int
    hi: int
    bucket: int
    hist: np.ndarray  # [rows, steps, (token, log-probability)] float64
    landed: torch.cuda.Event | None  # None on the CPU, where the copy is done when `send` returns
    layout: int

    def wait(self) -> np.ndarray:
        """The chunk's history, once it is on the host (the only wait for its steps)."""
        if self.landed is not None:
            self.landed.synchronize()
        return self.hist


class HistoryCopies:
    """Host buffers for chunks' histories, used in turn: two, since the engine launches a chunk only after
    reading the one before the chunk in flight. On a GPU they are pinned and the copy does not block: the
    host goes on while the chunk runs, and waits on the copy's event when it needs the tokens."""

    def __init__(self, hist: Tensor) -> None:
        self.hist = hist  # the device buffer the steps write [max rows, decode_chunk, 2]
        cuda = hist.is_cuda
        self._host = [torch.empty(hist.numel(), dtype=hist.dtype, pin_memory=cuda) for _ in range(2)]
        self._turn = 0

    def send(self, rows: int, steps: int) -> tuple[np.ndarray, torch.cuda.Event | None]:
        """Queue the copy of rows 0..rows-1, steps 0..steps-1 of the device history (on the current stream,
        after the chunk that writes it); returns their host view and the copy's event (None on the CPU)."""
        # contiguous on the host, so that the copy is one transfer the host does not wait for
        host = self._host[self._turn][:rows * steps * self.hist.shape[2]].view(rows, steps, -1)
        self._turn ^= 1
        host.copy_(self.hist[:rows, :steps], non_blocking=self.hist.is_cuda)
        if not self.hist.is_cuda:
            return host.numpy(), None
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.hist.device))
        return host.numpy(), landed
