"""Whisper checkpoints on disk, in every format users have, read into one form for one engine.

* OpenAI `.pt`: a pickled dict `{"dims": {...ModelDims...}, "model_state_dict": {...}}` whose
  parameter names are the ones `model.py` uses. Loaded with `weights_only=True` (no code runs).
* Hugging Face (`WhisperForConditionalGeneration` directories, e.g. distil-whisper): `config.json`
  and `model.safetensors` (or a sharded index, or `pytorch_model.bin`); names are mapped below.
* CTranslate2 / faster-whisper directories (`model.bin`, ...): read by `ct2.py`.

`read_checkpoint` turns any of them into a `Checkpoint`: dimensions, OpenAI-named weights, the
tokenizer, and what the format says beyond the weights (alignment heads for word timings).
Official names and downloads are in `registry.py` (kept free of torch so the CLI stays quick).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .model import ModelDims, Whisper
from .registry import whisper_cache
from .tokenizer import WhisperTokenizer

log = logging.getLogger(__name__)

class CheckpointError(ValueError):
    """A file that is not a usable Whisper checkpoint; the message names the file and the problem."""


# ------------------------------------------------------------------------ Hugging Face <-> OpenAI
_HF_BLOCK = [  # (Hugging Face, OpenAI) name pieces inside one layer
    ("self_attn.q_proj", "attn.query"), ("self_attn.k_proj", "attn.key"), ("self_attn.v_proj", "attn.value"),
    ("self_attn.out_proj", "attn.out"), ("self_attn_layer_norm", "attn_ln"),
    ("encoder_attn.q_proj", "cross_attn.query"), ("encoder_attn.k_proj", "cross_attn.key"),
    ("encoder_attn.v_proj", "cross_attn.value"), ("encoder_attn.out_proj", "cross_attn.out"),
    ("encoder_attn_layer_norm", "cross_attn_ln"), ("fc1", "mlp.0"), ("fc2", "mlp.2"),
    ("final_layer_norm", "mlp_ln"),
]
_HF_TOP = [
    ("model.encoder.conv1", "encoder.conv1"), ("model.encoder.conv2", "encoder.conv2"),
    ("model.encoder.embed_positions.weight", "encoder.positional_embedding"),
    ("model.encoder.layer_norm", "encoder.ln_post"),
    ("model.decoder.embed_tokens.weight", "decoder.token_embedding.weight"),
    ("model.decoder.embed_positions.weight", "decoder.positional_embedding"),
    ("model.decoder.layer_norm", "decoder.ln"),
]


def hf_to_openai_name(name: str) -> str | None:
    """Map one Hugging Face parameter name; None for names we drop (the tied output projection)."""
    if name == "proj_out.weight":
        return None
    m = re.fullmatch(r"model\.(encoder|decoder)\.layers\.(\d+)\.(.+)", name)
    if m:
        part, idx, rest = m.groups()
        for hf, oa in _HF_BLOCK:
            if rest.startswith(hf + ".") or rest == hf:
                return f"{part}.blocks.{idx}.{oa}{rest[len(hf):]}"
        raise CheckpointError(f"unknown Hugging Face Whisper parameter {name!r}")
    for hf, oa in _HF_TOP:
        if name == hf or name.startswith(hf + "."):
            return oa + name[len(hf):]
    raise CheckpointError(f"unknown Hugging Face Whisper parameter {name!r}")


def openai_to_hf_name(name: str) -> str:
    m = re.fullmatch(r"(encoder|decoder)\.blocks\.(\d+)\.(.+)", name)
    if m:
        part, idx, rest = m.groups()
        for hf, oa in _HF_BLOCK:
            if rest.startswith(oa + "."):
                return f"model.{part}.layers.{idx}.{hf}{rest[len(oa):]}"
        raise KeyError(name)
    for hf, oa in _HF_TOP:
        if name == oa or name.startswith(oa + "."):
            return hf + name[len(oa):]
    raise KeyError(name)


def dims_from_hf_config(cfg: dict, where: Path) -> ModelDims:
    try:
        d = cfg["d_model"]
        if cfg.get("encoder_ffn_dim", 4 * d) != 4 * d or cfg.get("decoder_ffn_dim", 4 * d) != 4 * d:
            raise CheckpointError(f"{where}: feed-forward width other than 4 x d_model is not supported")
        return ModelDims(
            n_mels=cfg["num_mel_bins"], n_audio_ctx=cfg["max_source_positions"], n_audio_state=d,
            n_audio_head=cfg["encoder_attention_heads"], n_audio_layer=cfg["encoder_layers"],
            n_vocab=cfg["vocab_size"], n_text_ctx=cfg["max_target_positions"], n_text_state=d,
            n_text_head=cfg["decoder_attention_heads"], n_text_layer=cfg["decoder_layers"],
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: config.json lacks {e.args[0]!r}; is this a Whisper model?") from e


def hf_config_from_dims(dims: ModelDims) -> dict:
    """config.json for a WhisperForConditionalGeneration with these dimensions (and Whisper's ids)."""
    sot = 50258 if dims.multilingual else 50257
    eot = sot - 1
    return {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": dims.n_vocab, "num_mel_bins": dims.n_mels, "d_model": dims.n_text_state,
        "encoder_layers": dims.n_audio_layer, "encoder_attention_heads": dims.n_audio_head,
        "decoder_layers": dims.n_text_layer, "decoder_attention_heads": dims.n_text_head,
        "encoder_ffn_dim": 4 * dims.n_audio_state, "decoder_ffn_dim": 4 * dims.n_text_state,
        "max_source_positions": dims.n_audio_ctx, "max_target_positions": dims.n_text_ctx,
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "decoder_start_token_id": sot, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
        "torch_dtype": "float32",
    }


def _read_hf_weights(d: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, Tensor] = {}
        for s in shards:
            out.update(load_file(str(d / s)))
        return out
    if (d / "pytorch_model.bin").is_file():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


@dataclass
class Checkpoint:
    """A Whisper checkpoint read from disk, whatever its format."""

    path: Path
    format: str  # "openai", "huggingface" or "ctranslate2"
    dims: ModelDims
    state: dict[str, Tensor]  # OpenAI parameter names (model.py)
    weight_dtype: str  # how the file stores the weights: float16, float32, bfloat16, int8, ...
    # (decoder layer, head) pairs whose cross-attention follows the audio, for word timings; None when
    # the format does not say (OpenAI .pt files: openai-whisper keeps them in a table by model name).
    alignment_heads: list[tuple[int, int]] | None = None
    vocabulary: list[str] | None = None  # the file's own token strings by id, when it has them

    def tokenizer(self) -> WhisperTokenizer:
        """Whisper's tokenizer for these dimensions (bundled rank files), checked against the file's vocabulary."""
        tok = WhisperTokenizer.load(self.dims.multilingual, self.dims.num_languages)
        if self.vocabulary is not None:
            try:
                tok.check_vocabulary(self.vocabulary, str(self.path))
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        return tok


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Any supported checkpoint: an OpenAI `.pt` file, a Hugging Face or a CTranslate2 directory."""
    from . import ct2

    path = Path(path)
    if ct2.is_ct2_dir(path):
        try:
            c = ct2.read_ct2_dir(path)
        except ct2.Ct2Error as e:
            raise CheckpointError(str(e)) from None
        if c.dims.multilingual:
            _check_lang_ids(c.config.get("lang_ids"), c.dims, path)
        return Checkpoint(path, "ctranslate2", c.dims, c.state, c.weight_dtype, c.alignment_heads, c.vocabulary)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            present = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
            raise CheckpointError(f"{path} is not a Whisper model directory (found: {present}); expected a "
                                  "CTranslate2 / faster-whisper directory (model.bin, config.json, vocabulary.json "
                                  "or vocabulary.txt or tokenizer.json) or a Hugging Face one (config.json, "
                                  "model.safetensors), or pass an OpenAI .pt file")
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("model_type") not in (None, "whisper"):
            raise CheckpointError(f"{path}: model_type is {cfg.get('model_type')!r}, not 'whisper'")
        dims = dims_from_hf_config(cfg, path)
        state = {}
        for k, v in _read_hf_weights(path).items():
            name = hf_to_openai_name(k)
            if name is not None:
                state[name] = v
        gen = path / "generation_config.json"
        heads = json.loads(gen.read_text()).get("alignment_heads") if gen.is_file() else None
        from .ct2 import read_vocabulary

        vocab = read_vocabulary(path) if (path / "tokenizer.json").is_file() else None
        dtype = str(next(iter(state.values())).dtype).replace("torch.", "") if state else "unknown"
        return Checkpoint(path, "huggingface", dims, state, dtype,
                          [(int(a), int(b)) for a, b in heads] if heads else None, vocab)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors, truncated downloads, ... all mean the same to a user
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint ({type(e).__name__}: {e}); "
                              "if it was downloaded, delete it and pull it again") from e
    if not isinstance(ckpt, dict) or "dims" not in ckpt or "model_state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not an OpenAI Whisper checkpoint (expected a dict with "
                              "'dims' and 'model_state_dict')")
    try:
        dims = ModelDims(**ckpt["dims"])
    except TypeError as e:
        raise CheckpointError(f"{path}: bad 'dims' entry: {e}") from e
    state = dict(ckpt["model_state_dict"])
    dtype = str(next(iter(state.values())).dtype).replace("torch.", "") if state else "unknown"
    return Checkpoint(path, "openai", dims, state, dtype)


def _check_lang_ids(lang_ids: list[int] | None, dims: ModelDims, path: Path) -> None:
    """A multilingual model's language tokens must be where the tokenizer puts them."""
    if not lang_ids:
        return
    sot = 50258
    want = list(range(sot + 1, sot + 1 + dims.num_languages))
    if sorted(int(i) for i in lang_ids) != want:
        raise CheckpointError(f"{path / 'config.json'}: lang_ids run {min(lang_ids)}..{max(lang_ids)} "
                              f"({len(lang_ids)} languages); a Whisper model with {dims.n_vocab} tokens has them "
                              f"at {want[0]}..{want[-1]}")


def tokenizer_search_dirs(path: Path, root: Path | None = None) -> list[Path]:
    """Where a checkpoint's `.tiktoken` file may live: beside it, then the model cache."""
    path = Path(path)
    here = path if path.is_dir() else path.parent
    dirs = [here, here.parent, whisper_cache(root)]
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def build_model(dims: ModelDims, state: dict[str, torch.Tensor], where: str = "checkpoint") -> Whisper:
    """The model of `dims` holding `state` (the encoder's sinusoids recomputed when absent); CheckpointError,
    naming `where`, for parameters missing, unknown or of another shape."""
    model = Whisper(dims)
    own = model.state_dict()
    missing = [k for k in own if k not in state and k != "encoder.positional_embedding"]
    unexpected = [k for k in state if k not in own]
    bad_shape = [f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in own
                 if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} parameters (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown parameters (e.g. {unexpected[:3]})")
        if bad_shape:
            parts.append(f"shape mismatches: {bad_shape[:3]}")
        raise CheckpointError(f"{where} does not match its own dimensions {dims}: " + "; ".join(parts))
    model.load_state_dict(state, strict=False)  # the encoder's sinusoids are recomputed when absent
    return model
