"""An engine's batch rows: the batch-size buckets its graphs are captured for, how many rows a memory
budget holds, the moves that keep live rows packed at 0..n-1 (so a step always runs on a prefix of
its caches), and how row indices made on the host reach the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from voiced.engines.base import EngineError


def to_device(values: Sequence, device: torch.device | str) -> torch.Tensor:
    """Integers from the host (row indices, tokens; a list or a list of equal lists) as a long tensor on
    `device`, without stalling the host. `torch.tensor(values, device="cuda")` copies from pageable
    memory, which first waits for everything queued on the stream: in issue 26's profile the Whisper
    admission spun ~75 ms there behind the encoder. Pinned memory and a non-blocking copy instead; the
    caching host allocator reuses the pinned block only after that copy has run."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t
    # pin_memory() copies into a pinned block; torch.tensor(..., pin_memory=True) refuses numpy input.
    return t.pin_memory().to(device, non_blocking=True)


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
