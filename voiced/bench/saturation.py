"""Where the daemon saturates: the largest number of real-time callers whose voice-to-voice p99 (as
the callers hear it) stays under a limit (500 ms unless told: a reply heard within half a second), read from an end-to-end
benchmark's levels.

A level passes when it was measured without errors (no failed caller, no daemon notice, no utterance
left unanswered) and its p99 is under the limit. Capacity is the largest level below the first level
that does not pass: latency that recovers at a higher count (noise in a short level) does not move it,
so a level that passes above the first failure is reported, not counted. Levels are keyed by caller
count, as ints or as the strings JSON makes of them.
"""

from __future__ import annotations

METRIC = "v2v_client_ms"  # voice-to-voice as heard: the daemon's end of speech -> first reply audio received


def level_errors(level: dict) -> int:
    """What went wrong in one level: a caller process that failed, callers whose call failed, daemon
    notices, utterances no reply answered."""
    if "error" in level:
        return 1
    return (sum(level.get("failed_callers", {}).values()) + sum(level.get("notices", {}).values())
            + level.get("unanswered", 0))


def passes(level: dict, limit_ms: float, metric: str = METRIC) -> bool:
    p99 = level.get(metric, {}).get("p99")
    return p99 is not None and p99 < limit_ms and level_errors(level) == 0


def saturation(levels: dict, limit_ms: float = 500.0, metric: str = METRIC) -> dict:
    """`capacity`: the largest caller count at which the daemon keeps up (0: at none measured);
    `first_over`: the first count that does not (None: none measured did, so capacity is a lower bound);
    `passed_above`: counts above first_over that passed anyway (a sign the levels are too short)."""
    ordered = sorted((int(n), level) for n, level in levels.items())
    capacity, first_over, above = 0, None, []
    for n, level in ordered:
        ok = passes(level, limit_ms, metric)
        if first_over is None:
            if ok:
                capacity = n
            else:
                first_over = n
        elif ok:
            above.append(n)
    return {"metric": metric, "quantile": "p99", "limit_ms": limit_ms, "capacity": capacity,
            "first_over": first_over, "saturated": first_over is not None, "passed_above": above,
            "levels": [n for n, _ in ordered]}


def next_level(levels: dict, limit_ms: float = 500.0, metric: str = METRIC) -> int | None:
    """The caller count to measure next to narrow the bracket (capacity, first_over): its midpoint,
    or None when nothing failed or the two are adjacent (zero callers count as passing, so a first
    level above 1 that fails is bracketed from 0)."""
    s = saturation(levels, limit_ms, metric)
    lo, hi = s["capacity"], s["first_over"]
    if hi is None or hi - lo < 2:
        return None
    return (lo + hi) // 2
