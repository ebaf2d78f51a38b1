"""SparkTTSEngine: the daemon's voice, a stepped continuous-batching TTS engine (see engines/base.py).

One `step()` does ONE bounded piece of work, so that the other engines on the stepping thread
(recognition) get the GPU between pieces instead of waiting behind all of them:
  - prefill: admit queued requests into free batch rows (highest priority first) and prefill the
     prompts of rows starting a segment, packed into one pass of at most PREFILL_STEP_TOKENS (padded
     to a multiple of PREFILL_BUCKET); requests moving on to their next sentence are re-prefilled in the
     row they already hold; each prefilled row samples its first token;
  - decode: `decode_steps` batched decode steps of the LM for every decoding row, each step's sampling
     (per-row temperature / top-k / top-p / seed, constrained to the tokens the current phase allows:
     global tokens while a controllable voice is still inventing its speaker, semantic tokens or the
     end afterwards) inside the same CUDA graph, then one read-back of all new tokens; the host walks
     each row's tokens and stops a row at its end (tokens sampled past it are dropped);
  - vocode: decode ready windows into AudioChunks, batched across requests, at most
     VOCODER_STEP_WINDOWS windows and VOCODER_STEP_TOKENS padded tokens: first chunks first, then the
     requests closest to running dry (least audio buffered ahead of real time). Once every active
     request has its first audio out, the ready chunks of a request go as one window (up to
     VOCODER_MERGE_TOKENS), paying the vocoder's context once instead of per chunk, and (several
     requests in flight) the chunks of a request well ahead of real time wait to grow such a window.
The kinds take turns (prefill -> decode -> vocode -> prefill ...), skipping a kind with nothing to do;
a request that has not begun is prefilled at the next step, out of turn (at most every other step).

Long text is cut into sentences spoken back to back in the same row; a controllable voice keeps the
speaker (its 32 global tokens) it chose in the first sentence. Rows stay compact (active requests in
rows 0..n-1): when one leaves, the last row's KV cache moves into the hole, so a decode step always
runs on a prefix of the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.profiler import record_function

from voiced.engines.base import (
    SAMPLE_RATE,
    AudioChunk,
    EngineError,
    EngineOutput,
    TTSOptions,
    TTSRequest,
    fault_output,
)
from voiced.hub import cache_dir
from voiced.memory_plan import EngineNeed, MemoryPlanError, Need, stream_workspace_bytes

from .bicodec import HOP, BiCodec, load_bicodec, reference_clip, volume_normalize
from .checkpoint import SparkCheckpoint, SpecialTokens, TextTokenizer, load_special_tokens, resolve
from .qwen2 import Qwen2LM, load_qwen2, padded_to, prefill_io_bytes
from .sampling import PhaseSampler, candidate_bucket
from .streaming import (
    BATCH_BUCKETS,
    ChunkPlanner,
    DecodeJob,
    Window,
    batch_bucket,
    decode_jobs,
    decoded_tokens,
    longest_fitting,
    padded_length,
    window_lengths,
)
from .voices import LANGUAGES, Voice, VoiceStore

log = logging.getLogger(__name__)

TOKENS_PER_SECOND = SAMPLE_RATE // HOP  # 50
N_GLOBAL = 32
MAX_SEGMENT_CHARS = 300  # longer sentences are cut at commas / spaces: the LM was trained on short utterances
# A sentence whose speech runs far past any plausible length is a runaway (a sampled loop that never
# reaches <|im_end|>); end it and move on rather than spend the request's whole budget on it.
SEGMENT_BASE_S, SEGMENT_S_PER_CHAR = 3.0, 0.3
GLOBAL_PHASE_LIMIT = N_GLOBAL + 64  # a controllable prompt that has not produced its speaker by then failed
PHASE_GLOBAL, PHASE_SEMANTIC = 0, 1
# Decode steps per host round trip. Each round trip costs a graph launch, two small copies and one
# sync (about 1-3 ms on a host that intercepts driver calls); 8 steps amortise that to a fraction of a
# step while adding at most 7 steps (a few ms) to when a request's first chunk can leave.
DECODE_STEPS = 8
# Packed prefill: the prompts one step prefills go through the LM together, up to this many tokens (a
# longer prompt goes alone); the rest wait for the next prefill turn. The pass is padded to a multiple
# of PREFILL_BUCKET tokens, so a GPU meets only the lengths `warmup` ran.
PREFILL_STEP_TOKENS = 1024
PREFILL_BUCKET = 64
PREFILL_PACK_TOKENS = PREFILL_STEP_TOKENS  # the old name
# A request whose streamed audio is this far ahead of real time can have its next chunk decoded a
# vocoder turn later: so that requests still waiting for their first chunk are decoded first, and
# (with other requests still being written) so that its ready chunks grow into one longer window.
VOCODER_SLACK_S = 1.0
SPEAKER_CACHE = 64  # speaker vectors kept (see SparkTTSEngine._speaker)
# One vocoder step's work: at most this many windows, and batch bucket x padded window length at most
# this many tokens (one window always goes, whatever its length).
VOCODER_STEP_WINDOWS = 16
VOCODER_STEP_TOKENS = 1024
# The longest window (padded) that merging consecutive ready chunks of one request makes (0: no merging).
# Each window pays 2R (~136) tokens of context: a lone 25-token chunk decodes ~161 tokens (176 padded),
# 35 chunks merged decode 1011 (1024 padded) for 875 released. Merging never applies while an active
# request still waits for its first audio: the steps on that path stay as short as they were.
# (It was off for a day: shortened replies in the CPU suite were blamed on it, then traced to the test
# checkpoint's random LM sampling its end token; see tests/spark_fixtures.py.)
VOCODER_MERGE_TOKENS = 1024
PHASES = ("prefill", "decode", "vocode")
_CJK = re.compile(r"[\u3000-\u30ff\u3400-\u9fff\uac00-\ud7af\uff00-\uffef]")


def split_text(text: str, max_chars: int = MAX_SEGMENT_CHARS) -> list[str]:
    """Sentences (via the daemon's splitter), each at most `max_chars` (cut at , ; or spaces)."""
    from voiced.text import split_sentences

    out: list[str] = []
    for sent in split_sentences(text) or ([text.strip()] if text.strip() else []):
        while len(sent) > max_chars:
            cut = max(sent.rfind(c, 0, max_chars) for c in (",", "，", ";", "、"))
            if cut < max_chars // 3:
                cut = sent.rfind(" ", 0, max_chars)
            if cut < max_chars // 3:
                cut = max_chars - 1
            out.append(sent[: cut + 1].strip())
            sent = sent[cut + 1 :].strip()
        if sent:
            out.append(sent)
    return out


def join_transcript(transcript: str, text: str) -> str:
    """Reference transcript + text as one content string. A space goes between them unless the text
    starts with a CJK character: "...gospel." + "Actions" would otherwise merge into one BPE token the
    model never saw, while a space before a CJK character breaks that script's tokens instead."""
    if not transcript:
        return text
    if transcript[-1].isspace() or (text and _CJK.match(text[0])):
        return transcript + text
    return transcript + " " + text


def build_prompt(sp: SpecialTokens, encode, voice: Voice, text: str, global_ids: list[int] | None = None) -> list[int]:
    """The LM prompt for one sentence (DESIGN §6). `global_ids`: a speaker already chosen (a
    controllable voice's first sentence produced them); without them a preset voice gets the
    controllable prompt and the LM writes its own 32 global tokens first."""
    v = voice
    if v.kind == "preset" and not global_ids:
        return [sp.task_controllable_tts, sp.start_content, *encode(text), sp.end_content, sp.start_style,
                sp.gender[v.gender], sp.pitch_label[v.pitch], sp.speed_label[v.speed], sp.end_style]
    globals_ = global_ids or v.global_ids or []
    head = [sp.task_tts, sp.start_content]
    g = [sp.start_global, *(sp.global_base + i for i in globals_), sp.end_global]
    if v.kind == "cloned" and v.transcript and v.semantic_ids:
        # prompt continuation: the model carries on speaking from the reference clip
        return [*head, *encode(join_transcript(v.transcript, text)), sp.end_content, *g, sp.start_semantic,
                *(sp.semantic_base + i for i in v.semantic_ids)]
    return [*head, *encode(text), sp.end_content, *g]


def tokenize_reference(codec: BiCodec, features, audio: np.ndarray, device: str) -> tuple[list[int], list[int]]:
    """16 kHz reference recording -> (32 global ids, semantic ids); `features(wav)` gives wav2vec2 features."""
    cfg = codec.config
    wav = volume_normalize(audio) if cfg.volume_normalize else np.asarray(audio, np.float32)
    ref = torch.from_numpy(reference_clip(wav, cfg)).to(device)[None]
    global_ids = codec.global_tokens(ref)[0].tolist()
    semantic_ids = codec.semantic_tokens(features(wav))[0].tolist()
    return global_ids, semantic_ids


@dataclass
class _Request:
    rid: int
    options: TTSOptions
    voice: Voice
    segments: list[str]
    seed: int
    max_semantic: int
    t_submit: float
    seg: int = 0
    slot: int = -1
    pos: int = 0  # next cache position to write
    last: int = 0  # token to feed at the next decode step
    steps: int = 0  # sampled tokens so far (the sampler's counter)
    needs_prefill: bool = True
    phase: int = PHASE_SEMANTIC
    phase_steps: int = 0
    global_ids: list[int] = field(default_factory=list)
    semantic: list[int] = field(default_factory=list)  # this segment's semantic ids
    speaker: torch.Tensor | None = None
    segment_cap: int = 0  # semantic tokens this sentence may take
    planner: ChunkPlanner | None = None
    segment_done: bool = False
    finished: bool = False
    sequence: int = 0
    offset: int = 0
    total_semantic: int = 0
    prompt_tokens: int = 0
    t_first_chunk: float | None = None
    solo: bool = False  # prefilled alone: its group's prefill failed and the culprit is being found


@dataclass
class VocoderWork:
    """What the vocoder did since the engine started (the benchmark reports the ratios)."""

    steps: int = 0
    windows: int = 0
    window_tokens: int = 0  # tokens of the windows decoded (context included)
    decoded_tokens: int = 0  # what the vocoder computed: window_tokens plus padding and repeated batch rows
    audio_tokens: int = 0  # tokens whose audio was released

    def add(self, windows: list[Window]) -> dict:
        """Count one vocoder step's windows; returns that step's counts."""
        step = {"windows": len(windows), "window_tokens": sum(w.end - w.start for w in windows),
                "decoded_tokens": decoded_tokens(windows), "audio_tokens": sum(w.keep_to - w.keep_from for w in windows)}
        self.steps += 1
        for k, v in step.items():
            setattr(self, k, getattr(self, k) + v)
        return step


@dataclass
class SynthesisResult:
    """What the one-shot `synthesize` returns (the CLI prints it with --json)."""

    audio: np.ndarray
    sample_rate: int
    chunks: int
    first_chunk_s: float | None
    total_s: float
    semantic_tokens: int
    prompt_tokens: int
    segments: int

    @property
    def audio_seconds(self) -> float:
        return self.audio.shape[0] / self.sample_rate


def _module_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    seen, total = set(), 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return total


def _doubling(top: int, start: int) -> list[int]:
    out, b = [], start
    while True:
        out.append(min(b, top))
        if b >= top:
            return out
        b *= 2


def vocoder_step_bytes(codec_config, dtype: torch.dtype) -> int:
    """The transient of the largest vocoder step: VOCODER_STEP_TOKENS window tokens, as
    VOCODER_STEP_WINDOWS windows (every batch bucket x padded length a step decodes holds at most that
    many tokens, and the activations grow with tokens), measured on the meta device."""
    from voiced.memory_plan import peak_live_bytes

    from .streaming import decode_windows

    b = VOCODER_STEP_WINDOWS
    length = VOCODER_STEP_TOKENS // b
    with torch.device("meta"):
        codec = BiCodec(codec_config).to(dtype).eval().requires_grad_(False)
        ids = torch.zeros(b, length, dtype=torch.long)
        spk = torch.zeros(b, codec_config.speaker_out_dim, dtype=dtype)
    with torch.no_grad():
        return peak_live_bytes(lambda: decode_windows(codec, ids, spk, [length] * b))


def prefill_bytes(cfg, tokens: int, itemsize: int) -> int:
    """A packed prefill's activations, estimated: its boolean mask and the attention's float one, the
    MLP's activations and the attention's inputs in the LM's dtype."""
    t = tokens
    return t * t * (1 + itemsize) + t * itemsize * (3 * cfg.intermediate_size + 4 * cfg.hidden_size)


def memory_need(cfg, lm_dtype: torch.dtype, lm_bytes: int, codec_bytes: int, max_batch: int, max_seq_len: int, *,
                cuda: bool, graphs: bool = True, decode_steps: int = DECODE_STEPS, workspace_bytes: int = 0,
                vocoder_bytes: int = 0) -> EngineNeed:
    """What `SparkTTSEngine.load(...)` with these settings holds on its device (see voiced.memory_plan).
    vocoder_bytes: the largest vocoder step's transient (`vocoder_step_bytes`)."""
    kv = 2 * cfg.num_hidden_layers * max_batch * cfg.num_key_value_heads * max_seq_len * cfg.head_dim * lm_dtype.itemsize
    e = lm_dtype.itemsize
    prefill_io = prefill_io_bytes(cfg, max_batch, max_seq_len, PREFILL_STEP_TOKENS, e)
    items = [Need("LM weights", lm_bytes), Need("BiCodec weights", codec_bytes),
             Need(f"LM KV cache: {max_seq_len} positions x {max_batch} rows", kv),
             Need("rope tables", 2 * max_seq_len * cfg.head_dim * 4),
             # phase logit masks, step state, first tokens, the prefill's inputs
             Need("step buffers", 2 * cfg.vocab_size * 4 + max_batch * (7 * 8 + 2 * 4 + 8) + prefill_io)]
    if not cuda:
        return EngineNeed("Spark-TTS", "tts_kv_fraction", items)
    if graphs:
        n = len(_doubling(max_batch, 1)) * len(_doubling(max_seq_len, 256))
        items.append(Need(f"decode graphs ({n}): sampled tokens", n * max_batch * decode_steps * 8))
    items.append(Need("cuBLAS workspaces (the default stream, the capture stream)", 2 * workspace_bytes))
    # The longest prefill: a pack of PREFILL_STEP_TOKENS, or one prompt as long as submit accepts.
    longest = max(PREFILL_STEP_TOKENS, min(max_seq_len, padded_to(max_seq_len - N_GLOBAL - 17, PREFILL_BUCKET)))
    if graphs:
        # Every graph of the LM allocates from one pool (Qwen2LM.graph_pool), which keeps the largest
        # graph's activations for good: a packed prefill of PREFILL_STEP_TOKENS (a decode step's are far
        # smaller). Longer prefills (one long prompt) run ungraphed, a transient.
        t = PREFILL_STEP_TOKENS
        items.append(Need(f"CUDA graphs' shared pool, estimated (a prefill of {t} tokens)", prefill_bytes(cfg, t, e)))
        if longest > t:
            items.append(Need(f"step transient, estimated (an ungraphed prefill of {longest} tokens)",
                              prefill_bytes(cfg, longest, e), transient=True))
    else:
        items.append(Need(f"step transient, estimated (prefill of {longest} tokens)", prefill_bytes(cfg, longest, e),
                          transient=True))
    if vocoder_bytes:
        items.append(Need(f"step transient: vocoder, {VOCODER_STEP_TOKENS} window tokens",
                          vocoder_bytes, transient=True))
    return EngineNeed("Spark-TTS", "tts_kv_fraction", items)


class SparkTTSEngine:
    """Spark-TTS-0.5B in PyTorch. Build with `SparkTTSEngine.load(...)`; drive from one thread."""

    backend = "torch"
    languages = LANGUAGES
    memory_need: EngineNeed | None = None  # set by load(): what it holds on its device

    def __init__(self, checkpoint: SparkCheckpoint, lm: Qwen2LM, codec: BiCodec, tokenizer: TextTokenizer,
                 special: SpecialTokens, *, device: str, max_batch: int, max_seq_len: int,
                 voices_dir: str | Path | None = None, use_cuda_graphs: bool = True,
                 model_name: str = "Spark-TTS-0.5B", decode_steps: int = DECODE_STEPS) -> None:
        self.checkpoint = checkpoint
        # Inference only: with parameters that require grad, every forward run outside no_grad (warm-up
        # ran the vocoder so) records an autograd graph that keeps each activation alive until the output
        # dies: a 5.8 GiB transient in the vocoder's warm-up at full size.
        lm.requires_grad_(False)
        codec.requires_grad_(False)
        self.lm, self.codec, self.tokenizer, self.special = lm, codec, tokenizer, special
        self.device = device
        self.model_name = model_name
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.use_cuda_graphs = use_cuda_graphs and str(device).startswith("cuda")
        self.radius = codec.receptive_radius()
        self.segment_base_s, self.segment_s_per_char = SEGMENT_BASE_S, SEGMENT_S_PER_CHAR
        if decode_steps < 1:
            raise EngineError("decode_steps must be at least 1")
        self.decode_steps = decode_steps
        lm.prefill_graph_tokens = PREFILL_STEP_TOKENS  # every pack the engine makes, graphed on a GPU
        lm.setup_cache(max_batch, max_seq_len)
        self._bias = self._phase_bias()
        # Every id any phase allows lies in [lo, hi): the head only computes that slice. The slice of
        # `_bias` is a view, so later edits to `_bias` (forced lengths in the benchmark) still apply.
        allowed = torch.isfinite(self._bias).any(0).nonzero()[:, 0]
        self._vocab_lo, self._vocab_hi = int(allowed.min()), int(allowed.max()) + 1
        self._samplers: dict[int, PhaseSampler] = {}
        self._speakers: dict[tuple[int, ...], torch.Tensor] = {}  # _speaker's cache, oldest first
        self._first_tok = torch.zeros(max_batch, dtype=torch.long, device=device)
        pin = str(device).startswith("cuda")
        self._host_ints = torch.zeros(7, max_batch, dtype=torch.long, pin_memory=pin)
        self._host_floats = torch.zeros(2, max_batch, dtype=torch.float32, pin_memory=pin)
        self._queue: list[_Request] = []
        self._active: list[_Request] = []  # index == cache row
        self._arrival = itertools.count()
        self._order: dict[int, int] = {}
        self._wav2vec2 = None
        self._last_kind = PHASES[-1]
        self._jumped = False  # the last step was a first prefill taken out of turn (see `step`)
        # What the last step did (tests, profiling): its kind and how much work.
        self.last_step: dict = {}
        self.vocoder_work = VocoderWork()
        root = Path(voices_dir) if voices_dir else cache_dir() / "voices"
        self.voices = VoiceStore(root, lambda: checkpoint_fingerprint(checkpoint), self._tokenize_reference)

    # ------------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, name_or_path: str | Path = "spark-tts-0.5b", device: str | None = None,
             dtype: str | torch.dtype | None = None, max_batch: int = 16, voices_dir: str | Path | None = None,
             kv_cache_bytes: int | None = None, max_seq_len: int = 4096, codec_dtype: str | torch.dtype | None = None,
             use_cuda_graphs: bool = True, decode_steps: int = DECODE_STEPS,
             compile_lm: bool | None = None, memory_limit: tuple[int, float] | None = None) -> SparkTTSEngine:
        """Load a Spark-TTS-0.5B directory (or the cached model by name).

        dtype: the LM's (default bf16 on GPU, fp32 on CPU; fp16 is refused: it overflows in this LM).
        kv_cache_bytes: a budget from the daemon's memory plan; it caps max_batch for max_seq_len.
        compile_lm: torch.compile the decode and prefill layers (fused kernels: 1.2 instead of 3.0 ms per step on an
            H200; ~20 s more warm-up). Default: on for CUDA when Triton is installed, unless the
            environment sets VOICED_SPARK_COMPILE=0. Tokens match the uncompiled path up to bf16 rounding.
        memory_limit: (free GPU bytes, the [memory] tts_kv_fraction): the computed need (`memory_need`) is
            checked against that share before anything goes to the GPU; above it, an EngineError naming the setting.
        """
        ckpt = resolve(name_or_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        lm_dtype = _dtype(dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        if lm_dtype == torch.float16:
            raise EngineError("fp16 is unusable for the Spark-TTS LM (activations overflow); use bfloat16 or float32")
        # BiCodec in bf16 on the GPU: its convolutions at 1536 channels are most of a chunk's cost and
        # run on the tensor cores in bf16; fp32 on the CPU, where streamed == offline is checked exactly.
        c_dtype = _dtype(codec_dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        tokenizer = TextTokenizer(ckpt.llm_dir)
        special = load_special_tokens(ckpt.llm_dir, tokenizer)
        need = cls.plan(ckpt, device, lm_dtype, c_dtype, max_batch, max_seq_len, kv_cache_bytes, use_cuda_graphs,
                        decode_steps)
        if memory_limit is not None:  # before anything goes to the GPU
            try:
                need.check(*memory_limit)
            except MemoryPlanError as e:
                raise EngineError(str(e)) from None
        lm = load_qwen2(ckpt.llm_dir, device, lm_dtype)
        if lm.config.vocab_size < special.semantic_base + special.n_semantic:
            raise EngineError(f"{ckpt.llm_dir}: vocab_size {lm.config.vocab_size} has no room for the BiCodec tokens")
        if kv_cache_bytes:
            cfg = lm.config
            per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * max_seq_len * lm_dtype.itemsize
            fit = int(kv_cache_bytes // per_row)
            if fit < 1:
                raise EngineError(f"the TTS KV-cache budget ({kv_cache_bytes / 2**20:.0f} MiB) holds no request of "
                                  f"{max_seq_len} tokens ({per_row / 2**20:.0f} MiB each); raise the TTS memory share")
            if fit < max_batch:
                log.info("TTS KV budget fits %d concurrent requests (asked for %d)", fit, max_batch)
            max_batch = min(max_batch, fit)
        codec = load_bicodec(ckpt.bicodec_dir, ckpt.root_config, device, c_dtype)
        if compile_lm is None:
            compile_lm = device.startswith("cuda") and os.environ.get("VOICED_SPARK_COMPILE", "1") != "0" \
                and _has_triton()
        if compile_lm:
            lm.compile_decode()
        engine = cls(ckpt, lm, codec, tokenizer, special, device=device, max_batch=max_batch, max_seq_len=max_seq_len,
                     voices_dir=voices_dir, use_cuda_graphs=use_cuda_graphs, model_name=ckpt.root.name,
                     decode_steps=decode_steps)
        engine.memory_need = need
        return engine

    @staticmethod
    def plan(ckpt: SparkCheckpoint, device: str, lm_dtype: torch.dtype, codec_dtype: torch.dtype, max_batch: int,
             max_seq_len: int, kv_cache_bytes: int | None = None, use_cuda_graphs: bool = True,
             decode_steps: int = DECODE_STEPS) -> EngineNeed:
        """The engine's memory need from the checkpoint's configs alone (modules built on the meta device)."""
        from .bicodec import BiCodecConfig
        from .qwen2 import Qwen2Config

        cfg = Qwen2Config.from_json(ckpt.llm_dir / "config.json")
        if kv_cache_bytes:
            per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * max_seq_len * lm_dtype.itemsize
            max_batch = min(max_batch, max(1, int(kv_cache_bytes // per_row)))
        codec_cfg = BiCodecConfig.from_yaml(ckpt.bicodec_dir / "config.yaml", ckpt.root_config)
        with torch.device("meta"):
            lm_bytes = _module_bytes(Qwen2LM(cfg), lm_dtype)
            codec_bytes = _module_bytes(BiCodec(codec_cfg), codec_dtype)
        cuda = str(device).startswith("cuda")
        return memory_need(cfg, lm_dtype, lm_bytes, codec_bytes, max_batch, max_seq_len, cuda=cuda,
                           graphs=use_cuda_graphs, decode_steps=decode_steps,
                           workspace_bytes=stream_workspace_bytes(device) if cuda else 0,
                           vocoder_bytes=vocoder_step_bytes(codec_cfg, codec_dtype) if cuda else 0)

    @torch.no_grad()
    def warmup(self, first_chunk_tokens: int | None = None, chunk_tokens: int | None = None) -> None:
        """Run now, on the GPU, every shape serving will meet, so that no request pays a first-time cost
        (torch.compile, CUDA-graph capture, cuDNN / cuBLAS plans):

        - the decode+sample CUDA graphs (and the compiled layer) for every batch / KV-length bucket
          (default sampling candidates; a request with top_k > 64 captures its bucket's graphs on first use);
        - packed prefill at every padded length (multiples of PREFILL_BUCKET up to the longest prompt
          the engine accepts; a CUDA graph of each up to PREFILL_STEP_TOKENS), the first-token sampler
          and the speaker vector;
        - the vocoder at every window length (`streaming.window_lengths` up to the longest window of a
          request with these chunk sizes, default TTSOptions', or a merged window) and every batch
          bucket a vocoder step can use, plus the end-masked variant.
        Nothing to do on the CPU. Skipped while requests are in flight (it uses their cache rows)."""
        if self._active or self._queue or not str(self.device).startswith("cuda"):
            return
        opts = TTSOptions()
        first = first_chunk_tokens or opts.first_chunk_tokens
        chunk = chunk_tokens or opts.chunk_tokens
        t0 = time.perf_counter()
        peaks = []  # GPU memory peak of each phase (the memory plan must leave room for the highest)
        torch.cuda.reset_peak_memory_stats()
        pick = self._sampler([opts.top_k])
        n = self.decode_steps
        b = 1
        while True:
            kv = 256
            while True:
                self.lm.run_steps(pick, b, n, max_pos=max(0, min(kv, self.max_seq_len) - n),
                                  use_graph=self.use_cuda_graphs)
                if kv >= self.max_seq_len:
                    break
                kv = min(kv * 2, self.max_seq_len)
            if b >= self.max_batch:
                break
            b = min(b * 2, self.max_batch)
        torch.cuda.synchronize()

        def peak() -> float:
            gib = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            return round(gib, 4)

        peaks.append(peak())
        t1 = time.perf_counter()
        lengths = self._warm_prefill(pick)
        peaks.append(peak())
        t2 = time.perf_counter()
        shapes = self._warm_vocoder(first, chunk)
        peaks.append(peak())
        t3 = time.perf_counter()
        self.warmup_stats = {"decode_graphs": len(self.lm._step_graphs), "decode_s": round(t1 - t0, 2),
                             "prefill_lengths": lengths, "prefill_graphs": len(self.lm._prefill_graphs),
                             "prefill_s": round(t2 - t1, 2),
                             "vocoder_shapes": shapes, "vocoder_s": round(t3 - t2, 2),
                             "peak_gib": dict(zip(("decode", "prefill", "vocoder"), peaks))}
        log.info("TTS warm-up: %d decode graphs (%d steps each) in %.1f s, %d prefill lengths (%d graphed) in %.1f s, "
                 "%d vocoder shapes in %.1f s; GPU memory peaks %.1f / %.1f / %.1f MiB", len(self.lm._step_graphs),
                 n, t1 - t0, lengths, len(self.lm._prefill_graphs), t2 - t1, shapes, t3 - t2,
                 *(p * 1024 for p in peaks))

    def _warm_prefill(self, pick) -> int:
        """Every packed length a prefill step can run (the longest prompt `submit` accepts is
        max_seq_len - N_GLOBAL - 17 tokens), the first-token sampler and the speaker vector."""
        longest = self.max_seq_len - N_GLOBAL - 17
        count = 0
        for n in range(PREFILL_BUCKET, min(self.max_seq_len, padded_to(longest, PREFILL_BUCKET)) + 1, PREFILL_BUCKET):
            # as `_prefill_fresh` sends prompts; on a GPU this captures the graph of each length graphed
            h = self.lm.prefill_many([[0] * n], [0], pad_to=PREFILL_BUCKET, use_graph=self.use_cuda_graphs)
            count += 1
        self._load_state()
        self._first_tok[:1] = pick(self.lm, h[:1], self.lm.state, slice(0, 1))
        self._first_tok.tolist()
        self._speaker([0] * N_GLOBAL)
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return count

    def _warm_vocoder(self, first: int, chunk: int) -> int:
        """Every (batch bucket, padded window length) a vocoder step can decode: windows are at most
        first + R (the first), chunk + 2R tokens long or VOCODER_MERGE_TOKENS (merged chunks), padded
        as `padded_length` does; batches as `_vocode` fills them (at most VOCODER_STEP_WINDOWS, bucket x
        length within VOCODER_STEP_TOKENS)."""
        from .streaming import decode_windows

        spk = self._speaker([0] * N_GLOBAL)
        longest = max(first + self.radius, chunk + 2 * self.radius, VOCODER_MERGE_TOKENS)
        count = 0
        for length in window_lengths(longest):
            for b in BATCH_BUCKETS:
                if b > VOCODER_STEP_WINDOWS or (b > 1 and b * length > VOCODER_STEP_TOKENS):
                    break
                ids = torch.zeros(b, length, dtype=torch.long, device=self.device)
                decode_windows(self.codec, ids, spk[None].repeat(b, 1), [length] * b).float().cpu()
                count += 1
            decode_windows(self.codec, ids[:1], spk[None], [length - 1]).float().cpu()  # the end-masked path
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        return count

    # ------------------------------------------------------------------------- the contract

    def submit(self, request_id: int, request: TTSRequest) -> None:
        opts = request.options or TTSOptions()
        text = (request.text or "").strip()
        if not text:
            raise EngineError("the text is empty; send something to say")
        if opts.max_seconds <= 0:
            raise EngineError("max_seconds must be positive")
        if opts.first_chunk_tokens < 1 or opts.chunk_tokens < 1:
            raise EngineError("first_chunk_tokens and chunk_tokens must be at least 1")
        if request_id in self._order:
            raise EngineError(f"request id {request_id} is already in use")
        voice = self.voices.resolve(opts.voice)
        segments = split_text(text)
        if not segments:
            raise EngineError("the text has nothing to say after cleanup")
        seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(6), "little")
        req = _Request(request_id, opts, voice, segments, seed,
                       max_semantic=max(1, int(opts.max_seconds * TOKENS_PER_SECOND)), t_submit=time.perf_counter())
        longest = max(len(self._prompt(req, i)) for i in range(len(segments)))
        if longest + N_GLOBAL + 16 >= self.max_seq_len:
            raise EngineError(f"the prompt needs {longest} tokens but the engine holds {self.max_seq_len} per request; "
                              "use a shorter reference recording for this voice or shorter text")
        self._order[request_id] = next(self._arrival)
        self._queue.append(req)

    def cancel(self, request_id: int) -> None:
        self._order.pop(request_id, None)
        for i, r in enumerate(self._queue):
            if r.rid == request_id:
                del self._queue[i]
                return
        for r in self._active:
            if r.rid == request_id:
                self._release(r)
                return

    def has_work(self) -> bool:
        return bool(self._queue or self._active)

    def active_requests(self) -> int:
        return len(self._queue) + len(self._active)

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        self._admit()
        if not self._active:
            self.last_step = {"kind": None}
            return outputs
        now = time.perf_counter()
        # For a request alone, which kind runs depends only on what is pending, never on the clock: it is
        # stepped the same way (and its windows batched the same way) in the daemon and in `synthesize`.
        ready = self._vocode_rows(now)
        work = {"prefill": any(r.needs_prefill for r in self._active),
                "decode": any(self._decoding(r) for r in self._active),
                "vocode": bool(ready)}
        if work["vocode"] and work["decode"] and self._first_chunk_decoding():
            # A caller is waiting for the first sound of a reply: its decode steps go back to back,
            # and the others' chunks wait while their audio stays VOCODER_SLACK_S ahead of playback.
            work["vocode"] = self._vocode_urgent(now)
        start = PHASES.index(self._last_kind) + 1
        kind = next((k for k in PHASES[start:] + PHASES[:start] if work[k]), None)
        jump = kind not in (None, "prefill") and not self._jumped and self._first_prefill_waiting()
        self._jumped = jump
        if jump:
            # A request that has not begun (a caller waiting for its first sound) is prefilled at the
            # next step rather than after the others' decode and vocoder turns: two requests sent
            # together but landing a step apart (one door's transport a millisecond slower) then start
            # a step apart, not a decode round apart. The jump does not move the turn order and never
            # follows a jump, so decode and vocode keep at least every other step however fast
            # requests arrive.
            kind = "prefill"
        self.last_step = {"kind": kind, "out_of_turn": jump}
        if kind is None:
            return outputs
        if not jump:
            self._last_kind = kind
        if kind == "prefill":
            with record_function("spark.prefill"):
                self._prefill_step(outputs)
        elif kind == "decode":
            with record_function("spark.decode"):
                self._decode_step(outputs)
        else:
            with record_function("spark.vocode"):
                outputs += self._vocode(now, ready)
        return outputs

    def _first_prefill_waiting(self) -> bool:
        """Some request in the batch waits for the prefill of its first sentence (no audio of it yet)."""
        return any(r.needs_prefill and r.seg == 0 and r.t_first_chunk is None for r in self._active)

    @staticmethod
    def _decoding(r: _Request) -> bool:
        return not r.needs_prefill and not r.segment_done

    def _prefill_step(self, outputs: list[EngineOutput]) -> None:
        """Prefill the rows starting a segment (one packed pass), then sample each one's first token.

        This is where a request joins the batch, so its faults are held to the requests prefilled: one
        alone fails; a group goes back to be prefilled one by one (see `_prefill_failed`)."""
        fresh = self._prefill_fresh(outputs)
        if not fresh or not self._active:
            return
        try:
            pick = self._sampler([r.options.top_k for r in self._active])
            self._load_state()
            for r, h in fresh:  # first token of each new segment, from its prompt's last hidden state
                self._first_tok[r.slot : r.slot + 1] = pick(self.lm, h[None], self.lm.state, slice(r.slot, r.slot + 1))
            first = self._first_tok.tolist()  # the step's one sync
        except Exception as e:
            self._prefill_failed([r for r, _ in fresh], e, outputs)
            return
        for r, token in [(r, first[r.slot]) for r, _ in fresh]:  # slots move when one fails
            if r.slot < 0:
                continue
            try:
                self._advance(r, token)
            except Exception as e:  # this request's token: its fault alone
                outputs.append(self._fault(r, e))
        self.last_step["prefilled"] = len(fresh)

    def _prefill_failed(self, group: list[_Request], error: Exception, outputs: list[EngineOutput]) -> None:
        """A prefill (a request joining the batch) failed: alone, the request caused it; in a group (out
        of memory, or a fault none of them can be blamed for), each is prefilled alone next."""
        if len(group) == 1:
            outputs.append(self._fault(group[0], error))
            return
        log.warning("prefill of %d requests together failed (%s: %s); prefilling them one by one",
                    len(group), type(error).__name__, str(error))  # not the error: a kept log record would keep its frames
        for r in group:
            r.solo = True
            r.needs_prefill = True

    def _decode_step(self, outputs: list[EngineOutput]) -> None:
        """`decode_steps` decode steps for rows 0..n-1; only the decoding rows take their tokens (a row
        waiting for its prefill or for its last windows runs along as padding: what it writes lies past
        its position, and what it samples is dropped). A failure of the shared pass raises with no row
        advanced (`_load_state` rewrites every row's inputs next time); a row's own tokens failing
        fails that request alone."""
        pick = self._sampler([r.options.top_k for r in self._active])
        self._load_state()
        n = len(self._active)
        rows = [r for r in self._active if self._decoding(r)]
        out = self.lm.run_steps(pick, n, self.decode_steps, max_pos=max(r.pos for r in rows),
                                use_graph=self.use_cuda_graphs)
        with record_function("spark.readback"):
            tokens = out.tolist()  # the step's one sync: every row's new tokens
        for r, row_tokens in [(r, tokens[r.slot]) for r in rows]:  # slots move when one fails
            if r.slot < 0:
                continue
            try:
                for t in row_tokens:
                    if r.segment_done:
                        break  # sampled past its end: dropped
                    r.pos += 1
                    self._advance(r, t)
            except Exception as e:  # this request's tokens: its fault alone
                outputs.append(self._fault(r, e))
        self.last_step["decoded_rows"] = len(rows)

    def _prefill_fresh(self, outputs: list[EngineOutput]) -> list[tuple[_Request, torch.Tensor]]:
        """Prefill rows that start a segment, highest priority first, packed into one pass of at most
        PREFILL_STEP_TOKENS (at least one prompt); returns (request, last hidden state)."""
        waiting = sorted((r for r in self._active if r.needs_prefill),
                         key=lambda r: (-r.options.priority, self._order.get(r.rid, 0)))
        group: list[tuple[_Request, list[int]]] = []
        size = 0
        for r in waiting:
            if group and (group[0][0].solo or r.solo):
                if group[0][0].solo:
                    break
                continue  # it goes in alone, at a later step
            try:
                ids = self._prompt(r, r.seg)
                if group and size + len(ids) > PREFILL_STEP_TOKENS:
                    break
                group.append((r, self._begin_segment(r, ids)))
                size += len(ids)
            except EngineError as e:  # the request cannot be served (its prompt is too long)
                outputs.append(self._fail(r, str(e)))
            except Exception as e:  # one request's fault must not stop the others
                log.exception("prefill failed for request %s", r.rid)
                outputs.append(self._fault(r, e))
        if not group:
            return []
        try:
            # the ids go as they are: the LM packs them into one host block, sent in one copy
            hidden = self.lm.prefill_many([ids for _, ids in group], [r.slot for r, _ in group],
                                          pad_to=PREFILL_BUCKET, use_graph=self.use_cuda_graphs)
        except Exception as e:
            log.error("prefill failed for requests %s", [r.rid for r, _ in group], exc_info=e)
            self._prefill_failed([r for r, _ in group], e, outputs)
            return []
        self.last_step["prefill_tokens"] = size
        return [(r, hidden[j]) for j, (r, _) in enumerate(group)]

    def _sampler(self, top_ks: list[int]) -> PhaseSampler:
        """The in-graph sampler for a batch with these top_k values (one per candidate bucket)."""
        k = candidate_bucket(top_ks, self._vocab_hi - self._vocab_lo)
        pick = self._samplers.get(k)
        if pick is None:
            sp = self.special
            pick = self._samplers[k] = PhaseSampler(
                self._vocab_lo, self._vocab_hi, self._bias[:, self._vocab_lo : self._vocab_hi], k,
                from_phase=PHASE_GLOBAL, to_phase=PHASE_SEMANTIC, g_lo=sp.global_base,
                g_hi=sp.global_base + sp.n_global, n_needed=N_GLOBAL)
        return pick

    def _load_state(self) -> None:
        """Write every active row's decode inputs and sampler state to the device (two copies).
        Rows past the active ones are padding for the graph's batch bucket: greedy, position 0."""
        ints, floats = self._host_ints, self._host_floats
        ints.zero_()
        ints[6].fill_(1)
        floats.fill_(1.0)
        top = self.max_seq_len - 1
        for r in self._active:
            o, i = r.options, r.slot
            ints[0, i], ints[1, i], ints[2, i] = r.last, min(r.pos, top), r.steps
            ints[3, i], ints[4, i], ints[5, i], ints[6, i] = r.phase, len(r.global_ids), r.seed, int(o.top_k)
            floats[0, i], floats[1, i] = float(o.temperature), float(o.top_p)
        self.lm.state.load(ints, floats)

    # ----------------------------------------------------------------------- one-shot helper

    def synthesize(self, text: str, options: TTSOptions | None = None) -> SynthesisResult:
        """Run one request to the end (CLI, tests); other requests already queued run alongside."""
        rid = -(next(self._arrival) + 1)
        t0 = time.perf_counter()
        self.submit(rid, TTSRequest(text, options or TTSOptions()))
        req = self._queue[-1]
        chunks: list[np.ndarray] = []
        first = None
        while True:
            done = False
            for out in self.step():
                if out.request_id != rid:
                    continue
                if out.error:
                    raise EngineError(out.error)
                if first is None:
                    first = time.perf_counter() - t0
                chunks.append(out.value.samples)
                done = out.final
            if done:
                break
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return SynthesisResult(audio, SAMPLE_RATE, len(chunks), first, time.perf_counter() - t0,
                               req.total_semantic, req.prompt_tokens, len(req.segments))

    # ---------------------------------------------------------------------------- internals

    def _phase_bias(self) -> torch.Tensor:
        """Additive logit masks per phase: 0 where allowed, -inf elsewhere."""
        sp, v = self.special, self.lm.config.vocab_size
        bias = torch.full((2, v), float("-inf"))
        g = slice(sp.global_base, sp.global_base + sp.n_global)
        s = slice(sp.semantic_base, sp.semantic_base + sp.n_semantic)
        bias[PHASE_GLOBAL, g] = 0
        # a controllable continuation may spell out acoustic values and the global markers first
        for t in [sp.start_acoustic, sp.end_acoustic, sp.start_global, sp.end_global, *sp.acoustic]:
            bias[PHASE_GLOBAL, t] = 0
        bias[PHASE_SEMANTIC, s] = 0
        for t in (sp.eos, sp.end_semantic, sp.start_semantic, sp.end_global):
            bias[PHASE_SEMANTIC, t] = 0
        return bias.to(self.device)

    def _prompt(self, r: _Request, seg: int) -> list[int]:
        return build_prompt(self.special, self.tokenizer.encode, r.voice, r.segments[seg], r.global_ids)

    def _admit(self) -> None:
        if not self._queue or len(self._active) >= self.max_batch:
            return
        self._queue.sort(key=lambda r: (-r.options.priority, self._order.get(r.rid, 0)))
        while self._queue and len(self._active) < self.max_batch:
            r = self._queue.pop(0)
            r.slot = len(self._active)
            self._active.append(r)
            if r.voice.kind == "cloned":
                r.global_ids = list(r.voice.global_ids or [])
            r.needs_prefill = True

    def _begin_segment(self, r: _Request, ids: list[int] | None = None) -> list[int]:
        """Reset r for its next sentence and return that sentence's prompt ids (prefilled by the caller)."""
        ids = self._prompt(r, r.seg) if ids is None else ids
        if len(ids) >= self.max_seq_len:
            raise EngineError(f"the prompt needs {len(ids)} tokens but the engine holds {self.max_seq_len} per request")
        r.prompt_tokens += len(ids)
        r.phase = PHASE_GLOBAL if (r.voice.kind == "preset" and not r.global_ids) else PHASE_SEMANTIC
        r.phase_steps = 0
        r.semantic = []
        r.segment_done = False
        chars = len(r.segments[r.seg])
        r.segment_cap = max(1, int((self.segment_base_s + self.segment_s_per_char * chars) * TOKENS_PER_SECOND))
        r.planner = ChunkPlanner(self.radius, r.options.first_chunk_tokens, r.options.chunk_tokens)
        if r.global_ids and r.speaker is None:
            r.speaker = self._speaker(r.global_ids)
        r.pos = len(ids)
        r.needs_prefill = False
        return ids

    def _speaker(self, global_ids: list[int]) -> torch.Tensor:
        """The speaker vector of these global ids, kept for the last SPEAKER_CACHE speakers: a
        registered voice's requests reuse it instead of paying a copy and the speaker decoder's small
        kernels in their prefill step (the vector is read-only downstream)."""
        key = tuple(global_ids)
        spk = self._speakers.pop(key, None)
        if spk is None:
            g = torch.tensor([global_ids], dtype=torch.long, device=self.device)
            spk = self.codec.speaker_vector(g)[0]
        self._speakers[key] = spk  # most recent last
        while len(self._speakers) > SPEAKER_CACHE:
            del self._speakers[next(iter(self._speakers))]
        return spk

    def _advance(self, r: _Request, t: int) -> None:
        """Take one sampled token `t` for r (the host side of the in-graph phase rule, plus the ends)."""
        sp = self.special
        r.steps += 1
        r.last = t
        r.phase_steps += 1
        if r.phase == PHASE_GLOBAL:
            if sp.is_global(t):
                r.global_ids.append(t - sp.global_base)
                if len(r.global_ids) == N_GLOBAL:
                    r.phase, r.phase_steps = PHASE_SEMANTIC, 0
                    r.speaker = self._speaker(r.global_ids)
            elif r.phase_steps > GLOBAL_PHASE_LIMIT:
                r.segment_done = r.finished = True
                r.global_ids = []
        elif sp.is_semantic(t):
            r.semantic.append(t - sp.semantic_base)
            r.total_semantic += 1
            if r.total_semantic >= r.max_semantic:
                r.segment_done = r.finished = True  # duration cap: stop the whole request
            elif len(r.semantic) >= r.segment_cap:
                log.warning("request %s: sentence %d ran past %d tokens without ending; moving on",
                            r.rid, r.seg, r.segment_cap)
                r.segment_done = True
        elif t in (sp.eos, sp.end_semantic):
            r.segment_done = True
        if r.pos >= self.max_seq_len and not r.segment_done:
            r.segment_done = True

    def _ahead_s(self, r: _Request, now: float) -> float:
        """Seconds of r's audio already sent beyond real time (since its first chunk); -inf before it."""
        if r.t_first_chunk is None:
            return float("-inf")
        return r.offset / SAMPLE_RATE - (now - r.t_first_chunk)

    def _has_window(self, r: _Request) -> bool:
        return (r.planner is not None and r.speaker is not None and bool(r.semantic)
                and r.planner.next_window(len(r.semantic), r.segment_done) is not None)

    def _first_chunk_decoding(self) -> bool:
        """Some request is still decoding toward its first chunk (no window of it is ready yet)."""
        return any(r.t_first_chunk is None and self._decoding(r) and not self._has_window(r) for r in self._active)

    def _vocode_urgent(self, now: float) -> bool:
        """Vocoder work that cannot wait: a first chunk is ready, a sentence ended (its row must move
        on), or a request's audio is within VOCODER_SLACK_S of running dry at the caller."""
        for r in self._active:
            if r.needs_prefill:
                continue
            if r.segment_done:
                return True
            if self._has_window(r) and (r.t_first_chunk is None or self._ahead_s(r, now) <= VOCODER_SLACK_S):
                return True
        return False

    def _merging(self) -> bool:
        """Ready chunks of a request go as one window: no active request waits for its first audio (a
        merged step is longer; the first-audio path keeps the short steps it had)."""
        return VOCODER_MERGE_TOKENS > 0 and all(r.t_first_chunk is not None for r in self._active)

    def _vocode_rows(self, now: float) -> list[_Request]:
        """The requests a vocoder step would serve now: those with a window ready that need not wait, or
        a sentence ended (its row must move on or be released). Built once per step (~0.1 ms at 64
        requests on the host) and handed to `_vocode` when that step vocodes."""
        rows = [r for r in self._active if not r.needs_prefill and (r.segment_done or self._has_window(r))]
        if len(self._active) > 1 and self._merging() and any(self._decoding(r) for r in self._active):
            # Chunks that can wait for a later vocoder turn do: those of a request whose audio is more
            # than VOCODER_SLACK_S ahead of real time, still being written, and whose ready chunks do
            # not fill a merged window yet. The LM's steps then go back to back and the window, when it
            # comes, releases more audio for its context. Never for a request alone: that stays
            # independent of the clock.
            rows = [r for r in rows if r.segment_done or self._ahead_s(r, now) <= VOCODER_SLACK_S
                    or self._fills_merged_window(r)]
        return rows

    def _fills_merged_window(self, r: _Request) -> bool:
        w = r.planner.next_window(len(r.semantic), r.segment_done, VOCODER_MERGE_TOKENS)
        return w is not None and w.keep_to + r.planner.chunk + self.radius <= len(r.semantic)

    def _vocode(self, now: float, rows: list[_Request]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        # Priority: when a request's first chunk is ready, it must not wait behind (or be padded up to)
        # the bulk chunks of long replies: later chunks of requests well ahead of real time wait a step.
        if any(r.t_first_chunk is None and self._has_window(r) for r in rows):
            rows = [r for r in rows if r.t_first_chunk is None or r.segment_done
                    or self._ahead_s(r, now) <= VOCODER_SLACK_S]
        # First chunks first (higher priority, then arrival), then the requests closest to running dry.
        rows.sort(key=lambda r: (0, -r.options.priority, self._order.get(r.rid, 0)) if r.t_first_chunk is None
                  else (1, self._ahead_s(r, now), 0))
        emitted_before = [(r, r.planner.emitted) for r in rows if r.planner is not None]
        merge = self._merging()
        # Take windows one per request per round, in that order, while the step's budget lasts; a
        # merged window takes as much of the budget as the windows already taken leave it.
        taken: dict[int, list[Window]] = {}
        jobs: list[tuple[_Request, DecodeJob]] = []
        ids: dict[int, torch.Tensor] = {}
        longest, full = 0, False
        while not full:
            progress = False
            for r in rows:
                if r.speaker is None or not r.semantic:
                    continue
                cap = min(VOCODER_MERGE_TOKENS, longest_fitting(VOCODER_STEP_TOKENS, len(jobs) + 1)) if merge else 0
                w = r.planner.next_window(len(r.semantic), r.segment_done, cap)
                if w is None:
                    continue
                length = max(longest, padded_length(w.end - w.start))
                if jobs and (len(jobs) >= VOCODER_STEP_WINDOWS
                             or batch_bucket(len(jobs) + 1) * length > VOCODER_STEP_TOKENS):
                    full = True
                    break
                r.planner.emitted = w.keep_to
                longest = length
                if id(r) not in ids:
                    ids[id(r)] = torch.tensor(r.semantic, dtype=torch.long).to(self.device, non_blocking=True)
                jobs.append((r, DecodeJob(ids[id(r)], r.speaker, w)))
                taken.setdefault(id(r), []).append(w)
                progress = True
            if not progress:
                break
        try:
            audio = decode_jobs(self.codec, [j for _, j in jobs]) if jobs else []
        except BaseException:
            # One vocoder pass for every window: no request can be blamed, so nothing may have
            # advanced (the scheduler drops one and steps again): the windows go back.
            for r, was in emitted_before:
                r.planner.emitted = was
            raise
        if jobs:
            self.last_step.update(self.vocoder_work.add([j.window for _, j in jobs]))
        self.last_step["windows"] = len(jobs)
        self.last_step["window_rows"] = len(taken)
        self.last_step["merged"] = merge
        pending: dict[int, list[np.ndarray]] = {}
        for (r, _), a in zip(jobs, audio):
            pending.setdefault(id(r), []).append(a)
        for r in rows:
            if r.slot < 0:
                continue
            pieces = pending.get(id(r), [])
            # The sentence is over once its last window has gone out.
            done = r.segment_done and (r.planner is None or r.planner.emitted >= len(r.semantic))
            final = done and (r.finished or r.seg + 1 >= len(r.segments))
            if final and r.phase == PHASE_GLOBAL and not r.global_ids:
                outputs.append(self._fail(r, "the model did not produce a speaker for this voice (no global tokens)"))
                continue
            if final and not pieces:
                pieces = [np.zeros(0, np.float32)]
            for i, a in enumerate(pieces):
                last = final and i == len(pieces) - 1
                if r.t_first_chunk is None and a.size:
                    r.t_first_chunk = time.perf_counter()
                chunk = AudioChunk(np.ascontiguousarray(a, dtype=np.float32), r.sequence, r.offset, last, r.total_semantic)
                outputs.append(EngineOutput(r.rid, chunk, final=last))
                r.sequence += 1
                r.offset += a.shape[0]
            if final:
                self._release(r)
            elif done:
                r.seg += 1
                r.needs_prefill = True
        return outputs

    def _fail(self, r: _Request, message: str) -> EngineOutput:
        self._release(r)
        return EngineOutput(r.rid, None, final=True, error=message)

    def _fault(self, r: _Request, error: Exception) -> EngineOutput:
        """A fault pinned on request r: it fails alone, the others go on."""
        log.error("speech synthesis request %s failed", r.rid, exc_info=error)
        self._release(r)
        return fault_output(r.rid, "speech synthesis", error)

    def _release(self, r: _Request) -> None:
        """Free r's row and keep rows compact: the last active row moves into the hole."""
        self._order.pop(r.rid, None)
        if r not in self._active:
            return
        i = self._active.index(r)
        last = self._active.pop()
        if last is not r:
            self.lm.move_slot(last.slot, i, min(last.pos, self.max_seq_len))
            last.slot = i
            self._active[i] = last
        r.slot = -1

    # ------------------------------------------------------------------- voice registration

    def _tokenize_reference(self, audio: np.ndarray) -> tuple[list[int], list[int]]:
        """16 kHz reference recording -> (32 global ids, semantic ids): runs wav2vec2 (loaded on first use)."""
        return tokenize_reference(self.codec, self._features, audio, self.device)

    def _features(self, wav: np.ndarray) -> torch.Tensor:
        if self._wav2vec2 is None:
            self._wav2vec2 = Wav2Vec2Features(self.checkpoint.wav2vec2_dir, self.device)
        return self._wav2vec2(wav)

    def add_voice(self, name: str, audio: np.ndarray, transcript: str):
        return self.voices.add(name, audio, transcript)

    def list_voices(self):
        return self.voices.list()

    def delete_voice(self, name: str) -> bool:
        return self.voices.delete(name)


class Wav2Vec2Features:
    """wav2vec2-large-xlsr-53 features through `transformers`: mean of hidden states 11, 14 and 16."""

    LAYERS = (11, 14, 16)

    def __init__(self, path: str | Path, device: str) -> None:
        try:
            import transformers
            from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Model
        except ModuleNotFoundError as e:  # after start-up: no command line around to explain it
            from voiced.extras import missing_extra

            raise EngineError(str(missing_extra(e, "registering a voice") or e)) from None

        path = Path(path)
        if not (path / "config.json").exists():
            raise EngineError(f"registering a voice needs wav2vec2 ({path} is missing); run `voiced models pull spark-tts-0.5b`")
        self.processor = Wav2Vec2FeatureExtractor.from_pretrained(path)
        # fp32, as upstream runs it: transformers 5 loads in the dtype config.json names ("auto"), 4.x
        # in fp32; 4.56 renamed `torch_dtype` to `dtype`, and 5.x warns on the old name.
        kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
        self.model = Wav2Vec2Model.from_pretrained(path, **{kw: torch.float32}).to(device).eval()
        if self.model.config.num_hidden_layers < max(self.LAYERS):
            raise EngineError(f"{path}: wav2vec2 has {self.model.config.num_hidden_layers} layers; need {max(self.LAYERS)}")
        self.device = device

    @torch.no_grad()
    def __call__(self, wav: np.ndarray) -> torch.Tensor:
        x = self.processor(wav, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_values.to(self.device)
        hs = self.model(x, output_hidden_states=True).hidden_states
        return sum(hs[i] for i in self.LAYERS) / len(self.LAYERS)


def checkpoint_fingerprint(ckpt: SparkCheckpoint) -> str:
    """Identifies the BiCodec + wav2vec2 weights cheaply: config, the safetensors header (names, shapes,
    offsets), the file sizes, and 64 KiB samples spread through the weights. Voices' cached tokens
    live under it, so a different checkpoint re-tokenizes instead of reusing foreign tokens."""
    h = hashlib.sha256()
    for path in (ckpt.bicodec_dir / "config.yaml", ckpt.bicodec_dir / "model.safetensors"):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for k in range(17):
                f.seek(size * k // 17)
                h.update(f.read(65536))
    for path in sorted(ckpt.wav2vec2_dir.glob("*")) if ckpt.wav2vec2_dir.is_dir() else []:
        if path.is_file():
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _has_triton() -> bool:
    # triton comes with torch where torch.compile can use it; only its presence matters here.
    return importlib.util.find_spec("triton") is not None


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def _dtype(d: str | torch.dtype | None) -> torch.dtype | None:
    if d is None or isinstance(d, torch.dtype):
        return d
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if d not in table:
        raise EngineError(f"unknown dtype {d!r}; use bfloat16 or float32")
    return table[d]
