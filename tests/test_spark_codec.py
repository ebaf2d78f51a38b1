"""BiCodec: the published checkpoint layout, decode/encode paths, and exact streaming."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.spark_fixtures import cached_spark_checkpoint
from tests.speech import phrase
from voiced.engines.spark.bicodec import HOP, BiCodec, BiCodecConfig, fold_weight_norm, load_bicodec, mel_filterbank
from voiced.engines.spark.checkpoint import CheckpointError, TextTokenizer, load_special_tokens
from voiced.engines.spark.streaming import ChunkPlanner, DecodeJob, decode_jobs, stream_decode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def codec(ckpt):
    return load_bicodec(ckpt / "BiCodec", ckpt / "config.yaml", "cpu")


def test_published_layout_loads_with_every_tensor_accounted_for(ckpt, codec):
    raw = load_file(ckpt / "BiCodec" / "model.safetensors")
    # names as in the published file (independent evidence: upstream module paths)
    for name in ["decoder.model.0.weight_g", "decoder.model.1.block.1.weight_v", "decoder.model.1.block.2.block.1.weight_v",
                 "decoder.model.6.weight_g", "quantizer.in_project.weight_g", "quantizer.codebook.weight",
                 "quantizer.cluster_size", "encoder.encoder.embed.weight", "encoder.downsample.0.1.convnext.1.gamma",
                 "prenet.vocos_backbone.convnext.0.norm.scale.weight", "prenet.linear_pre.weight",
                 "speaker_encoder.speaker_encoder.layer2.se_res2block.1.convs.0.weight",
                 "speaker_encoder.speaker_encoder.layer4.se_res2block.3.linear2.bias",
                 "speaker_encoder.speaker_encoder.pool.linear1.weight",
                 "speaker_encoder.perceiver_sampler.layers.1.0.to_kv.weight",
                 "speaker_encoder.perceiver_sampler.layers.0.1.2.weight", "speaker_encoder.perceiver_sampler.norm.gamma",
                 "speaker_encoder.quantizer.project_in.weight", "speaker_encoder.project.weight", "postnet.linear.weight"]:
        assert name in raw, name
    assert not any(k.endswith(".weight") and k[:-7] + ".weight_g" in raw for k in raw)
    # every tensor lands: strict load, folded weights equal g * v / |v|
    w = codec.decoder.model[0].weight
    g, v = raw["decoder.model.0.weight_g"], raw["decoder.model.0.weight_v"]
    assert torch.allclose(w, g * v / v.norm(dim=(1, 2), keepdim=True), atol=1e-6)


def test_unexpected_or_missing_tensors_are_refused(ckpt, tmp_path):

    bad = tmp_path / "BiCodec"
    shutil.copytree(ckpt / "BiCodec", bad)
    state = load_file(bad / "model.safetensors")
    state["prenet.extra.weight"] = torch.zeros(1)
    save_file(state, bad / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected.*prenet.extra.weight"):
        load_bicodec(bad, ckpt / "config.yaml", "cpu")
    state.pop("prenet.extra.weight")
    state.pop("prenet.linear.bias")
    save_file(state, bad / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*prenet.linear.bias"):
        load_bicodec(bad, ckpt / "config.yaml", "cpu")


def test_fold_weight_norm_accepts_parametrization_names():
    v = torch.randn(4, 3, 5)
    g = torch.rand(4, 1, 1)
    a = fold_weight_norm({"x.weight_g": g, "x.weight_v": v})["x.weight"]
    b = fold_weight_norm({"x.parametrizations.weight.original0": g, "x.parametrizations.weight.original1": v})["x.weight"]
    assert torch.equal(a, b) and torch.allclose(a.flatten(1).norm(dim=1), g.flatten())


def test_special_token_ids_checked_against_added_tokens(ckpt, tmp_path):

    sp = load_special_tokens(ckpt / "LLM", TextTokenizer(ckpt / "LLM"))
    assert (sp.eos, sp.global_base, sp.semantic_base) == (151645, 151665, 155761)
    assert (sp.task_tts, sp.task_controllable_tts, sp.start_content, sp.end_semantic) == (165137, 165143, 165146, 165157)
    llm = tmp_path / "LLM"
    shutil.copytree(ckpt / "LLM", llm)
    table = json.loads((llm / "added_tokens.json").read_text())
    table["<|bicodec_semantic_4096|>"] += 1
    (llm / "added_tokens.json").write_text(json.dumps(table))
    with pytest.raises(CheckpointError, match="special token ids differ"):
        load_special_tokens(llm)


def test_mel_filterbank_matches_transformers_slaney():
    from transformers.audio_utils import mel_filter_bank

    ours = mel_filterbank(513, 10.0, 8000.0, 128, 16000).numpy()
    ref = mel_filter_bank(num_frequency_bins=513, num_mel_filters=128, min_frequency=10.0, max_frequency=8000.0,
                          sampling_rate=16000, norm="slaney", mel_scale="slaney")
    assert np.allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 50, 123])
def test_detokenize_gives_320_samples_per_token(codec, n):
    ids = torch.randint(0, 8192, (2, n))
    g = torch.randint(0, 4096, (2, 32))
    wav = codec.detokenize(ids, g)
    assert wav.shape == (2, n * HOP) and torch.isfinite(wav).all() and wav.abs().max() < 1


def test_tokenize_then_detokenize_espeak_speech(ckpt, codec):
    from voiced.engines.spark.reference import Wav2Vec2Features

    audio = phrase("The quick brown fox jumps over the lazy dog.")
    feats = Wav2Vec2Features(ckpt / "wav2vec2-large-xlsr-53", "cpu")(audio)
    # wav2vec2 (through transformers) runs at 50 frames/s: one semantic token per 320 samples
    assert abs(feats.shape[1] - len(audio) / HOP) <= 2
    semantic = codec.semantic_tokens(feats)
    from voiced.engines.spark.bicodec import reference_clip, volume_normalize

    ref = torch.from_numpy(reference_clip(volume_normalize(audio), codec.config))[None]
    assert ref.shape[1] == 96000
    glob = codec.global_tokens(ref)
    assert glob.shape == (1, 32) and 0 <= int(glob.min()) and int(glob.max()) < 4096
    assert semantic.shape == (1, feats.shape[1]) and int(semantic.max()) < 8192
    # Both token streams follow the audio, so a tokenizer defect would show: most 20 ms frames get a code
    # of their own, the 32 global tokens are many different codes, and another speaker's clip gets others.
    assert len(set(semantic[0].tolist())) / (len(audio) / 16000) >= 15  # distinct codes per second (was 1.6)
    assert len(set(glob[0].tolist())) >= 8
    other = torch.from_numpy(reference_clip(volume_normalize(phrase("She sells sea shells.", "en+f3")), codec.config))
    assert int((codec.global_tokens(other[None]) != glob).sum()) >= 16
    # the factorized VQ picks the nearest code by L2 distance between unit vectors (upstream's formula)
    z = codec.quantizer.in_project(codec.encoder(feats.transpose(1, 2)))[0].T
    e = torch.nn.functional.normalize(z, dim=-1)
    cb = torch.nn.functional.normalize(codec.quantizer.codebook.weight, dim=-1)
    dist = e.pow(2).sum(1, keepdim=True) - 2 * e @ cb.T + cb.pow(2).sum(1)[None]
    assert torch.equal(semantic[0], dist.argmin(1))
    wav = codec.detokenize(semantic, glob)
    assert wav.shape[1] == semantic.shape[1] * HOP and wav.std() > 1e-3


def test_wav2vec2_runs_in_fp32_whatever_its_config_names(ckpt, tmp_path):
    """transformers 5 loads a model in the dtype its config.json names; 4.x in fp32. Voice registration
    asks for fp32 itself, as upstream runs it, so its tokens do not depend on the transformers line."""
    from voiced.engines.spark.reference import Wav2Vec2Features

    w2v = tmp_path / "wav2vec2"
    shutil.copytree(ckpt / "wav2vec2-large-xlsr-53", w2v)
    cfg = json.loads((w2v / "config.json").read_text())
    cfg.update(torch_dtype="bfloat16", dtype="bfloat16")
    (w2v / "config.json").write_text(json.dumps(cfg))
    features = Wav2Vec2Features(w2v, "cpu")
    assert {p.dtype for p in features.model.parameters()} == {torch.float32}
    audio = phrase("Hello there.")
    assert torch.equal(features(audio), Wav2Vec2Features(ckpt / "wav2vec2-large-xlsr-53", "cpu")(audio))


@pytest.mark.parametrize("first", [1, 5, 10, 50])
def test_streamed_chunks_join_to_the_offline_decode(codec, first):
    torch.manual_seed(first)
    ids = torch.randint(0, 8192, (157,))
    g = torch.randint(0, 4096, (32,))
    offline = codec.detokenize(ids[None], g[None])[0].numpy()
    chunks = stream_decode(codec, ids, g, first_chunk_tokens=first, chunk_tokens=20)
    assert len(chunks) > 2 and chunks[0].shape[0] == first * HOP
    joined = np.concatenate(chunks)
    assert joined.shape == offline.shape
    assert np.abs(joined - offline).max() < 1e-4


def test_too_little_lookahead_leaves_seams(codec):
    """The exactness above is not free: with a short window the chunks differ from the offline decode."""
    torch.manual_seed(0)
    ids = torch.randint(0, 8192, (120,))
    g = torch.randint(0, 4096, (32,))
    offline = codec.detokenize(ids[None], g[None])[0].numpy()
    joined = np.concatenate(stream_decode(codec, ids, g, 10, 20, radius=3))
    assert np.abs(joined - offline).max() > 1e-3


def test_batched_windows_of_several_requests_equal_single_decodes(codec):
    torch.manual_seed(3)
    spk = codec.speaker_vector(torch.randint(0, 4096, (3, 32)))
    seqs = [torch.randint(0, 8192, (n,)) for n in (90, 140, 60)]
    jobs = []
    for s, sp in zip(seqs, spk):
        planner = ChunkPlanner(codec.receptive_radius(), 10, 25)
        jobs += [DecodeJob(s, sp, w) for w in planner.windows(len(s), ended=len(s) == 60)]
    batched = decode_jobs(codec, jobs)
    single = [decode_jobs(codec, [j])[0] for j in jobs]
    for a, b in zip(batched, single):
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-4


def test_full_size_config_radius_and_parameter_count():
    with torch.device("meta"):
        m = BiCodec(BiCodecConfig())
    assert 60 <= m.receptive_radius() <= 72  # about 1.3 s of context either side at 50 tokens/s
    decode_path = sum(p.numel() for n, p in m.named_parameters()
                      if n.startswith(("prenet.", "decoder.", "quantizer.out_project", "quantizer.codebook")))
    assert 85e6 < decode_path < 100e6
