"""The turn bench's verdicts (shared by the live bench, voiced.bench.turn_bench, and the offline
replay, voiced.bench.turn_replay): a caller's outcome judged against where its speech really ends,
the detector's row, the table."""

from __future__ import annotations

from dataclasses import dataclass, field

from voiced.bench.steps import pct
from voiced.bench.turn_set import TurnCaller

FRAME_S = 0.02


@dataclass
class Outcome:
    """What one caller saw: every turn end and final transcript, in the caller's audio time (seconds
    of audio spoken when the event arrived)."""

    turn_ends: list[float] = field(default_factory=list)
    finals: list[tuple[float, str]] = field(default_factory=list)
    replies: list[float] = field(default_factory=list)  # when each reply's first text arrived (the echo agent answering a turn)
    error: str = ""


def judge(caller: TurnCaller, outcome: Outcome) -> dict:
    """A caller's verdict: cut off (a turn ended before the real end of speech) and the end-of-turn
    latency in ms (the first turn end after the real end; None when none came)."""
    end = caller.speech_end_s
    before = [t for t in outcome.turn_ends if t < end]
    after = [t for t in outcome.turn_ends if t >= end]
    # A turn still open when the audio runs out ends with the call (the caller hangs up): its latency
    # is a lower bound, counted as such and marked.
    unended = not after or after[0] >= caller.duration_s - FRAME_S
    replies = [t for t in outcome.replies if t >= end]
    return {"name": caller.name, "kind": caller.kind, "style": caller.style, "tail": caller.tail,
            "line": caller.line, "family": caller.family,
            "cut_off": bool(before), "eot_ms": round((after[0] - end) * 1000, 1) if after else None,
            "unended": unended, "reply_ms": round((replies[0] - end) * 1000, 1) if replies else None,
            "turn_ends_s": [round(t, 3) for t in outcome.turn_ends],
            "finals": [text for _, text in outcome.finals], "finals_s": [round(t, 3) for t, _ in outcome.finals],
            "replies_s": [round(t, 3) for t in outcome.replies], **({"error": outcome.error} if outcome.error else {})}


def summarize(detector: str, verdicts: list[dict]) -> dict:
    paused = [v for v in verdicts if v["kind"] == "paused"]
    finished = [v for v in verdicts if v["kind"] == "finished"]
    eot = [v["eot_ms"] for v in verdicts if v["eot_ms"] is not None]
    return {
        "detector": detector,
        "callers": len(verdicts),
        "paused_cut_off": sum(v["cut_off"] for v in paused),
        "paused": len(paused),
        "paused_cut_off_pct": round(100 * sum(v["cut_off"] for v in paused) / len(paused), 1) if paused else None,
        "finished_cut_off": sum(v["cut_off"] for v in finished),
        "finished": len(finished),
        "eot_ms": pct(eot),
        "eot_finished_ms": pct([v["eot_ms"] for v in finished if v["eot_ms"] is not None]),
        "reply_ms": pct([v["reply_ms"] for v in verdicts if v.get("reply_ms") is not None]),
        "unended": sum(v["unended"] for v in verdicts),
        "errors": sum(bool(v.get("error")) for v in verdicts),
        # What follows the speech matters to a VAD (hold music is sound): the figures per tail
        "by_tail": _by(verdicts, "tail"),
        # A telephone line and a voice family change what every signal says: each reported apart
        "by_line": _by(verdicts, "line"),
        "by_family": _by(verdicts, "family"),
        "per_caller": verdicts,
    }


def _by(verdicts: list[dict], key: str) -> dict:
    """The row's main figures for each value of `key` ("tail", "line", "family") among the callers."""
    out = {}
    for value in sorted({v.get(key, "") for v in verdicts}):
        vs = [v for v in verdicts if v.get(key, "") == value]
        out[value] = {"callers": len(vs), "paused_cut_off": sum(v["cut_off"] for v in vs if v["kind"] == "paused"),
                      "paused": sum(v["kind"] == "paused" for v in vs), "unended": sum(v["unended"] for v in vs),
                      "eot_ms": pct([v["eot_ms"] for v in vs if v["eot_ms"] is not None])}
    return out


def turn_targets(row: dict) -> dict:
    """Issue 25's targets for our detector on this set."""
    from voiced.bench.targets import judge

    return judge({"issue25_paused_cut_off_pct": row["paused_cut_off_pct"],
                  "issue25_eot_p50_ms": row["eot_ms"].get("p50"), "issue25_eot_p90_ms": row["eot_ms"].get("p90")})


def table(rows: list[dict]) -> str:
    head = ("| detector | paused callers cut off | finished cut off | end of turn p50 | p90 | unended | reply p50 | p90 |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['detector']} | skipped: {r['skipped']} | | | | | | |")
            continue

        def p(f: dict) -> str:
            return f"{f['p50']:.0f} ms | {f['p90']:.0f} ms" if f.get("n") else "- | -"

        share = "" if r["paused_cut_off_pct"] is None else f" ({r['paused_cut_off_pct']:.0f} %)"  # (a set of no paused callers)
        lines.append(f"| {r['detector']} | {r['paused_cut_off']} of {r['paused']}{share} | "
                     f"{r['finished_cut_off']} of {r['finished']} | {p(r['eot_ms'])} | {r['unended']} | "
                     f"{p(r.get('reply_ms', {}))} |")
    return head + "\n".join(lines)
