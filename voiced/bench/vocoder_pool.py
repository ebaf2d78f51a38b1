"""GPU probe: what the vocoder graphs' pool holds at full size (BiCodec's published size, random weights,
bf16, the 91 default shapes), and what decides it. Run on a GPU from the repository root:

    PYTHONPATH=$PWD python3 -m voiced.bench.vocoder_pool

Each line is one fresh process (the allocator's state matters):
  ops      the eager decode of the largest shape, op by op: each op's transient beyond its inputs and output
           (cuDNN's convolution workspace, taken through PyTorch's allocator), the largest ones first;
  capture  the 91 captures as vocoder_graphs.VocoderGraphs makes them, with reserve R MiB (0: none, as before
           this probe; 'plan': what memory_plan plans): the pool's size and segments at the end, what each
           capture grew it by, the allocated peak while capturing, and the plan's numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MiB = 2**20


def setup():
    import torch

    from voiced.engines.base import TTSOptions
    from voiced.engines.spark import streaming, vocoder_schedule
    from voiced.engines.spark import vocoder_graphs as vg
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig

    cfg = BiCodecConfig()
    with torch.device("meta"):
        meta = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    opts = TTSOptions()
    shapes = vocoder_schedule.window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, meta.receptive_radius())
    torch.manual_seed(0)
    with torch.device("cuda"):
        codec = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    stream = torch.cuda.Stream()
    spk = torch.randn(16, cfg.speaker_out_dim, device="cuda").to(torch.bfloat16)
    return torch, vg, streaming, meta, codec, shapes, stream, spk, cfg


def ops() -> dict:
    torch, vg, streaming, meta, codec, shapes, stream, spk, cfg = setup()
    from torch.utils._python_dispatch import TorchDispatchMode

    b, length = max(shapes, key=lambda s: s[0] * s[1])
    ids = torch.zeros(b, length, dtype=torch.long, device="cuda")
    valid = torch.full((b,), length, dtype=torch.long, device="cuda")
    rows = []

    class Scan(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = func(*args, **(kwargs or {}))
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            shp = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:2]
            rows.append((extra, str(func), shp))
            return out

    with torch.no_grad(), torch.cuda.stream(stream):
        vg.graphed_decode(codec, ids, spk[:b], valid)  # first use (cuDNN plans, 1/alpha), unmeasured
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = vg.graphed_decode(codec, ids, spk[:b], valid)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_allocated() - a0
        del out
        with Scan():
            vg.graphed_decode(codec, ids, spk[:b], valid)
    rows.sort(key=lambda r: -r[0])
    return {"mode": "ops", "shape": [b, length], "meta_peak_mib": vg.activation_bytes(meta, shapes) / MiB,
            "eager_peak_mib": eager_peak / MiB, "largest_op_transients_mib":
            [(round(e / MiB, 2), f, s) for e, f, s in rows[:8]],
            "ops_with_transient": sum(1 for r in rows if r[0] > 0), "ops": len(rows),
            "cudnn": torch.backends.cudnn.version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def capture(reserve: str) -> dict:
    torch, vg, streaming, meta, codec, shapes, stream, spk, cfg = setup()
    planned = vg.pool_reserve_bytes(meta, shapes) if hasattr(vg, "pool_reserve_bytes") else None
    r = planned if reserve == "plan" else int(float(reserve) * MiB)
    with torch.no_grad():
        with torch.cuda.stream(stream):  # as the engine's warm-up has before it captures
            b, length = max(shapes, key=lambda s: s[0] * s[1])
            streaming.decode_windows(codec, torch.zeros(b, length, dtype=torch.long, device="cuda"), spk[:b],
                                     [length - 1] * b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        g = vg.VocoderGraphs(codec, shapes, stream, reserve_bytes=r)
        torch.cuda.synchronize()
        segs = sorted(s["total_size"] // MiB for s in torch.cuda.memory_snapshot()
                      if tuple(s.get("segment_pool_id") or ()) == tuple(g.pool))
        torch.cuda.empty_cache()
        out = {"mode": "capture", "reserve_mib": r / MiB, "planned_reserve_mib": planned and planned / MiB,
               "pool_mib": g.pool_bytes() / MiB, "pool_segments_mib": segs,
               "peak_mib": (torch.cuda.max_memory_allocated() - a0) / MiB,
               "allocated_mib": (torch.cuda.memory_allocated() - a0) / MiB,
               "reserved_mib": (torch.cuda.memory_reserved() - r0) / MiB,
               "io_mib": g.io_bytes() / MiB, "meta_activations_mib": vg.activation_bytes(meta, shapes) / MiB,
               "growth_mib_first5": [round(x / MiB, 1) for x in g.pool_growth[:5]],
               "captures_that_grew_pool": sum(1 for x in g.pool_growth[1:] if x), "capture_s": round(g.capture_s, 1)}
        # replay check on the largest shape
        codec._graphs = g
        b, length = max(shapes, key=lambda s: s[0] * s[1])
        ids = torch.randint(0, 8192, (b, length), device="cuda")
        valid = [length - 5] + [length] * (b - 1)
        rep = streaming.decode_windows(codec, ids, spk[:b], valid).clone()
        codec._graphs = None
        eager = streaming.decode_windows(codec, ids, spk[:b], valid)
        out["replay_equals_eager"] = bool(torch.equal(rep.view(torch.int16), eager.view(torch.int16)))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(ops() if sys.argv[1] == "ops" else capture(sys.argv[2])), flush=True)
    else:
        runs = [["ops"], ["capture", "0"], ["capture", "plan"]]
        runs += [["capture", r] for r in os.environ.get("PROBE_RESERVES", "").split(",") if r]
        for args in runs:
            p = subprocess.run([sys.executable, "-m", "voiced.bench.vocoder_pool", *args], capture_output=True,
                               text=True)
            print(p.stdout.strip() or f"{args}: rc {p.returncode}\n{p.stderr[-3000:]}", flush=True)
