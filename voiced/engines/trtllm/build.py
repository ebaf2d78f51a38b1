"""Build TensorRT-LLM engines for Whisper and the Spark-TTS LM, with a manifest to skip rebuilds.

A build is: pull the checkpoint -> ``convert_checkpoint.py`` (TensorRT-LLM's example script for the
architecture) -> ``trtllm-build`` (twice for Whisper: encoder and decoder). The flags follow the
seeds' recipes (shared/seeds 000/001 for Whisper, 004 for Spark-TTS) and TensorRT-LLM's
examples/models/core/whisper/README.md:

- in-flight batching needs a paged KV cache and ``--remove_input_padding enable`` on the decoder
  (the README's "Run C++ runtime" note); we pass both explicitly rather than rely on defaults. The
  paged cache is ``--kv_cache_type paged``: ``--paged_kv_cache enable`` still parses in 1.0 but
  trtllm-build logs it as deprecated (tensorrt_llm/commands/build.py); ``--kv_cache_type`` exists in
  every release we support;
- Whisper encoder: ``--gemm_plugin disable --bert_attention_plugin <dtype> --max_input_len 3000
  --max_seq_len 3000`` (3000 mel frames = the 30 s window), and ``--max_num_tokens`` = batch x 3000:
  with the input padding removed the encoder's tokens are mel frames, and trtllm-build's default
  (``BuildConfig.max_num_tokens`` = 8192) would fit two utterances per encoder step whatever the
  batch size;
- Whisper decoder: ``--gemm_plugin/--bert_attention_plugin/--gpt_attention_plugin <dtype>
  --max_encoder_input_len 3000 --max_input_len <prompt> --max_seq_len <prompt + new tokens>``, plus
  ``--gather_context_logits`` so the runner can read the no-speech and language probabilities at
  the start-of-transcript position, as openai-whisper does;
- Whisper is float16 only: TensorRT-LLM's Whisper example runs float16 alone (run.py's ``--dtype``
  takes ``float16`` only) although the converter accepts bfloat16/float32;
- Spark-TTS LM (a Qwen2): ``--gemm_plugin bfloat16 --gpt_attention_plugin bfloat16
  --max_batch_size 16 --max_num_tokens 32768`` (seed 004), bf16 because fp16 is reported unusable.
  ``--max_input_len`` (1024 here, trtllm-build's default too) bounds the voice-cloning prompt: the
  executor refuses longer prompts, and a cloned voice's reference clip costs 50 tokens a second;
- ``--weight-only int8|int4`` becomes ``--use_weight_only --weight_only_precision <p>`` at conversion
  (the README's "INT8/INT4 Weight Only Quant" rows).

Everything the engine depends on goes into ``manifest.json`` next to it: the model, the checkpoint's
sha256, the TensorRT-LLM version, the options and the exact command lines. A build whose manifest
matches is skipped; the manifest is written last, so an interrupted build never looks finished.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from voiced import hub
from voiced.engines.trtllm import versions
from voiced.engines.trtllm.manifest import MANIFEST, Manifest
from voiced.engines.trtllm.whisper_runner import N_FRAMES

log = logging.getLogger(__name__)

KINDS = ("whisper", "spark-tts")

# OpenAI checkpoints (the URLs carry the file's sha256, as openai-whisper's _MODELS table does).
# Only names that TensorRT-LLM's convert_checkpoint.py accepts for --model_name are listed.
_OPENAI = "https://openaipublic.azureedge.net/main/whisper/models"
WHISPER_CHECKPOINTS: dict[str, str] = {
    "tiny.en": f"{_OPENAI}/d3dd57d32accea0b295c96e26691aa14d8822fac7d9d27d5dc00b4ca2826dd03/tiny.en.pt",
    "tiny": f"{_OPENAI}/65147644a518d12f04e32d6f3b26facc3f8dd46e5390956a9424a650c0ce22b9/tiny.pt",
    "base.en": f"{_OPENAI}/25a8566e1d0c1e2231d1c762132cd20e0f96a85d16145c3a00adf5d1ac670ead/base.en.pt",
    "base": f"{_OPENAI}/ed3a0b6b1c0edf879ad9b11b1af5a0e6ab5db9205f891f668f8b0e6c6326e34e/base.pt",
    "small.en": f"{_OPENAI}/f953ad0fd29cacd07d5a9eda5624af0f6bcf2258be67c92b79389873d91e0872/small.en.pt",
    "small": f"{_OPENAI}/9ecf779972d90ba49c06d968637d720dd632c55bbf19d441fb42bf17a411e794/small.pt",
    "medium.en": f"{_OPENAI}/d7440d1dc186f76616474e0ff0b3b6b879abc9d1a4926b7adfa41db2d497ab4f/medium.en.pt",
    "medium": f"{_OPENAI}/345ae4da62f9b3d59415adc60127b97c714f32e89e936602e85993674d08dcb1/medium.pt",
    "large-v2": f"{_OPENAI}/81f7c96c852ee8fc832187b0132e569d6c3065a3252ed18e56effd0b6a73e524/large-v2.pt",
    "large-v3": f"{_OPENAI}/e5b1a55b89c1367dacf97e3e19bfd829a01529dbfdeefa8caeb59b3f1b81dadb/large-v3.pt",
    "large-v3-turbo": (
        f"{_OPENAI}/aff26ae408abcba5fbf8813c21e62b0941638c5f6eebfb145be0c9839262a19a/large-v3-turbo.pt"
    ),
}

# Where TensorRT-LLM's example scripts live: the repository moved them in 0.18.
_CONVERT_SCRIPTS = {
    "whisper": ("models/core/whisper/convert_checkpoint.py", "whisper/convert_checkpoint.py"),
    "spark-tts": ("models/core/qwen/convert_checkpoint.py", "qwen/convert_checkpoint.py"),
}
# Places the examples are found: NVIDIA's release container keeps them under /app/tensorrt_llm.
_EXAMPLES_CANDIDATES = ("/app/tensorrt_llm/examples", "/workspace/TensorRT-LLM/examples", "/opt/TensorRT-LLM/examples")


class BuildError(RuntimeError):
    """A build that cannot start or failed; the message says what to do."""


@dataclass(frozen=True)
class BuildOptions:
    """Everything that changes the engine. Two builds with equal options and checkpoint are equal."""

    kind: str  # "whisper" | "spark-tts"
    model: str  # whisper: large-v3, ...; spark-tts: Spark-TTS-0.5B
    dtype: str = "float16"
    weight_only: str | None = None  # None | "int8" | "int4"
    max_batch_size: int = 8
    max_beam_width: int = 1
    # Whisper decoder prompt and output budget: SOT, language, task, notimestamps (+ a prompt).
    max_prompt_tokens: int = 14
    max_new_tokens: int = 100
    # Spark-TTS: the voice-cloning prompt carries the reference's semantic tokens (50/s), so it is long.
    max_input_len: int = 1024
    max_seq_len: int = 2560
    max_num_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BuildError(f"unknown engine kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.weight_only not in (None, "int8", "int4"):
            raise BuildError(f"--weight-only must be int8 or int4, got {self.weight_only!r}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise BuildError(f"--dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        if self.kind == "whisper" and self.dtype != "float16":
            # The converter accepts the others, but TensorRT-LLM's Whisper runtime is float16 only
            # (examples/models/core/whisper/run.py); an engine built otherwise fails on every request.
            raise BuildError(f"--dtype {self.dtype}: Whisper engines are float16 only in TensorRT-LLM; "
                             "leave --dtype out (use --weight-only int8 or int4 for a smaller engine)")
        for name in ("max_batch_size", "max_beam_width", "max_prompt_tokens", "max_new_tokens",
                     "max_input_len", "max_seq_len", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise BuildError(f"{name} must be at least 1")
        if self.kind == "whisper":
            if self.model not in WHISPER_CHECKPOINTS:
                raise BuildError(
                    f"unknown Whisper model {self.model!r}; TensorRT-LLM's converter takes "
                    f"{', '.join(WHISPER_CHECKPOINTS)}"
                )
            # Whisper's text context is 448 positions; the decoder cannot be built longer.
            if self.max_prompt_tokens + self.max_new_tokens > 448:
                raise BuildError("max_prompt_tokens + max_new_tokens must be at most 448 (Whisper's text context)")
        else:
            if self.max_beam_width != 1:
                raise BuildError("the Spark-TTS LM samples; beam search is not supported (max_beam_width 1)")
            if self.max_input_len >= self.max_seq_len:
                raise BuildError("max_input_len must be smaller than max_seq_len")

    @property
    def name(self) -> str:
        """The engine folder's name under engines/, as the daemon's loader looks it up
        (voiced/engines/loader.py ``engine_dir``): ``whisper-<model>`` or the TTS model's name.
        A build with other options replaces the folder's engine (its manifest no longer matches);
        keep variants side by side with ``--name``.
        """
        return f"whisper-{self.model}" if self.kind == "whisper" else self.model


def default_options(kind: str, model: str | None = None, **overrides) -> BuildOptions:
    """The seeds' defaults per kind, with CLI overrides (None values are ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if kind == "whisper":
        base = {"kind": kind, "model": model or "large-v3", "dtype": "float16", "max_batch_size": 8, "max_beam_width": 1}
    elif kind == "spark-tts":
        base = {"kind": kind, "model": model or "Spark-TTS-0.5B", "dtype": "bfloat16", "max_batch_size": 16}
    else:
        raise BuildError(f"unknown engine kind {kind!r}; expected one of {', '.join(KINDS)}")
    base.update(overrides)
    return BuildOptions(**base)


# ------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class BuildStep:
    title: str
    argv: tuple[str, ...]

    def shell(self) -> str:
        return shlex.join(self.argv)


def whisper_steps(opts: BuildOptions, checkpoint: Path, out_dir: Path, convert_script: Path,
                  python: str = sys.executable) -> list[BuildStep]:
    """Command lines for a Whisper build. `checkpoint` is the OpenAI .pt file (its folder is used)."""
    ckpt_dir = out_dir / "tllm_checkpoint"
    dt = opts.dtype
    convert = [python, str(convert_script), "--model_dir", str(checkpoint.parent),
               "--model_name", opts.model, "--dtype", dt, "--output_dir", str(ckpt_dir)]
    if opts.weight_only:
        convert += ["--use_weight_only", "--weight_only_precision", opts.weight_only]
    encoder = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir / "encoder"), "--output_dir", str(out_dir / "encoder"),
               "--moe_plugin", "disable", "--max_batch_size", str(opts.max_batch_size),
               "--gemm_plugin", "disable", "--bert_attention_plugin", dt,
               "--remove_input_padding", "enable",
               "--max_input_len", str(N_FRAMES), "--max_seq_len", str(N_FRAMES),
               # tokens are mel frames here: room for a full batch of 30 s windows per step
               "--max_num_tokens", str(opts.max_batch_size * N_FRAMES)]
    decoder = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir / "decoder"), "--output_dir", str(out_dir / "decoder"),
               "--moe_plugin", "disable", "--max_beam_width", str(opts.max_beam_width),
               "--max_batch_size", str(opts.max_batch_size),
               "--max_seq_len", str(opts.max_prompt_tokens + opts.max_new_tokens),
               "--max_input_len", str(opts.max_prompt_tokens), "--max_encoder_input_len", str(N_FRAMES),
               "--gemm_plugin", dt, "--bert_attention_plugin", dt, "--gpt_attention_plugin", dt,
               "--kv_cache_type", "paged", "--remove_input_padding", "enable",
               "--gather_context_logits"]
    return [
        BuildStep("convert checkpoint", tuple(convert)),
        BuildStep("build encoder engine", tuple(encoder)),
        BuildStep("build decoder engine", tuple(decoder)),
    ]


def spark_steps(opts: BuildOptions, llm_dir: Path, out_dir: Path, convert_script: Path,
                python: str = sys.executable) -> list[BuildStep]:
    """Command lines for the Spark-TTS LM (Qwen2) build. `llm_dir` is Spark-TTS-0.5B/LLM."""
    ckpt_dir = out_dir / "tllm_checkpoint"
    dt = opts.dtype
    convert = [python, str(convert_script), "--model_dir", str(llm_dir), "--dtype", dt, "--output_dir", str(ckpt_dir)]
    if opts.weight_only:
        convert += ["--use_weight_only", "--weight_only_precision", opts.weight_only]
    build = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir), "--output_dir", str(out_dir / "llm"),
             "--max_batch_size", str(opts.max_batch_size), "--max_num_tokens", str(opts.max_num_tokens),
             "--max_input_len", str(opts.max_input_len), "--max_seq_len", str(opts.max_seq_len),
             "--gemm_plugin", dt, "--gpt_attention_plugin", dt,
             "--kv_cache_type", "paged", "--remove_input_padding", "enable"]
    return [BuildStep("convert checkpoint", tuple(convert)), BuildStep("build LM engine", tuple(build))]


def plan_steps(opts: BuildOptions, checkpoint: Path, out_dir: Path, convert_script: Path,
               python: str = sys.executable) -> list[BuildStep]:
    if opts.kind == "whisper":
        return whisper_steps(opts, checkpoint, out_dir, convert_script, python)
    return spark_steps(opts, checkpoint, out_dir, convert_script, python)


# ------------------------------------------------------------------------------------- manifest


def manifest_for(opts: BuildOptions, checkpoint_sha256: str, trtllm_version: str,
                 steps: Sequence[BuildStep] = ()) -> Manifest:
    """The manifest of a build with these options (voiced.engines.trtllm.manifest)."""
    return Manifest(kind=opts.kind, model=opts.model, checkpoint_sha256=checkpoint_sha256,
                    trtllm_version=trtllm_version, options=asdict(opts), commands=[s.shell() for s in steps])


# ------------------------------------------------------------------------------------- where things are


def engines_root(explicit: str | os.PathLike | None = None) -> Path:
    """The home of built engines: `explicit` (the caller's `[engines] dir`), else ./engines."""
    return Path(explicit).expanduser() if explicit else Path.cwd() / "engines"


def find_convert_script(kind: str, examples_dir: str | os.PathLike | None = None) -> Path:
    """TensorRT-LLM's convert_checkpoint.py for `kind` (the pip wheel does not ship the examples)."""
    candidates: list[Path] = []
    for root in [examples_dir, os.environ.get("TRTLLM_EXAMPLES_DIR"), *_EXAMPLES_CANDIDATES]:
        if root:
            candidates += [Path(root) / rel for rel in _CONVERT_SCRIPTS[kind]]
    for c in candidates:
        if c.is_file():
            return c
    looked = "\n  ".join(str(c) for c in candidates)
    raise BuildError(
        f"cannot find TensorRT-LLM's convert_checkpoint.py for {kind}. Looked in:\n  {looked}\n"
        "Pass --examples-dir (the `examples` folder of the TensorRT-LLM release you have installed) "
        "or set TRTLLM_EXAMPLES_DIR. NVIDIA's release container has them under /app/tensorrt_llm/examples."
    )


def fetch_checkpoint(opts: BuildOptions, checkpoint: str | os.PathLike | None = None) -> Path:
    """The checkpoint to convert: a given path, else the model cache (downloading what is missing).

    Whisper: the OpenAI .pt file, laid out as <dir>/<model>.pt because the converter finds it by name.
    Spark-TTS: the LLM/ folder of Spark-TTS-0.5B.
    """
    if opts.kind == "whisper":
        if checkpoint is not None:
            path = Path(checkpoint).expanduser()
            if not path.is_file():
                raise BuildError(f"Whisper checkpoint {path} does not exist")
            if path.name != f"{opts.model}.pt":
                raise BuildError(
                    f"TensorRT-LLM's converter loads <dir>/{opts.model}.pt; rename {path.name} or pass --model "
                    "to match the file"
                )
            return path
        url = WHISPER_CHECKPOINTS[opts.model]
        sha = url.rsplit("/", 2)[-2]
        dest = hub.cache_dir() / "whisper" / f"{opts.model}.pt"
        path = hub.download(url, dest, sha256=sha, desc=f"{opts.model}.pt")
        _fetch_tiktoken(opts.model, dest.parent)
        return path
    # spark-tts: the published directory as the Spark-TTS engine resolves and pulls it (the runtime
    # needs its BiCodec and tokenizer too, not just the LM we convert).
    from voiced.engines.spark import checkpoint as spark_ckpt

    if checkpoint is not None:
        path = Path(checkpoint).expanduser()
        if path.name == "LLM" and (path / "config.json").is_file():
            return path
        try:
            return spark_ckpt.resolve(path).llm_dir
        except (hub.ModelNotFoundError, spark_ckpt.CheckpointError) as e:
            raise BuildError(str(e)) from None
    try:
        return spark_ckpt.resolve(opts.model).llm_dir
    except hub.ModelNotFoundError:
        log.info("Spark-TTS is not in the model cache; downloading it")
        spark_ckpt.pull()
        return spark_ckpt.resolve(opts.model).llm_dir


def _fetch_tiktoken(model: str, dest_dir: Path) -> None:
    """The runner's tokenizer needs the .tiktoken rank file beside the checkpoint (model cache)."""
    try:
        from voiced.engines.whisper.tokenizer import TIKTOKEN_FILES
    except ImportError:
        return
    name = "gpt2.tiktoken" if model.endswith(".en") else "multilingual.tiktoken"
    url, sha = TIKTOKEN_FILES[name]
    hub.download(url, dest_dir / name, sha256=sha, desc=name)


def checkpoint_sha256(kind: str, checkpoint: Path) -> str:
    """The digest that identifies the weights: the .pt file, or the LM's safetensors files."""
    if kind == "whisper":
        return hub.sha256_file(checkpoint)
    weights = sorted(checkpoint.glob("*.safetensors")) or sorted(checkpoint.glob("*.bin"))
    if not weights:
        raise BuildError(f"no weights (*.safetensors) in {checkpoint}")
    if len(weights) == 1:
        return hub.sha256_file(weights[0])
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        h.update(w.name.encode() + b"\0" + hub.sha256_file(w).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------- running


def run_steps(steps: Sequence[BuildStep], log_path: Path, *, echo: Callable[[str], None] | None = None,
              env: dict | None = None) -> None:
    """Run each step, streaming its output to the console and to `log_path`; stop at the first failure.

    trtllm-build prints for minutes; streaming it (instead of capturing) shows it is alive, and a tqdm
    bar over the steps shows where the build is.
    """
    echo = echo or (lambda line: tqdm.write(line, file=sys.stderr))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as logf, tqdm(total=len(steps), desc="engine build", unit="step") as bar:
        for step in steps:
            bar.set_postfix_str(step.title)
            logf.write(f"$ {step.shell()}\n")
            logf.flush()
            try:
                proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, env=env)
            except FileNotFoundError:
                raise BuildError(
                    f"{step.title}: `{step.argv[0]}` not found. Run the build where TensorRT-LLM is installed "
                    f"(the container from our Dockerfile, FROM {versions.CONTAINER_IMAGE})."
                ) from None
            assert proc.stdout is not None
            tail: list[str] = []
            for line in proc.stdout:
                line = line.rstrip("\n")
                logf.write(line + "\n")
                echo(line)
                tail = (tail + [line])[-20:]
            rc = proc.wait()
            if rc != 0:
                raise BuildError(
                    f"{step.title} failed (exit status {rc}). Last lines:\n  " + "\n  ".join(tail)
                    + f"\nFull log: {log_path}\nCommand: {step.shell()}"
                )
            bar.update(1)


@dataclass
class BuildResult:
    engine_dir: Path
    manifest: Manifest
    skipped: bool


def build(opts: BuildOptions, *, root: str | os.PathLike | None = None, name: str | None = None,
          checkpoint: str | os.PathLike | None = None,
          examples_dir: str | os.PathLike | None = None, force: bool = False, keep_checkpoint: bool = False,
          trtllm_version: str | None = None,
          runner: Callable[[Sequence[BuildStep], Path], None] = run_steps) -> BuildResult:
    """Build (or reuse) the engine for `opts` under <root>/<name or opts.name>/."""
    version = trtllm_version or versions.installed_version()
    if version is None:
        raise BuildError(versions.missing_message("Building TensorRT-LLM engines"))
    engine_dir = engines_root(root) / (name or opts.name)
    ckpt = fetch_checkpoint(opts, checkpoint)
    log.info("hashing checkpoint %s", ckpt)
    digest = checkpoint_sha256(opts.kind, ckpt)
    wanted = manifest_for(opts, digest, version)
    have = Manifest.read(engine_dir)
    if have is not None and not force:
        if have.matches(wanted) and engine_files_present(opts.kind, engine_dir):
            log.info("engine %s is up to date (manifest matches); skipping the build", engine_dir)
            return BuildResult(engine_dir, have, skipped=True)
        log.info("rebuilding %s: %s", engine_dir, "; ".join(wanted.differences(have)) or "engine files missing")
    script = find_convert_script(opts.kind, examples_dir)
    steps = plan_steps(opts, ckpt, engine_dir, script)
    wanted.commands = [s.shell() for s in steps]
    # A stale manifest must not survive a half-finished rebuild.
    (engine_dir / MANIFEST).unlink(missing_ok=True)
    engine_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runner(steps, engine_dir / "build.log")
    if not keep_checkpoint:
        shutil.rmtree(engine_dir / "tllm_checkpoint", ignore_errors=True)
    if not engine_files_present(opts.kind, engine_dir):
        raise BuildError(f"the build finished but {engine_dir} lacks engine files; see {engine_dir / 'build.log'}")
    wanted.built_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    wanted.build_seconds = round(time.monotonic() - t0, 1)
    wanted.write(engine_dir)
    return BuildResult(engine_dir, wanted, skipped=False)


def engine_files_present(kind: str, engine_dir: Path) -> bool:
    """Does `engine_dir` hold a complete engine (config.json and at least one *.engine per part)?"""
    engine_dir = Path(engine_dir)
    parts = ("encoder", "decoder") if kind == "whisper" else ("llm",)
    for part in parts:
        d = engine_dir / part
        if not (d / "config.json").is_file() or not any(d.glob("*.engine")):
            return False
    return True


def list_engines(root: str | os.PathLike | None = None) -> list[tuple[Path, Manifest | None, bool]]:
    """(folder, manifest, complete?) for every engine folder under the engines root."""
    base = engines_root(root)
    out = []
    if not base.is_dir():
        return out
    for d in sorted(p for p in base.iterdir() if p.is_dir() and p.name != "recipes"):
        m = Manifest.read(d)
        complete = m is not None and engine_files_present(m.kind, d)
        out.append((d, m, complete))
    return out
