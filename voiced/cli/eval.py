"""`voiced eval DIR`: word and character error rates, real-time factor and per-utterance latency of
our Whisper engine on a set of recordings, with faster-whisper and openai-whisper on the same
weights in the same run when they are installed. `voiced eval make-set DIR` makes a set with
espeak-ng (see voiced/bench/speech_set.py); the rest is voiced/bench/asr_eval.py.

    voiced eval make-set set/ --n 50 [--noise] [--phone]
    voiced eval set/ --model tiny.en-pypi [--dtype float32,int8] [--window full,auto] [--compare auto] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from voiced.cli import CliError

COMPARABLE = ("faster-whisper", "openai-whisper")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="WER, CER, real-time factor and latency on a set of recordings (and make such a set)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="voiced eval DIR --model M [options]\n       voiced eval make-set DIR [--n N] [--noise] [--phone]")
    p.add_argument("target", nargs="+", metavar="DIR",
                   help="a folder of audio files with same-name .txt references, or a manifest.jsonl "
                        "({\"audio\": PATH, \"text\": REF} a line); or `make-set DIR`")
    e = p.add_argument_group("evaluating")
    e.add_argument("--model", help="our model: an official name (see `voiced models list`) or a checkpoint path")
    e.add_argument("--language", default="en", help="the set's language (default en; 'auto': detect)")
    e.add_argument("--beam-size", type=int, default=1, help="1 = greedy (default), for every system")
    e.add_argument("--dtype", default="float32",
                   help="ours, comma-separated to run several: float32 (default), int8 (CPU), float16, bfloat16")
    e.add_argument("--device", default="cpu", help="ours: cpu or cuda[:N] (the references run on the CPU)")
    e.add_argument("--window", default="full",
                   help="ours, comma-separated to run both: full (default: Whisper's 30 s) or auto (the daemon's: "
                        "on a cpu the encoder's window sized to the clip)")
    e.add_argument("--compare", default="auto",
                   help="auto (default: faster-whisper at each of our dtypes and openai-whisper, when installed), "
                        "none, or a list such as faster-whisper,faster-whisper:int8,openai-whisper")
    e.add_argument("--faster-whisper-model", default=None,
                   help="the CTranslate2 directory faster-whisper loads (default: --model, when it is one)")
    e.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for every system (default: all cores)")
    e.add_argument("--repeats", type=int, default=1, help="timed runs per utterance; latency is their median")
    e.add_argument("--limit", type=int, default=None, help="only the first N utterances")
    e.add_argument("--json", action="store_true", help="print the figures as JSON")
    e.add_argument("--out", default=None, help="also write the figures, hypotheses and machine to this JSON file")
    m = p.add_argument_group("make-set")
    m.add_argument("--n", type=int, default=50, help="utterances (default 50)")
    m.add_argument("--noise", action="store_true", help="add pink room noise")
    m.add_argument("--snr", type=float, default=15.0, help="signal-to-noise ratio with --noise, dB (default 15)")
    m.add_argument("--phone", action="store_true", help="through a phone line: 8 kHz, 300-3400 Hz, mu-law WAV")
    m.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.target[0] == "make-set":
        return make_set(args)
    if len(args.target) != 1:
        raise CliError(f"give one set (a folder or a manifest), not {len(args.target)}: {' '.join(args.target)}")
    return evaluate(args)


def make_set(args: argparse.Namespace) -> int:
    from voiced.bench.speech_set import make_set as make

    if len(args.target) != 2:
        raise CliError("usage: voiced eval make-set DIR [--n N] [--noise] [--phone]")
    try:
        manifest = make(args.target[1], args.n, noise=args.noise, snr_db=args.snr, phone=args.phone, seed=args.seed)
    except (RuntimeError, ValueError) as e:
        raise CliError(str(e)) from None
    print(f"wrote {args.n} utterances and {manifest}")
    return 0


def _compare_list(args: argparse.Namespace, dtypes: list[str]) -> list[tuple[str, str]]:
    """(system, compute type) pairs to run next to ours."""
    from voiced.bench.asr_eval import installed

    spec = args.compare.strip().lower()
    if spec == "none":
        return []
    if spec == "auto":
        out = []
        if installed("faster_whisper"):
            out += [("faster-whisper", d) for d in dtypes if d in ("float32", "int8")]
        if installed("whisper"):
            out.append(("openai-whisper", "float32"))
        return out
    out = []
    for item in spec.split(","):
        name, _, kind = item.strip().partition(":")
        if name not in COMPARABLE:
            raise CliError(f"--compare: unknown system {name!r}; use {', '.join(COMPARABLE)} (faster-whisper:int8 "
                           "for its int8 mode), auto or none")
        package = "faster_whisper" if name == "faster-whisper" else "whisper"
        if not installed(package):
            raise CliError(f"--compare {name}: the package is not installed (pip install {name})")
        out.append((name, kind or "float32"))
    return out


def evaluate(args: argparse.Namespace) -> int:
    import torch

    from voiced.bench import asr_eval as ev
    from voiced.engines.base import EngineError
    from voiced.engines.whisper.checkpoint import CheckpointError
    from voiced.engines.whisper.registry import resolve
    from voiced.hub import ModelNotFoundError

    if not args.model:
        raise CliError("--model is required: the Whisper model to evaluate (a name or a checkpoint path)")
    if args.repeats < 1 or args.threads < 1:
        raise CliError("--repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    language = None if args.language == "auto" else args.language
    settings = ev.DecodeSettings(language=language, beam_size=args.beam_size, threads=args.threads)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    try:
        utts = ev.load_set(args.target[0], args.limit)
        windows = [w.strip() for w in args.window.split(",") if w.strip()]
        systems: list[ev.System] = [ev.Voiced(args.model, d, args.device, settings, window=w)
                                    for d in dtypes for w in windows]
        model_path = resolve(args.model)
        for name, kind in _compare_list(args, dtypes):
            if name == "openai-whisper":
                systems.append(ev.OpenAIWhisper(args.model, settings))
                continue
            fw_model = args.faster_whisper_model or (str(model_path) if (model_path / "model.bin").is_file() else None)
            if fw_model is None:
                print(f"voiced eval: skipping faster-whisper: {model_path} is not a CTranslate2 directory; pass "
                      "--faster-whisper-model DIR (or a faster-whisper size name, which it downloads)", file=sys.stderr)
                continue
            try:
                systems.append(ev.FasterWhisper(fw_model, kind, settings))
            except Exception as e:  # its own loader's errors (a missing tokenizer.json it cannot download, ...)
                print(f"voiced eval: skipping faster-whisper {kind}: {type(e).__name__}: {e}", file=sys.stderr)
    except (ev.EvalError, ModelNotFoundError, CheckpointError, EngineError) as e:
        raise CliError(str(e)) from None
    normalize, norm_name = ev.normalizer(language)
    results = ev.evaluate(utts, systems, repeats=args.repeats)
    rows = [r.figures(utts, normalize) for r in results]
    report = {"set": str(args.target[0]), "model": args.model, "normalizer": norm_name, "language": args.language,
              "beam_size": args.beam_size, "repeats": args.repeats, "threads": args.threads,
              "audio_seconds": sum(u.seconds for u in utts), "machine": ev.machine(), "results": rows}
    if args.out:
        full = dict(report, hypotheses={r.name: dict(zip((u.name for u in utts), r.hypotheses)) for r in results},
                    latencies_ms={r.name: dict(zip((u.name for u in utts), r.utterance_ms())) for r in results},
                    references={u.name: u.text for u in utts})
        Path(args.out).write_text(json.dumps(full, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(ev.table(rows))
    by_name = {r["system"]: r for r in rows}
    per_utt = {r.name: r.utterance_ms() for r in results}
    for r in rows:
        if r["system"].startswith("voiced "):
            ref = by_name.get("faster-whisper " + r["system"].split(" ", 1)[1])
            if ref:
                # Paired per utterance too: on a shared machine the median of the ratios is steadier
                # than the ratio of the medians.
                ratios = [a / b for a, b in zip(per_utt[r["system"]], per_utt[ref["system"]])]
                print(f"{r['system']}: p50 latency {r['latency_p50_ms'] / ref['latency_p50_ms']:.2f}x "
                      f"{ref['system']}'s (per utterance: median {statistics.median(ratios):.2f}x, faster on "
                      f"{sum(x < 1 for x in ratios)} of {len(ratios)}), WER {100 * (r['wer'] - ref['wer']):+.2f} points")
    print(f"normalizer: {norm_name}; {len(utts)} utterances, {report['audio_seconds']:.1f} s of audio; "
          f"{args.threads} threads, {args.repeats} timed run(s) each")
    return 0
