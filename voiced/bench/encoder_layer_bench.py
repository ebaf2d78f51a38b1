"""One Whisper encoder layer alone, timed per way of running it: where the encoder's time could come from.

The engine's GPU encoder is 32 of these layers (large-v3-turbo), compiled with torch's defaults and replayed
from a CUDA graph per batch bucket (`whisper.fast.FastEncoder`). This runs `fast.encoder_layer` on random
weights of the given dimensions, at each batch, each way:

* attention kernel: torch's pick (cuDNN's on Hopper), or flash, cuDNN or memory-efficient pinned;
* eager, compiled as the engine compiles it, or compiled with `mode="max-autotune-no-cudagraphs"` (Inductor
  times its Triton GEMM templates against cuBLAS per shape and keeps the fastest, with the bias and GELU in
  the GEMM's epilogue where a template wins);

with the activations either in the layout the engine's layers get them (`FastEncoder` adds the positional
embedding to the convolutions' output transposed to [B, T, D] as a view, so they sit in memory as [B, D, T],
and an eager residual add keeps that layout through every layer) or contiguous. It reports milliseconds per
layer (CUDA events over replays of a graph of the layer, so launches do not count) and the TFLOPS that makes,
against the eager layer with torch's pick on the first layout measured in the same run. Each row also gives the
largest difference of its output from that reference's.

    python3 -m voiced.bench.encoder_layer_bench --batches 1 32 --layouts engine contiguous --out layer.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
from pathlib import Path

import torch

from voiced.bench.gpu_time import per_call_ms
from voiced.bench.report import emit
from voiced.bench.whisper_bench import DIMS
from voiced.engines.whisper.fast import SDPA_BACKENDS, encoder_layer, pinned_attention

log = logging.getLogger("encoder_layer_bench")

COMPILE_MODES = {"eager": None, "compiled": "default", "autotune": "max-autotune-no-cudagraphs"}


def layer_weights(d: int, device: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random weights of one layer in `encoder_layer`'s argument order, at scales that keep activations O(1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    return (1 + rnd(d, scale=0.1), rnd(d, scale=0.1), rnd(3 * d, d, scale=d ** -0.5), rnd(3 * d, scale=0.1),
            rnd(d, d, scale=d ** -0.5), rnd(d, scale=0.1), 1 + rnd(d, scale=0.1), rnd(d, scale=0.1),
            rnd(4 * d, d, scale=d ** -0.5), rnd(4 * d, scale=0.1), rnd(d, 4 * d, scale=(4 * d) ** -0.5),
            rnd(d, scale=0.1))


def graphed(fn, x: torch.Tensor, reps: int = 4):
    """`fn` applied `reps` times in a row (each to x, so every call does the same work), captured in one CUDA
    graph; returns the replay and the last output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # lazy initialisations and autotuning outside the capture
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for _ in range(reps)]
    return graph.replay, outs[-1]


def run_case(mode: str, attn: str, x: torch.Tensor, n_head: int, weights: tuple, reps: int) -> tuple[float, torch.Tensor]:
    torch._dynamo.reset()  # a compiled layer keeps the attention it was traced with
    with pinned_attention(None if attn == "default" else attn), torch.inference_mode():
        layer = encoder_layer if COMPILE_MODES[mode] is None else torch.compile(
            encoder_layer, dynamic=False, fullgraph=True, mode=COMPILE_MODES[mode])
        replay, out = graphed(lambda t: layer(t, n_head, *weights), x, reps)
        ms = per_call_ms(replay, 10, warmup=2) / reps
    return ms, out.clone()


def layer_input(b: int, t: int, d: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """Activations [b, t, d] on the GPU, the same values in either layout: "engine", strided as FastEncoder's
    first layer gets them (the convolutions' [b, d, t] output transposed, plus the positional embedding, cast);
    "contiguous", row-major."""
    g = torch.Generator().manual_seed(b)
    conv_out = torch.randn(b, d, t, generator=g).to("cuda")
    x = (conv_out.transpose(1, 2) + torch.randn(t, d, generator=g).to("cuda")).to(dtype)
    return x.contiguous() if layout == "contiguous" else x


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="large-v3-turbo", choices=sorted(DIMS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--cases", nargs="+", default=["eager:default", "eager:flash", "eager:cudnn", "eager:efficient",
                                                   "compiled:default", "compiled:flash", "autotune:default",
                                                   "autotune:flash"],
                    help=f"MODE:ATTENTION pairs; MODE one of {', '.join(COMPILE_MODES)}, ATTENTION default (torch's "
                         f"pick) or one of {', '.join(SDPA_BACKENDS)}")
    ap.add_argument("--layouts", nargs="+", default=["engine"], choices=["engine", "contiguous"],
                    help="the activations' memory layout: the engine's ([B, D, T] in memory, a transposed view) "
                         "or contiguous")
    ap.add_argument("--reps", type=int, default=4, help="layer calls per graph replay")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("encoder_layer_bench times CUDA graphs: it needs a CUDA GPU")
    dims, dtype = DIMS[args.dims], getattr(torch, args.dtype)
    d, t, h = dims.n_audio_state, dims.n_audio_ctx, dims.n_audio_head
    weights = layer_weights(d, "cuda", dtype)
    report: dict = {"dims": args.dims, "dtype": args.dtype, "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "python": platform.python_version(), "reps": args.reps, "rows": []}
    for b in args.batches:
        flops = 2 * b * t * (12 * d * d + 2 * t * d)
        ref = None  # the eager layer with torch's attention on the first layout
        cases = ["eager:default"] + [c for c in args.cases if c != "eager:default"]
        for layout, case in [(lay, c) for lay in args.layouts for c in cases]:
            mode, attn = case.split(":")
            try:
                ms, out = run_case(mode, attn, layer_input(b, t, d, layout, dtype), h, weights, args.reps)
            except Exception as e:  # (a kernel that does not run at these shapes or on this GPU)
                report["rows"].append({"batch": b, "layout": layout, "case": case, "error": repr(e)[:300]})
                log.warning("batch %d %s %s: %r", b, layout, case, e)
                continue
            ref = (ms, out) if ref is None else ref
            row = {"batch": b, "layout": layout, "case": case, "ms_per_layer": round(ms, 4),
                   "tflops": round(flops / ms / 1e9, 1),
                   "vs_eager_default": round(ref[0] / ms, 3),
                   "max_abs_diff_vs_eager_default": (out.float() - ref[1].float()).abs().max().item()}
            report["rows"].append(row)
            log.info("%s", row)
            if args.out:  # (every row as it comes: a run stopped by a time limit keeps what it measured)
                args.out.write_text(json.dumps(report, indent=2))
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
