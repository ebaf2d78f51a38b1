"""The GIL profile's summary: whose Python held the lock, and where (voiced.bench.gil_profile)."""

from voiced.bench.gil_profile import summarise

# py-spy's raw format: one collapsed stack a line, the root frame naming the thread, then a count.
RAW = """\
thread (0x7f01): voiced-daemon;run_forever (asyncio/base_events.py:641);Session._read (voiced/core/session.py:297);key (voiced/audio/dtmf.py:53) 60
thread (0x7f01): voiced-daemon;run_forever (asyncio/base_events.py:641);Session._read (voiced/core/session.py:297) 15
thread (0x7f01): voiced-daemon;run_forever (asyncio/base_events.py:641);select (selectors.py:468) 5
thread (0x7f02): tts-worker;SparkTTSEngine.step (voiced/engines/spark/engine.py:200);Snake1d.forward (voiced/engines/spark/bicodec.py:288) 15
thread (0x7f03): asr-worker;WhisperEngine.step (voiced/engines/whisper/engine.py:361) 5
"""


def test_each_threads_share_and_its_functions_inclusive(tmp_path):
    raw = tmp_path / "gil.txt"
    raw.write_text(RAW)
    s = summarise(raw, top=3)
    assert s["samples"] == 100
    threads = s["threads"]
    assert list(threads) == ["voiced-daemon", "tts-worker", "asr-worker"]  # most samples first
    loop = threads["voiced-daemon"]
    assert (loop["samples"], loop["share"]) == (80, 0.8)
    # A function counts every sample it is on the stack for, once (inclusive), not only as the leaf.
    assert dict(loop["top"])["Session._read (session.py)"] == round(75 / 80, 3)
    assert dict(loop["top"])["key (dtmf.py)"] == 0.75
    assert threads["tts-worker"]["share"] == 0.15


def test_lines_that_are_not_stacks_are_skipped(tmp_path):
    raw = tmp_path / "gil.txt"
    raw.write_text("\n" + RAW + "py-spy> Wrote raw flamegraph data\n")
    assert summarise(raw)["samples"] == 100
