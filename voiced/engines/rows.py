"""An engine's batch rows: the batch-size buckets its graphs are captured for, how many rows a memory
budget holds, the moves that keep live rows packed at 0..n-1 (so a step always runs on a prefix of
its caches), and how row indices made on the host reach the device."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from voiced.engines.base import EngineError


def to_device(values: Sequence, device: torch.device | str) -> torch.Tensor:
    """Integers from the host (row indices, tokens; a list, a list of equal lists or an int array) as a long
    tensor on `device`, without stalling the host. `torch.tensor(values, device="cuda")` copies from
    pageable memory, which first waits for everything queued on the stream (the Whisper admission spun
    ~75 ms there behind the encoder). Pinned memory and a non-blocking copy instead, the pinned blocks
    from a small ring kept per device (`_PinnedRing`): a fresh pinned allocation and copy per call was
    17 % of the recognition thread at 128 callers."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=torch.long)
    return _ring(torch.device(device)).send(np.ascontiguousarray(values, dtype=np.int64), device)


def _pinned_copy(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (on the host) on `device` through a pinned block of the caching host allocator, without a sync.
    pin_memory() copies into the block; torch.tensor(..., pin_memory=True) refuses numpy input."""
    return t.pin_memory().to(device, non_blocking=True)


class _PinnedRing:
    """`to_device`'s pinned staging: `SLOTS` blocks of `SLOT_LONGS` int64, used in turn, each with the CUDA
    event of the copy that last read it (recorded on the stream that copy was queued on). The copies queue
    behind the stream's kernels (an encoder pass, a chunk of steps), so a block may still wait to be read
    when its turn comes round again: then, and for values larger than a block, the call takes a pinned
    block of its own from the caching host allocator (which also reuses it only after the copy). Either way
    the host never waits. The engines' threads share a ring (lock)."""

    SLOTS = 32
    SLOT_LONGS = 4096  # 32 KiB: every row-index and token list the engines send fits; vocoder windows may not

    def __init__(self) -> None:
        self.host = torch.zeros(self.SLOTS, self.SLOT_LONGS, dtype=torch.long, pin_memory=True)
        self.blocks = list(self.host.unbind(0))  # views made once: a call slices one
        self.host_np = self.host.numpy()
        self.events = [torch.cuda.Event() for _ in range(self.SLOTS)]  # query() of an unrecorded event: True
        self.next = 0
        self.lock = threading.Lock()

    def send(self, values: np.ndarray, device: torch.device | str) -> torch.Tensor:
        n = values.size
        with self.lock:
            i = self.next
            if n <= self.SLOT_LONGS and self.events[i].query():
                self.next = (i + 1) % self.SLOTS
                self.host_np[i, :n] = values.reshape(-1)
                out = self.blocks[i][:n].view(values.shape).to(device, non_blocking=True)
                self.events[i].record(torch.cuda.current_stream(device))  # where the copy was queued
                return out
        return _pinned_copy(torch.from_numpy(values), device)


_rings: dict[torch.device, _PinnedRing] = {}
_rings_lock = threading.Lock()


def _ring(device: torch.device) -> _PinnedRing:
    """The staging ring of a CUDA device ("cuda" and "cuda:N" of the current device share one)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ring = _rings.get(device)
    if ring is None:
        with _rings_lock:
            ring = _rings.get(device)
            if ring is None:
                with torch.cuda.device(device):  # its events belong to this device
                    ring = _rings[device] = _PinnedRing()
    return ring


def doubling(top: int, start: int = 1) -> list[int]:
    """start, 2*start, 4*start, ... up to `top`, which ends the list (`[1, 2, 4, 6]` for top 6)."""
    out, b = [], start
    while True:
        out.append(min(b, top))
        if b >= top:
            return out
        b *= 2


def rows_in_budget(wanted: int, budget: int | None, per_row: int, *, owner: str, row: str) -> int:
    """The rows to allocate: `wanted`, or fewer when `budget` bytes (None: no budget) hold fewer rows
    of `per_row` bytes. A budget that holds not one row is refused, naming `owner`'s memory share."""
    if budget is None:
        return wanted
    fit = int(budget // per_row)
    if fit < 1:
        raise EngineError(f"the {owner} KV-cache budget ({budget / 2**20:.0f} MiB) holds no {row} "
                          f"({per_row / 2**20:.1f} MiB each); raise the {owner} memory share")
    return min(wanted, fit)


def compaction(occupied: Sequence[bool]) -> list[tuple[int, int]]:
    """(from, to) row moves that pack the occupied rows of 0..n-1 into 0..live-1: each occupied row
    at or past `live` moves into a free row below it, lowest first."""
    live = sum(1 for o in occupied if o)
    holes = [r for r in range(live) if not occupied[r]]
    movers = [r for r in range(live, len(occupied)) if occupied[r]]
    return list(zip(movers, holes))
