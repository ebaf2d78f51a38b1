"""The vocoder alone: BiCodec window decodes under each environment setting in turn, in one process on one GPU.

    python -m benchmarks.vocoder_bench VOICED_SPARK_VOCODER_KERNELS=0 VOICED_SPARK_VOCODER_KERNELS=1 \\
        VOICED_SPARK_VOCODER_KERNELS=0 VOICED_SPARK_VOCODER_KERNELS=1 --out vocoder.json

The published BiCodec's size with random weights (bf16) decodes windows of the shapes a vocoder turn runs
(rows x tokens: a first chunk, lone 25-token chunks with their context, a merged window, many short rows),
each timed over 20 calls eagerly (as `streaming.decode_windows` runs it without graphs) and as one CUDA
graph of the end-masked decode (as the engine's vocoder graphs capture it): GPU ms per call and per 1000
tokens. Each mode's audio is compared, bit for bit, with the first mode's. Repeat the modes to see the
run's drift.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.gpu_time import per_call_ms

SHAPES = ((1, 80), (4, 176), (1, 1024), (16, 64))


def timed(fn, n: int = 20) -> float:
    return round(per_call_ms(fn, n, warmup=3), 3)


def parse_mode(mode: str) -> dict[str, str]:
    """`VAR=VALUE[,VAR=VALUE...]`, or `default` (no variable set)."""
    if mode == "default":
        return {}
    pairs = [p.split("=", 1) for p in mode.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"vocoder_bench: mode {mode!r} is not VAR=VALUE[,VAR=VALUE...] or 'default'")
    return dict(pairs)


def set_mode(env: dict[str, str], modes: list[tuple[str, dict[str, str]]]) -> None:
    """Make one mode's environment: every variable any of `modes` sets is cleared, then this one's set."""
    for k in {k for _, e in modes for k in e}:
        os.environ.pop(k, None)
    os.environ.update(env)


def main(argv: list[str] | None = None) -> int:
    from voiced.engines.spark import streaming
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig
    from voiced.engines.spark.vocoder_graphs import graphed_decode

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modes", nargs="+", help="VAR=VALUE[,VAR=VALUE...] or 'default'")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.vocoder_bench needs a CUDA GPU")
    modes = [(m, parse_mode(m)) for m in args.modes]
    cfg = BiCodecConfig()
    torch.manual_seed(0)
    with torch.device("cuda"):
        codec = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    streaming._install_end_masks(codec)
    spk = torch.randn(max(b for b, _ in SHAPES), cfg.speaker_out_dim, device="cuda").to(torch.bfloat16)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    first_audio: dict = {}
    for mode, env in modes:
        set_mode(env, modes)
        run: dict = {"mode": mode}
        for b, length in SHAPES:
            ids = torch.randint(0, cfg.codebook_size, (b, length), device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(b * length))
            valid = torch.full((b,), length, device="cuda")
            with torch.no_grad():
                eager = timed(lambda: streaming.decode_windows(codec, ids, spk[:b], [length] * b))
                audio = streaming.decode_windows(codec, ids, spk[:b], [length] * b).clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # cuDNN's plans and lazy inits outside the capture
                    graphed_decode(codec, ids, spk[:b], valid)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graphed_decode(codec, ids, spk[:b], valid)
                graphed = timed(graph.replay)
                del graph
            key = f"{b}x{length}"
            run[key] = {"eager_ms": eager, "graph_ms": graphed, "graph_ms_per_1k_tokens": round(graphed * 1000 / (b * length), 3),
                        "audio_equal_first_mode": bool(torch.equal(first_audio.setdefault(key, audio), audio))}
            torch.cuda.empty_cache()
        print(json.dumps(run), flush=True)
        res["runs"].append(run)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
