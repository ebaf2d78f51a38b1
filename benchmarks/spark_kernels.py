"""The Spark LM decode step's projections on a GPU: cuBLAS against our GEMV kernels, shape by shape.

    python -m benchmarks.spark_kernels [--rows 1 16 64] [--out FILE]

For each projection of Spark-TTS-0.5B's decode step (q/k/v with bias, output, gate/up, down, the
head's speech-token slice) at 1, 16 and 64 rows: microseconds per call as a CUDA graph replays it (20
calls per graph, so launch costs are those a decode graph pays), cuBLAS through `F.linear` beside
voiced/engines/kernels/decode_linear.py's kernels at several tile widths, and the weight-read floor at
the H200's 4.8 TB/s. Then the whole sampled decode step (random full-size weights, compiled, graphs)
with the GEMV kernels and with cuBLAS, and whether greedy tokens agree over 200 steps. Prints JSON.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_time import per_call_ms
from voiced.bench.report import emit

# (outputs, inputs) of each projection at Spark-TTS-0.5B's size
SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (2 * 4864, 896), "down": (896, 4864), "head": (13568, 896)}


def graph_us(fn, reps: int = 400) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of 20 calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return round(per_call_ms(graph.replay, reps // 20) * 1000 / 20, 2)


def kernels(rows: int) -> dict:
    from voiced.engines.kernels import decode_linear as dl

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, r = randn(rows, 896), {"rows": rows}
    w_qkv, b_qkv, w_o, w_gu, w_head = (randn(*SHAPES["qkv"]), randn(SHAPES["qkv"][0]), randn(*SHAPES["o"]),
                                       randn(*SHAPES["gate_up"]), randn(*SHAPES["head"]))
    a, w_down, resid, ln = randn(rows, 4864), randn(*SHAPES["down"]), randn(rows, 896), randn(896)
    r["floor_us"] = {k: round(n * kk * 2 / 4.8e12 * 1e6, 2) for k, (n, kk) in SHAPES.items()}
    r["qkv_cublas"] = graph_us(lambda: F.linear(x, w_qkv, b_qkv))
    r["qkv_gemv"] = graph_us(lambda: dl.linear(x, w_qkv, b_qkv))
    # the output and down projections: cuBLAS's GEMM then torch's add + norm, against split-K + add_norm
    for name, inp, w in (("o", x, w_o), ("down", a, w_down)):
        r[f"{name}_cublas"] = graph_us(lambda: F.linear(inp, w))
        r[f"{name}_gemv_split"] = graph_us(lambda: dl.linear_partials(inp, w))
        r[f"{name}_gemv_split_add_norm"] = graph_us(lambda: dl.add_norm(dl.linear_partials(inp, w), resid, ln, 1e-6))
    r["gate_up_cublas_then_swiglu"] = graph_us(lambda: dl.reference_swiglu_linear(x, w_gu))
    for bn in (32, 64):
        r[f"swiglu_gemv_bn{bn}"] = graph_us(lambda: dl.swiglu_linear(x, w_gu, block_n=bn))
    r["head_cublas"] = graph_us(lambda: F.linear(x, w_head))
    for bn in (64, 128):
        r[f"head_gemv_bn{bn}"] = graph_us(lambda: dl.linear(x, w_head, block_n=bn))
    return r


def decode_steps(batches: list[int]) -> dict:
    """The engine's sampled decode step with the GEMV kernels and with cuBLAS, same weights."""
    import unittest.mock

    from benchmarks.spark_bench import steps_decode
    from voiced.engines.kernels import decode_linear as dl
    from voiced.engines.random_weights import random_spark

    engine = random_spark("cuda", torch.bfloat16, torch.bfloat16, max(batches), 1024, Path(tempfile.mkdtemp()))
    prompt = torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(0)).cuda()
    out, greedy = {}, {}
    for label, gemv in (("gemv", dl.supported), ("cublas", lambda *a: False)):
        with unittest.mock.patch.object(dl, "supported", gemv):  # the projections through cuBLAS, for scale
            engine.lm.compile_decode()
        greedy[label], _ = steps_decode(engine, prompt, 200, 1, use_graph=True)
        out[label] = {f"batch{b}_ms": round(steps_decode(engine, prompt, 200, 50, use_graph=True, batch=b)[1] * 1000, 3)
                      for b in batches}
    out["greedy_tokens_agree"] = next((i for i, (p, q) in enumerate(zip(greedy["gemv"], greedy["cublas"])) if p != q),
                                      len(greedy["gemv"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-steps", action="store_true", help="the per-shape table only (spark_bench times the step)")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "kernels_us": [kernels(m) for m in args.rows]}
    if not args.skip_steps:
        report["decode_step"] = decode_steps(args.rows)
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
