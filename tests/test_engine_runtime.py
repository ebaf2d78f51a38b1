"""How the engines run, settled once from the config (voiced.engines.runtime.EngineRuntime): what `voiced serve`,
the engine process and the benchmarks all read, so "auto" means the same thing to each of them."""

from __future__ import annotations

import pytest

from voiced.cli import build_parser
from voiced.cli.serve import overrides
from voiced.config import ConfigError, load_config
from voiced.engines import runtime
from voiced.engines.runtime import EngineRuntime


@pytest.fixture
def gpu(monkeypatch):
    """This machine seen as one with a CUDA GPU (the resolution reads only the resolved device)."""
    monkeypatch.setattr(runtime, "resolve_device", lambda d: "cuda" if d == "auto" else d)


def test_on_the_cpu_auto_is_one_process_one_thread_no_overlap_no_graphs():
    rt = EngineRuntime.resolve(load_config(env={}, overrides={"asr.device": "cpu", "tts.device": "cpu"}))
    assert (rt.process, rt.threads, rt.overlap) == ("inline", "shared", False)
    assert rt.asr.device == "cpu" and not rt.asr.graphs and rt.asr.max_batch is None
    assert rt.tts is not None and rt.tts.thread == "engines" and not rt.tts.compile and not rt.concurrent_steps


def test_on_a_gpu_auto_is_a_process_of_their_own_one_overlapping_thread_graphs_and_compile(gpu):
    rt = EngineRuntime.resolve(load_config(env={}))
    assert (rt.process, rt.threads, rt.overlap) == ("separate", "shared", True)
    assert rt.asr.graphs and rt.tts.graphs and rt.tts.compile and rt.concurrent_steps
    # In the daemon's process a thread each (the event loop is there); then nothing overlaps on one thread
    inline = EngineRuntime.resolve(load_config(env={"VOICED_ENGINES_PROCESS": "inline"}))
    assert (inline.threads, inline.overlap, inline.tts.thread) == ("separate", False, "tts")


def test_the_flags_reach_the_runtime(gpu):
    args = build_parser().parse_args(["serve", "--engine-overlap", "off", "--engine-process", "inline",
                                      "--engine-threads", "shared", "--no-tts-compile"])
    config = load_config(env={"VOICED_ASR_MAX_BATCH": "12"}, overrides=overrides(args))
    rt = EngineRuntime.resolve(config)
    assert (rt.process, rt.threads, rt.overlap) == ("inline", "shared", False)
    assert not rt.tts.compile and rt.tts.graphs and rt.asr.max_batch == 12
    assert EngineRuntime.resolve(load_config(env={}, overrides={"tts.enabled": False})).tts is None
    on = EngineRuntime.resolve(load_config(env={}, overrides={"engines.overlap": "on", "asr.device": "cpu"}))
    assert on.overlap  # "on" is obeyed on the CPU too


def test_a_misspelt_setting_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="auto, on, off"):
        load_config(env={"VOICED_ENGINES_OVERLAP": "yes"}).validate()
    with pytest.raises(ValueError, match="use auto, cpu, cuda or cuda:N"):
        EngineRuntime.resolve(load_config(env={}, overrides={"asr.device": "tpu"}))
