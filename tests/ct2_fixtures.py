"""CTranslate2 Whisper directories written the way CTranslate2's converter writes them, for tests.

    path = write_ct2_dir(tmp_path / "m", dims, state, quantization="int8_float16")

`state` is an OpenAI-named state dict (whisper_fixtures.random_state_dict). The layout follows
`ct2-transformers-converter` (python/ctranslate2/converters/transformers.py, WhisperLoader) and the
quantization and serialization follow python/ctranslate2/specs/model_spec.py (`_quantize`,
`_serialize`): fused QKV with a zero key bias, variables in sorted order, the output projection as an
alias of the token embedding, int8 rows scaled by 127 / max|row|, int16 by 2**10 / max|w|.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import numpy as np
import torch

from voiced.engines.whisper.ct2 import PARAMETERS, key_map
from voiced.engines.whisper.model import ModelDims
from voiced.engines.whisper.tokenizer import ASSETS, LANGUAGES, N_TIMESTAMPS, TIMESTAMP_SECONDS

# numpy has no bfloat16: bfloat16 values travel as their bits in uint16 arrays.
_TYPE_IDS = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2, np.dtype("int32"): 3,
             np.dtype("float16"): 4, np.dtype("uint16"): 5}


def _cast(value: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return torch.from_numpy(value.astype(np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    return value.astype(dtype)
GELU = 3


def ct2_variables(dims: ModelDims, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """OpenAI names -> the converter's variable names (float32 arrays, plus the scalars it writes), by
    the engine's own key map (the reader's inverse)."""
    f = lambda k: state[k].float().numpy()
    out: dict[str, np.ndarray] = {}
    for kind, scope, names in key_map(dims.n_audio_layer, dims.n_text_layer):
        if kind == "tensor":
            out[scope] = f(names[0])
        elif kind == "fused":
            out[f"{scope}/weight"] = np.concatenate([f(f"{n}.weight") for n in names])
            out[f"{scope}/bias"] = np.concatenate([f(f"{n}.bias") if f"{n}.bias" in state
                                                   else np.zeros(state[f"{n}.weight"].shape[0], np.float32)
                                                   for n in names])
        else:
            weight, bias = PARAMETERS[kind]
            out[f"{scope}/{weight}"], out[f"{scope}/{bias}"] = f(f"{names[0]}.weight"), f(f"{names[0]}.bias")
    scalars = {"encoder/num_heads": np.int16(dims.n_audio_head), "decoder/num_heads": np.int16(dims.n_text_head),
               "decoder/activation": np.int8(GELU), "decoder/pre_norm": np.int8(1),
               "decoder/scale_embeddings": np.int8(0), "decoder/alibi": np.int8(0),
               "decoder/start_from_zero_embedding": np.int8(0), "decoder/alignment_layer": np.int16(-1),
               "decoder/alignment_heads": np.int16(1)}
    out.update({k: np.array(v) for k, v in scalars.items()})
    return out


def _quantizable(name: str) -> bool:
    # LinearSpec, Conv1DSpec and EmbeddingsSpec have a weight_scale; nothing else does.
    return name.endswith("/weight")


def quantize(variables: dict[str, np.ndarray], quantization: str) -> dict[str, np.ndarray]:
    """model_spec.LayerSpec._quantize, variable by variable."""
    out = {}
    for name, value in variables.items():
        if value.ndim == 0:
            out[name] = value
            continue
        if _quantizable(name):
            if quantization == "int16":
                value = value.astype(np.float32)
                scale = np.float32(2**10 / np.amax(np.absolute(value)))
                value = np.clip(np.rint(value * scale), np.iinfo(np.int16).min, np.iinfo(np.int16).max)
                out[name], out[name + "_scale"] = value.astype(np.int16), np.array(scale)
            elif quantization.startswith("int8"):
                value = value.astype(np.float32)
                amax = np.amax(np.absolute(value), axis=1)
                amax[amax == 0] = 127.0
                scale = (127.0 / amax).astype(np.float32)
                out[name] = np.rint(value * np.expand_dims(scale, 1)).astype(np.int8)
                out[name + "_scale"] = scale
            else:
                out[name] = _cast(value, quantization)
        else:
            target = {"float16": "float16", "int8_float16": "float16", "bfloat16": "bfloat16",
                      "int8_bfloat16": "bfloat16", "float32": "float32", "int16": "float32",
                      "int8_float32": "float32"}.get(quantization)
            out[name] = _cast(value, target) if target else value
    return out


def write_model_bin(path: Path, variables: dict[str, np.ndarray], aliases: dict[str, str],
                    spec: str = "WhisperSpec", revision: int = 3, version: int = 6) -> None:
    with open(path, "wb") as f:
        def string(s: str):
            f.write(struct.pack("<H", len(s) + 1) + s.encode() + b"\0")

        f.write(struct.pack("<I", version))
        string(spec)
        f.write(struct.pack("<I", revision))
        f.write(struct.pack("<I", len(variables)))
        for name, value in sorted(variables.items()):
            value = np.asarray(value)  # (ascontiguousarray would make scalars 1-D; tobytes() is C order)
            string(name)
            f.write(struct.pack("<B", value.ndim))
            for d in value.shape:
                f.write(struct.pack("<I", d))
            f.write(struct.pack("<BI", _TYPE_IDS[value.dtype], value.nbytes))
            f.write(value.tobytes())
        f.write(struct.pack("<I", len(aliases)))
        for alias, target in sorted(aliases.items()):
            string(alias)
            string(target)


def _bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def whisper_vocabulary(dims: ModelDims) -> list[str]:
    """The token strings CTranslate2's converter writes for a Whisper model (Hugging Face spellings)."""
    name = "multilingual.tiktoken" if dims.multilingual else "gpt2.tiktoken"
    enc = _bytes_to_unicode()
    ranks = {}
    for line in (ASSETS / name).read_bytes().split(b"\n"):
        if line.strip():
            tok, rank = line.split()
            ranks[int(rank)] = "".join(enc[b] for b in base64.b64decode(tok))
    tokens = [ranks[i] for i in range(len(ranks))]
    tokens += ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in list(LANGUAGES)[:dims.num_languages]],
               "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
               "<|notimestamps|>", *[f"<|{i * TIMESTAMP_SECONDS:.2f}|>" for i in range(N_TIMESTAMPS)]]
    assert len(tokens) == dims.n_vocab, (len(tokens), dims.n_vocab)
    return tokens


def ct2_config(dims: ModelDims) -> dict:
    sot = 50258 if dims.multilingual else 50257
    half = dims.n_text_layer // 2
    return {
        "alignment_heads": [[layer, h] for layer in range(half, dims.n_text_layer) for h in range(dims.n_text_head)],
        "lang_ids": list(range(sot + 1, sot + 1 + dims.num_languages)) if dims.multilingual else [],
        "suppress_ids": [1, 2, 7], "suppress_ids_begin": [220, sot - 1],
    }


def write_ct2_dir(directory: str | Path, dims: ModelDims, state: dict[str, torch.Tensor],
                  quantization: str = "float16", vocabulary: str = "vocabulary.json",
                  preprocessor: bool = True) -> Path:
    """A complete converted directory: model.bin, config.json, the vocabulary and preprocessor_config.json."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    variables = quantize(ct2_variables(dims, state), quantization)
    write_model_bin(d / "model.bin", variables, {"decoder/projection/weight": "decoder/embeddings/weight"})
    (d / "config.json").write_text(json.dumps(ct2_config(dims), indent=2))
    tokens = whisper_vocabulary(dims)
    if vocabulary == "vocabulary.json":
        (d / "vocabulary.json").write_text(json.dumps(tokens, ensure_ascii=False))
    elif vocabulary == "vocabulary.txt":
        (d / "vocabulary.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    elif vocabulary == "tokenizer.json":
        specials_from = 50256 if not dims.multilingual else 50257
        (d / "tokenizer.json").write_text(json.dumps({
            "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens[:specials_from])}},
            "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(tokens)
                             if i >= specials_from][:8 + dims.num_languages],  # like Hugging Face: no timestamps
        }, ensure_ascii=False))
    if preprocessor:
        (d / "preprocessor_config.json").write_text(json.dumps({
            "chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": dims.n_mels,
            "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "sampling_rate": 16000}))
    return d
