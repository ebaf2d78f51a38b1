"""CUDA graphs of BiCodec's window decode, one per (batch bucket, padded window length).

Why: one vocoder call is ~400 small kernels. Launched from Python, each costs the TTS thread host time
whatever the batch: 6-16 ms a call at 64-128 callers, the largest host cost of a TTS step. Replaying a
graph launches them all in one call; it equals the eager decode bit for bit (tests/test_spark_gpu.py).

Every shape a vocoder turn decodes is one that warm-up runs (`vocoder_schedule.window_shapes`), so
graphs are captured there and serving never captures. One graph serves the plain and the end-masked
decode of its shape: it always applies the end mask, from a static `valid` buffer; a row whose window
does not end its utterance has valid == length, where the mask keeps every sample
(`torch.where(True, x, 0)` is x, exactly).

What they hold, and why no more (`held_bytes`, `activation_bytes`; the memory plan counts both):
  - one set of static inputs and one output (`_SharedIO`), sized for the shape with the most rows and
    the one with the most tokens; each graph reads and writes contiguous prefix views of it. Inside the
    capture the decode's result is copied into the shared output, so the decode's own output is freed at
    the end of its capture like every other intermediate;
  - one memory pool for all graphs, which therefore ends each capture with nothing live in it: the next
    capture reuses the same memory. Sharing is safe because replays run one at a time: the engine reads
    a vocoder turn's audio back before it launches the next.
    Left to itself the pool would hold far more than the largest decode's activations: (1) cuDNN takes
    its convolution workspace through PyTorch's allocator (120.5 MiB for each 7-tap Conv1d over
    [16, 192, 10240] at full size, invisible on the meta device), and (2) PyTorch's caching allocator
    cudaMallocs a new segment sized for the request when no free block is big enough and never merges
    segments, so a decode whose tensors grow layer by layer leaves one segment per growing size. Hence
    `reserve_bytes` (`pool_reserve_bytes`): the first capture allocates and frees one segment of the
    activations + POOL_ALLOWANCE before it decodes, and every later allocation splits a block of it, so
    the pool is that segment and the small pool's few 2 MiB segments. The allowance is absolute (sized
    for the full-size codec), so the test checkpoint's pool is mostly allowance;
  - nothing per stream: every graph is warmed up and captured on one given stream (the LM's capture
    stream), because PyTorch gives each (thread, stream) pair that runs cuBLAS a workspace of its own
    (32 MiB on Hopper) for the life of the process (see the LM's `capture_stream`).

A replay's output is a view of the shared buffer: the next replay (of any shape) overwrites it. Every
caller queues the copy of the audio to the host on the same stream before the next vocoder call
(`streaming.launch_jobs`; warm-up reads it back), which is what makes that safe.

The engine captures them wherever it runs CUDA graphs (`SparkTTSEngine.use_cuda_graphs`).
"""

from __future__ import annotations

import time

import torch

from voiced.engines.rows import to_device

from .bicodec import HOP, BiCodec

ALLOC_GRANULE = 512  # PyTorch's CUDA caching allocator rounds every block up to a multiple of this


def _granules(n_bytes: int) -> int:
    return -(-n_bytes // ALLOC_GRANULE) * ALLOC_GRANULE


def io_sizes(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """(most rows, most tokens) over these (batch, length) shapes: what the shared buffers must hold."""
    return max(b for b, _ in shapes), max(b * length for b, length in shapes)


def held_bytes(shapes: list[tuple[int, int]], speaker_dim: int, itemsize: int) -> int:
    """The device bytes of the shared inputs and output of graphs of these shapes (`_SharedIO`), as the
    allocator rounds them."""
    rows, tokens = io_sizes(shapes)
    return (_granules(tokens * 8) + _granules(rows * speaker_dim * itemsize) + _granules(rows * 8)
            + _granules(tokens * HOP * itemsize))


def graphed_decode(codec: BiCodec, ids: torch.Tensor, spk: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """What each graph captures: the end-masked window decode (`streaming.decode_windows`), the valid
    lengths already on the device. Also run on the meta device by the memory plan (`activation_bytes`)."""
    codec._window_valid = (valid, ids.shape[1], {})
    try:
        return codec.decode(ids, spk)
    finally:
        codec._window_valid = None


def activation_bytes(codec: BiCodec, shapes: list[tuple[int, int]]) -> int:
    """The pool's share: the largest peak of live tensors among the captured decodes with the most tokens,
    measured on the meta device (pass a meta codec). Every activation of the decode is [rows, channels,
    tokens x the layer's samples per token], so the peak grows with rows x tokens; the rows alone change
    it by a few bytes (for the published model every shape of 1024 tokens peaks at 304.5 MiB in bf16, 960
    tokens at 285.5), so the shapes with the most tokens are the ones to measure."""
    from voiced.memory_plan import peak_live_bytes

    from .bicodec import Snake1d
    from .streaming import _install_end_masks

    dtype = next(codec.parameters()).dtype
    _install_end_masks(codec)
    for m in codec.modules():  # made once and kept, by the engine's eager warm-up before any capture
        if isinstance(m, Snake1d):
            m.inverse_alpha()
    most = max(b * length for b, length in shapes)
    peaks = []
    for b, length in shapes:
        if b * length < most:
            continue
        with torch.device("meta"):
            ids = torch.zeros(b, length, dtype=torch.long)
            spk = torch.zeros(b, codec.config.speaker_out_dim, dtype=dtype)
            valid = torch.full((b,), length, dtype=torch.long)
        with torch.no_grad():
            peaks.append(peak_live_bytes(lambda ids=ids, spk=spk, valid=valid: graphed_decode(codec, ids, spk, valid)))
    return max(peaks)


SEGMENT_GRANULE = 2 * 2**20  # a segment of 10 MiB or more is cudaMalloc'd in multiples of this
# What one segment needs beyond the largest decode's live tensors (304.5 MiB for the full-size BiCodec in
# bf16): cuDNN's 120.5 MiB convolution workspace, taken through PyTorch's allocator, and the fragmentation of
# freed blocks inside the segment (a reserve of 426-470 MiB still needs a separate segment for that workspace;
# one of 520 MiB holds everything).
POOL_ALLOWANCE = 520 * 2**20 - 304 * 2**20
# Allocations under 1 MiB come from the allocator's small pool, 2 MiB segments that a large segment never
# serves: the pool holds 4 of them whatever the reserve.
SMALL_SEGMENTS = 4 * 2 * 2**20


def pool_reserve_bytes(codec: BiCodec, shapes: list[tuple[int, int]]) -> int:
    """The one large segment the graphs' pool is made of (`VocoderGraphs(reserve_bytes=...)`): the largest
    captured decode's activations (`activation_bytes`, meta device) and POOL_ALLOWANCE (cuDNN's convolution
    workspace and fragmentation, measured), in whole segment granules."""
    n = activation_bytes(codec, shapes) + POOL_ALLOWANCE
    return -(-n // SEGMENT_GRANULE) * SEGMENT_GRANULE


def pool_bytes_planned(codec: BiCodec, shapes: list[tuple[int, int]]) -> int:
    """What the pool holds for good with that reserve: the segment and the small pool's (the plan's row)."""
    return pool_reserve_bytes(codec, shapes) + SMALL_SEGMENTS


class _SharedIO:
    """The static inputs and output every graph uses, as flat buffers: graph (b, length) takes the first
    b*length ids as a [b, length] view, and so on, so that each graph's tensors are contiguous (a prefix of
    a [rows, tokens] buffer would not be, for other widths)."""

    def __init__(self, codec: BiCodec, shapes: list[tuple[int, int]]) -> None:
        p = next(codec.parameters())
        rows, tokens = io_sizes(shapes)
        self.speaker_dim = codec.config.speaker_out_dim
        self.ids = torch.zeros(tokens, dtype=torch.long, device=p.device)
        self.spk = torch.zeros(rows * self.speaker_dim, dtype=p.dtype, device=p.device)
        self.valid = torch.zeros(rows, dtype=torch.long, device=p.device)
        self.out = torch.zeros(tokens * HOP, dtype=p.dtype, device=p.device)

    def views(self, b: int, length: int) -> tuple[torch.Tensor, ...]:
        """(ids [b, length], spk [b, C], valid [b], out [b, length*HOP])."""
        return (self.ids[: b * length].view(b, length), self.spk[: b * self.speaker_dim].view(b, self.speaker_dim),
                self.valid[:b], self.out[: b * length * HOP].view(b, length * HOP))


class _Graph:
    def __init__(self, codec: BiCodec, io: _SharedIO, b: int, length: int, pool, stream: torch.cuda.Stream,
                 reserve_bytes: int = 0) -> None:
        self.ids, self.spk, self.valid, self.out = io.views(b, length)
        self.valid.fill_(length)
        dev = self.ids.device
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # first-use work (cuDNN plans) outside the capture
            graphed_decode(codec, self.ids, self.spk, self.valid)
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            if reserve_bytes:
                # One segment of the pool's planned size, made and freed before anything else (no kernel:
                # an allocation alone records nothing in the graph): every later allocation of every
                # capture splits a block of it, so the pool is this one segment (module docstring).
                del_me = torch.empty(reserve_bytes, dtype=torch.uint8, device=dev)
                del del_me
            # The copy is part of the graph: the decode's own output dies with this block, so its memory
            # goes back to the pool for the next capture instead of staying live per graph.
            self.out.copy_(graphed_decode(codec, self.ids, self.spk, self.valid))

    def replay(self, ids: torch.Tensor, spk: torch.Tensor, valid: list[int]) -> torch.Tensor:
        self.ids.copy_(ids)
        self.spk.copy_(spk)
        # Without a sync, through to_device's staging (which keeps a pinned block until its copy has run:
        # two replays may be queued before either is read back, streaming.launch_jobs).
        self.valid.copy_(to_device(valid, self.valid.device))
        self.graph.replay()
        return self.out


class VocoderGraphs:
    """The captured window decodes of one codec, by (batch, padded length): every shape in `shapes`,
    warmed up and captured on `stream` (give the one stream the engine captures on: see the module
    docstring)."""

    def __init__(self, codec: BiCodec, shapes: list[tuple[int, int]], stream: torch.cuda.Stream,
                 reserve_bytes: int = 0) -> None:
        from .streaming import _install_end_masks

        _install_end_masks(codec)
        self.codec = codec
        self.shapes = sorted(set(shapes))
        self.pool = torch.cuda.graph_pool_handle()
        self.io = _SharedIO(codec, self.shapes)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.stats: dict = {}  # what warm-up measured of them (warmup.capture_vocoder_graphs)
        self.reserve_bytes = reserve_bytes
        self.pool_growth: list[int] = []  # what each capture added to the pool, in capture order
        t0 = time.perf_counter()
        # Most tokens first: the first capture sizes the pool's blocks for the largest decode, and each
        # later (smaller) one fits in them, rather than the pool growing by a block a later capture needs
        # that the smaller ones before it left in pieces. The set of shapes is the caller's.
        for i, (b, length) in enumerate(sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[0]))):
            before = self.pool_bytes()
            self.graphs[(b, length)] = _Graph(codec, self.io, b, length, self.pool, stream,
                                              reserve_bytes if i == 0 else 0)
            self.pool_growth.append(self.pool_bytes() - before)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def covers(self, shapes: list[tuple[int, int]]) -> bool:
        return set(shapes) <= set(self.graphs)

    def io_bytes(self) -> int:
        """The shared inputs and output, on the device (what `held_bytes` plans)."""
        io = self.io
        return sum(_granules(t.nbytes) for t in (io.ids, io.spk, io.valid, io.out))

    def pool_bytes(self) -> int:
        """What the graphs' pool holds on the device (its segments; nothing in them is live between
        replays): what `pool_bytes_planned` plans."""
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id") or ()) == tuple(self.pool))

    def decode(self, ids: torch.Tensor, spk: torch.Tensor, valid: list[int]) -> torch.Tensor | None:
        """The graphed decode of these windows, or None for a shape warm-up did not capture. The result is
        a view of the shared output: read it before the next call (module docstring)."""
        g = self.graphs.get((ids.shape[0], ids.shape[1]))
        return None if g is None else g.replay(ids, spk, valid)
