"""Tiny, randomly initialised Whisper checkpoints in the real on-disk formats, for tests.

    path = make_openai_checkpoint(tmp_path, n_mels=80, multilingual=True, seed=0)   # OpenAI .pt
    path = make_hf_checkpoint(tmp_path, n_mels=128, seed=1)                          # HF directory
    audio = speech("hello world", tmp_path)                                         # espeak-ng, 16 kHz

Widths and depths are tiny, but the vocabulary and the 1500-position audio context are the real
ones, so real tokenizers, real log-mel features of 30 s windows and openai-whisper's own decode
run unchanged against them. The `.tiktoken` file the model needs is copied next to the checkpoint
from the installed openai-whisper package (tests only; the product pulls it from GitHub).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from voiced.engines.whisper.checkpoint import hf_config_from_dims, openai_to_hf_name
from voiced.engines.whisper.model import ModelDims, Whisper, sinusoids


def tiny_dims(n_mels: int = 80, multilingual: bool = True, v3: bool | None = None, n_state: int = 64,
              n_head: int = 4, n_audio_layer: int = 2, n_text_layer: int = 2) -> ModelDims:
    """v3 (100 languages, vocab 51866) defaults to on for 128 mels, like large-v3."""
    v3 = (n_mels == 128) if v3 is None else v3
    if not multilingual:
        n_vocab = 51864
    else:
        n_vocab = 51866 if v3 else 51865
    return ModelDims(n_mels=n_mels, n_audio_ctx=1500, n_audio_state=n_state, n_audio_head=n_head,
                     n_audio_layer=n_audio_layer, n_vocab=n_vocab, n_text_ctx=448, n_text_state=n_state,
                     n_text_head=n_head, n_text_layer=n_text_layer)


def random_state_dict(dims: ModelDims, seed: int = 0, eot_boost: float = 0.0) -> dict[str, torch.Tensor]:
    """Weights that make a tiny random model behave like a model, not like noise.

    Plain random weights give near-uniform attention (the audio averages away, every utterance
    decodes the same) and a tied embedding that keeps repeating the last token. So: sharp
    attention (query/key weights 6x fan-in scale), small embeddings (0.1) with a large final
    layer-norm gain (4x), which makes outputs depend on the audio and vary from token to token.
    `eot_boost` adds about that much to the end-of-text logit at every step (through the final
    layer norm's bias), so tests can get sequences that end on their own.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in Whisper(dims).state_dict().items():
        shape = p.shape
        if name == "encoder.positional_embedding":
            out[name] = sinusoids(*shape)
        elif name.endswith("_ln.weight") or name == "encoder.ln_post.weight":
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "decoder.ln.weight":
            out[name] = 4.0 * (1.0 + 0.1 * torch.randn(shape, generator=g))
        elif name.endswith(".bias"):
            out[name] = 0.01 * torch.randn(shape, generator=g)
        elif name == "decoder.token_embedding.weight" or name == "decoder.positional_embedding":
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:  # linear and conv weights: fan-in scaling, sharper for attention scores
            fan_in = int(np.prod(shape[1:]))
            gain = 6.0 if name.endswith(("query.weight", "key.weight")) else 1.0
            out[name] = gain * torch.randn(shape, generator=g) / fan_in**0.5
    if eot_boost:
        eot = 50257 if dims.multilingual else 50256
        e = out["decoder.token_embedding.weight"][eot]
        out["decoder.ln.bias"] = out["decoder.ln.bias"] + eot_boost * e / e.dot(e)
    return out


def _whisper_assets() -> Path:
    import whisper

    return Path(whisper.__file__).parent / "assets"


def place_tokenizer(directory: Path, multilingual: bool) -> Path:
    name = "multilingual.tiktoken" if multilingual else "gpt2.tiktoken"
    dest = Path(directory) / name
    if not dest.exists():
        shutil.copyfile(_whisper_assets() / name, dest)
    return dest


def make_openai_checkpoint(directory: str | Path, *, n_mels: int = 80, multilingual: bool = True, seed: int = 0,
                           v3: bool | None = None, eot_boost: float = 0.0, name: str | None = None,
                           with_tokenizer: bool = True, **dims_kw) -> Path:
    """Write `{"dims", "model_state_dict"}` like OpenAI's files; returns the .pt path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dims = tiny_dims(n_mels, multilingual, v3, **dims_kw)
    state = random_state_dict(dims, seed, eot_boost)
    path = directory / (name or f"tiny-random-{n_mels}-{'ml' if multilingual else 'en'}-s{seed}.pt")
    torch.save({"dims": asdict(dims), "model_state_dict": state}, path)
    if with_tokenizer:
        place_tokenizer(directory, dims.multilingual)
    return path


def make_hf_checkpoint(directory: str | Path, *, n_mels: int = 80, multilingual: bool = True, seed: int = 0,
                       v3: bool | None = None, eot_boost: float = 0.0, name: str | None = None,
                       with_tokenizer: bool = True, **dims_kw) -> Path:
    """The same weights as `make_openai_checkpoint` with the same arguments, as a Hugging Face
    WhisperForConditionalGeneration directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    dims = tiny_dims(n_mels, multilingual, v3, **dims_kw)
    state = random_state_dict(dims, seed, eot_boost)
    path = Path(directory) / (name or f"tiny-random-hf-{n_mels}-{'ml' if multilingual else 'en'}-s{seed}")
    path.mkdir(parents=True, exist_ok=True)
    hf = {openai_to_hf_name(k): v.contiguous() for k, v in state.items()}
    save_file(hf, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config_from_dims(dims), indent=2))
    if with_tokenizer:
        place_tokenizer(path, dims.multilingual)
    return path


def openai_reference_model(checkpoint: str | Path):
    """openai-whisper's own model class loaded from one of our .pt files (fp32, CPU)."""
    import whisper.model as wm

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = wm.Whisper(wm.ModelDimensions(**ckpt["dims"]))
    model.load_state_dict(ckpt["model_state_dict"])
    return model.eval()


# float32's unit roundoff: a float32 result is the exact result on data moved by about this much.
FLOAT32_U = 2.0**-24


def float32_spread(model, inputs: torch.Tensor, quantity, draws: int = 3, seed: int = 0) -> np.ndarray:
    """How far float32 arithmetic lets `quantity(model, inputs)` (floats) move: the largest deviation,
    per element over `draws` draws, when every weight of `model` and every input value are
    multiplied by (1 + FLOAT32_U * N(0, 1)).

    Why that measures it: a float32 matrix product or sum, in any order and with any blocking, equals
    the exact one on inputs moved by about its length x FLOAT32_U in the worst case and by about
    sqrt(length) x FLOAT32_U in practice (rounding errors of random sign). Moving every input by
    FLOAT32_U moves each dot product by the same sqrt(length) x FLOAT32_U, so two float32
    computations of one quantity that sum in different orders (threads, SIMD width, SDPA or not)
    land within a small multiple of this spread of each other. The tiny random checkpoints'
    sharp attention amplifies rounding a lot (a word probability moves ~1 % here), real weights
    little; measuring it on the model at hand gives each a tolerance it actually guarantees.
    """
    import copy

    base = np.asarray(quantity(model, inputs), dtype=np.float64)
    g = torch.Generator().manual_seed(seed)
    worst = np.zeros_like(base)
    for _ in range(draws):
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                p.mul_(1 + FLOAT32_U * torch.randn(p.shape, generator=g))
        x = inputs * (1 + FLOAT32_U * torch.randn(inputs.shape, generator=g))
        worst = np.maximum(worst, np.abs(np.asarray(quantity(moved, x), dtype=np.float64) - base))
    return worst


def assert_float32_close(got, want, model, inputs: torch.Tensor, quantity, floor: float) -> None:
    """`got` equals `want` (floats or arrays of them, computed in float32 by other kernels or in
    another order) as far as float32 arithmetic determines them: their largest difference is at
    most 3 x `float32_spread(model, inputs, quantity)` (each lies within about one spread of the
    exact value; the margin covers a spread estimated from a few draws). `quantity(model, inputs)`
    recomputes `want`. A difference under `floor` passes without measuring the spread (it costs
    forward passes); `floor` must be far below what a wrong computation would give.
    """
    diff = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))))
    if diff <= floor:
        return
    tol = 3 * float(np.max(float32_spread(model, inputs, quantity)))
    assert diff <= tol, f"differ by {diff:.3g}, more than float32 allows here ({tol:.3g}): {got} vs {want}"


def forced_scores(tokens: list[int], language: str, **decoding_options):
    """A `quantity` for `float32_spread`: (model, mel) -> [the mean log-probability of `tokens` and
    <|endoftext|> (openai-whisper's avg_logprob), <|nospeech|>'s probability at <|startoftranscript|>],
    with `tokens` forced after the initial tokens openai-whisper's decode uses for those options.
    (Without its logit filters: they change how far the log-probabilities move by little.)"""
    import whisper
    from whisper.decoding import DecodingTask

    def scores(model, mel):
        task = DecodingTask(model, whisper.DecodingOptions(fp16=False, **{**decoding_options, "language": language}))
        prefix, tok = list(task.initial_tokens), task.tokenizer
        forced = torch.tensor([prefix + list(tokens) + [tok.eot]])
        with torch.no_grad():
            logits = model(mel[None], forced)[0].float()
        lp = logits[len(prefix) - 1:-1].log_softmax(-1).gather(1, forced[0, len(prefix):, None])
        return [lp.mean().item(), logits[task.sot_index].softmax(-1)[tok.no_speech].item()]

    return scores


def assert_same_scores(got, want, model, mel: torch.Tensor, **decoding_options) -> None:
    """Transcripts `got` and `want` (ours or openai-whisper's DecodingResult) of the same tokens have
    the same avg_logprob and no_speech_prob as far as float32 determines them on `model`
    (openai-whisper's class); `decoding_options`: openai-whisper's options for the decode."""
    options = {k: v for k, v in decoding_options.items() if k != "language"}  # the language `want` has
    scores = forced_scores(list(want.tokens), want.language, **options)
    assert_float32_close(got.avg_logprob, want.avg_logprob, model, mel, lambda m, x: scores(m, x)[0], floor=1e-4)
    assert_float32_close(got.no_speech_prob, want.no_speech_prob, model, mel, lambda m, x: scores(m, x)[1],
                         floor=1e-3 * want.no_speech_prob + 1e-6)


def speech(text: str, directory: str | Path, voice: str = "en", speed: int = 175) -> np.ndarray:
    """`text` spoken by espeak-ng, as 16 kHz mono float32 (written through a real WAV file; rendered
    beforehand where espeak-ng is missing, see tests/speech.py)."""
    from tests.speech import espeak_wav
    from voiced.audio.wavfile import load_16k

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    wav = directory / f"espeak-{abs(hash((text, voice, speed)))}.wav"
    return load_16k(espeak_wav(text, wav, voice, speed))
