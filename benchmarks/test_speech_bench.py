"""`python -m benchmarks.speech_bench` as a dry run on the CPU (tiny random models): the benchmark behind the HTTP
door's first-byte figure in docs/BENCHMARKS.md still runs, and times both doors in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_speech_bench_times_both_doors_in_one_run(tmp_path):
    from voiced.engines.whisper.tokenizer import find_tiktoken_file

    out = tmp_path / "speech.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speech_bench", "--tiny-cpu", "--tiktoken-dir",
                           str(find_tiktoken_file("multilingual.tiktoken").parent), "--concurrency", "2", "--duration", "2", "--reply-seconds",
                           "0.3", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    level = json.loads(out.read_text())["levels"]["2"]
    assert level["errors"] == [] and level["callers"] == 2, level
    for key in ("grpc_first_chunk_ms", "http_first_byte_ms", "http_minus_grpc_paired_ms"):
        assert level[key]["n"] >= 1, key
    assert level["grpc_first_chunk_ms"]["n"] == level["http_first_byte_ms"]["n"] == level["http_minus_grpc_paired_ms"]["n"]
    assert "within_5_ms" in level
