"""The time warping of word timings (`timing.dtw_many`) as one GPU kernel, the path walked back there too.

On a GPU a request's word timings are a forced decoder pass (a few hundred microseconds of kernels) and
then, on the host, the time warping: N + M numpy steps of a few microseconds each, ~2-3 ms for a turn of a
few seconds, about two thirds of the host time word timings cost (at 64 smart-turn callers that host time,
on the thread both engines share, was most of what the detector cost). Here one program per
matrix sweeps its anti-diagonals (the lanes are the token rows), keeping the last two diagonals' costs
in a small scratch ring and each cell's move in a trace table, then walks back from the corner; the host
reads back only the paths, in the copy that brings the token probabilities.

The arithmetic is `timing.dtw_many`'s (and openai-whisper's `dtw_cpu`): a cell's cost is minus the
float32 matrix entry in float64, plus the float32 best predecessor, rounded to float32; ties go to the
right-hand move, then down. tests/test_dtw_kernel.py holds the paths to `timing.dtw` under Triton's
interpreter and on a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from voiced.engines.rows import to_device
from voiced.engines.triton_lang import tl, triton


def supported(device: torch.device) -> bool:
    """Whether word timings on `device` warp on it: a CUDA device (or Triton's interpreter) with Triton
    (the paths equal the host's: tests/test_dtw_kernel*.py)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (device.type == "cuda" or interpreted)


if triton is not None:
    # (the sizes are not specialised on: one compiled kernel per block size, all made by `warm`)
    @triton.jit(do_not_specialize=["trace_rows", "out_len"])
    def _warp(x_ptr, offsets_ptr, shapes_ptr, ring_ptr, trace_ptr, out_ptr, trace_rows, out_len,
              BLOCK: tl.constexpr):
        r = tl.program_id(0)
        x = x_ptr + tl.load(offsets_ptr + r)
        n = tl.load(shapes_ptr + 2 * r)
        m = tl.load(shapes_ptr + 2 * r + 1)
        ring = ring_ptr + r * 3 * BLOCK  # costs of diagonals d % 3: lane i holds cell (i, d - i)
        trace = trace_ptr + r * trace_rows * BLOCK  # [d, i]: 0 diagonal, 1 down, 2 right
        i = tl.arange(0, BLOCK)
        inf = float("inf")
        tl.store(ring + i, tl.where(i == 0, 0.0, inf))  # diagonal 0: the corner (0, 0) costs nothing
        tl.store(ring + BLOCK + i, tl.full([BLOCK], inf, tl.float32))  # diagonal 1: borders only
        rows = (i >= 1) & (i <= n)
        for d in range(2, n + m + 1):
            tl.debug_barrier()  # the diagonals before this one are written (and read: the ring turns)
            c0 = tl.load(ring + ((d - 2) % 3) * BLOCK + i - 1, mask=rows, other=inf)  # (i-1, j-1)
            c1 = tl.load(ring + ((d - 1) % 3) * BLOCK + i - 1, mask=rows, other=inf)  # (i-1, j)
            c2 = tl.load(ring + ((d - 1) % 3) * BLOCK + i, mask=rows, other=inf)  # (i, j-1)
            j = d - i
            cell = rows & (j >= 1) & (j <= m)
            cost = tl.load(x + (i - 1) * m + (j - 1), mask=cell, other=0.0)
            diag = (c0 < c1) & (c0 < c2)
            down = (c1 < c0) & (c1 < c2)  # (never with diag: that needs c0 < c1)
            best = tl.where(diag, c0, tl.where(down, c1, c2))
            acc = (-(cost.to(tl.float64)) + best.to(tl.float64)).to(tl.float32)
            tl.store(ring + (d % 3) * BLOCK + i, tl.where(cell, acc, inf))  # outside: a border's inf
            tl.store(trace + d * BLOCK + i, tl.where(diag, 0, tl.where(down, 1, 2)).to(tl.int8), mask=cell)
        tl.debug_barrier()
        # Walk back from (n, m) while both are inside; the host adds the straight run home along a border.
        out = out_ptr + r * (2 * out_len + 3)
        a = n
        b = m
        k = n * 0
        while (a > 0) & (b > 0):
            tl.store(out + 3 + k, a - 1)
            tl.store(out + 3 + out_len + k, b - 1)
            move = tl.load(trace + (a + b) * BLOCK + a)
            a = tl.where(move != 2, a - 1, a)
            b = tl.where(move != 1, b - 1, b)
            k += 1
        tl.store(out, k)
        tl.store(out + 1, a)
        tl.store(out + 2, b)


def launch(matrices: list[torch.Tensor]) -> torch.Tensor:
    """Start the warping of each float32 matrix [N, M] (on one device, N < 1024, all of them < 2**31
    entries); returns the device
    buffer `paths` reads on the host (nothing is read back here)."""
    dev = matrices[0].device
    n_max = max(mat.shape[0] for mat in matrices)
    m_max = max(mat.shape[1] for mat in matrices)
    block = max(16, triton.next_power_of_2(n_max + 1))
    offsets = np.cumsum([0] + [mat.numel() for mat in matrices[:-1]])
    meta = to_device(np.concatenate([offsets, np.array([mat.shape for mat in matrices]).reshape(-1)]), dev)
    meta = meta.to(torch.int32)
    x = torch.cat([mat.reshape(-1).float() for mat in matrices])
    out_len = n_max + m_max
    ring = torch.empty(len(matrices), 3, block, dtype=torch.float32, device=dev)
    trace = torch.empty(len(matrices), n_max + m_max + 1, block, dtype=torch.int8, device=dev)
    out = torch.empty(len(matrices), 2 * out_len + 3, dtype=torch.int32, device=dev)
    _warp[(len(matrices),)](x, meta, meta[len(matrices):], ring, trace, out, n_max + m_max + 1, out_len,
                            BLOCK=block, num_warps=max(1, min(8, block // 64)))
    return out


def warm(device: torch.device) -> None:
    """Compile the kernel for every block size word timings meet (texts up to Whisper's 448 positions) at
    the engine's warm-up, not at a caller's pause (a first compile takes a few hundred milliseconds)."""
    if supported(device):
        for n in (1, 16, 32, 64, 128, 448):  # blocks of 16, 32, ... 512 lanes
            launch([torch.zeros(n, 4, device=device)])


def paths(buffer: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (row indices, column indices) of each matrix's path from `launch`'s buffer read back [R, 3 + 2L],
    as `timing.dtw` gives them."""
    out_len = (buffer.shape[1] - 3) // 2
    found = []
    for row in buffer:
        k, a, b = (int(v) for v in row[:3])
        walked_rows, walked_cols = row[3:3 + k][::-1], row[3 + out_len:3 + out_len + k][::-1]
        # The border run home, as timing._walk_back appends it (then reversed): down column -1, or along row -1.
        rows = np.concatenate([np.full(b, -1), np.arange(a), walked_rows]).astype(np.int64)
        cols = np.concatenate([np.arange(b), np.full(a, -1), walked_cols]).astype(np.int64)
        found.append((rows, cols))
    return found
