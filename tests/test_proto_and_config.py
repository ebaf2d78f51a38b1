import importlib.util
import sys
from pathlib import Path

import pytest

from voiced.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = ROOT / "client" / "voiced_client" / "proto"
    for name in gen.FILES:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"{name} is stale: run `make proto` and commit the result")


def test_config_file_then_environment_then_flags(tmp_path):
    f = tmp_path / "voiced.toml"
    f.write_text('[server]\nlisten = "0.0.0.0:6000"\nmax_sessions = 5\n[asr]\nmodel = "small"\n'
                 '[memory]\ntts_kv_fraction = 0.3\n')
    env = {"VOICED_SERVER_MAX_SESSIONS": "7", "VOICED_BARGE_IN_ENABLED": "false",
           "VOICED_MEMORY_WHISPER_KV_FRACTION": "0.2"}
    c = load_config(f, env=env, overrides={"asr.model": "tiny", "server.listen": None})
    assert c.server.listen == "0.0.0.0:6000"
    assert c.server.max_sessions == 7
    assert c.barge_in.enabled is False
    assert c.asr.model == "tiny"
    assert c.memory.tts_kv_fraction == 0.3 and c.memory.whisper_kv_fraction == 0.2
    c.validate()


@pytest.mark.parametrize("text,env,words", [
    ("[server]\nlisen = 'x'\n", {}, "unknown key server.lisen"),
    ("[sever]\n", {}, "unknown section [sever]"),
    ("[server]\nmax_sessions = 'many'\n", {}, "not a valid int"),
    ("", {"VOICED_ASR_BEAM_SIZE": "two"}, "environment VOICED_ASR_BEAM_SIZE"),
    ("[server\n", {}, "not valid TOML"),
])
def test_config_mistakes_name_the_key(tmp_path, text, env, words):
    f = tmp_path / "voiced.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_config(f, env=env)


def test_memory_plan_that_overcommits_is_refused():
    c = load_config(env={"VOICED_MEMORY_WHISPER_KV_FRACTION": "0.6", "VOICED_MEMORY_TTS_KV_FRACTION": "0.5"})
    with pytest.raises(ConfigError, match="headroom"):
        c.validate()


def test_importing_the_daemon_does_not_import_torch_or_tensorrt_llm():
    import subprocess

    code = ("import sys, voiced.daemon, voiced.doors.grpc_server, voiced.core.session, voiced.cli.serve; "
            "print('torch' in sys.modules, 'tensorrt_llm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_configuration_reference_lists_every_key_with_its_default(tmp_path):
    import dataclasses
    import re

    import tomllib

    from voiced.config import Config

    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    block = re.search(r"## Every key, with its default.*?```toml\n(.*?)```", text, re.S).group(1)
    documented = tomllib.loads(block)
    actual = {f.name: dataclasses.asdict(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}
    assert documented == actual, "docs/CONFIGURATION.md's config block is out of date with voiced/config.py"


def test_engine_threads_setting_is_checked_and_reaches_the_plan():
    """`engines.threads` (flag --engine-threads): a typo is refused with the choices; "separate" makes the
    plan count each engine's step transient, since two threads may step both at once."""
    from voiced.memory_plan import EngineNeed, Need, plan_table, plan_total

    assert load_config(env={"VOICED_ENGINES_THREADS": "separate"}).engines.threads == "separate"
    with pytest.raises(ConfigError, match="auto, shared, separate"):
        load_config(env={"VOICED_ENGINES_THREADS": "both"}).validate()
    needs = [EngineNeed("Whisper", "whisper_kv_fraction", [Need("weights", 100), Need("encode", 30, transient=True)]),
             EngineNeed("Spark-TTS", "tts_kv_fraction", [Need("weights", 200), Need("prefill", 50, transient=True),
                                                         Need("vocoder", 40, transient=True)])]
    assert plan_total(needs) == 300 + 50
    assert plan_total(needs, concurrent=True) == 300 + 30 + 50
    assert "each engine's largest transient" in plan_table(needs, concurrent=True)


def test_event_loop_setting_is_checked_and_the_flag_reaches_it():
    """`server.event_loop` (flag --event-loop, VOICED_SERVER_EVENT_LOOP): uvloop unless asked otherwise; a
    typo is refused with the choices."""
    import asyncio

    from voiced import event_loop
    from voiced.cli import build_parser
    from voiced.cli.serve import overrides

    assert load_config(env={}).server.event_loop == "uvloop"
    assert load_config(env={"VOICED_SERVER_EVENT_LOOP": "asyncio"}).server.event_loop == "asyncio"
    args = build_parser().parse_args(["serve", "--event-loop", "asyncio"])
    assert load_config(env={}, overrides=overrides(args)).server.event_loop == "asyncio"
    with pytest.raises(ConfigError, match="uvloop or asyncio"):
        load_config(env={"VOICED_SERVER_EVENT_LOOP": "trio"}).validate()

    async def kind():
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert event_loop.run(kind(), "uvloop") == "uvloop"
    assert event_loop.run(kind(), "asyncio") == "asyncio"


@pytest.mark.parametrize("key", ["asr.max_batch", "tts.max_batch"])
def test_a_negative_batch_is_refused_saying_what_zero_means(key):
    load_config(env={}).validate()  # 0 by default: as many rows as the GPU's share holds
    c = load_config(env={}, overrides={key: "-4"})
    with pytest.raises(ConfigError, match=f"{key} is -4; set the rows to hold, or 0 for as many"):
        c.validate()
