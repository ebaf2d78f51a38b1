"""Tiny random Spark-TTS-0.5B checkpoints in the published on-disk layout, for tests.

`make_spark_checkpoint(dir, seed=0)` writes what `SparkAudio/Spark-TTS-0.5B` ships, file for file, with
small hidden sizes so the suite runs on two CPU cores:

- `config.yaml`, `BiCodec/config.yaml` (`audio_tokenizer:` section) and `BiCodec/model.safetensors` holding
  every published tensor name, weight-normed convolutions as `weight_g`/`weight_v`, the training-only
  postnet and the quantizer's `cluster_size`;
- `LLM/`: a Qwen2 `config.json` in the published (transformers 4.43) key layout, `model.safetensors` made by
  `transformers.Qwen2ForCausalLM` itself (tied embeddings, so no `lm_head.weight`), and a real byte-level BPE
  `tokenizer.json` + `added_tokens.json` whose ids are the published ones: the base vocabulary has
  151643 entries (bytes, a few merges, then never-produced fillers standing in for Qwen's BPE pieces), then
  Qwen's 22 special tokens from 151643, then Spark-TTS's 13493 added tokens in their published order
  (globals from 151665, semantics from 155761, ..., `<|end_semantic_token|>` = 165157). The embedding has the
  published 166000 rows with a small hidden size;
- `wav2vec2-large-xlsr-53/`: a tiny `Wav2Vec2Model` (16 layers, so hidden_states[16] exists; the real
  convolutional front end strides, so 320 samples per frame) and its `preprocessor_config.json`, saved by
  `transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from voiced.engines.random_weights import BASE_VOCAB, QWEN_SPECIALS, spark_added_tokens
from voiced.engines.random_weights import write_spark_tokenizer as _write_tokenizer


def llm_config(hidden: int = 32, layers: int = 2) -> dict:
    """A Qwen2 config.json in the published key layout (GQA 2:1 here; 14:2 at full size)."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": hidden * 2, "max_position_embeddings": 32768, "max_window_layers": 21,
        "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": layers, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 166000,
    }


def _write_llm(llm: Path, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg_json = llm_config()
    (llm / "config.json").write_text(json.dumps(cfg_json, indent=2))
    torch.manual_seed(seed)
    cfg = Qwen2Config(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "transformers_version", "torch_dtype")})
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger than HF's 0.02 init so the random LM has peaked, seed-sensitive output
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3 if "embed" in name else 0.15)
        # The sentence-end tokens get zero rows (tied: their logit is 0 at every step). The semantic
        # tokens' logits spread ~N(0, 1.7^2), so an end token never reaches the top 50 a request samples
        # from by default: every sentence runs to its cap, which the tests that count reply lengths rely
        # on. With random rows a random LM ended about one reply in 25 early (6 of 160 of a 2 s
        # sentence), seen as rare door-test failures on slow machines.
        ends = [BASE_VOCAB + QWEN_SPECIALS.index("<|im_end|>"),
                BASE_VOCAB + len(QWEN_SPECIALS) + spark_added_tokens().index("<|end_semantic_token|>")]
        model.model.embed_tokens.weight[ends] = 0
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, llm / "model.safetensors", metadata={"format": "pt"})
    _write_tokenizer(llm)


BICODEC_YAML = """\
audio_tokenizer:
  mel_params:
    sample_rate: 16000
    n_fft: 1024
    win_length: 640
    hop_length: 320
    mel_fmin: 10
    mel_fmax: null
    num_mels: 128
  encoder:
    input_channels: {w2v}
    vocos_dim: 16
    vocos_intermediate_dim: 32
    vocos_num_layers: 2
    out_channels: {latent}
    sample_ratios: [1, 1]
  decoder:
    input_channel: {latent}
    channels: 32
    rates: [8, 5, 4, 2]
    kernel_sizes: [16, 11, 8, 4]
  quantizer:
    input_dim: {latent}
    codebook_size: 8192
    codebook_dim: 8
    commitment: 0.25
    codebook_loss_weight: 2.0
    use_l2_normlize: true
    threshold_ema_dead_code: 0.2
  speaker_encoder:
    input_dim: 128
    out_dim: {latent}
    latent_dim: 16
    token_num: 32
    fsq_levels: [4, 4, 4, 4, 4, 4]
    fsq_num_quantizers: 1
  prenet:
    input_channels: {latent}
    vocos_dim: 16
    vocos_intermediate_dim: 32
    vocos_num_layers: 2
    out_channels: {latent}
    condition_dim: {latent}
    sample_ratios: [1, 1]
    use_tanh_at_final: false
  postnet:
    input_channels: {latent}
    vocos_dim: 16
    vocos_intermediate_dim: 32
    vocos_num_layers: 1
    out_channels: {w2v}
    use_tanh_at_final: false
"""

ROOT_YAML = """\
highpass_cutoff_freq: 40
sample_rate: 16000
segment_duration: 2.4
max_val_duration: 12
latent_hop_length: 320
ref_segment_duration: 6
volume_normalize: true
"""


def _write_bicodec(root: Path, seed: int, w2v_hidden: int) -> None:
    from safetensors.torch import save_file

    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig, FeatDecoder, unfold_weight_norm, weight_normed_keys

    bc = root / "BiCodec"
    bc.mkdir(parents=True, exist_ok=True)
    (bc / "config.yaml").write_text(BICODEC_YAML.format(w2v=w2v_hidden, latent=32))
    (root / "config.yaml").write_text(ROOT_YAML)
    cfg = BiCodecConfig.from_yaml(bc / "config.yaml", root / "config.yaml")
    torch.manual_seed(seed + 1)
    model = BiCodec(cfg)
    postnet = FeatDecoder(cfg.postnet)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(postnet.named_parameters()):
            if name.endswith("alpha"):
                p.uniform_(0.5, 1.5)  # Snake frequencies
            elif name.endswith("codebook.weight"):
                p.normal_()
            elif p.ndim >= 2:
                fan_in = p[0].numel()
                p.normal_(0, 1.0 / fan_in**0.5)
            else:
                p.normal_(0, 0.1)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(1000)
        # Make both token streams follow the audio, so that tests on them can catch a tokenizer defect.
        # At random init a bias adds the same vector to every frame and the 1-D norm weights (0.1 scale)
        # shrink each layer's signal, so every frame got nearly one semantic code and the speaker path's
        # output was its learned latents, whatever the recording: all 32 global tokens the centre code.
        # Unit norms and no biases in both encoders; the speaker's frames brought up to the latents'
        # scale in the perceiver, and the quantizer's inputs spread over its 4 levels.
        for part in (model.encoder, model.speaker_encoder):
            for name, p in part.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.ndim == 1:
                    p.fill_(1.0)
            for m in part.modules():
                if isinstance(m, torch.nn.BatchNorm1d):
                    m.running_mean.zero_()
        model.quantizer.in_project.bias.zero_()
        model.speaker_encoder.perceiver_sampler.proj_context.weight.mul_(20.0)
        model.speaker_encoder.quantizer.project_in.weight.mul_(3.0)
        # Keep the output conv small so the final tanh is not saturated: a saturated waveform would
        # hide differences between decodes (and could not fail an exactness test).
        probe = torch.randint(0, 8192, (1, 60), generator=torch.Generator().manual_seed(seed))
        spk = model.speaker_vector(torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(seed)))
        z = model.prenet(model.quantizer.detokenize(probe), spk) + spk[:, :, None]
        pre_tanh = model.decoder.model[:-1](z)
        model.decoder.model[-2].weight.mul_(0.3 / pre_tanh.std())
        model.decoder.model[-2].bias.mul_(0.3 / pre_tanh.std())
    state = model.state_dict()
    state = unfold_weight_norm(state, weight_normed_keys(model))
    state.update({f"postnet.{k}": v for k, v in postnet.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, bc / "model.safetensors", metadata={"format": "pt"})


def _write_wav2vec2(root: Path, seed: int) -> int:
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    d = root / "wav2vec2-large-xlsr-53"
    torch.manual_seed(seed + 2)
    cfg = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=16, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, do_stable_layer_norm=True,
        feat_extract_norm="layer", conv_bias=True, mask_time_prob=0.0,
    )
    Wav2Vec2Model(cfg).eval().save_pretrained(d)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(d)
    return cfg.hidden_size


def make_spark_checkpoint(dest: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Spark-TTS-0.5B-layout directory at `dest` and return it."""
    root = Path(dest)
    (root / "LLM").mkdir(parents=True, exist_ok=True)
    w2v_hidden = _write_wav2vec2(root, seed)
    _write_bicodec(root, seed, w2v_hidden)
    _write_llm(root / "LLM", seed)
    return root


_CACHE: dict[int, Path] = {}


def cached_spark_checkpoint(tmp_path_factory, seed: int = 0) -> Path:
    """One checkpoint per seed per test session, shared by every test file (building one takes
    seconds on two cores). Tests must not write into it. Named as published: `Spark-TTS-0.5B`."""
    if seed not in _CACHE:
        _CACHE[seed] = make_spark_checkpoint(tmp_path_factory.mktemp(f"spark{seed}") / "Spark-TTS-0.5B", seed)
    return _CACHE[seed]
