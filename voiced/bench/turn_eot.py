"""LiveKit's eot-bench protocol for `voiced bench turns`: every pause scored, the policy swept.

eot-bench (github livekit/eot-bench, its harness `eot_harness.metrics` and `eot_harness.io`, Apache-2.0)
judges an end-of-turn detector the way a live agent meets it: at every silence of 100 ms or more in a
caller's turn. The last silence ends the turn ("eot"); every earlier one is a pause the agent must listen
through ("hold"). A detector is scored causally in each silence: the first moment (seconds into the
silence) at which its probability of the end passes a threshold. A policy on top of the score has three
knobs, swept together:

- `threshold` (0 to 1 by 0.01): the score that ends the turn;
- `action_delay` (0.2 to 1.0 s by 0.1): the least silence before the agent may act on it;
- `timeout` (1.0 to 3.5 s by 0.5, never under the delay): silence that ends the turn whatever the score.

A hold is cut off where its silence outlasts the timeout, or the detector fired and the silence outlasted
max(action_delay, fire); the wait at an eot is max(action_delay, fire) where that comes before the
timeout, else the timeout. Holds shorter than 0.2 s or longer than 5 s are left out of the cut-off rate
(eots always count). The figures: the least false cut-off rate at a mean wait of at most 300 ms and
600 ms, and the least mean wait at a cut-off rate of at most 5 % and 10 % ("-" where no policy reaches
the budget). The VAD baseline ends every silence at one fixed delay (each action delay and timeout).

How each of our detectors is scored on that protocol:
- `smart-turn`: one score per silence, Smart Turn's probability on the audio up to 0.2 s into it
  (eot-bench's `SmartTurnAudioAdapter`, `score_point = 0.2`);
- `smart:EAGERNESS`: the daemon's own rule replayed over the caller (voiced.bench.turn_replay): a
  binary score, 1 from the moment the rule ended the turn inside that silence (as eot-bench scores
  providers that only say "ended", such as OpenAI's semantic VAD); the sweep then moves only the delay
  and the timeout. Unlike eot-bench's independent prefixes, a turn the rule ended at a hold goes on as
  a new turn, as it would in the daemon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MIN_SILENCE_S = 0.1  # eot-bench's span set: every silence this long
MIN_HOLD_S, MAX_HOLD_S = 0.2, 5.0  # holds outside these are left out of the cut-off rate
SCORE_POINT_S = 0.2  # where a one-score detector (Smart Turn) is read in each silence
THRESHOLDS = tuple(round(i / 100, 2) for i in range(101))
ACTION_DELAYS = tuple(round(0.2 + i / 10, 1) for i in range(9))
TIMEOUTS = tuple(1.0 + i / 2 for i in range(6))
LATENCY_BUDGETS_S = (0.3, 0.6)
CUTOFF_BUDGETS = (0.05, 0.10)
EPS = 1e-9


@dataclass
class Span:
    """One silence of a caller's turn and what a detector said in it."""

    caller: str
    index: int
    label: str  # "eot" (the last silence) | "hold"
    start: float  # seconds in the caller's audio
    end: float
    scores: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the silence, p of the end)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def fires(self, threshold: float) -> float:
        """Seconds into the silence at which the score first passes `threshold` (inf: never)."""
        return next((t for t, p in sorted(self.scores) if p > threshold), math.inf)


def spans_of(caller: str, silences: list[tuple[float, float]]) -> list[Span]:
    """eot-bench's spans of one turn: its silences of MIN_SILENCE_S or more, the last one the eot."""
    out = []
    for i, (a, b) in enumerate(silences):
        if b - a >= MIN_SILENCE_S - EPS:
            out.append(Span(caller, i, "eot" if i == len(silences) - 1 else "hold", a, b))
    return out


def counted(spans: list[Span]) -> list[Span]:
    """The spans the figures count: every eot, and the holds from MIN_HOLD_S to MAX_HOLD_S."""
    return [s for s in spans if s.label == "eot" or MIN_HOLD_S - EPS <= s.duration <= MAX_HOLD_S + EPS]


def sweep(spans: list[Span], thresholds=THRESHOLDS) -> list[dict]:
    """Every policy (threshold, action delay, timeout): its false cut-off rate and mean wait."""
    spans = counted(spans)
    hold = [s for s in spans if s.label == "hold"]
    eot = [s for s in spans if s.label == "eot"]
    if not hold or not eot:
        raise ValueError(f"the eot-bench figures need holds and eots: {len(hold)} holds, {len(eot)} eots")
    hold_dur = np.array([s.duration for s in hold])
    rows = []
    for threshold in thresholds:
        hold_fire = np.array([s.fires(threshold) for s in hold])
        eot_fire = np.array([s.fires(threshold) for s in eot])
        for delay in ACTION_DELAYS:
            hold_at = np.maximum(delay, hold_fire)
            eot_at = np.maximum(delay, eot_fire)
            for timeout in TIMEOUTS:
                if timeout + EPS < delay:
                    continue
                cut = (hold_dur > timeout + EPS) | (np.isfinite(hold_fire) & (hold_dur > hold_at + EPS))
                detected = np.isfinite(eot_fire) & (eot_at <= timeout + EPS)
                wait = np.where(detected, eot_at, timeout)
                rows.append({"threshold": threshold, "action_delay": delay, "timeout": timeout,
                             "cutoff_rate": float(cut.mean()), "mean_latency": float(wait.mean()),
                             "timeout_rate": float((~detected).mean())})
    return rows


def vad_baseline(spans: list[Span]) -> list[dict]:
    """Silence alone: every silence ends at one delay (each action delay and timeout of the grid)."""
    spans = counted(spans)
    hold_dur = np.array([s.duration for s in spans if s.label == "hold"])
    return [{"threshold": None, "action_delay": d, "timeout": d, "mean_latency": d, "timeout_rate": 0.0,
             "cutoff_rate": float((hold_dur > d + EPS).mean()) if len(hold_dur) else 0.0}
            for d in sorted(set(ACTION_DELAYS) | set(TIMEOUTS))]


def operating_points(rows: list[dict]) -> dict:
    """eot-bench's four figures (None where no policy reaches the budget), each with its policy."""
    out = {}
    for budget in LATENCY_BUDGETS_S:
        ok = [r for r in rows if r["mean_latency"] <= budget + EPS]
        best = min(ok, key=lambda r: (r["cutoff_rate"], r["mean_latency"]), default=None)
        out[f"cutoff_at_{int(budget * 1000)}ms"] = best
    for budget in CUTOFF_BUDGETS:
        ok = [r for r in rows if r["cutoff_rate"] <= budget + EPS]
        best = min(ok, key=lambda r: (r["mean_latency"], r["cutoff_rate"]), default=None)
        out[f"latency_at_{int(round(budget * 100))}pct"] = best
    return out


def figures(spans: list[Span], binary: bool = False) -> dict:
    """A detector's eot-bench figures over its scored spans (`binary`: its score is 0 or 1 only, so the
    threshold is not swept)."""
    rows = sweep(spans, thresholds=(0.5,) if binary else THRESHOLDS)
    kept = counted(spans)
    return {"holds": sum(s.label == "hold" for s in kept), "eots": sum(s.label == "eot" for s in kept),
            **operating_points(rows)}


def baseline_figures(spans: list[Span]) -> dict:
    kept = counted(spans)
    return {"holds": sum(s.label == "hold" for s in kept), "eots": sum(s.label == "eot" for s in kept),
            **operating_points(vad_baseline(spans))}


def fired_in(spans: list[Span], turn_ends: list[float]) -> list[Span]:
    """A binary detector's scores from where it ended turns: 1 from the first turn end inside each silence."""
    for s in spans:
        inside = [t for t in turn_ends if s.start - EPS <= t <= s.end + EPS]
        s.scores = [(round(inside[0] - s.start, 3), 1.0)] if inside else []
    return spans


def table(rows: list[tuple[str, dict]]) -> str:
    """The four figures per detector, as eot-bench's README tables them."""
    def pct(point):
        return "-" if point is None else f"{100 * point['cutoff_rate']:.1f} %"

    def ms(point):
        return "-" if point is None else f"{1000 * point['mean_latency']:.0f} ms"

    head = ("| detector | holds / eots | false cut-offs @ 300 ms | @ 600 ms | mean wait @ 5 % cut-offs | @ 10 % |\n"
            "|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {name} | {f['holds']} / {f['eots']} | {pct(f['cutoff_at_300ms'])} | {pct(f['cutoff_at_600ms'])} | "
        f"{ms(f['latency_at_5pct'])} | {ms(f['latency_at_10pct'])} |" for name, f in rows)


# ----------------------------------------------------------------------------------- on the bench's sets


def caller_silences(caller) -> list[tuple[float, float]]:
    """A caller's (voiced.bench.turn_set.TurnCaller) silences: as its set recorded them, or, in a set made
    before they were, its pauses and the silence after its speech."""
    return [tuple(s) for s in caller.silences] or [*caller.pauses, (caller.speech_end_s, caller.duration_s)]


def groups_of(callers) -> dict[str, list]:
    """The callers as the figures are reported: all, and per line and per voice family."""
    out = {"all": list(callers)}
    for key in ("line", "family"):
        values = sorted({getattr(c, key) for c in callers})
        if len(values) > 1:
            out.update({f"{key} {v}": [c for c in callers if getattr(c, key) == v] for v in values})
    return out


def report(detectors: list[dict], callers, smart_turn_scores: dict | None = None) -> dict:
    """eot-bench's figures for every detector row of a bench result (their callers' turn ends), Smart
    Turn scored at SCORE_POINT_S where `smart_turn_scores` ({caller: {span index: p}}) are given, and the
    VAD baseline; per group (`groups_of`). {"groups": {group: [(name, figures)]}, "tables": {group: text}}."""
    out: dict = {"groups": {}, "tables": {}}
    for group, members in groups_of(callers).items():
        rows = []
        try:
            spans = [s for c in members for s in spans_of(c.name, caller_silences(c))]
            rows.append(("silence (eot-bench's VAD baseline)", baseline_figures(spans)))
            if smart_turn_scores:
                for s in spans:
                    p = smart_turn_scores.get(s.caller, {}).get(s.index)
                    s.scores = [] if p is None else [(SCORE_POINT_S, p)]
                rows.append(("smart-turn (one score 0.2 s into each silence)", figures(spans)))
            for row in detectors:
                if "per_caller" not in row:
                    continue
                ends = {v["name"]: v["turn_ends_s"] for v in row["per_caller"]}
                scored = [s for c in members for s in fired_in(spans_of(c.name, caller_silences(c)), ends[c.name])]
                rows.append((row["detector"], figures(scored, binary=True)))
        except ValueError as e:  # a group of only finished callers has no holds
            out["tables"][group] = f"(no figures: {e})"
            continue
        out["groups"][group] = rows
        out["tables"][group] = table(rows)
    return out


def smart_turn_at_score_point(model, audio_of, callers) -> dict:
    """Smart Turn's probability 0.2 s into each silence of each caller ({caller: {span index: p}}), on the
    audio up to there (its last 8 s: the model's window), as eot-bench's Smart Turn adapter scores it.
    `audio_of(caller)`: the caller's 16 kHz float32 audio."""
    out: dict = {}
    for c in callers:
        audio = audio_of(c)
        spans = spans_of(c.name, caller_silences(c))
        clips = [audio[: int(round((s.start + SCORE_POINT_S) * 16000))] for s in spans]
        probs = model.predict(clips) if clips else []
        out[c.name] = {s.index: round(float(p), 4) for s, p in zip(spans, probs)}
    return out


# ----------------------------------------------------------------------------------- eot-bench's own data


def read_eot_bench(src, dest, languages: list[str] | None = None, limit: int | None = None) -> list:
    """The eot-bench-data layout (`livekit/eot-bench-data` as its repository is cloned: parquet files,
    `data/<language>/validation-*.parquet`, rows with `id`, `language`, `audio` (`bytes` of an audio file,
    or `array` and `sampling_rate`), `silence_spans` ([{start, end}] seconds), optionally `words`) ->
    a turn set in `dest` (16 kHz WAVs and manifest.jsonl, voiced.bench.turn_set), so every detector of
    `voiced bench turns` runs on it. Its callers' family is their language and their line "eot-bench"."""
    import io
    import json
    from dataclasses import asdict
    from pathlib import Path

    from voiced.bench.turn_set import TurnCaller

    try:
        import pyarrow.parquet as pq
        import soundfile
    except ImportError as e:
        raise RuntimeError(f"--eot-bench reads parquet with pyarrow and audio with soundfile ({e}): "
                           "pip install pyarrow soundfile") from None
    from voiced_client.wavio import resample, write_wav

    files = sorted(Path(src).rglob("*.parquet"))
    if not files:
        raise ValueError(f"--eot-bench {src}: no parquet files under it (clone the livekit/eot-bench-data "
                         "dataset repository and give its folder, or its data/<language> folder)")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    callers = []
    for f in files:
        for row in pq.read_table(f).to_pylist():
            language = str(row["language"]).strip().lower()
            if languages and language not in languages:
                continue
            audio = row["audio"]
            if audio.get("array") is not None:
                x, rate = np.asarray(audio["array"], np.float32), int(audio["sampling_rate"])
            else:
                x, rate = soundfile.read(io.BytesIO(audio["bytes"]), dtype="float32")
                x = x.mean(axis=1) if x.ndim > 1 else x
            x = resample(x.astype(np.float32), rate, 16000) if rate != 16000 else x.astype(np.float32)
            spans = [(round(float(s["start"]), 4), round(float(s["end"]), 4)) for s in row["silence_spans"]]
            if not spans:
                continue
            name = f"{language}-{row['id']}"
            holds = [(a, b) for a, b in spans[:-1] if b - a >= MIN_HOLD_S - EPS]
            text = " ".join(str(w["word"]).strip() for w in (row.get("words") or []))
            duration = round(len(x) / 16000, 3)
            caller = TurnCaller(name, "paused" if holds else "finished", text, [text], "", 0, "human", "silence",
                                0.0, spans[-1][0], holds, duration, f"{name}.wav", "eot-bench", language,
                                silences=spans, language=language)
            write_wav(dest / caller.audio, x, 16000)
            callers.append(caller)
            if limit is not None and len(callers) >= limit:
                break
        if limit is not None and len(callers) >= limit:
            break
    if not callers:
        raise ValueError(f"--eot-bench {src}: no rows{' in ' + ', '.join(languages) if languages else ''}")
    (dest / "manifest.jsonl").write_text("".join(json.dumps(asdict(c)) + "\n" for c in callers))
    return callers
