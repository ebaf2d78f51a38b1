"""The caller sweep, how each figure grows from 1 to 64 callers: where the daemon
saturates (voiced.bench.saturation), the e2e bench's sweep on the CPU dry-run path, and
`voiced bench plot` drawing it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from voiced.bench.saturation import next_level, saturation

ROOT = Path(__file__).resolve().parent.parent


def level(p50: float, p99: float, **extra) -> dict:
    return {"v2v_client_ms": {"n": 40, "p50": p50, "p90": (p50 + p99) / 2, "p99": p99}, "notices": {},
            "failed_callers": {}, "unanswered": 0, **extra}


# A sweep as an H200 might give it: p99 crosses 500 ms between 24 and 32 callers.
SWEEP = {1: level(150, 166), 2: level(148, 170), 4: level(146, 210), 8: level(160, 230), 16: level(186, 245),
         24: level(230, 420), 32: level(300, 560), 48: level(520, 980), 64: level(650, 1360)}


def test_saturation_is_the_last_level_under_the_limit_before_the_first_over_it():
    s = saturation(SWEEP, 500)
    assert (s["capacity"], s["first_over"], s["saturated"], s["passed_above"]) == (24, 32, True, [])
    # JSON makes the caller counts strings; the verdict is the same
    assert saturation(json.loads(json.dumps(SWEEP)), 500) == s


def test_refinement_halves_the_bracket_until_the_two_levels_are_adjacent():
    levels = dict(SWEEP)
    asked = []
    while (n := next_level(levels, 500)) is not None:
        asked.append(n)
        levels[n] = level(260, 480) if n <= 29 else level(280, 510)
    assert asked == [28, 30, 29]
    assert saturation(levels, 500)["capacity"] == 29 and saturation(levels, 500)["first_over"] == 30


def test_a_daemon_that_never_saturates_reports_its_largest_level_as_a_lower_bound():
    levels = {n: level(100, 200) for n in (1, 4, 16, 64)}
    s = saturation(levels, 500)
    assert (s["capacity"], s["first_over"], s["saturated"]) == (64, None, False)
    assert next_level(levels, 500) is None


def test_a_daemon_saturated_at_one_caller_has_no_capacity_and_nothing_to_refine():
    s = saturation(SWEEP, 100)
    assert (s["capacity"], s["first_over"], s["saturated"]) == (0, 1, True)
    assert next_level(SWEEP, 100) is None
    # a sweep that starts above one caller and fails there is bracketed from zero
    assert next_level({4: level(400, 700), 8: level(500, 900)}, 500) == 2


def test_errors_or_missing_figures_fail_a_level_and_recovery_above_the_first_failure_is_only_reported():
    levels = dict(SWEEP)
    levels[8] = level(160, 230, notices={"TTS_FAILED: out of memory": 1})
    s = saturation(levels, 500)
    assert (s["capacity"], s["first_over"], s["passed_above"]) == (4, 8, [16, 24])
    levels[8] = {"error": "the caller process failed"}
    assert saturation(levels, 500)["first_over"] == 8
    levels[8] = level(160, 230, unanswered=2)
    assert saturation(levels, 500)["first_over"] == 8
    del levels[8]["v2v_client_ms"], levels[8]["unanswered"]
    assert saturation(levels, 500)["first_over"] == 8


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                       os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_the_e2e_sweep_measures_every_level_on_one_daemon_and_refines_the_saturation_bracket(tmp_path):
    from voiced_client.wavio import resample

    from tests.speech import layout, write_wav
    from voiced.engines.whisper.tokenizer import find_tiktoken_file

    wav = tmp_path / "speech.wav"  # at 22.05 kHz, as espeak-ng writes: the bench resamples it
    audio = layout(["What time does the shop open tomorrow?"], lead_s=0.3, gap_s=0.5, tail_s=1.0).audio
    write_wav(wav, resample(audio, 16000, 22050), rate=22050)
    out = tmp_path / "sweep.json"
    # A limit no level can meet: level 2 fails, so --refine measures level 1 (the bracket 0..2), which
    # fails too, and then stops (0..1 is adjacent): a deterministic refinement on the CPU.
    proc = subprocess.Popen([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--asr-dims", "tiny-random",
                             "--wav", str(wav), "--tiktoken-dir", str(find_tiktoken_file("multilingual.tiktoken").parent),
                             "--sessions", "2", "--duration", "2", "--reply-seconds", "0.3", "--asr-tokens", "4",
                             "--saturation-ms", "0", "--refine", "3", "--caller-processes", "2", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.log").open("w"), env=env())
    # After its first level the report is on disk, marked incomplete, while the refinement runs: a sweep a time
    # limit stops keeps what it measured (a lent GPU's call lost a whole sweep that way in session 26).
    deadline = time.monotonic() + 600
    while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    partial = json.loads(out.read_text())
    proc.wait(timeout=600)
    assert proc.returncode == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    assert partial["complete"] is False and list(partial["levels"]) == ["2"], partial.get("levels")
    result = json.loads(out.read_text())
    assert result["complete"] is True
    assert list(result["levels"]) == ["1", "2"]  # the refined level sorted in
    for n, lv in result["levels"].items():
        # the callers split over two processes where there are two, their figures merged as one level's
        assert lv["callers"] == int(n) and lv["caller_processes"] == int(n), lv
        assert (lv["failed_callers"], lv["notices"], lv["unanswered"]) == ({}, {}, 0), lv
        for figure in ("v2v_client_ms", "v2v_real_end_ms", "first_audio_ms", "asr_ms", "tts_first_chunk_ms", "rtf"):
            assert lv[figure]["n"] >= int(n) and {"p50", "p90", "p99"} <= set(lv[figure]), (n, figure)
        # from the caller's real end of speech: the same replies, timed from no later than the detected end
        assert lv["v2v_real_end_ms"]["p50"] >= lv["v2v_client_ms"]["p50"], lv
    sat = result["saturation"]["grpc"]
    assert (sat["capacity"], sat["first_over"], sat["levels"], sat["limit_ms"]) == (0, 1, [1, 2], 0.0)
    assert result["startup_s"] > 0 and result["duration_s"] == 2.0


def test_the_e2e_bench_reports_each_processs_garbage_collections_with_the_engines_in_their_own(tmp_path):
    """With the engines in a process of their own (as `voiced serve` runs them on a GPU) each level reports
    the daemon's process's collections and the engines' process's apart: either one stalls every caller."""
    from tests.speech import layout, write_wav
    from voiced.engines.whisper.tokenizer import find_tiktoken_file

    wav = tmp_path / "speech.wav"
    write_wav(wav, layout(["What time does the shop open tomorrow?"], lead_s=0.3, tail_s=1.0).audio)
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--asr-dims", "tiny-random",
                           "--engine-process", "separate", "--wav", str(wav),
                           "--tiktoken-dir", str(find_tiktoken_file("multilingual.tiktoken").parent),
                           "--sessions", "2", "--duration", "2", "--reply-seconds", "0.3", "--asr-tokens", "4",
                           "--out", str(out)], capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(set(re.findall(r"froze \d+ objects .* process (\d+)\)", proc.stderr))) == 2, \
        proc.stderr[-3000:]  # each process froze its own start-up
    [lv] = json.loads(out.read_text())["levels"].values()
    assert lv["unanswered"] == 0 and lv["failed_callers"] == {}, lv
    for key in ("gc", "engine_gc"):
        assert {"gen0", "gen1", "gen2"} <= set(lv[key]), (key, lv.get(key))
    # replying moves tensors and numpy arrays through the engines' process: its young generation collects
    assert lv["engine_gc"]["gen0"]["n"] > 0, lv["engine_gc"]


@pytest.mark.slow
def test_callers_at_every_door_wait_for_their_answer_before_hanging_up(tmp_path):
    """Through each door the bench's callers hold the line (silence, as a phone or an open microphone
    sends) until what they said is answered: a hang-up ends a phone call and its reply, and the bench
    then measured one reply fewer at the phone doors and the Realtime API than at gRPC, at no cost."""
    from tests.speech import layout, write_wav
    from voiced.engines.whisper.tokenizer import find_tiktoken_file

    wav = tmp_path / "speech.wav"
    write_wav(wav, layout(["What time does the shop open tomorrow?"], lead_s=0.3, gap_s=0.5, tail_s=1.0).audio)
    out = tmp_path / "doors.json"
    proc = subprocess.run([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--asr-dims", "tiny-random",
                           "--wav", str(wav), "--tiktoken-dir", str(find_tiktoken_file("multilingual.tiktoken").parent),
                           "--sessions", "2", "--duration", "2", "--reply-seconds", "0.3", "--asr-tokens", "4",
                           "--front", "grpc", "audiosocket", "media_ws", "realtime", "wyoming", "--out", str(out)],
                          capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fronts = {front: levels["2"] for front, levels in json.loads(out.read_text())["fronts"].items()}
    for front, lv in fronts.items():
        assert (lv["failed_callers"], lv["notices"], lv["unanswered"]) == ({}, {}, 0), (front, lv)
        # every caller's utterance answered, as over gRPC (whose callers half-close and wait)
        assert lv["v2v_client_ms"]["n"] == fronts["grpc"]["v2v_client_ms"]["n"] >= 2, (front, lv["v2v_client_ms"])


@pytest.mark.slow
def test_the_e2e_bench_with_a_real_whisper_decides_turns_with_the_smart_detector(tmp_path):
    from tests.real_whisper import CACHE, tiny_en_dir
    from tests.speech import layout, write_wav
    from tests.turn_model import smart_turn_path

    smart_turn_path()  # pulled into the test cache, where the bench finds it as `voiced serve` does
    wav = tmp_path / "speech.wav"
    write_wav(wav, layout(["What time does the shop open tomorrow?", "Thank you very much."], lead_s=0.3, gap_s=2.5,
                          tail_s=2.5).audio)
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--asr-model", str(tiny_en_dir()),
                           "--wav", str(wav), "--sessions", "1", "--duration", "8", "--reply-seconds", "0.3",
                           "--asr-batch", "4", "--out", str(out)],
                          capture_output=True, text=True, env={**env(), "VOICED_CACHE": str(CACHE)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["asr_model"], result["turn_detection"]) == (str(tiny_en_dir()), "smart")
    [level] = result["levels"].values()
    assert (level["failed_callers"], level["notices"]) == ({}, {}), level
    assert level["asr_ms"]["n"] == 2, level  # each sentence one turn, one final transcript
    assert level["v2v_real_end_ms"]["n"] >= 1, level  # voice-to-voice from the caller's real end of speech
    assert level["v2v_real_end_ms"]["p50"] >= level["v2v_client_ms"]["p50"], level
    # Each reply is timed from its own turn's end, told by the daemon's SPEECH_ENDED: a smart detector ends
    # turns before the caller's copy of the silence rule would, and a reply paired with the previous
    # turn's end reads seconds (seen on the H100: 4.9 s, every first reply unmatched).
    assert (level["unmatched_replies"], level["unanswered"]) == (0, 0), level
    assert level["v2v_real_end_ms"]["p99"] < 2500, level  # under the gap between the two sentences


def test_bench_plot_draws_every_figure_against_callers_with_targets_and_saturation(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from voiced.bench.plot import DPI, FIGSIZE
    from voiced.cli import main

    levels = {}
    for n, lv in SWEEP.items():
        levels[str(n)] = {**lv, "callers": n, "asr_ms": {"p50": 23 + n / 4, "p99": 40 + 3 * n},
                          "tts_first_chunk_ms": {"p50": 120 + 2 * n, "p99": 170 + 12 * n},
                          "rtf": {"p50": 0.1 + n / 200, "p99": 0.2 + n / 100},
                          "gpu_memory": {"allocated_gib": 7.1, "peak_gib": 7.5 + n / 100, "reserved_gib": 9.0}}
    run = {"bench": "e2e", "gpu": "NVIDIA H200", "date": "2026-11-23", "duration_s": 12.0, "startup_s": 150.0,
           "levels": levels, "fronts": {"grpc": levels}, "saturation": {"grpc": saturation(levels, 500)},
           "gpu_memory": {"TTS load and warm-up": {"allocated_gib": 7.1, "peak_gib": 7.3}}}
    js = tmp_path / "sweep-h200.json"
    js.write_text(json.dumps(run))
    (tmp_path / "soak.json").write_text(json.dumps({"bench": "gpu_soak"}))
    assert main(["bench", "plot", str(js), str(tmp_path / "soak.json"), "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "soak.json" in printed
    assert "up to 24 callers (over at 32)" in printed
    row = next(line.split() for line in printed.splitlines() if line.split()[:1] == ["64"])
    assert row[1:6] == ["650", "/", "1005", "/", "1360"]  # the table's row for 64 callers: v2v p50/p90/p99
    assert row[-2:] == ["8.14", "0"]  # its GPU memory peak and errors

    png = matplotlib.image.imread(tmp_path / "plots" / "sweep-h200.png")
    assert png.shape == (FIGSIZE[1] * DPI, FIGSIZE[0] * DPI, 4)
    assert png[..., :3].std() > 0.05  # drawn on, not a blank canvas
    svg = (tmp_path / "plots" / "sweep-h200.svg").read_text()
    for text in ("concurrent real-time callers", "voice-to-voice as heard", "end of speech -&gt; final transcript",
                 "TTS first chunk", "real-time factor", "GPU memory", "errors per level", "end-to-end target",
                 "p99 ≤ 400", "p50 ≤ 130", "saturates: 24 callers", "saturation limit (p99 500 ms)"):
        assert text in svg, text


def test_a_callers_clock_times_a_reply_from_the_turn_the_daemon_ended_not_from_its_own_silence_rule():
    from voiced.bench.phone_callers import EndOfSpeech
    from voiced.bench.turn_set import LOUD

    rate, frame = 16000, 320
    t = np.arange(frame) / rate
    voice = (0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype(np.int16).tobytes()
    quiet = bytes(2 * frame)
    assert 0.3 > LOUD
    clock = EndOfSpeech(door_decides=True)
    at = 0.0
    for _ in range(50):  # 1 s of voice, then 200 ms of silence: a smart detector's end, short of the 500 ms rule's
        at += 0.02
        clock.sent(voice, at)
    last_sound = at
    for _ in range(10):
        at += 0.02
        clock.sent(quiet, at)
    clock.decided(at)  # SPEECH_ENDED arrives
    out = {"v2v_client_ms": [], "v2v_real_end_ms": [], "unmatched_replies": []}
    clock.reply_started(out, at + 0.1)
    assert out["unmatched_replies"] == []
    assert out["v2v_client_ms"] == [pytest.approx(100.0)]
    assert out["v2v_real_end_ms"] == [pytest.approx(300.0, abs=1.0)]  # from the voice's last sample
    clock.finished(at + 1.0)
    assert not clock.ends and clock.utterances == 1  # the daemon's end is the only one counted
    assert last_sound < at


def test_a_turn_the_daemon_ends_before_the_callers_own_clock_does_is_counted_once():
    """Silence detection: the caller's clock runs the daemon's segmenter over the frames it sends and finds
    each end with the daemon. On a busy machine the daemon's SPEECH_ENDED can arrive before the clock has
    heard the frame that ends the utterance; the clock's own end that follows is the same utterance, so the
    reply to that turn answers it and nothing is left unanswered (it counted one, 3 runs in 12 of the sweep
    test with both cores busy)."""
    from voiced.bench.phone_callers import EndOfSpeech

    rate, frame = 16000, 320
    t = np.arange(frame) / rate
    voice = (0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype(np.int16).tobytes()
    quiet = bytes(2 * frame)
    talk = [voice] * 50 + [quiet] * 60
    twin = EndOfSpeech()  # where the segmenter ends the utterance: the frame the daemon decides on
    end = next(i for i, f in enumerate(talk) if (twin.sent(f, i * 0.02), twin.ends)[1])
    for door_first in (False, True):
        clock = EndOfSpeech()
        out = {"v2v_client_ms": [], "v2v_real_end_ms": [], "unmatched_replies": []}
        for i, f in enumerate(talk):
            if door_first and i == end:
                clock.decided(i * 0.02 + 0.001, turn=1)  # SPEECH_ENDED before the clock heard this frame
            clock.sent(f, i * 0.02)
            if not door_first and i == end:
                clock.decided(i * 0.02 + 0.001, turn=1)
        clock.transcribed(1)
        clock.reply_started(out, end * 0.02 + 0.2, turn=1)
        clock.finished(len(talk) * 0.02)
        assert clock.unanswered() == 0 and clock.utterances == 1 and not clock.ends, door_first
        assert out["unmatched_replies"] == [] and len(out["v2v_client_ms"]) == 1
        assert out["v2v_client_ms"][0] == pytest.approx(200.0 if not door_first else 199.0, abs=0.01)


def test_a_turn_the_daemon_drops_takes_no_reply_from_the_next_turn():
    """A door that names its turns: a turn the daemon ended but dropped (no transcript: its words a
    hallucination, such as the tail of a word where a looped WAV starts) is owed no reply. The next turn's
    reply is timed from that turn's own end, not from the dropped one's (a queue did that: one sentence's
    period, ~4.8 s, added to a p99), and nothing is left unanswered."""
    from voiced.bench.phone_callers import EndOfSpeech

    quiet = bytes(640)
    clock = EndOfSpeech(door_decides=True)
    out = {"v2v_client_ms": [], "v2v_real_end_ms": [], "unmatched_replies": []}
    clock.sent(quiet, 0.7)
    clock.decided(0.7, turn=1)  # the fragment: SPEECH_ENDED, then no transcript
    clock.sent(quiet, 6.5)
    clock.decided(6.5, turn=2)
    clock.transcribed(2)
    clock.reply_started(out, 6.7, turn=2)
    clock.decided(11.0, turn=3)
    clock.transcribed(3)  # the last turn: words, and no reply before the caller hung up
    assert out["v2v_client_ms"] == [pytest.approx(200.0)] and out["unmatched_replies"] == []
    assert clock.unanswered() == 1
    clock.reply_started(out, 11.3, turn=3)
    clock.reply_started(out, 12.0, turn=7)  # a reply to no turn the caller saw end
    assert out["v2v_client_ms"] == [pytest.approx(200.0), pytest.approx(300.0)]
    assert out["unmatched_replies"] == [1] and clock.unanswered() == 0 and clock.utterances == 3


def test_bench_callers_hang_up_after_what_they_are_saying_so_no_turn_ends_at_the_hang_up():
    """Every bench caller stops at the end of its level; one that stopped mid-sentence would have the daemon
    end that turn on the spot, and with all callers stopping at one instant those turns all end together,
    a burst of transcripts no real callers make. Past its duration a caller talks on until the daemon's
    segmenter (same settings, same frames) has no utterance in progress."""
    from tests.speech import layout
    from voiced.bench.phone_callers import talk_seconds
    from voiced.config import Config
    from voiced.core.segmenter import Segmenter
    from voiced.core.spec import segmentation_for

    lay = layout(["Please call me back tomorrow morning.", "I would like to book a table for two people."],
                 lead_s=0.3, gap_s=1.0, tail_s=0.8)
    pcm = (lay.audio * 32767).astype("<i2").tobytes()
    n_frames = len(pcm) // 640

    def in_utterance_at(start: int, seconds: float) -> bool:
        segmenter = Segmenter(segmentation_for(Config()))
        for k in range(round(seconds / 0.02)):
            segmenter.push(np.frombuffer(pcm, "<i2", 320, ((start + k) % n_frames) * 640))
        return segmenter.in_speech

    starts = range(0, n_frames, 7)
    cut = [s for s in starts if in_utterance_at(s, 2.0)]
    assert len(cut) > len(starts) // 3  # hanging up at 2 s would end many turns mid-sentence
    for start in starts:
        seconds = talk_seconds(pcm, start, 2.0)
        assert 2.0 <= seconds < 2.0 + lay.audio.size / 16000
        assert not in_utterance_at(start, seconds), start


def test_the_e2e_bench_refuses_turn_detection_without_a_real_whisper(tmp_path):
    """Random weights write noise, so their turns end on silence: asking for a detector there is an error
    that says what to add, before anything loads."""
    proc = subprocess.run([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--wav", str(tmp_path / "x.wav"),
                           "--tiktoken-dir", str(tmp_path), "--turn-detection", "smart"],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and "--turn-detection needs --asr-model" in proc.stderr, proc.stderr[-2000:]


def test_the_e2e_bench_refuses_a_wav_it_cannot_read_before_anything_loads(tmp_path):
    bad = tmp_path / "speech.wav"
    bad.write_bytes(b"not a wav file at all")
    proc = subprocess.run([sys.executable, "-m", "voiced.bench.e2e_bench", "--tiny-cpu", "--wav", str(bad),
                           "--tiktoken-dir", str(tmp_path)], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2 and f"--wav {bad}" in proc.stderr, proc.stderr[-2000:]
    assert "Loading" not in proc.stderr and "warm" not in proc.stderr.lower()


class _Node:
    """A cyclic object of a type no other code makes, to find in the census."""

    def __init__(self):
        self.me = self


def test_a_slow_full_collection_is_reported_with_what_it_freed_and_what_the_collector_still_tracks():
    import gc

    from voiced.bench.e2e_bench import GcPauses

    pauses = GcPauses(census_ms=0.0, top=100_000)  # every full collection is slow here; every type counted
    kept = [_Node() for _ in range(3000)]
    gc.callbacks.append(pauses)
    gc.disable()  # no automatic collection frees the garbage before the full one
    try:
        for _ in range(2000):
            _Node()  # garbage only a collection frees
        gc.collect()
    finally:
        gc.enable()
        gc.callbacks.remove(pauses)
    out = pauses.take()
    assert out["gen2"]["n"] >= 1
    census = out["slow_full"][-1]
    assert census["collected"] >= 2000
    assert census["top"].get(_Node.__qualname__, 0) >= len(kept)
    assert census["tracked"] >= len(kept)
    assert "slow_full" not in pauses.take()  # each level reports its own


def test_a_caller_that_falls_behind_still_says_all_it_was_to_say():
    """The bench's callers send a fixed length of audio, paced against the clock: one slowed down (a busy
    machine) catches up rather than hanging up early, mid-utterance, on a turn it was meant to finish."""
    import asyncio
    import time

    from voiced.bench.phone_callers import paced

    frames = [bytes([k]) * 640 for k in range(7)]
    sent, out = [], {"late_ms": []}

    async def slow_send(frame: bytes) -> None:
        time.sleep(0.03)  # longer than a frame: the caller falls behind the clock
        sent.append(frame[0])

    asyncio.run(paced(frames, 5, 0.3, slow_send, out))
    assert sent == [(5 + n) % 7 for n in range(15)]  # 0.3 s of 20 ms frames, looped from frame 5
    assert len(out["late_ms"]) == 15 and max(out["late_ms"]) > 100  # it fell behind, and said so


def test_the_request_timer_splits_a_replys_time_into_waiting_for_a_row_and_holding_one(tmp_path_factory):
    """The e2e bench's tts_engine_ms: a reply that finds every TTS row taken shows its wait as queue_ms, and
    the reply in the row shows none; what separates "the rows are full" from "the steps are slow" at
    saturation."""
    from types import SimpleNamespace

    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.bench.steps import RequestTimer
    from voiced.engines.base import TTSOptions, TTSRequest
    from voiced.engines.spark.engine import SparkTTSEngine

    engine = SparkTTSEngine.load(str(cached_spark_checkpoint(tmp_path_factory)), device="cpu", max_batch=1,
                                 voices_dir=tmp_path_factory.mktemp("voices"))
    finals = []
    worker = SimpleNamespace(engine=engine, _submit=engine.submit, _cancel=engine.cancel,
                             _deliver=lambda out: finals.append(out.request_id) if out.final else None)
    timer = RequestTimer(worker)
    opts = TTSOptions(seed=1, max_seconds=0.4, first_chunk_tokens=5, chunk_tokens=5)
    for rid in (1, 2):
        worker._submit(rid, TTSRequest("Hello there, how are you today?", opts))
    while engine.has_work():
        for out in engine.step():
            worker._deliver(out)
    assert finals == [1, 2]  # one row: the second reply began once the first had left it
    got = timer.take()
    assert got["n"] == 2 and got["queue_ms"]["n"] == 2
    first, second = sorted(got["slowest"], key=lambda r: r["queued_ms"])
    # the first had its row at the next step; the second waited about as long as the first held it
    assert second["queued_ms"] > 10 * first["queued_ms"], got["slowest"]
    assert second["queued_ms"] >= 0.9 * (first["ms"] - first["queued_ms"]), got["slowest"]
    assert got["held_ms"]["p50"] > 0
