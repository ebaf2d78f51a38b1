"""`voiced bench`: the benchmarks behind docs/BENCHMARKS.md (made to run on a GPU machine).

    voiced bench whisper --tiktoken-dir DIR [...]   engine sweep next to transformers (JSON)
    voiced bench spark [...]                        Spark-TTS LM + vocoder next to transformers (JSON)
    voiced bench e2e --wav W --tiktoken-dir DIR     N concurrent calls through gRPC (JSON); --front grpc
                                                    audiosocket media_ws realtime: the same through each door
    voiced bench speech --tiktoken-dir DIR          /v1/audio/speech's first byte next to gRPC Synthesize's (JSON)
    voiced bench memory --tiktoken-dir DIR          both engines' GPU memory: the printed plan against the
                                                    allocator, warm-up and serving peaks (JSON); --trace
    voiced bench plot RESULT.json... --out bench.png
Each sub-command's own options: `voiced bench whisper --help`, and so on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voiced.cli import CliError

SUITES = {"whisper": "voiced.bench.whisper_bench", "spark": "voiced.bench.spark_bench",
          "e2e": "voiced.bench.e2e_bench", "speech": "voiced.bench.speech_bench",
          "memory": "voiced.bench.memory_bench"}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (GPU): engines next to transformers, and end to end",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=[*SUITES, "plot"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the suite's own options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.suite == "plot":
        return plot(args.rest)
    import importlib

    importlib.import_module(SUITES[args.suite]).main(args.rest)
    return 0


def plot(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="voiced bench plot")
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench.png"))
    a = ap.parse_args(argv)
    import matplotlib  # missing: the command line names the extra (voiced.extras)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    e2e = [json.loads(p.read_text()) for p in a.results]
    e2e = [r for r in e2e if r.get("bench") == "e2e"]
    if not e2e:
        raise CliError("no e2e results among the files (plot draws `voiced bench e2e --out` JSON)")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in e2e:
        levels = sorted(r["levels"], key=int)
        xs = [int(n) for n in levels]
        for ax, metric, title in zip(axes, ("asr_ms", "tts_first_chunk_ms", "first_audio_ms"),
                                     ("end of speech -> final transcript", "reply text -> first audio chunk",
                                      "voice-to-voice (end of speech -> first audio)")):
            for q, style in (("p50", "-o"), ("p95", "--s"), ("p99", ":^")):
                ys = [r["levels"][n].get(metric, {}).get(q) for n in levels]
                ax.plot(xs, ys, style, label=f"{q}")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("concurrent Converse sessions")
            ax.set_ylabel("ms")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"voiced end to end over gRPC on {e2e[0]['gpu']} ({e2e[0]['date']})")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0
