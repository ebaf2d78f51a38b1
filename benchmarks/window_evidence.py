"""What Whisper's encoder window does to the evidence the end-of-turn rule reads (voiced.core.turns).

    python -m benchmarks.window_evidence --model tiny.en-pypi --set DIR... [--windows 10 15 20 30] [--json OUT]

Every caller of a turn set (`voiced bench turns --keep-set`) is decoded as the session decodes it at a pause:
its audio up to 100 ms after the voice stopped, once at each pause inside the turn (a hold) and once at its
real end. Each decode runs in a window of the given length (the engine's clip window forced to it; 30 s is
Whisper's own), with word timings on, as the session asks. Per window and set: the median stop probability
after the last word (`Transcript.stop_prob`), end-of-text probability and last word's probability at the ends
and at the holds, how well each tells an end from a hold (ROC AUC; 0.5 is chance), and the finished callers
whose stop probability is under `turns.STOP_P` (each one a turn held `doubt_ms`). The 30 s row is the
reference the rule's thresholds were chosen on (voiced/engines/whisper/clip_window.py says what was chosen).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.smart_turn_separation import auc

RATE = 16000
AFTER_S = 0.1  # the session's pause decode starts 100 ms into the silence (turns.PAUSE_MS)


def points(directory: Path) -> list[tuple[str, str, np.ndarray]]:
    """(caller, "hold" | "end", audio up to AFTER_S past the voice's stop) for every pause and end of a set."""
    from voiced_client.wavio import read_wav

    out = []
    for line in (directory / "manifest.jsonl").read_text().splitlines():
        c = json.loads(line)
        samples, rate = read_wav(directory / c["audio"])
        if rate != RATE:
            raise SystemExit(f"{c['audio']}: {rate} Hz; turn sets are 16 kHz")
        x = samples.astype(np.float32) / 32768.0
        out += [(c["name"], "hold", x[: int((start + AFTER_S) * RATE)]) for start, _ in c["pauses"]]
        out.append((c["name"], "end", x[: int((c["speech_end_s"] + AFTER_S) * RATE)]))
    return out


def measure(model: str, sets: list[Path], windows: list[int]) -> list[dict]:
    from voiced.bench.turn_replay import session_asr_options
    from voiced.core.turns import STOP_P
    from voiced.engines.base import ASRRequest
    from voiced.engines.whisper import engine as engine_module
    from voiced.engines.whisper.audio import N_SAMPLES
    from voiced.engines.whisper.engine import WhisperEngine

    opts = dataclasses.replace(session_asr_options(), word_timestamps=True)
    engine = WhisperEngine.load(model, device="cpu", max_batch=2, window="auto")
    rows = []
    for directory in sets:
        pts = points(directory)
        for w in windows:
            # every request in a window of w seconds (30: Whisper's own, none of the clip window's handling)
            engine_module.window_samples = lambda n, w=w: min(N_SAMPLES, w * RATE)
            got = {"hold": [], "end": []}
            for _, kind, audio in pts:
                r = engine.transcribe(ASRRequest(audio, opts))
                got[kind].append((r.stop_prob or 0.0, r.end_prob or 0.0, r.words[-1].probability if r.words else 0.0))
            ends, holds = np.array(got["end"]), np.array(got["hold"])
            row = {"set": directory.name, "window_s": w, "ends": len(ends), "holds": len(holds),
                   "ends_doubted_stop": round(float((ends[:, 0] < STOP_P).mean()), 3)}
            for i, name in enumerate(("stop_p", "end_p", "last_word_p")):
                row[f"{name}_ends"] = round(float(np.median(ends[:, i])), 3)
                row[f"{name}_holds"] = round(float(np.median(holds[:, i])), 3) if len(holds) else None
                row[f"{name}_auc"] = round(auc(list(ends[:, i]), list(holds[:, i])) or float("nan"), 2)
            rows.append(row)
            print(f"{row['set']:<12} {w:>3} s  stop p AUC {row['stop_p_auc']:.2f}, ends {row['stop_p_ends']:.3f} / "
                  f"holds {row['stop_p_holds']}; end-of-text p AUC {row['end_p_auc']:.2f}, ends "
                  f"{row['end_p_ends']:.3f}; last word AUC {row['last_word_p_auc']:.2f}; ends doubted (stop p "
                  f"< {STOP_P}) {100 * row['ends_doubted_stop']:.0f} %", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Whisper model name or path (tiny.en-pypi, base-pypi)")
    ap.add_argument("--set", type=Path, nargs="+", required=True, help="turn sets (folders with manifest.jsonl)")
    ap.add_argument("--windows", type=int, nargs="+", default=[10, 15, 20, 30], help="window lengths, seconds")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if any(not 1 <= w <= 30 for w in args.windows):
        ap.error("--windows: seconds from 1 to 30 (Whisper's window is 30 s at most)")
    for d in args.set:
        if not (d / "manifest.jsonl").is_file():
            ap.error(f"--set {d}: no manifest.jsonl (make one with voiced bench turns --keep-set {d})")
    rows = measure(args.model, args.set, args.windows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
