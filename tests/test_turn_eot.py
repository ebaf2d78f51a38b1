"""LiveKit's eot-bench protocol in `voiced bench turns` (voiced.bench.turn_eot): the policy sweep's
figures worked out by hand, and the bench run on a small set in eot-bench-data's own layout."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from tests.speech import RATE, phrase
from voiced.bench import turn_eot
from voiced.bench.turn_eot import Span, baseline_figures, figures, fired_in, spans_of


def _spans(holds: list[float], eots: int = 2) -> list[Span]:
    out, t = [], 0.0
    for i, d in enumerate(holds):
        out.append(Span(f"c{i}", 0, "hold", t + 1, t + 1 + d))
        t += 10
    for i in range(eots):
        out.append(Span(f"e{i}", 1, "eot", t + 1, t + 4))
        t += 10
    return out


def test_spans_are_every_silence_of_100_ms_the_last_the_end_of_the_turn():
    spans = spans_of("c", [(1.0, 1.05), (2.0, 2.4), (3.0, 3.3), (4.0, 6.0)])
    assert [(s.index, s.label, round(s.duration, 2)) for s in spans] == [(1, "hold", 0.4), (2, "hold", 0.3),
                                                                         (3, "eot", 2.0)]
    # the cut-off rate counts holds of 0.2-5 s only; every eot counts
    kept = turn_eot.counted(_spans([0.15, 0.3, 6.0]))
    assert [s.label for s in kept] == ["hold", "eot", "eot"]


def test_silence_alone_cuts_off_every_pause_longer_than_its_delay():
    f = baseline_figures(_spans([0.3, 0.5, 0.8, 1.5]))
    assert (f["holds"], f["eots"]) == (4, 2)
    at300, at600 = f["cutoff_at_300ms"], f["cutoff_at_600ms"]
    assert (at300["cutoff_rate"], at300["mean_latency"]) == (0.75, 0.3)  # a pause of just 0.3 s is waited out
    assert (at600["cutoff_rate"], at600["mean_latency"]) == (0.5, 0.5)  # 0.5 s cuts off as many as 0.6 s, sooner
    # 5 % cut-offs: only a delay of 1.5 s or more waits out every pause
    assert f["latency_at_5pct"]["mean_latency"] == 1.5 and f["latency_at_5pct"]["cutoff_rate"] == 0.0
    assert f["latency_at_10pct"]["mean_latency"] == 1.5


def test_a_detector_that_fires_only_at_the_end_waits_only_the_least_action_delay():
    spans = fired_in(_spans([0.3, 0.5, 0.8, 1.5]), [])  # never fired in a pause
    for s in spans:
        if s.label == "eot":
            s.scores = [(0.05, 1.0)]
    f = figures(spans, binary=True)
    assert f["cutoff_at_300ms"]["cutoff_rate"] == 0.0 and f["cutoff_at_300ms"]["mean_latency"] == pytest.approx(0.2)
    assert f["latency_at_5pct"]["mean_latency"] == pytest.approx(0.2)
    # one that fires 0.1 s into every silence is silence alone: the action delay is all that holds a pause
    for s in spans:
        s.scores = [(0.1, 1.0)]
    f = figures(spans, binary=True)
    assert f["cutoff_at_300ms"]["cutoff_rate"] == 0.75 and f["latency_at_5pct"] is None  # delays end at 1 s


def test_a_scored_detector_is_swept_over_its_threshold():
    spans = _spans([0.3, 0.5, 0.8, 1.5])
    for s in spans:
        s.scores = [(0.2, 0.3 if s.label == "hold" else 0.8)]
    f = figures(spans)
    best = f["latency_at_5pct"]
    assert best["cutoff_rate"] == 0.0 and best["mean_latency"] == pytest.approx(0.2) and 0.3 <= best["threshold"] < 0.8
    # a turn detector whose fire came only through its end of turn in a pause: the turn ends read as scores
    spans = fired_in(_spans([0.8]), [1.5, 12.0])
    assert spans[0].scores == [(0.5, 1.0)] and spans[1].scores == [(1.0, 1.0)] and spans[2].scores == []


def _eot_bench_fixture(root):
    """Three turns in eot-bench-data's layout: data/en/validation-00000-of-00001.parquet, audio as WAV bytes."""
    pa = pytest.importorskip("pyarrow", reason="pip install pyarrow (the dev extra has it)")
    import pyarrow.parquet as pq
    import soundfile

    rows = []
    for i, (first, pause, second) in enumerate([("I would like to book a table for", 0.9, "four people."),
                                                ("Please call me back tomorrow.", None, None),
                                                ("My number is four five", 1.2, "seven two.")]):
        parts = [np.zeros(int(0.4 * RATE), np.float32), phrase(first)]
        spans = []
        t = sum(map(len, parts)) / RATE
        if pause:
            parts += [np.zeros(int(pause * RATE), np.float32), phrase(second)]
            spans.append({"start": t, "end": t + pause})
            t = sum(map(len, parts)) / RATE
        parts.append(np.zeros(int(2.5 * RATE), np.float32))
        spans.append({"start": t, "end": sum(map(len, parts)) / RATE})
        wav = io.BytesIO()
        soundfile.write(wav, np.concatenate(parts), RATE, format="WAV")
        rows.append({"id": f"turn{i}", "language": "en", "audio": {"bytes": wav.getvalue(), "path": f"{i}.wav"},
                     "silence_spans": spans, "words": [{"word": w, "start": 0.0, "end": 0.0}
                                                       for w in (first + " " + (second or "")).split()]})
    folder = root / "data" / "en"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "validation-00000-of-00001.parquet")
    return rows


def test_bench_turns_runs_on_eot_bench_data_and_prints_its_figures(tmp_path, capsys):
    rows = _eot_bench_fixture(tmp_path / "eot-bench-data")
    from voiced.bench.turn_bench import main

    result = main(["--eot-bench", str(tmp_path / "eot-bench-data"), "--keep-set", str(tmp_path / "set"), "--offline",
                   "--detectors", "silence", "silence:1500", "--out", str(tmp_path / "r.json")])
    manifest = [json.loads(line) for line in (tmp_path / "set" / "manifest.jsonl").read_text().splitlines()]
    assert [m["name"] for m in manifest] == ["en-turn0", "en-turn1", "en-turn2"]
    assert [m["kind"] for m in manifest] == ["paused", "finished", "paused"] and {m["family"] for m in manifest} == {"en"}
    assert manifest[0]["speech_end_s"] == pytest.approx(rows[0]["silence_spans"][-1]["start"], abs=1e-3)
    figures_ = dict(result["eot_bench"]["groups"]["all"])
    assert set(figures_) == {"silence (eot-bench's VAD baseline)", "silence", "silence:1500"}
    # the VAD baseline by definition: pauses of 0.9 and 1.2 s; a delay under 0.9 s cuts both off
    assert figures_["silence (eot-bench's VAD baseline)"]["cutoff_at_600ms"]["cutoff_rate"] == 1.0
    # the daemon's segmenter at 500 ms ends the turn inside both pauses; at 1.5 s inside neither
    silence = {v["name"]: v for v in result["detectors"][0]["per_caller"]}
    assert silence["en-turn0"]["cut_off"] and silence["en-turn2"]["cut_off"]
    assert figures_["silence"]["cutoff_at_600ms"]["cutoff_rate"] == 1.0
    assert figures_["silence:1500"]["latency_at_5pct"]["cutoff_rate"] == 0.0
    assert "false cut-offs @ 300 ms" in capsys.readouterr().err
