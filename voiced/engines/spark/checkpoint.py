"""The published `SparkAudio/Spark-TTS-0.5B` directory: where it lives, what is in it, its token ids.

Layout (as on Hugging Face):

    config.yaml                     sample_rate, ref_segment_duration, latent_hop_length, volume_normalize
    BiCodec/config.yaml             audio_tokenizer: mel_params, encoder, decoder, quantizer, speaker_encoder, prenet, postnet
    BiCodec/model.safetensors       weight-normed convs as weight_g / weight_v
    LLM/config.json                 Qwen2 (vocab padded to 166000)
    LLM/model.safetensors
    LLM/tokenizer.json, added_tokens.json, vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json
    wav2vec2-large-xlsr-53/         config.json, preprocessor_config.json, pytorch_model.bin

The LM writes BiCodec tokens as ordinary vocabulary ids, so a tokenizer whose added tokens moved would
make the engine speak garbage without any error. `load_special_tokens` therefore checks the fixed ids
(`<|im_end|>` 151645, globals 151665+i, semantics 155761+i) against `added_tokens.json` and against the
tokenizer itself, and refuses to load when they differ.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from voiced import hub

log = logging.getLogger(__name__)

MODEL_NAME = "spark-tts-0.5b"
HF_REPO = "SparkAudio/Spark-TTS-0.5B"
HF_URL = f"https://huggingface.co/{HF_REPO}/resolve/main/{{path}}"
ALIASES = {MODEL_NAME, "spark-tts-0.5B", "Spark-TTS-0.5B", HF_REPO}

# Files `voiced models pull spark-tts-0.5b` fetches (the whole published directory that inference reads).
PUBLISHED_FILES = [
    "config.yaml",
    "BiCodec/config.yaml",
    "BiCodec/model.safetensors",
    "LLM/config.json",
    "LLM/model.safetensors",
    "LLM/tokenizer.json",
    "LLM/tokenizer_config.json",
    "LLM/added_tokens.json",
    "LLM/special_tokens_map.json",
    "LLM/vocab.json",
    "LLM/merges.txt",
    "wav2vec2-large-xlsr-53/config.json",
    "wav2vec2-large-xlsr-53/preprocessor_config.json",
    "wav2vec2-large-xlsr-53/pytorch_model.bin",
]
# What must be present to load (the wav2vec2 weights only matter for registering cloned voices).
REQUIRED_FILES = [
    "BiCodec/config.yaml",
    "BiCodec/model.safetensors",
    "LLM/config.json",
    "LLM/tokenizer.json",
    "LLM/added_tokens.json",
]

EOS = "<|im_end|>"
EOS_ID = 151645
GLOBAL_BASE, N_GLOBAL = 151665, 4096
SEMANTIC_BASE, N_SEMANTIC = 155761, 8192

GENDERS = {"female": 0, "male": 1}
LEVELS = {"very_low": 0, "low": 1, "moderate": 2, "high": 3, "very_high": 4}


class CheckpointError(ValueError):
    """A Spark-TTS directory that is incomplete or inconsistent; the message names the file."""


@dataclass
class SparkCheckpoint:
    root: Path

    @property
    def llm_dir(self) -> Path:
        return self.root / "LLM"

    @property
    def bicodec_dir(self) -> Path:
        return self.root / "BiCodec"

    @property
    def wav2vec2_dir(self) -> Path:
        return self.root / "wav2vec2-large-xlsr-53"

    @property
    def root_config(self) -> Path:
        return self.root / "config.yaml"


def default_dir() -> Path:
    return hub.cache_dir() / MODEL_NAME


def expected_layout(root: str | Path) -> str:
    """The directory this loader reads, file by file (for messages about a missing or partial one)."""
    lines = [f"{root}/ in the layout published at https://huggingface.co/{HF_REPO}:"]
    for rel in PUBLISHED_FILES:
        lines.append(f"  {rel}{'  (only to clone voices from recordings)' if rel.startswith('wav2vec2') else ''}")
    return "\n".join(lines)


def resolve(name_or_path: str | Path) -> SparkCheckpoint:
    """A directory path, or the model name (then the cache directory `voiced models pull` fills)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        root = p
    elif str(name_or_path) in ALIASES:
        root = default_dir()
        if not (root / "LLM" / "config.json").exists():
            raise hub.ModelNotFoundError(
                f"Spark-TTS is not downloaded (looked in {root}). Run `voiced models pull {MODEL_NAME}`, "
                f"or pass the path of a {HF_REPO} directory with --model. Expected: {expected_layout(root)}"
            )
    else:
        raise hub.ModelNotFoundError(
            f"{name_or_path!r} is neither a directory nor a known TTS model; use {MODEL_NAME!r} or a path to "
            f"a {HF_REPO} directory."
        )
    missing = [f for f in REQUIRED_FILES if not (root / f).exists()]
    if missing:
        raise CheckpointError(f"{root} is not a complete Spark-TTS directory: missing {', '.join(missing)}. "
                              f"Expected: {expected_layout(root)}")
    return SparkCheckpoint(root)


def pull(dest: str | Path | None = None) -> Path:
    """Download the published directory into the cache (skips files already there)."""
    dest = Path(dest) if dest else default_dir()
    for rel in PUBLISHED_FILES:
        hub.download(HF_URL.format(path=rel), dest / rel, desc=f"{MODEL_NAME}/{rel}")
    return dest


# ------------------------------------------------------------------------------------ tokens


@dataclass
class SpecialTokens:
    """Ids of the control tokens the prompts and the decoding grammar use."""

    eos: int
    end_semantic: int
    task_tts: int
    task_controllable_tts: int
    start_content: int
    end_content: int
    start_global: int
    end_global: int
    start_semantic: int
    start_style: int
    end_style: int
    start_acoustic: int
    end_acoustic: int
    gender: dict[str, int]
    pitch_label: dict[str, int]
    speed_label: dict[str, int]
    # acoustic value/label tokens a controllable prompt's continuation may carry before its globals
    acoustic: list[int] = field(default_factory=list)
    global_base: int = GLOBAL_BASE
    semantic_base: int = SEMANTIC_BASE
    n_global: int = N_GLOBAL
    n_semantic: int = N_SEMANTIC

    def is_global(self, t: int) -> bool:
        return self.global_base <= t < self.global_base + self.n_global

    def is_semantic(self, t: int) -> bool:
        return self.semantic_base <= t < self.semantic_base + self.n_semantic


def load_special_tokens(llm_dir: str | Path, tokenizer=None) -> SpecialTokens:
    llm_dir = Path(llm_dir)
    path = llm_dir / "added_tokens.json"
    try:
        added: dict[str, int] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e

    def need(name: str) -> int:
        if name not in added:
            raise CheckpointError(f"{path}: token {name} is missing; this is not a Spark-TTS tokenizer")
        return int(added[name])

    problems = []
    if need(EOS) != EOS_ID:
        problems.append(f"{EOS} is {added[EOS]}, expected {EOS_ID}")
    for kind, base, n in (("global", GLOBAL_BASE, N_GLOBAL), ("semantic", SEMANTIC_BASE, N_SEMANTIC)):
        for i in (0, 1, n // 2, n - 1):  # spot checks, then the full range below
            name = f"<|bicodec_{kind}_{i}|>"
            if need(name) != base + i:
                problems.append(f"{name} is {added[name]}, expected {base + i}")
        if not problems:
            bad = [i for i in range(n) if added.get(f"<|bicodec_{kind}_{i}|>") != base + i]
            if bad:
                problems.append(f"{len(bad)} {kind} tokens off their published ids (first: {kind}_{bad[0]})")
    if tokenizer is not None:
        for name in (EOS, "<|bicodec_global_0|>", f"<|bicodec_semantic_{N_SEMANTIC - 1}|>", "<|task_tts|>", "<|start_content|>"):
            tid = tokenizer.token_to_id(name)
            if name in added and tid != added[name]:
                problems.append(f"tokenizer.json maps {name} to {tid} but added_tokens.json says {added[name]}")
    if problems:
        raise CheckpointError(
            f"{llm_dir}: special token ids differ from the published Spark-TTS-0.5B ones ("
            + "; ".join(problems[:5])
            + "). The LM's output ids would be misread; use the tokenizer files that ship with the checkpoint."
        )
    acoustic = sorted(
        v for k, v in added.items()
        if re.fullmatch(r"<\|(pitch_value|pitch_var_value|speed_value|loudness_value)_\d+\|>", k)
    )
    return SpecialTokens(
        eos=EOS_ID,
        end_semantic=need("<|end_semantic_token|>"),
        task_tts=need("<|task_tts|>"),
        task_controllable_tts=need("<|task_controllable_tts|>"),
        start_content=need("<|start_content|>"),
        end_content=need("<|end_content|>"),
        start_global=need("<|start_global_token|>"),
        end_global=need("<|end_global_token|>"),
        start_semantic=need("<|start_semantic_token|>"),
        start_style=need("<|start_style_label|>"),
        end_style=need("<|end_style_label|>"),
        start_acoustic=need("<|start_acoustic_token|>"),
        end_acoustic=need("<|end_acoustic_token|>"),
        gender={g: need(f"<|gender_{i}|>") for g, i in GENDERS.items()},
        pitch_label={lv: need(f"<|pitch_label_{i}|>") for lv, i in LEVELS.items()},
        speed_label={lv: need(f"<|speed_label_{i}|>") for lv, i in LEVELS.items()},
        acoustic=acoustic,
    )


_CONTROL = re.compile(r"<\|[^<>|]{1,64}\|>")


class TextTokenizer:
    """The LM's byte-level BPE (`LLM/tokenizer.json`) through the `tokenizers` library."""

    def __init__(self, llm_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(llm_dir) / "tokenizer.json"
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception on malformed files
            raise CheckpointError(f"cannot load {path}: {e}") from e

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        # User text must never smuggle control tokens (<|im_end|>, <|bicodec_...|>) into the prompt.
        return self.tok.encode(_CONTROL.sub(" ", text), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)
