"""Engine builds: command lines from options, manifests, skipping, progress and failures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from voiced.cli import build_parser
from voiced.engines.trtllm import build as b


def flags(argv):
    """argv -> {flag: value or True}, to check flags without caring about their order."""
    out, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a] = argv[i + 1]
                i += 2
                continue
            out[a] = True
        i += 1
    return out


def test_whisper_command_lines_follow_the_recipes(tmp_path):
    opts = b.default_options("whisper", "large-v3", max_batch_size=16, max_beam_width=4)
    ckpt = tmp_path / "cache" / "large-v3.pt"
    convert, enc, dec = b.whisper_steps(opts, ckpt, tmp_path / "out", Path("/ex/convert_checkpoint.py"), "python3")
    assert convert.argv[:2] == ("python3", "/ex/convert_checkpoint.py")
    c = flags(convert.argv)
    assert c["--model_dir"] == str(ckpt.parent) and c["--model_name"] == "large-v3"
    assert c["--dtype"] == "float16" and c["--output_dir"] == str(tmp_path / "out" / "tllm_checkpoint")
    assert "--use_weight_only" not in c
    e = flags(enc.argv)
    assert enc.argv[0] == "trtllm-build"
    assert e["--checkpoint_dir"].endswith("tllm_checkpoint/encoder") and e["--output_dir"].endswith("out/encoder")
    assert (e["--gemm_plugin"], e["--bert_attention_plugin"], e["--moe_plugin"]) == ("disable", "float16", "disable")
    assert (e["--max_input_len"], e["--max_seq_len"], e["--max_batch_size"]) == ("3000", "3000", "16")
    # Issue 16.3: without it trtllm-build's default (8192 tokens = mel frames) fits two 30 s windows a step.
    assert e["--max_num_tokens"] == str(16 * 3000)
    d = flags(dec.argv)
    assert d["--checkpoint_dir"].endswith("tllm_checkpoint/decoder")
    # In-flight batching; issue 16.5: `--paged_kv_cache` is deprecated in 1.0 for `--kv_cache_type`.
    assert (d["--kv_cache_type"], d["--remove_input_padding"]) == ("paged", "enable")
    assert "--paged_kv_cache" not in dec.argv
    assert d["--gemm_plugin"] == d["--gpt_attention_plugin"] == d["--bert_attention_plugin"] == "float16"
    assert (d["--max_input_len"], d["--max_seq_len"], d["--max_encoder_input_len"]) == ("14", "114", "3000")
    assert (d["--max_beam_width"], d["--max_batch_size"]) == ("4", "16")
    assert d["--gather_context_logits"] is True


def test_weight_only_quantization_goes_to_the_converter(tmp_path):
    opts = b.default_options("whisper", "small", weight_only="int4")
    convert = b.whisper_steps(opts, tmp_path / "small.pt", tmp_path, Path("c.py"))[0]
    assert flags(convert.argv)["--weight_only_precision"] == "int4" and "--use_weight_only" in convert.argv
    assert opts.name == "whisper-small"  # where the daemon looks (voiced/engines/loader.py)


def test_spark_command_lines_follow_the_recipe(tmp_path):
    opts = b.default_options("spark-tts")
    assert (opts.dtype, opts.max_batch_size, opts.model) == ("bfloat16", 16, "Spark-TTS-0.5B")
    convert, build = b.spark_steps(opts, tmp_path / "LLM", tmp_path / "out", Path("qwen/convert_checkpoint.py"), "py")
    c, f = flags(convert.argv), flags(build.argv)
    assert c["--model_dir"] == str(tmp_path / "LLM") and c["--dtype"] == "bfloat16"
    assert f["--output_dir"] == str(tmp_path / "out" / "llm")
    assert (f["--max_batch_size"], f["--max_num_tokens"]) == ("16", "32768")
    assert (f["--gemm_plugin"], f["--gpt_attention_plugin"]) == ("bfloat16", "bfloat16")
    assert (f["--kv_cache_type"], f["--remove_input_padding"]) == ("paged", "enable")
    assert "--paged_kv_cache" not in build.argv
    assert (f["--max_input_len"], f["--max_seq_len"]) == ("1024", "2560")
    assert opts.name == "Spark-TTS-0.5B"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kind": "whisper", "model": "huge"}, "unknown Whisper model 'huge'"),
        ({"kind": "whisper", "model": "tiny", "weight_only": "int2"}, "int8 or int4"),
        ({"kind": "whisper", "model": "tiny", "max_new_tokens": 440}, "448"),
        ({"kind": "spark-tts", "model": "Spark-TTS-0.5B", "max_beam_width": 2}, "beam search"),
        ({"kind": "tts", "model": "x"}, "unknown engine kind"),
        ({"kind": "whisper", "model": "tiny", "max_batch_size": 0}, "max_batch_size must be at least 1"),
        # Issue 16.1: TensorRT-LLM's Whisper runtime feeds float16 features; other dtypes fail per request.
        ({"kind": "whisper", "model": "tiny", "dtype": "bfloat16"}, "Whisper engines are float16 only"),
        ({"kind": "whisper", "model": "tiny", "dtype": "float32"}, "Whisper engines are float16 only"),
    ],
)
def test_bad_options_are_refused(kw, message):
    with pytest.raises(b.BuildError, match=message):
        b.BuildOptions(**kw)


def test_manifest_identity_and_differences():
    opts = b.default_options("whisper", "tiny")
    m1 = b.manifest_for(opts, "a" * 64, "1.0.0")
    m2 = b.manifest_for(opts, "a" * 64, "1.0.0", steps=[b.BuildStep("x", ("echo",))])
    assert m1.matches(m2)  # command lines and timings do not count
    m3 = b.manifest_for(b.default_options("whisper", "tiny", max_batch_size=4), "a" * 64, "1.0.1")
    diffs = m3.differences(m1)
    assert "max_batch_size: 8 -> 4" in diffs and "trtllm_version: '1.0.0' -> '1.0.1'" in diffs


def test_run_steps_streams_output_and_reports_failures(tmp_path):
    lines = []
    ok = b.BuildStep("say hello", (sys.executable, "-c", "print('hello'); print('world')"))
    b.run_steps([ok], tmp_path / "build.log", echo=lines.append)
    assert lines == ["hello", "world"]
    assert "$ " in (tmp_path / "build.log").read_text() and "world" in (tmp_path / "build.log").read_text()
    bad = b.BuildStep("convert checkpoint", (sys.executable, "-c", "print('KeyError: blocks.0'); raise SystemExit(3)"))
    never = b.BuildStep("never", (sys.executable, "-c", "open('ran','w')"))
    with pytest.raises(b.BuildError) as e:
        b.run_steps([bad, never], tmp_path / "build.log", echo=lambda s: None)
    msg = str(e.value)
    assert "convert checkpoint failed (exit status 3)" in msg and "KeyError: blocks.0" in msg and "build.log" in msg
    assert not Path("ran").exists()
    missing = b.BuildStep("build", ("trtllm-build-does-not-exist", "--help"))
    with pytest.raises(b.BuildError, match="not found.*TensorRT-LLM is installed"):
        b.run_steps([missing], tmp_path / "build.log", echo=lambda s: None)


@pytest.fixture
def whisper_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt" / "tiny.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"weights")
    examples = tmp_path / "examples" / "models" / "core" / "whisper"
    examples.mkdir(parents=True)
    (examples / "convert_checkpoint.py").write_text("")
    monkeypatch.setenv("TRTLLM_EXAMPLES_DIR", str(tmp_path / "examples"))
    return ckpt


def trtllm_build_outputs(steps, log_path):
    """Stands in for convert_checkpoint.py + trtllm-build (external tools): writes what they write."""
    for step in steps:
        f = flags(step.argv)
        if step.argv[0] == "trtllm-build":
            out = Path(f["--output_dir"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text("{}")
            (out / "rank0.engine").write_bytes(b"\0")
        else:
            Path(f["--output_dir"]).mkdir(parents=True, exist_ok=True)
    trtllm_build_outputs.calls += 1


def test_build_skips_when_the_manifest_matches(tmp_path, whisper_checkpoint):
    trtllm_build_outputs.calls = 0
    opts = b.default_options("whisper", "tiny")
    kw = {"root": tmp_path / "engines", "checkpoint": whisper_checkpoint, "trtllm_version": "1.0.0",
              "runner": trtllm_build_outputs}
    first = b.build(opts, **kw)
    assert not first.skipped and trtllm_build_outputs.calls == 1
    assert first.engine_dir == tmp_path / "engines" / "whisper-tiny"
    m = b.Manifest.read(first.engine_dir)
    assert m.checkpoint_sha256 == b.hub.sha256_file(whisper_checkpoint) and m.trtllm_version == "1.0.0"
    assert any(c.startswith("trtllm-build") for c in m.commands)
    assert not (first.engine_dir / "tllm_checkpoint").exists()  # intermediate checkpoint removed
    again = b.build(opts, **kw)
    assert again.skipped and trtllm_build_outputs.calls == 1
    # A different TensorRT-LLM, new weights or --force rebuild.
    b.build(opts, **{**kw, "trtllm_version": "1.0.1"})
    assert trtllm_build_outputs.calls == 2
    whisper_checkpoint.write_bytes(b"fine-tuned weights")
    b.build(opts, **{**kw, "trtllm_version": "1.0.1"})
    assert trtllm_build_outputs.calls == 3
    b.build(opts, **{**kw, "trtllm_version": "1.0.1"}, force=True)
    assert trtllm_build_outputs.calls == 4


def test_engines_built_with_the_old_flags_are_rebuilt(tmp_path, whisper_checkpoint):
    """Issue 16.3/16.5 changed the command lines; a manifest of the earlier schema no longer matches."""
    trtllm_build_outputs.calls = 0
    opts = b.default_options("whisper", "tiny")
    kw = {"root": tmp_path / "engines", "checkpoint": whisper_checkpoint, "trtllm_version": "1.0.0",
          "runner": trtllm_build_outputs}
    first = b.build(opts, **kw)
    manifest = first.engine_dir / b.MANIFEST
    old = json.loads(manifest.read_text())
    old["schema"] = 1  # written before --max_num_tokens / --kv_cache_type
    manifest.write_text(json.dumps(old))
    assert not b.build(opts, **kw).skipped and trtllm_build_outputs.calls == 2
    assert b.build(opts, **kw).skipped


def test_failed_build_leaves_no_manifest(tmp_path, whisper_checkpoint):
    opts = b.default_options("whisper", "tiny")

    def failing(steps, log_path):
        raise b.BuildError("build encoder engine failed")

    with pytest.raises(b.BuildError):
        b.build(opts, root=tmp_path / "e", checkpoint=whisper_checkpoint, trtllm_version="1.0.0", runner=failing)
    assert b.Manifest.read(tmp_path / "e" / opts.name) is None
    rows = b.list_engines(tmp_path / "e")
    assert [(p.name, m, ok) for p, m, ok in rows] == [(opts.name, None, False)]


def test_build_needs_tensorrt_llm_and_its_examples(tmp_path, whisper_checkpoint, monkeypatch):
    opts = b.default_options("whisper", "tiny")
    monkeypatch.setattr(b.versions, "installed_version", lambda: None)
    with pytest.raises(b.BuildError, match="needs the `tensorrt_llm` package"):
        b.build(opts, root=tmp_path, checkpoint=whisper_checkpoint)
    monkeypatch.delenv("TRTLLM_EXAMPLES_DIR")
    with pytest.raises(b.BuildError, match="(?s)cannot find TensorRT-LLM.s convert_checkpoint.py.*--examples-dir"):
        b.find_convert_script("whisper", tmp_path / "nowhere")
    old_layout = tmp_path / "old" / "whisper"  # releases before 0.18 kept examples/whisper
    old_layout.mkdir(parents=True)
    (old_layout / "convert_checkpoint.py").write_text("")
    assert b.find_convert_script("whisper", tmp_path / "old") == old_layout / "convert_checkpoint.py"


def test_checkpoint_must_be_named_for_the_converter(tmp_path):
    wrong = tmp_path / "my-whisper.pt"
    wrong.write_bytes(b"x")
    with pytest.raises(b.BuildError, match="loads <dir>/tiny.pt"):
        b.fetch_checkpoint(b.default_options("whisper", "tiny"), wrong)
    spark = tmp_path / "Spark-TTS-0.5B"
    (spark / "LLM").mkdir(parents=True)
    (spark / "LLM" / "config.json").write_text("{}")
    assert b.fetch_checkpoint(b.default_options("spark-tts"), spark / "LLM") == spark / "LLM"
    with pytest.raises(b.BuildError, match="not a complete Spark-TTS directory"):
        b.fetch_checkpoint(b.default_options("spark-tts"), spark)


def test_checkpoint_table_matches_openai_whisper():
    whisper = pytest.importorskip("whisper")
    for name, url in b.WHISPER_CHECKPOINTS.items():
        assert whisper._MODELS[name] == url


def test_cli_dry_run_and_list(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VOICED_ENGINES_DIR", str(tmp_path / "engines"))
    args = build_parser().parse_args(["engines", "build", "whisper", "--model", "small", "--weight-only", "int8",
                                      "--max-batch-size", "4", "--dry-run", "--examples-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "engines" / "whisper-small") in out
    assert "--weight_only_precision int8" in out and out.count("trtllm-build") == 2
    args = build_parser().parse_args(["engines", "build", "spark-tts", "--dry-run", "--name", "spark-int8",
                                      "--weight-only", "int8"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "engines" / "spark-int8") in out and "--dtype bfloat16" in out
    args = build_parser().parse_args(["engines", "list"])
    assert args.func(args) == 0
    assert "no engines under" in capsys.readouterr().out


def test_engines_are_built_where_the_daemon_looks_for_them(tmp_path, capsys, monkeypatch):
    """`voiced engines` reads `[engines] dir` as `voiced serve` does: from the config file, then its
    environment overlay (VOICED_ENGINES_DIR); --engines-dir overrides both."""
    from voiced.cli import CliError

    monkeypatch.delenv("VOICED_ENGINES_DIR", raising=False)
    monkeypatch.delenv("VOICED_CONFIG", raising=False)
    config = tmp_path / "voiced.toml"
    config.write_text(f'[engines]\ndir = "{tmp_path / "from-file"}"\n')

    def dry_run(*extra: str) -> str:
        args = build_parser().parse_args(["engines", *extra, "build", "whisper", "--model", "small", "--dry-run",
                                          "--examples-dir", str(tmp_path)])
        assert args.func(args) == 0
        return capsys.readouterr().out

    assert str(tmp_path / "from-file" / "whisper-small") in dry_run("--config", str(config))
    monkeypatch.setenv("VOICED_ENGINES_DIR", str(tmp_path / "from-env"))
    assert str(tmp_path / "from-env" / "whisper-small") in dry_run("--config", str(config))
    assert str(tmp_path / "given" / "whisper-small") in dry_run("--engines-dir", str(tmp_path / "given"))
    with pytest.raises(CliError, match="does not exist"):
        dry_run("--config", str(tmp_path / "missing.toml"))
