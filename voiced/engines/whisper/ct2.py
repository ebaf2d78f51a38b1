"""CTranslate2 (faster-whisper) model directories, read without CTranslate2.

A converted Whisper model is a directory (what `ct2-transformers-converter` writes, what
faster-whisper and Home Assistant keep on disk):

    model.bin                  the weights, in CTranslate2's binary format (below)
    config.json                alignment_heads, lang_ids, suppress_ids, suppress_ids_begin
    vocabulary.json | vocabulary.txt | tokenizer.json   the token strings by id
    preprocessor_config.json   the feature extractor (optional: n_mels also follows from the weights)

model.bin, as `ModelSpec._serialize` (python/ctranslate2/specs/model_spec.py) writes it and
`Model::load` (src/models/model.cc) reads it, all integers little-endian:

    u32 binary_version (<= 6)       string spec name ("WhisperSpec")     u32 spec revision
    u32 n_variables, then per variable:
        string name   u8 rank   u32 dims[rank]   u8 dtype   u32 n_bytes   bytes
    u32 n_aliases, then per alias: string alias   string target
    string = u16 length (with the trailing NUL), then the bytes and the NUL

dtype ids (versions >= 4): 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16; versions
< 4 store an item size instead (4 float32, 2 int16, 1 int8). Versions < 2 have no name/revision.

How Whisper is laid out in it (the converter's WhisperLoader, python/ctranslate2/converters/
transformers.py): names are scopes like `decoder/layer_3/attention/linear_1/weight`;

* self-attention query, key and value are fused into one `linear_0` ([3D, D]; the key's bias,
  which Whisper does not have, is stored as zeros); cross-attention has `linear_0` = query and
  `linear_1` = key and value fused ([2D, D]); the output projections are `linear_1` / `linear_2`;
* layer norms are `gamma` / `beta`; the FFN is `ffn/linear_0`, `ffn/linear_1`;
* the conv weights keep PyTorch's [out, in, kernel] layout; both position tables are stored
  (the encoder's is the sinusoid table, rounded to the file's dtype);
* the output projection is an alias of the token embedding (tied);
* scalars record the architecture (`num_heads`, `activation`, `pre_norm`, ...); they are checked
  against Whisper's so a file for some other Transformer is refused rather than misread;
* quantized weights (int8*, int16) carry a `<name>_scale`: int8 rows are round(w * 127 / max|row|)
  with the per-row scale 127 / max|row|, int16 uses one scale 2**10 / max|w| for the tensor.

Quantized files load dequantized (w = q / scale) into the float engine: the rounding the converter
did stays in the weights; activations are not quantized. README.md gives the measured cost.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .model import ModelDims

log = logging.getLogger(__name__)

MAX_BINARY_VERSION = 6
MAX_WHISPER_REVISION = 3
_DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16, 5: torch.bfloat16}
_DTYPE_NAMES = {torch.float32: "float32", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
                torch.float16: "float16", torch.bfloat16: "bfloat16"}
_OLD_DTYPES = {4: torch.float32, 2: torch.int16, 1: torch.int8}  # binary versions < 4: by item size
VOCABULARY_FILES = ("vocabulary.json", "vocabulary.txt", "tokenizer.json")
# CTranslate2's Activation enum: GELU is 3 from spec revision 3 on; revisions 1-2 called it 1
# (before the tanh approximation took that number).
_GELU = {1: 1, 2: 1, 3: 3}


class Ct2Error(ValueError):
    """A CTranslate2 directory or model.bin that cannot be used; the message names file and problem."""


@dataclass
class Ct2Model:
    """The raw contents of a model.bin."""

    binary_version: int
    spec: str
    revision: int
    variables: dict[str, Tensor]
    aliases: dict[str, str]

    def get(self, name: str) -> Tensor | None:
        seen = set()
        while name in self.aliases and name not in seen:  # aliases may point at aliases
            seen.add(name)
            name = self.aliases[name]
        return self.variables.get(name)


@dataclass
class Ct2Checkpoint:
    """What a CTranslate2 Whisper directory holds, in this package's terms."""

    dims: ModelDims
    state: dict[str, Tensor]  # OpenAI parameter names (model.py), float
    weight_dtype: str  # what model.bin stores its matrices in: float16, float32, int8, ...
    config: dict = field(default_factory=dict)  # config.json (alignment_heads, lang_ids, suppress_ids, ...)
    vocabulary: list[str] | None = None  # token string of each id, byte-level BPE form

    @property
    def quantized(self) -> bool:
        return self.weight_dtype in ("int8", "int16")

    @property
    def alignment_heads(self) -> list[tuple[int, int]] | None:
        heads = self.config.get("alignment_heads")
        return [(int(a), int(b)) for a, b in heads] if heads else None


# ------------------------------------------------------------------------------------ model.bin
class _Reader:
    def __init__(self, f, path: Path):
        self.f, self.path = f, path

    def truncated(self, what: str) -> Ct2Error:
        return Ct2Error(f"{self.path} ends early (at byte {self.f.tell()}, reading {what}): the file is "
                        "truncated. Download it again; a model.bin split into parts must be joined first "
                        "(`voiced models pull` does that for the models it knows).")

    def read(self, n: int, what: str) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise self.truncated(what)
        return b

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.read(struct.calcsize("<" + fmt), what))

    def string(self, what: str) -> str:
        (n,) = self.unpack("H", what)
        if n == 0:
            raise Ct2Error(f"{self.path}: invalid string length while reading {what}; not a CTranslate2 model.bin")
        return self.read(n, what)[:-1].decode("utf-8", errors="replace")

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, n_bytes: int, name: str) -> Tensor:
        buf = bytearray(n_bytes)
        if self.f.readinto(buf) != n_bytes:
            raise self.truncated(f"variable {name!r}")
        return torch.frombuffer(buf, dtype=dtype).reshape(shape) if n_bytes else torch.empty(shape, dtype=dtype)


def read_model_bin(path: str | Path) -> Ct2Model:
    path = Path(path)
    with open(path, "rb") as f:
        r = _Reader(f, path)
        (version,) = r.unpack("I", "the binary version")
        if not 1 <= version <= MAX_BINARY_VERSION:
            raise Ct2Error(f"{path}: binary version {version} is not one voiced reads (1..{MAX_BINARY_VERSION}); "
                           "either this is not a CTranslate2 model.bin or a newer CTranslate2 wrote it")
        spec, revision = "", 1
        if version >= 2:
            spec = r.string("the spec name")
            (revision,) = r.unpack("I", "the spec revision")
        (n,) = r.unpack("I", "the variable count")
        variables: dict[str, Tensor] = {}
        for _ in range(n):
            name = r.string("a variable name")
            (rank,) = r.unpack("B", f"the rank of {name!r}")
            shape = r.unpack("I" * rank, f"the shape of {name!r}")
            if version >= 4:
                type_id, n_bytes = r.unpack("BI", f"the type of {name!r}")
                if type_id not in _DTYPES:
                    raise Ct2Error(f"{path}: variable {name!r} has unknown data type id {type_id}")
                dtype = _DTYPES[type_id]
            else:
                item, count = r.unpack("BI", f"the type of {name!r}")
                if item not in _OLD_DTYPES:
                    raise Ct2Error(f"{path}: variable {name!r} has unknown item size {item}")
                dtype, n_bytes = _OLD_DTYPES[item], count * item
            numel = 1
            for d in shape:
                numel *= d
            if n_bytes != numel * torch.empty((), dtype=dtype).element_size():
                raise Ct2Error(f"{path}: variable {name!r} has {n_bytes} bytes for shape {shape}; the file is damaged")
            variables[name] = r.tensor(shape, dtype, n_bytes, name)
        aliases = {}
        if version >= 3:
            (n_alias,) = r.unpack("I", "the alias count")
            for _ in range(n_alias):
                alias = r.string("an alias")
                aliases[alias] = r.string(f"the target of alias {alias!r}")
    return Ct2Model(version, spec, revision, variables, aliases)


# ----------------------------------------------------------------------------- weights -> OpenAI
def _dequantize(m: Ct2Model, name: str) -> Tensor:
    """The float value of variable `name` (int8 / int16 weights divided by their scale)."""
    w = m.get(name)
    if w is None:
        raise KeyError(name)
    if not w.is_floating_point():
        scale = m.get(name + "_scale")
        if scale is None:
            raise Ct2Error(f"{name} is stored as {_DTYPE_NAMES[w.dtype]} without a {name}_scale")
        scale = scale.float()
        # int8: one scale per output row ([out] for a linear layer; [out, kernel] for a conv, whose
        # rows the converter takes over its input axis; [out] would be per output channel); int16:
        # one scale for the tensor.
        if scale.dim() == w.dim() - 1:
            scale = scale.unsqueeze(1)
        elif scale.dim() == 1:
            scale = scale.view(-1, *([1] * (w.dim() - 1)))
        try:
            return w.float() / scale
        except RuntimeError:
            raise Ct2Error(f"{name}_scale has shape {tuple(m.get(name + '_scale').shape)}, which does not fit "
                           f"{name} {tuple(w.shape)}") from None
    return w


def _scalar(m: Ct2Model, name: str) -> int | None:
    v = m.get(name)
    return None if v is None else int(v.reshape(-1)[0].item())


# Scalars the Whisper spec writes, and the values Whisper's architecture needs (None: any value).
def _expected_scalars(revision: int) -> dict[str, int | None]:
    return {
        "encoder/num_heads": None, "decoder/num_heads": None,
        "decoder/activation": _GELU.get(revision, 3), "decoder/pre_norm": 1, "decoder/scale_embeddings": 0,
        "decoder/alibi": 0, "decoder/alibi_use_positive_positions": 0, "decoder/scale_alibi": 0,
        "decoder/start_from_zero_embedding": 0,
        # CTranslate2's own alignment settings for its attention output; word timings use
        # config.json's alignment_heads instead.
        "decoder/alignment_layer": None, "decoder/alignment_heads": None,
    }


def _layer_count(m: Ct2Model, part: str) -> int:
    ids = {int(x.group(1)) for k in m.variables if (x := re.match(rf"{part}/layer_(\d+)/", k))}
    if ids != set(range(len(ids))):
        raise Ct2Error(f"{part} layers are not numbered 0..{len(ids) - 1}: {sorted(ids)}")
    return len(ids)


# A layer's (weight, bias) names in CTranslate2 by kind: linear layers keep PyTorch's, norms are gamma/beta.
PARAMETERS = {"linear": ("weight", "bias"), "norm": ("gamma", "beta")}
OPTIONAL_TENSOR = "encoder/position_encodings/encodings"  # older converters left the sinusoids out


def key_map(n_audio_layer: int, n_text_layer: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """Whisper's weights as CTranslate2's converter lays them out: (kind, CTranslate2 scope, OpenAI
    names). Kinds: "linear" (scope/weight, scope/bias), "norm" (scope/gamma, scope/beta from the
    OpenAI weight and bias), "fused" (the rows of several projections in scope/weight and one
    scope/bias, zeros for a key, which has none), "tensor" (one array named by the scope itself).
    The reader here and the tests' writer (tests/ct2_fixtures.py) both follow it."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for part, n in (("encoder", n_audio_layer), ("decoder", n_text_layer)):
        for i in range(n):
            s, d = f"{part}/layer_{i}", f"{part}.blocks.{i}"
            out += [("norm", f"{s}/self_attention/layer_norm", (f"{d}.attn_ln",)),
                    ("fused", f"{s}/self_attention/linear_0", (f"{d}.attn.query", f"{d}.attn.key", f"{d}.attn.value")),
                    ("linear", f"{s}/self_attention/linear_1", (f"{d}.attn.out",))]
            if part == "decoder":
                out += [("norm", f"{s}/attention/layer_norm", (f"{d}.cross_attn_ln",)),
                        ("linear", f"{s}/attention/linear_0", (f"{d}.cross_attn.query",)),
                        ("fused", f"{s}/attention/linear_1", (f"{d}.cross_attn.key", f"{d}.cross_attn.value")),
                        ("linear", f"{s}/attention/linear_2", (f"{d}.cross_attn.out",))]
            out += [("norm", f"{s}/ffn/layer_norm", (f"{d}.mlp_ln",)),
                    ("linear", f"{s}/ffn/linear_0", (f"{d}.mlp.0",)),
                    ("linear", f"{s}/ffn/linear_1", (f"{d}.mlp.2",))]
    return out + [
        ("linear", "encoder/conv1", ("encoder.conv1",)), ("linear", "encoder/conv2", ("encoder.conv2",)),
        ("norm", "encoder/layer_norm", ("encoder.ln_post",)),
        ("tensor", OPTIONAL_TENSOR, ("encoder.positional_embedding",)),
        ("tensor", "decoder/embeddings/weight", ("decoder.token_embedding.weight",)),
        ("tensor", "decoder/position_encodings/encodings", ("decoder.positional_embedding",)),
        ("norm", "decoder/layer_norm", ("decoder.ln",)),
    ]


def to_openai_state(m: Ct2Model, where: str = "model.bin") -> tuple[ModelDims, dict[str, Tensor], str]:
    """Dimensions, OpenAI-named float weights, and the storage dtype of a Whisper model.bin."""
    if m.spec and m.spec != "WhisperSpec":
        raise Ct2Error(f"{where} holds a CTranslate2 {m.spec!r}, not a Whisper model (WhisperSpec)")
    if m.revision > MAX_WHISPER_REVISION:
        raise Ct2Error(f"{where}: WhisperSpec revision {m.revision} is newer than the {MAX_WHISPER_REVISION} "
                       "voiced reads; convert the model with a CTranslate2 4.x converter")
    expected = _expected_scalars(m.revision)
    for name, v in m.variables.items():
        if v.dim() != 0 or name.endswith("_scale"):  # int16 weights have a scalar scale
            continue
        value = int(v.item()) if not v.is_floating_point() else float(v.item())
        if name in expected:
            want = expected[name]
            if want is not None and value != want:
                raise Ct2Error(f"{where}: {name} is {value}, but Whisper needs {want}; this model.bin is not a "
                               "Whisper model as the CTranslate2 converter writes it")
        elif value != 0:  # an architecture switch voiced does not know, turned on: refuse to misread it
            raise Ct2Error(f"{where}: {name} = {value} is a CTranslate2 setting voiced does not know; "
                           "it cannot load this model exactly")

    used: set[str] = set()
    state: dict[str, Tensor] = {}

    def take(name: str) -> Tensor:
        try:
            t = _dequantize(m, name)
        except KeyError:
            raise Ct2Error(f"{where} lacks {name!r}; the model.bin is incomplete or not a Whisper model") from None
        used.update({name, name + "_scale"})
        return t

    for kind, scope, names in key_map(_layer_count(m, "encoder"), _layer_count(m, "decoder")):
        if kind == "tensor":
            if scope == OPTIONAL_TENSOR and m.get(scope) is None:
                continue  # model.py computes the sinusoids
            state[names[0]] = take(scope)
        elif kind == "fused":
            # Split row-wise; keys have no bias in Whisper (the converter wrote zeros, and a bias on keys
            # would shift every score of a query equally, which softmax ignores).
            w, b = take(f"{scope}/weight"), take(f"{scope}/bias")
            for dst, wi, bi in zip(names, w.chunk(len(names)), b.chunk(len(names))):
                state[f"{dst}.weight"] = wi
                if not dst.endswith(".key"):
                    state[f"{dst}.bias"] = bi
        else:
            weight, bias = PARAMETERS[kind]
            state[f"{names[0]}.weight"] = take(f"{scope}/{weight}")
            state[f"{names[0]}.bias"] = take(f"{scope}/{bias}")

    # The output projection must be the token embedding (Whisper ties them).
    proj = m.get("decoder/projection/weight")
    used.update({"decoder/projection/weight", "decoder/projection/weight_scale"})
    if proj is not None and not (m.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight"
                                 or torch.equal(_dequantize(m, "decoder/projection/weight"),
                                                state["decoder.token_embedding.weight"])):
        raise Ct2Error(f"{where}: the output projection differs from the token embedding; Whisper ties them, "
                       "and voiced's engine does too")
    if m.get("decoder/projection/bias") is not None:
        bias = m.get("decoder/projection/bias")
        used.add("decoder/projection/bias")
        if bias.abs().max().item() != 0:
            raise Ct2Error(f"{where}: the output projection has a bias; Whisper has none")
    left = sorted(k for k in m.variables if m.variables[k].dim() != 0 and k not in used)
    if left:
        raise Ct2Error(f"{where} has weights a Whisper model does not: {', '.join(left[:5])}"
                       f"{' ...' if len(left) > 5 else ''}")

    conv1 = state["encoder.conv1.weight"]
    emb = state["decoder.token_embedding.weight"]
    d_audio, d_text = conv1.shape[0], emb.shape[1]
    for part, d in (("encoder", d_audio), ("decoder", d_text)):
        if state[f"{part}.blocks.0.mlp.0.weight"].shape[0] != 4 * d:
            raise Ct2Error(f"{where}: a feed-forward width other than 4 x the model width is not supported")
    n_audio_ctx = (state["encoder.positional_embedding"].shape[0] if "encoder.positional_embedding" in state
                   else 1500)
    dims = ModelDims(
        n_mels=conv1.shape[1], n_audio_ctx=n_audio_ctx, n_audio_state=d_audio,
        n_audio_head=_scalar(m, "encoder/num_heads") or 0, n_audio_layer=_layer_count(m, "encoder"),
        n_vocab=emb.shape[0], n_text_ctx=state["decoder.positional_embedding"].shape[0], n_text_state=d_text,
        n_text_head=_scalar(m, "decoder/num_heads") or 0, n_text_layer=_layer_count(m, "decoder"),
    )
    if not dims.n_audio_head or not dims.n_text_head:
        raise Ct2Error(f"{where} lacks encoder/num_heads or decoder/num_heads")
    return dims, state, _weight_dtype(m)


def _weight_dtype(m: Ct2Model) -> str:
    """The dtype of the big matrices (the first encoder layer's fused QKV stands for them all)."""
    w = m.get("encoder/layer_0/self_attention/linear_0/weight")
    if w is None:
        w = m.get("decoder/embeddings/weight")
    return _DTYPE_NAMES.get(w.dtype, str(w.dtype)) if w is not None else "unknown"


# ------------------------------------------------------------------------------------ directory
def read_vocabulary(directory: Path) -> list[str] | None:
    """Token strings by id from vocabulary.json, vocabulary.txt or tokenizer.json (first found)."""
    for name in VOCABULARY_FILES:
        p = directory / name
        if not p.is_file():
            continue
        try:
            if name == "vocabulary.txt":
                # One token per line; tokens never contain "\n" (byte-level BPE writes it as "Ċ"), but one
                # may be empty (multilingual.tiktoken's rank 50256), so lines are not stripped.
                lines = p.read_text(encoding="utf-8").split("\n")
                return lines[:-1] if lines and lines[-1] == "" else lines
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Ct2Error(f"{p} cannot be read: {e}") from e
        if name == "vocabulary.json":
            if not isinstance(data, list) or not all(isinstance(t, str) for t in data):
                raise Ct2Error(f"{p} is not a JSON list of token strings")
            return data
        try:
            by_id = {int(i): t for t, i in data["model"]["vocab"].items()}
            by_id.update({int(a["id"]): a["content"] for a in data.get("added_tokens", [])})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise Ct2Error(f"{p} is not a Hugging Face tokenizer.json ({e})") from e
        n = max(by_id) + 1 if by_id else 0
        missing = [i for i in range(n) if i not in by_id]
        if missing:
            raise Ct2Error(f"{p} has no token for ids {missing[:5]}")
        return [by_id[i] for i in range(n)]
    return None


def is_ct2_dir(path: Path) -> bool:
    """A directory that is (or was meant to be) a CTranslate2 model: it has model.bin (or parts of one),
    CTranslate2's vocabulary file, or CTranslate2's config.json (Hugging Face's names a model_type)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / "model.bin").is_file() or any(path.glob("model.bin.part*")):
        return True
    if (path / "vocabulary.json").is_file() or (path / "vocabulary.txt").is_file():
        return True
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model_type" not in cfg and bool({"suppress_ids", "lang_ids"} & set(cfg))


def read_ct2_dir(path: str | Path) -> Ct2Checkpoint:
    path = Path(path)
    present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not (path / "model.bin").is_file():
        parts = sorted(path.glob("model.bin.part*"))
        hint = (f"; it has {', '.join(p.name for p in parts)}: join them in order (`cat "
                f"{' '.join(p.name for p in parts)} > model.bin`)" if parts else "")
        raise Ct2Error(f"{path} is not a complete CTranslate2 model directory: model.bin is missing{hint} "
                       f"(found: {', '.join(present) or 'nothing'})")
    vocab_file = next((n for n in VOCABULARY_FILES if (path / n).is_file()), None)
    if vocab_file is None:
        raise Ct2Error(f"{path} is not a complete CTranslate2 model directory: it has no vocabulary "
                       f"({', '.join(VOCABULARY_FILES)}); copy the one that came with the model "
                       f"(found: {', '.join(present)})")
    config: dict = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise Ct2Error(f"{path / 'config.json'} cannot be read: {e}") from e
        if not isinstance(config, dict):
            raise Ct2Error(f"{path / 'config.json'} is not a JSON object")
    else:
        log.warning("%s has no config.json: no alignment heads for word timings; using the model as is", path)
    if config.get("quantization_type") not in (None, 0):
        raise Ct2Error(f"{path}: model.bin is quantized with method {config['quantization_type']!r} (AWQ), which "
                       "voiced cannot read; convert the original model with `ct2-transformers-converter "
                       "--quantization float16` instead")
    dims, state, weight_dtype = to_openai_state(read_model_bin(path / "model.bin"), str(path / "model.bin"))
    _check_preprocessor(path, dims)
    vocabulary = read_vocabulary(path)
    # The converter pads its vocabulary to the embedding's size; tokenizer.json may stop before the
    # timestamps (Tokenizer.check_vocabulary compares what is there).
    if vocabulary is not None and vocab_file != "tokenizer.json" and len(vocabulary) != dims.n_vocab:
        raise Ct2Error(f"{path / vocab_file} has {len(vocabulary)} tokens but model.bin's embedding "
                       f"{dims.n_vocab}; the files come from different models")
    ckpt = Ct2Checkpoint(dims, state, weight_dtype, config, vocabulary)
    heads = ckpt.alignment_heads or []
    bad = [h for h in heads if not (0 <= h[0] < dims.n_text_layer and 0 <= h[1] < dims.n_text_head)]
    if bad:
        raise Ct2Error(f"{path / 'config.json'}: alignment_heads {bad[:3]} lie outside the decoder's "
                       f"{dims.n_text_layer} layers x {dims.n_text_head} heads")
    if ckpt.quantized:
        log.warning("%s stores its weights as %s; they are dequantized to float: the rounding stays in the weights "
                    "(see README: quantized CTranslate2 models)", path / "model.bin", weight_dtype)
    return ckpt


def _check_preprocessor(path: Path, dims: ModelDims) -> None:
    """preprocessor_config.json, when there, must describe Whisper's features for this model."""
    p = path / "preprocessor_config.json"
    if not p.is_file():
        return
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise Ct2Error(f"{p} cannot be read: {e}") from e
    want = {"feature_size": dims.n_mels, "sampling_rate": 16000, "n_fft": 400, "hop_length": 160,
            "chunk_length": 30}
    bad = {k: (cfg[k], v) for k, v in want.items() if k in cfg and cfg[k] != v}
    if bad:
        detail = ", ".join(f"{k} is {got}, expected {exp}" for k, (got, exp) in bad.items())
        raise Ct2Error(f"{p}: {detail}; voiced computes Whisper's standard features for this model")
