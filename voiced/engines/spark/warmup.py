"""The Spark engine's warm-up: run now, on the GPU, every shape serving will meet, so that no request
pays a first-time cost (torch.compile, CUDA-graph capture, cuDNN / cuBLAS plans). `engine` below is
the SparkTTSEngine (not imported here: it imports this module)."""

from __future__ import annotations

import logging
import time

import torch

from voiced.engines.base import TTSOptions
from voiced.engines.rows import doubling, to_device

from . import streaming, vocoder_schedule
from .lm_steps import PREFILL_BUCKET, padded_to
from .prompt import N_GLOBAL, longest_prompt

log = logging.getLogger(__name__)


@torch.no_grad()
def warm_up(engine, first_chunk_tokens: int | None = None, chunk_tokens: int | None = None) -> None:
    """What `SparkTTSEngine.warmup` runs (see there); sets `engine.warmup_stats`."""
    opts = TTSOptions()
    first = first_chunk_tokens or opts.first_chunk_tokens
    chunk = chunk_tokens or opts.chunk_tokens
    lm = engine.lm
    t0 = time.perf_counter()
    peaks = []  # GPU memory peak of each phase (the memory plan must leave room for the highest)
    torch.cuda.reset_peak_memory_stats()
    pick = engine._sampler([opts.top_k])
    n = engine.decode_steps
    for b in doubling(engine.max_batch, 1):
        for kv in doubling(engine.max_seq_len, 256):
            lm.run_steps(pick, b, n, max_pos=max(0, kv - n), use_graph=engine.use_cuda_graphs)
    torch.cuda.synchronize()

    def peak(held: int = 0) -> float:
        gib = (torch.cuda.max_memory_allocated() + held) / 2**30
        torch.cuda.reset_peak_memory_stats()
        return round(gib, 4)

    peaks.append(peak())
    t1 = time.perf_counter()
    # (each phase logged as it ends: a start-up of minutes on a GPU shows where it is, and where a cut-off one stopped)
    log.info("TTS warm-up: %d decode graphs in %.1f s", len(lm._step_graphs), t1 - t0)
    # The vocoder before the prefill: its graphs' pool (when on) is the GPU's from its capture on, so the
    # prefill phase holds it and the longest prefill's transient at once, as serving can (what the memory
    # plan adds up). Between replays nothing in the pool counts as allocated: that phase's peak is what
    # the allocator saw plus the pool.
    shapes = warm_vocoder(engine, first, chunk)
    peaks.append(peak())
    graphs = getattr(engine.codec, "_graphs", None)
    pool = graphs.pool_bytes() if graphs is not None else 0
    t2 = time.perf_counter()
    log.info("TTS warm-up: %d vocoder shapes in %.1f s; now the prefill lengths and the first-token sampler",
             shapes, t2 - t1)
    lengths = warm_prefill(engine, pick)
    peaks.append(peak(pool))
    t3 = time.perf_counter()
    engine.warmup_stats = {"decode_graphs": len(lm._step_graphs), "decode_s": round(t1 - t0, 2),
                           "vocoder_shapes": shapes, "vocoder_s": round(t2 - t1, 2),
                           "prefill_lengths": lengths, "prefill_graphs": len(lm._prefill_graphs),
                           "prefill_s": round(t3 - t2, 2),
                           "peak_gib": dict(zip(("decode", "vocoder", "prefill"), peaks))}
    if graphs is not None:
        engine.warmup_stats["vocoder_graphs"] = graphs.stats
    log.info("TTS warm-up: %d decode graphs (%d steps each) in %.1f s, %d vocoder shapes in %.1f s, "
             "%d prefill lengths (%d graphed) in %.1f s; GPU memory peaks %.1f / %.1f / %.1f MiB",
             len(lm._step_graphs), n, t1 - t0, shapes, t2 - t1, lengths, len(lm._prefill_graphs), t3 - t2,
             *(p * 1024 for p in peaks))


def warm_prefill(engine, pick) -> int:
    """Every packed length a prefill step can run (up to the longest prompt `submit` accepts,
    `prompt.longest_prompt`), the first-token sampler and the speaker vector."""
    longest = longest_prompt(engine.max_seq_len)
    lm = engine.lm
    count = 0
    t0 = time.perf_counter()
    for n in range(PREFILL_BUCKET, min(engine.max_seq_len, padded_to(longest, PREFILL_BUCKET)) + 1, PREFILL_BUCKET):
        # as `_prefill_fresh` sends prompts; on a GPU this captures the graph of each length graphed
        h = lm.prefill_many([[0] * n], [0], pad_to=PREFILL_BUCKET, use_graph=engine.use_cuda_graphs)
        count += 1
    t1 = time.perf_counter()
    log.info("TTS warm-up: %d prefill lengths (%d graphed) in %.1f s", count, len(lm._prefill_graphs), t1 - t0)
    engine._load_state()
    # The first-token sampler as `_prefill_step` calls it, for every number of prompts a step can
    # prefill, on consecutive rows and on scattered ones: the head's GEMV kernel is specialised per
    # row-count class, and serving must compile nothing. (The draw itself runs uncompiled here: see
    # PhaseSampler.__call__.)
    for m in range(1, engine.max_batch + 1):
        hm = h[:1].expand(m, -1).contiguous()
        pick(lm, hm, lm.state, slice(0, m)).tolist()
        if m > 1:
            pick(lm, hm, lm.state, to_device(list(range(m)), engine.device)).tolist()
    engine._speaker([0] * N_GLOBAL)
    if str(engine.device).startswith("cuda"):
        torch.cuda.synchronize()
    log.info("TTS warm-up: the first-token sampler at 1..%d rows in %.1f s", engine.max_batch, time.perf_counter() - t1)
    return count


def warm_vocoder(engine, first: int, chunk: int) -> int:
    """Every (batch bucket, padded window length) a vocoder step can decode
    (`vocoder_schedule.window_shapes`), plus the end-masked variant of each length."""
    spk = engine._speaker([0] * N_GLOBAL)
    shapes = vocoder_schedule.window_shapes(first, chunk, engine.radius)
    for i, (b, length) in enumerate(shapes):
        ids = torch.zeros(b, length, dtype=torch.long, device=engine.device)
        streaming.decode_windows(engine.codec, ids, spk[None].repeat(b, 1), [length] * b).float().cpu()
        if i + 1 == len(shapes) or shapes[i + 1][1] != length:  # the last bucket of this length
            streaming.decode_windows(engine.codec, ids[:1], spk[None], [length - 1]).float().cpu()  # end-masked
    if getattr(engine, "vocoder_graphs", False):
        capture_vocoder_graphs(engine, shapes)
    if str(engine.device).startswith("cuda"):
        torch.cuda.synchronize()
    return len(shapes)


def capture_vocoder_graphs(engine, shapes: list[tuple[int, int]]):
    """Capture the vocoder's graphs of these shapes (vocoder_graphs.py) unless those captured already
    cover them, on the LM's capture stream (one cuBLAS workspace for all the engine's graphs); returns
    them. streaming.decode_windows replays them from then on."""
    from .vocoder_graphs import VocoderGraphs

    graphs = getattr(engine.codec, "_graphs", None)
    if graphs is None or not graphs.covers(shapes):
        if graphs is not None:  # a warm-up with longer chunks: recapture all, into buffers sized for them
            shapes = sorted(set(shapes) | set(graphs.graphs))
            engine.codec._graphs = graphs = None  # the old graphs and their pool go before the new capture
        import torch

        from .bicodec import BiCodec
        from .vocoder_graphs import pool_reserve_bytes

        dtype = next(engine.codec.parameters()).dtype
        with torch.device("meta"):  # the plan's reserve (memory_plan.plan), from the same configs
            meta = BiCodec(engine.codec.config).to(dtype).eval().requires_grad_(False)
        graphs = VocoderGraphs(engine.codec, shapes, engine.lm.capture_stream(),
                               reserve_bytes=pool_reserve_bytes(meta, shapes))
        engine.codec._graphs = graphs
        graphs.stats = {"graphs": len(graphs.graphs), "capture_s": round(graphs.capture_s, 2),
                        "io_mib": round(graphs.io_bytes() / 2**20, 2),
                        "pool_mib": round(graphs.pool_bytes() / 2**20, 2)}
        log.info("TTS vocoder graphs: %(graphs)d captured in %(capture_s).1f s; shared inputs and output "
                 "%(io_mib).1f MiB, pool %(pool_mib).1f MiB", graphs.stats)
    return graphs
