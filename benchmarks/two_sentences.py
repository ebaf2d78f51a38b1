"""Callers who say two sentences with a short gap between them: does the daemon give them two turns?

A finished sentence, 0.8-1.0 s of silence, another sentence (issue 59's phone callers, and two more). Where the
pause's decode takes longer than the gap, the caller's next sentence comes back before the evidence, the pause is
dropped and both sentences become one turn, answered once, late. On a GPU the decode takes ~20 ms; on a CPU it is
most of a second, and it is what `asr.window` changes. Each caller is streamed through gRPC Converse in real time
(20 ms frames; voiced.bench.turn_bench's caller), clean and through a noisy phone line with two noise seeds, to a
`voiced serve` the bench starts for each window, with the product's defaults otherwise (smart turn detection at
medium, Smart Turn loaded):

    python -m benchmarks.two_sentences --asr-model base-pypi --windows auto full

It prints, for each window, how many callers got two turns (or more), per line, and the final transcripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from voiced.bench.soak import DaemonProcess
from voiced.bench.speech_set import speak
from voiced.bench.turn_bench import segmentation, stream_caller
from voiced.bench.turn_set import RATE, through_phone
from voiced.config import ASR_WINDOWS

# (first sentence, the gap after it in seconds, second sentence)
CALLERS = [
    ("I would like to check the balance on my savings account", 0.9, "yes that is correct"),
    ("no I said account number four four seven one", 0.8, "thank you goodbye"),
    ("My name is Sarah Jones.", 0.9, "I am calling about my electricity bill."),
    ("The package never arrived.", 1.0, "I would like a refund please."),
]
LINES = (("clean", None), ("phone", 1), ("phone", 2))  # (line, noise seed)
PHONE_SNR_DB = 20.0
VOICE, SPEECH_RATE = "en-us", 165


def caller_audio(first: str, gap_s: float, second: str, line_seed: int | None) -> bytes:
    """One caller as 16 kHz LINEAR16: 0.5 s of silence, the two sentences `gap_s` apart, 4.5 s of silence (longer
    than the detector's bound at medium); through a phone line with line noise where `line_seed` is set."""
    a, b = speak(first, VOICE, SPEECH_RATE), speak(second, VOICE, SPEECH_RATE)  # (each with 0.3 s of silence around)
    audio = np.concatenate([np.zeros(RATE // 5, np.float32), a, np.zeros(int((gap_s - 0.6) * RATE), np.float32), b,
                            np.zeros(int(4.2 * RATE), np.float32)])
    if line_seed is not None:
        audio = through_phone(audio, PHONE_SNR_DB, np.random.default_rng(line_seed))
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def split_counts(rows: list[dict]) -> dict[str, str]:
    """"k/n" callers with two turns or more, per line and in all."""
    out = {}
    for line in ("clean", "phone", "all"):
        mine = [r for r in rows if line == "all" or r["line"] == line]
        out[line] = f"{sum(r['turns'] >= 2 for r in mine)}/{len(mine)}"
    return out


def run_window(model: str, window: str, workdir: Path, start_timeout: float) -> list[dict]:
    serve = ["--asr-model", model, "--no-tts", "--agent", "echo", "--asr-window", window]
    daemon = DaemonProcess(serve, workdir / f"daemon-{window}.log")
    rows = []
    try:
        daemon.wait_serving(start_timeout)
        for first, gap_s, second in CALLERS:
            for line, seed in LINES:
                outcome = asyncio.run(stream_caller(daemon.address, caller_audio(first, gap_s, second, seed),
                                                    segmentation("smart:medium")))
                if outcome.error:
                    raise RuntimeError(f"caller {first!r} ({line}): {outcome.error}")
                finals = [text for _, text in outcome.finals]
                rows.append({"caller": first, "line": line, "turns": len(finals), "finals": finals})
                print(f"  {window:5} {line:5} {len(finals)} turn(s): {finals}", flush=True)
    finally:
        daemon.stop()
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.two_sentences", description=__doc__.split("\n\n")[0])
    p.add_argument("--asr-model", default="base-pypi", help="Whisper model (default base-pypi, the CPU's default)")
    p.add_argument("--windows", nargs="+", default=list(ASR_WINDOWS), choices=ASR_WINDOWS,
                   help=f"asr.window values to compare, each with its own daemon (default: {' '.join(ASR_WINDOWS)})")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a daemon to report SERVING")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    result = {"bench": "two_sentences", "date": time.strftime("%Y-%m-%d"), "asr_model": args.asr_model, "windows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for window in args.windows:
            rows = run_window(args.asr_model, window, Path(tmp), args.start_timeout)
            result["windows"][window] = {"split": split_counts(rows), "callers": rows}
    print(f"\ncallers given two turns ({args.asr_model}; {len(CALLERS)} callers x {len(LINES)} lines):")
    print("| window | clean | phone | all |\n| --- | --- | --- | --- |")
    for window, r in result["windows"].items():
        s = r["split"]
        print(f"| {window} | {s['clean']} | {s['phone']} | {s['all']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
