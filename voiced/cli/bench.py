"""`voiced bench`: the benchmarks behind docs/BENCHMARKS.md (made to run on a GPU machine).

    voiced bench whisper --tiktoken-dir DIR [...]   engine sweep next to transformers (JSON)
    voiced bench spark [...]                        Spark-TTS LM + vocoder next to transformers (JSON)
    voiced bench spark-kernels [...]                the decode step's projections: cuBLAS against our GEMV
                                                    kernels per shape, and the whole step with each (JSON)
    voiced bench spark-env VAR=V1 VAR=V2 ...        the Spark engine under each environment setting in turn, one
                                                    process: decode step, first chunk, audio at 64 (JSON)
    voiced bench spark-knockout [KIND ...]          the Spark decode step with one kind of kernel left out at a
                                                    time: what each costs inside the step's chain (JSON)
    voiced bench vocoder VAR=V1 VAR=V2 ...          BiCodec window decodes (eager and graphed) under each
                                                    environment setting in turn, one process (JSON)
    voiced bench e2e --wav W --tiktoken-dir DIR     N concurrent calls through gRPC (JSON); --front grpc
                                                    audiosocket media_ws realtime: the same through each door;
                                                    --sessions 1 2 4 ... 64 --refine N: a caller sweep and
                                                    where the daemon saturates
    voiced bench words --wav W --asr-model M        word timings' GPU kernel time and engine-thread time per
                                                    request, next to the same requests without them (JSON)
    voiced bench speech --tiktoken-dir DIR          /v1/audio/speech's first byte next to gRPC Synthesize's (JSON)
    voiced bench memory --tiktoken-dir DIR          both engines' GPU memory: the printed plan against the
                                                    allocator, warm-up and serving peaks (JSON); --trace
    voiced bench turns [--asr-model tiny.en-pypi]   end of turn: paused callers cut off and end-of-turn latency
                                                    after the real end of speech, per detector (silence 500 ms,
                                                    Smart Turn alone as Pipecat runs it, ours); runs on a CPU
    voiced bench frames [--sessions 16 32 64]       the daemon's CPU per incoming 20 ms caller frame (process and
                                                    event-loop thread), N real-time callers; --tree OLD --tree NEW
                                                    alternates two source trees in one run; runs on a CPU
    voiced bench plot RESULT.json... --out DIR      each e2e figure against the number of callers, issue 15's
                                                    targets and the saturation point marked (PNG and SVG)
    voiced bench step-ops [--batches 1 16 64]       torch calls, readbacks and list->device copies per kind of
                                                    engine step, both engines on the CPU (a checkout: the tests'
                                                    random checkpoints)
Each sub-command's own options: `voiced bench whisper --help`, and so on.
"""

from __future__ import annotations

import argparse

SUITES = {"whisper": "voiced.bench.whisper_bench", "spark": "voiced.bench.spark_bench",
          "spark-kernels": "voiced.bench.spark_kernels", "spark-env": "voiced.bench.spark_env_ab",
          "spark-knockout": "voiced.bench.spark_knockout",
          "vocoder": "voiced.bench.vocoder_bench", "words": "voiced.bench.words_bench",
          "e2e": "voiced.bench.e2e_bench", "speech": "voiced.bench.speech_bench",
          "memory": "voiced.bench.memory_bench", "turns": "voiced.bench.turn_bench", "frames": "voiced.bench.frame_cost",
          "plot": "voiced.bench.plot", "step-ops": "voiced.bench.step_ops"}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (GPU): engines next to transformers, and end to end",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the suite's own options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(SUITES[args.suite]).main(args.rest)
    return 0
