"""benchmarks/whisper_bench.py as a CPU smoke run (tiny random weights): every section it reports still runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_benchmark_script_runs_on_cpu(tmp_path):
    import whisper

    from benchmarks import whisper_bench

    assets = Path(whisper.__file__).parent / "assets"
    report = whisper_bench.main(["--dims", "tiny-random", "--device", "cpu", "--tiktoken-dir", str(assets),
                                 "--tokens", "4", "--max-batch", "4", "--encoder-batch", "2", "--decode-chunk", "8",
                                 "--throughput-utts", "4", "--latency-runs", "1", "--skip-hf", "--timeline",
                                 "--out", str(tmp_path / "r.json")])
    assert "equality_error" not in report and "speed_error" not in report and "timeline_error" not in report
    # one utterance's time by engine part (a part that yields: a range per resume): its encoder pass once,
    # its tokens in a chunk launched and read back, its end
    parts = report["timeline"]["ranges"]
    assert parts["admission._encode_into_cache"]["n"] == 1 and parts["_greedy_chunk"]["n"] == 2, parts
    assert parts["_finish"]["n"] >= 1, parts
    assert 0 < parts["admission._encode_into_cache"]["total_ms"] <= report["timeline"]["wall_ms"]
    assert (tmp_path / report["timeline"]["trace"]).exists()
    # and the saturated run's: four utterances admitted two at a time, so two encoder passes and their audio
    busy = report["timeline_throughput"]["ranges"]
    assert busy["admission._encode_into_cache"]["n"] == 2 and busy["admission._audio"]["n"] == 2, busy
    assert (tmp_path / report["timeline_throughput"]["trace"]).exists()
    assert all(report["graphs_equal_eager"][k] for k in ("staggered_12", "single", "batch_16"))
    assert report["throughput_ours_cuda_graphs"]["utts"] == 4
    # the encoder alone is the engine's own pass where it has one (a GPU); on a CPU only the module's forward
    assert report["encoder_reference_module"]["utt_per_s"] > 0 and "encoder_only" not in report
    assert json.loads((tmp_path / "r.json").read_text())["dims"] == "tiny-random"
