"""`voiced bench`: the benchmarks a user runs against voiced, from an installed voiced.

    voiced bench e2e [--tiny-cpu] --wav W ...       N concurrent callers through a door of a daemon serving
                                                    random full-size weights (JSON); --sessions 1 2 4 ... 64
                                                    --refine N: a caller sweep and where the daemon saturates
                                                    (voice-to-voice p99 under --saturation-ms)
    voiced bench plot RESULT.json... --out DIR      each e2e figure against the number of callers, the targets
                                                    and the saturation point marked (PNG and SVG)
    voiced bench turns [--asr-model tiny.en-pypi]   end of turn: paused callers cut off and end-of-turn latency
                                                    after the real end of speech, per detector; runs on a CPU
    voiced bench soak [--asr-model tiny.en-pypi]    many sessions against one real `voiced serve` process, and
                                                    the memory, threads, tasks and descriptors they leave behind
Word error rates over a spoken set are `voiced eval`. The engines' own benchmarks (kernels, one engine next to
transformers, memory against the plan) are for developers of the engines: benchmarks/ in the repository.
Each sub-command's own options: `voiced bench e2e --help`, and so on.
"""

from __future__ import annotations

import argparse

SUITES = {"e2e": "voiced.bench.e2e_bench", "plot": "voiced.bench.plot", "turns": "voiced.bench.turn_bench",
          "soak": "voiced.bench.soak"}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: callers end to end, turn taking, soak",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the suite's own options")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    status = importlib.import_module(SUITES[args.suite]).main(args.rest)
    return status if isinstance(status, int) else 0
