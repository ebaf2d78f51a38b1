"""Both engines with random weights at their published sizes: what `voiced bench e2e` serves and the
engine benchmarks measure, with no checkpoint to download.

Random weights decode noise, so the serving benches force what a trained model does (transcript and reply
lengths, a fixed voice); the engines' work per step is the real one because every shape is.

- `WHISPER_DIMS`, `random_whisper`: Whisper's published sizes, and a model made on the device;
- `random_spark`: Spark-TTS-0.5B's LM and BiCodec wrapped in the engine, with a byte-level tokenizer whose
  ids are the published ones (`write_spark_tokenizer`, also the tests' checkpoints' tokenizer);
- `chirps`: distinct deterministic utterances for the random Whisper to hear.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from voiced.engines.whisper.model import ModelDims, Whisper, sinusoids

WHISPER_DIMS = {
    "large-v3-turbo": ModelDims(n_mels=128, n_audio_ctx=1500, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                                n_vocab=51866, n_text_ctx=448, n_text_state=1280, n_text_head=20, n_text_layer=4),
    "large-v3": ModelDims(n_mels=128, n_audio_ctx=1500, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                          n_vocab=51866, n_text_ctx=448, n_text_state=1280, n_text_head=20, n_text_layer=32),
    "small": ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=768, n_audio_head=12, n_audio_layer=12,
                       n_vocab=51865, n_text_ctx=448, n_text_state=768, n_text_head=12, n_text_layer=12),
    "base": ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=512, n_audio_head=8, n_audio_layer=6,
                      n_vocab=51865, n_text_ctx=448, n_text_state=512, n_text_head=8, n_text_layer=6),
    "tiny.en": ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=384, n_audio_head=6, n_audio_layer=4,
                         n_vocab=51864, n_text_ctx=448, n_text_state=384, n_text_head=6, n_text_layer=4),
    # For CPU dry runs: the real vocabulary and audio context, tiny widths.
    "tiny-random": ModelDims(n_mels=128, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2,
                             n_vocab=51866, n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2),
}


def random_whisper(dims: ModelDims, device: str, dtype: torch.dtype, seed: int = 0) -> Whisper:
    """Random weights made on the device (seconds at 800M parameters).

    Scaled like the test fixtures (sharper attention, small embeddings, a large final layer-norm gain) so
    that outputs depend on the audio and differ between utterances (an equality check between two paths
    means little if every utterance decodes to the same tokens), while fp16 activations stay far from
    overflow.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = Whisper(dims)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "decoder.ln.weight":
                p.fill_(4.0)
            elif name.endswith(("ln.weight", "ln_post.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.01)
            elif name.endswith(("token_embedding.weight", "positional_embedding")):
                p.normal_(0.0, 0.1)
            else:
                gain = 3.0 if name.endswith(("query.weight", "key.weight")) else 1.0
                p.normal_(0.0, gain / math.sqrt(p[0].numel()))
        model.encoder.positional_embedding.copy_(sinusoids(dims.n_audio_ctx, dims.n_audio_state))
    return model.to(dtype).eval().requires_grad_(False)


def chirps(n: int, seconds: float = 10.0, seed: int = 0) -> list[np.ndarray]:
    """Different deterministic 'utterances': chirps plus noise, so every request's features differ."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    out = []
    for _ in range(n):
        f0, f1 = rng.uniform(100, 400), rng.uniform(500, 3000)
        x = 0.3 * np.sin(2 * np.pi * (f0 + (f1 - f0) * t / seconds / 2) * t) + 0.05 * rng.standard_normal(t.size)
        out.append((x * np.hanning(t.size) ** 0.1).astype(np.float32))
    return out


# ------------------------------------------------------------------------------------------ Spark-TTS

BASE_VOCAB = 151643
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]


def spark_added_tokens() -> list[str]:
    """Spark-TTS's added tokens, in the order its tokenizer was extended (so ids 151665.. match)."""
    toks = [f"<|bicodec_global_{i}|>" for i in range(4096)]
    toks += [f"<|bicodec_semantic_{i}|>" for i in range(8192)]
    toks += [f"<|pitch_value_{i}|>" for i in range(1001)] + [f"<|pitch_var_value_{i}|>" for i in range(11)]
    toks += [f"<|pitch_label_{i}|>" for i in range(5)] + [f"<|pitch_var_label_{i}|>" for i in range(5)]
    toks += [f"<|speed_value_{i}|>" for i in range(11)] + [f"<|speed_label_{i}|>" for i in range(5)]
    toks += [f"<|loudness_value_{i}|>" for i in range(31)] + [f"<|loudness_label_{i}|>" for i in range(5)]
    toks += [f"<|age_{i}|>" for i in range(5)] + [f"<|gender_{i}|>" for i in range(3)]
    toks += [f"<|emotion_{i}|>" for i in range(101)]
    toks += [
        "<|task_vc|>", "<|task_tts|>", "<|task_asr|>", "<|task_s2s|>", "<|task_t2s|>", "<|task_cap|>",
        "<|task_understand|>", "<|task_controllable_tts|>", "<|task_prompt_tts|>", "<|task_edit|>",
        "<|start_content|>", "<|start_style_label|>", "<|start_style_prompt|>", "<|start_acoustic_token|>",
        "<|start_global_token|>", "<|start_semantic_token|>", "<|end_content|>", "<|end_style_label|>",
        "<|end_style_prompt|>", "<|end_acoustic_token|>", "<|end_global_token|>", "<|end_semantic_token|>",
    ]
    return toks


def write_spark_tokenizer(llm: Path) -> None:
    """A real byte-level BPE tokenizer in Spark-TTS's `LLM/` layout whose special and added tokens have the
    published ids: the base vocabulary is bytes, a few merges and never-produced fillers up to 151643."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    while len(vocab) < BASE_VOCAB:
        vocab[f"<fill_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = QWEN_SPECIALS + spark_added_tokens()
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [
        {"id": BASE_VOCAB + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t in QWEN_SPECIALS}
        for i, t in enumerate(added)
    ]
    (llm / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (llm / "added_tokens.json").write_text(json.dumps({t: BASE_VOCAB + i for i, t in enumerate(added)}, indent=2))
    (llm / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (llm / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (llm / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 131072, "clean_up_tokenization_spaces": False, "errors": "replace",
    }, indent=2))
    (llm / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }, indent=2))


def random_spark(device: str, dtype: torch.dtype, codec_dtype: torch.dtype, max_batch: int, max_seq: int,
                 workdir: Path, tiny: bool = False):
    """Random full-size LM + BiCodec (tiny widths with `tiny`, for CPU dry runs) and the tokenizer above,
    wrapped in the engine as `voiced serve` loads it (vocoder graphs on a GPU, captured by its warm-up)."""
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig
    from voiced.engines.spark.checkpoint import SparkCheckpoint, TextTokenizer, load_special_tokens
    from voiced.engines.spark.engine import SparkTTSEngine
    from voiced.engines.spark.qwen2 import Qwen2Config
    from voiced.engines.spark.served_lm import ServedLM

    llm = workdir / "LLM"
    llm.mkdir(parents=True, exist_ok=True)
    write_spark_tokenizer(llm)
    torch.manual_seed(0)
    cfg, ccfg = Qwen2Config(), BiCodecConfig()
    if tiny:
        from voiced.engines.spark.bicodec import VocosParams

        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        v = dict(vocos_dim=16, vocos_intermediate_dim=32, vocos_num_layers=2, input_channels=32, out_channels=32)
        ccfg = BiCodecConfig(encoder=VocosParams(**v), prenet=VocosParams(**v, condition_dim=32),
                             postnet=VocosParams(**v), latent_dim=32, speaker_out_dim=32, speaker_latent_dim=16,
                             wave_channels=32)
    with torch.device(device):
        lm = ServedLM(cfg)
        for name, p in lm.named_parameters():
            if p.ndim == 2:
                # a larger embedding (tied with the output) gives peaked logits, so greedy tokens
                # compare kernels rather than bf16 rounding among near-ties
                torch.nn.init.normal_(p, 0, 0.02 if "embed" not in name else 0.15)
        lm = lm.to(dtype).eval()
        codec = BiCodec(ccfg).to(codec_dtype).eval()
    tok = TextTokenizer(llm)
    special = load_special_tokens(llm, tok)
    return SparkTTSEngine(SparkCheckpoint(workdir), lm, codec, tok, special, device=device, max_batch=max_batch,
                          max_seq_len=max_seq, voices_dir=workdir / "voices", model_name="Spark-TTS-0.5B (random)")
