"""The Whisper ASR engine: continuous batching over static KV-cache slots.

Each request owns `beam_size` rows ("slots") of the preallocated caches from admission until it
finishes or is cancelled. Live rows are kept packed at 0..n-1 (a leaving request's holes are filled
by moving the last rows down), so a decoder step is always "rows 0..n-1", which is what lets one
CUDA graph per batch-size bucket serve any mix of requests. One `step()`:

1. runs one decoder step for every request already sampling (rows 0..n-1);
2. admits queued requests into free rows: log-mel + encoder for the new audio, cross-attention
   keys/values into their slots, language detection where asked, and a prefill of their initial
   tokens, whose last logits are their first sampling step;
3. filters the logits of all rows and picks tokens (greedy arg-max, or beam search per request),
   with one device->host copy; finished requests leave and free their rows.

So requests join and leave between steps, and a cancelled request's rows are free at once.

Beside this module: fast.py (the GPU encoder and decoder step, and their CUDA graphs), chunks.py (chunks of
greedy steps in flight, and decode-ahead), language.py (language detection), token_choice.py (filtering logits
and choosing tokens for a batch), decoding.py (the per-request rules).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voiced.engines.base import (
    SAMPLE_RATE,
    ASROptions,
    ASRRequest,
    CapacityError,
    EngineError,
    EngineOutput,
    StepParts,
    Transcript,
    fault_output,
    finish,
    resumed_in,
)
from voiced.engines.footprint import AUTO_GPU_ROWS, DTYPES, check_memory_limit, parse_dtype, rows_that_fit, tensor_bytes
from voiced.engines.kernels import decode_linear
from voiced.engines.rows import compaction, doubling, rows_in_budget, to_device
from voiced.engines.switches import env_switch
from voiced.memory_plan import EngineNeed, Need, stream_workspace_bytes

from . import dtw_kernel
from .audio import HOP_LENGTH, N_FFT, N_SAMPLES, log_mel_spectrogram
from .checkpoint import CheckpointError, read_checkpoint
from .chunks import Chunk, HistoryCopies
from .cpu import column_major_embedding_, int8_available, quantize_int8_
from .decoding import DecodePlan, RequestDecoder, Suppression
from .fast import (
    ALIGN_GRAPH_ROWS,
    ALIGN_GRAPH_TOKENS,
    PREFILL_GRAPH_TOKENS,
    AlignmentPasses,
    CudaGraphs,
    DecoderSteps,
    FastDecoder,
    FastEncoder,
    Prefills,
    conditional_nodes_supported,
    encoder_pieces,
    gemv_supported,
)
from .language import detect_languages
from .model import KVCache, ModelDims, TextDecoder, Whisper
from .registry import resolve
from .timing import (
    SegmentSpan,
    attention_matrix,
    check_heads,
    default_alignment_heads,
    dtw_many,
    fit_to_pauses,
    last_word_end,
    official_alignment_heads,
    word_timings,
)
from .token_choice import Choice, advance_greedy, apply_choice, choose_tokens, launch_choice
from .tokenizer import WhisperTokenizer

log = logging.getLogger(__name__)


@dataclass
class _Forced:
    """A finished request's text as the word-timing pass forces it through the decoder."""

    row: int  # the cache row holding its audio's cross keys/values
    language: str  # for splitting words ("en" where the plan had none: an English-only model)
    prefix: list[int]  # <|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>
    text: list[int]
    spans: list[SegmentSpan]
    audio: np.ndarray
    tokens: list[int]  # the whole forced sequence: prefix, text, <|endoftext|>

    @classmethod
    def of(cls, tok: WhisperTokenizer, row: int, language: str | None, task: str, text: list[int],
           spans: list[SegmentSpan], audio: np.ndarray) -> _Forced:
        prefix = [*tok.sot_sequence(language, task), tok.no_timestamps]
        return cls(row, language or "en", prefix, text, spans, audio, [*prefix, *text, tok.eot])


# Bytes one forced word-timing pass may hold at once (its logits, the heads' scores and a layer's cross
# keys/values gathered from the cache rows), at most: the requests finishing in one step go through in as
# few passes as fit, where each took a pass, a readback and a time warping of its own (issue 25: at 64
# smart-turn callers these, one after another, were the slowest recognition steps, 140-364 ms). On a GPU
# the budget is also held to the memory plan's room for a step's transients (`step_transient_bytes`).
ALIGN_GROUP_BYTES = 128 << 20


@dataclass
class _Active:
    rid: int
    request: ASRRequest
    dec: RequestDecoder
    rows: list[int]
    seconds: float
    order: int
    solo: bool = False  # admitted alone: its group's admission failed and the culprit is being found


def prefill_graphs_default() -> bool:
    """The admission's prefill from CUDA graphs on a GPU: on unless VOICED_WHISPER_PREFILL_GRAPHS=0 (issue 26:
    measured on an H100 with the other host-side changes, 128 callers' final transcript p50 236 -> 72 ms)."""
    return env_switch("VOICED_WHISPER_PREFILL_GRAPHS", True)


def cross_in_encoder_default() -> bool:
    """The decoder's cross keys/values of every layer made in the encoder's pass (its CUDA graph) and copied
    into the cache with one call per tensor, instead of four torch calls per layer after it (issue 26: 49 %
    of the recognition thread at 128 callers). On unless VOICED_WHISPER_CROSS_IN_ENCODER=0: the GPU suite
    passed with it on (H100, 2026-11-27: tests/test_whisper_gpu.py -k cross and every exactness test), and
    at 128 callers the slowest admissions' cache writes fell from 33-74 ms to 1-19 ms (docs/BENCHMARKS.md).
    It holds one more largest-bucket buffer of every layer's cross keys/values (~469 MiB for large-v3-turbo
    in bf16 at encoder batch 16), which the memory plan counts."""
    return env_switch("VOICED_WHISPER_CROSS_IN_ENCODER", True)


# Whether the GPU encoder's layers are compiled (`compile_encoder_default`), by what the encoder computes in:
# - float16 / bfloat16 (what is served): eager, on contiguous activations. Measured on H200s in session 27, run
#   alternately on one machine (docs/BENCHMARKS.md): one large-v3-turbo utterance 16.04 / 16.57 ms eager against
#   17.91 compiled, throughput 167.3 / 167.4 against 164.4 utt/s; and the warm-up makes no encoder compiles.
#   (Session 26's eager layers lost because they ran on the convolutions' transposed layout: fast.FastEncoder
#   makes it contiguous first.)
# - float32 (the GPU's reference mode, asked for to get openai-whisper's tokens): compiled. Its exactness tests pass
#   with compiled layers and, in sessions 26 and 27 alike, not with eager ones (a random checkpoint's German request
#   parts from openai-whisper's at a near tie, token 28 of 48).
def compile_encoder_default(dtype: torch.dtype) -> bool:
    """The GPU encoder's layers through torch.compile (one specialisation per batch bucket, made at warm-up)
    rather than eagerly on contiguous activations; either way a CUDA graph per bucket replays them.
    VOICED_WHISPER_COMPILE_ENCODER=1 or 0 if set, else compiled in float32, eager in half precision (above)."""
    return env_switch("VOICED_WHISPER_COMPILE_ENCODER", dtype == torch.float32)


# Whether the eager GPU encoder runs each residual add and the layer norm after it as one kernel
# (`encoder_add_norm_default`, fast.encoder_layer_add_norm): on. Session 28 profiled one large-v3-turbo layer on an
# H200: at batch 32, 4.23 ms of kernels of which the two residual adds took 0.17 ms and the two layer norms 0.26.
# Then, alternately on one H200 (docs/BENCHMARKS.md): throughput 171.7 / 170.9 utt/s with it against 167.0 / 166.2
# without, the encoder alone at batch 32 200.0 / 196.9 against 192.4 / 193.7 utt/s; one utterance 15.53 / 16.23 ms
# against 16.08 / 15.82 (within the runs' spread); and `make test-gpu` with it on passed (90, 1 skipped).
ENCODER_ADD_NORM_DEFAULT = True


def encoder_add_norm_default() -> bool:
    """VOICED_WHISPER_ENCODER_ADD_NORM=1 or 0 if set, else ENCODER_ADD_NORM_DEFAULT. Applies to eager encoder
    layers on a GPU that runs the decode kernels (`decode_linear.supported`)."""
    return env_switch("VOICED_WHISPER_ENCODER_ADD_NORM", ENCODER_ADD_NORM_DEFAULT)


# Whether the GPU encoder's attention is pinned to flash attention (`encoder_attention_default`): off. Session 24
# measured one large-v3-turbo utterance ~1.5 ms faster with it on an H200; session 26 did not repeat that (17.83 /
# 18.25 ms with flash against 16.56 with torch's pick, cuDNN's, and one layer 0.171 against 0.158 ms at batch 1).
# And with it on, two GPU tests of "together equals alone" fail on the suite's tiny checkpoints (4 heads of 16) in
# every run (4 of 4: two copies of one clip in one batch decoded differently; word timings of requests finishing
# together differed from each alone). Under large-v3-turbo's width no attention kernel gives a lone utterance the
# features it gets batched in fp16 (docs/BENCHMARKS.md, sessions 24-26).
FLASH_ENCODER_DEFAULT = False


def encoder_attention_default(dtype: torch.dtype, capability: tuple[int, int] | None) -> str | None:
    """The SDPA backend the GPU encoder is pinned to: "flash" where VOICED_WHISPER_FLASH_ENCODER=1 (unset:
    FLASH_ENCODER_DEFAULT) and flash runs (fp16/bf16, compute capability 8.0 or newer), else None (torch's
    choice: cuDNN's attention on Hopper with torch 2.11). `capability`: the device's, None on the CPU."""
    fits = capability is not None and capability >= (8, 0) and dtype in (torch.float16, torch.bfloat16)
    return "flash" if fits and env_switch("VOICED_WHISPER_FLASH_ENCODER", FLASH_ENCODER_DEFAULT) else None


# Whether a chunk of greedy steps replays as one CUDA graph on a GPU (`chunk_graphs_default`): on since the GPU
# suite passed with it (H100, 2026-11-27: tests/test_whisper_gpu.py -k chunk, bit for bit against the per-step
# graphs, and every exactness test) and 128 callers' final transcript fell (docs/BENCHMARKS.md, issue 26).
CHUNK_GRAPHS_DEFAULT = True


def chunk_graphs_default() -> bool:
    """A chunk of `decode_chunk` greedy steps and their history writes replayed as one CUDA graph (captured
    at warm-up per batch bucket) instead of one greedy-step replay and two history writes per step, 24 torch
    calls per chunk at 8 steps, each of which waits to win the GIL back (issue 26: 50-110 ms wall for
    6-18 ms of CPU per recognition step at 128 callers). VOICED_WHISPER_CHUNK_GRAPHS=1 or 0 if set, else
    CHUNK_GRAPHS_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_CHUNK_GRAPHS", CHUNK_GRAPHS_DEFAULT)


# Whether chunk graphs stop on the device (`stopping_chunks_default`): off, written in session 27 after the device
# time ran out, never run on a GPU: the H200 image's torch 2.11 has no CUDAGraph.begin_capture_to_if_node (checked
# in session 28; the switch then warns and runs plain chunks). With it a chunk is STOPPING_CHUNK steps long, every
# step after the first a CUDA graph conditional node that the GPU skips once a row has ended (fast.DecoderSteps),
# and the engine comes back to the host only then, or after QUEUED_CHUNK steps while requests wait to be admitted.
# To measure, on a torch that has it:
#   python3 -m voiced.bench.whisper_bench ..., then the same with VOICED_WHISPER_STOPPING_CHUNKS=1
#   VOICED_WHISPER_STOPPING_CHUNKS=1 make test-gpu
STOPPING_CHUNKS_DEFAULT = False
PLAIN_CHUNK = 8  # a chunk's steps on a GPU otherwise
STOPPING_CHUNK = 32
QUEUED_CHUNK = PLAIN_CHUNK  # a stopping chunk's most while requests wait: back as often as plain chunks come


def stopping_chunks_default() -> bool:
    """VOICED_WHISPER_STOPPING_CHUNKS=1 or 0 if set, else STOPPING_CHUNKS_DEFAULT (off)."""
    return env_switch("VOICED_WHISPER_STOPPING_CHUNKS", STOPPING_CHUNKS_DEFAULT)


def default_decode_chunk(cuda: bool, stopping: bool) -> int:
    """Greedy steps a chunk covers when the engine is not told: one on the CPU (see WhisperEngine), 8 on a GPU,
    STOPPING_CHUNK with chunks that stop on the device."""
    return (STOPPING_CHUNK if stopping else PLAIN_CHUNK) if cuda else 1


# Whether the next chunk is launched before the last one is read back (`decode_ahead_default`): on since session 29
# measured it on an H200 (one large-v3-turbo utterance 15.53 / 15.64 ms against 16.16 / 17.36 without, alternate
# runs on one machine; with an admission's first chunk behind its token choice, 15.45 / 15.40 against 16.95 / 17.14
# on another; throughput unchanged, 174-176 utt/s; docs/BENCHMARKS.md).
DECODE_AHEAD_DEFAULT = True


def decode_ahead_default() -> bool:
    """On a GPU, the next chunk of the same rows launched from the inputs the last one left on the device before
    the host reads that one back (chunks.py), so the GPU does not wait out the host's token bookkeeping at every
    chunk boundary. VOICED_WHISPER_DECODE_AHEAD=1 or 0 if set, else DECODE_AHEAD_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_DECODE_AHEAD", DECODE_AHEAD_DEFAULT)


# Whether a greedy step whose rows have all ended skips its kernels' work (`skip_ended_default`): on since session 30
# measured it on an H200. With decode-ahead, the chunk launched before the read that finds a lone utterance's end
# ran 8 steps for no one (2.14 ms at one row), and the next admission, or the finished request's forced pass for
# its word timings, waited behind it: such a step now takes 0.056 ms against 0.267 (whisper_bench's ended_b1 and
# b1, docs/BENCHMARKS.md), and a live step the same (the check's load overlaps its kernel's wait).
SKIP_ENDED_DEFAULT = True


def skip_ended_default() -> bool:
    """With the GEMV decoder step: a greedy step whose rows all hold end-of-text returns from each of its GEMV,
    attention and norm kernels at their top (`fast.DecoderSteps`'s `skip_ended`). VOICED_WHISPER_SKIP_ENDED=1 or
    0 if set, else SKIP_ENDED_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_SKIP_ENDED", SKIP_ENDED_DEFAULT)


# On since measured live (H200, 2026-11-28, 64 callers with smart turn detection): the recognition thread's
# CPU 2.37 s per 20 s against 5.08 s with the eager pass (1.53 s with silence), its p99 step 9.4 ms against 155.
ALIGN_GRAPHS_DEFAULT = True


def align_graphs_default() -> bool:
    """The word timings' forced pass from CUDA graphs (`fast.AlignmentPasses`, captured at warm-up; the
    memory plan counts them: `align_graph_needs`). VOICED_WHISPER_ALIGN_GRAPHS=1 or 0 if set, else
    ALIGN_GRAPHS_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_ALIGN_GRAPHS", ALIGN_GRAPHS_DEFAULT)


# Whether the decoder step runs through the shared GEMV kernels (`gemv_decoder_default`): on (measured on the
# H200 in session 18: a batch-1 step 0.387 -> 0.342 ms, batch 256 5.62 -> 2.83 ms, one utterance 22.4 -> 19.2 ms;
# in float32 the same tokens as openai-whisper; docs/BENCHMARKS.md).
GEMV_DEFAULT = True


# Whether the decoder step's small eager work is compiled (`compiled_tail_default`): on since session 19 measured
# it on an H200 (batch-1 step 0.339 -> 0.313 ms, one utterance 18.94 -> 18.71 ms; docs/BENCHMARKS.md).
COMPILED_TAIL_DEFAULT = True


def compiled_tail_default() -> bool:
    """On a GPU with the decoder step compiled or through the GEMV kernels: the greedy choice and its bookkeeping
    after each step (`token_choice.greedy_advance`, ~12 small kernels eagerly) and the GEMV step's embeddings
    (`fast.step_embeddings`, 3) each compiled into a few kernels; the tokens are the same (the choice is exact),
    the log-probabilities may differ in their last bits. VOICED_WHISPER_COMPILED_TAIL=1 or 0 if set, else
    COMPILED_TAIL_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_COMPILED_TAIL", COMPILED_TAIL_DEFAULT)


# Whether the GEMV step runs fewer kernels (`fewer_step_kernels_default`): on since session 30 measured it on an H200
# (with SKIP_ENDED_DEFAULT, alternate runs on one machine): a batch-1 greedy step 0.241 / 0.242 ms against 0.267,
# batch 256 2.66 / 2.67 against 2.77, one large-v3-turbo utterance 14.26 / 14.58 ms against 15.43 / 15.48, throughput
# unchanged (176 utt/s); the same tokens (docs/BENCHMARKS.md).
FEWER_STEP_KERNELS_DEFAULT = True


def fewer_step_kernels_default() -> bool:
    """The GEMV decoder step with fewer kernels (`fast.FastDecoder`'s `fewer_kernels`): the self-attention never
    split (no combine after it: 4 kernels a step fewer for large-v3-turbo), the logits stored in float32 by their
    GEMV (no `.float()` kernel), and a greedy step's token choice made in the head's GEMV and one pick kernel
    (`decode_linear.greedy_head`, ~10 kernels fewer); the same tokens, the log-probabilities summed in another
    order. VOICED_WHISPER_FEWER_STEP_KERNELS=1 or 0 if set, else FEWER_STEP_KERNELS_DEFAULT (on)."""
    return env_switch("VOICED_WHISPER_FEWER_STEP_KERNELS", FEWER_STEP_KERNELS_DEFAULT)


def gemv_decoder_default() -> bool:
    """The decoder step through the shared GEMV and attention kernels (`fast.FastDecoder`'s `gemv`) on a GPU
    that runs them: VOICED_WHISPER_GEMV_DECODER=1 or 0 if set, else GEMV_DEFAULT (on; 0 gives the compiled
    layer with cuBLAS's GEMMs)."""
    return env_switch("VOICED_WHISPER_GEMV_DECODER", GEMV_DEFAULT)


def build_model(dims: ModelDims, state: dict[str, torch.Tensor], where: str = "checkpoint") -> Whisper:
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


def memory_need(dims: ModelDims, dtype: torch.dtype, weight_bytes: int, max_batch: int, *, cuda: bool,
                max_encoder_batch: int | None = None, cuda_graphs: bool = True, decode_chunk: int = 8,
                workspace_bytes: int = 0, prefill_graphs: bool = False, cross_in_encoder: bool = False,
                align_graphs: bool = False, alignment_heads: int = 0) -> EngineNeed:
    """What `WhisperEngine(...)` with these settings holds on its device (see voiced.memory_plan).
    alignment_heads: how many the word timings read (counted with align_graphs)."""
    rows = max_batch
    items = [Need("weights", weight_bytes),
             Need(f"KV cache: self {dims.n_text_ctx} + cross {dims.n_audio_ctx} positions x {rows} rows",
                  rows * KVCache.bytes_per_slot(dims, dtype)),
             # token, position, min-length countdown, chunk step limit, log-prob, chunk history; the suppression mask
             Need("step buffers", rows * (4 * 8 + 4 + decode_chunk * 16) + dims.n_vocab)]
    if not cuda:
        return EngineNeed("Whisper", "whisper_kv_fraction", items)
    enc = min(max_encoder_batch or 16, rows)
    elem = dtype.itemsize
    items.append(Need("mel filterbank", dims.n_mels * (N_FFT // 2 + 1) * 4))
    if cross_in_encoder:
        # fast.FastEncoder.cross_out: the encoder pass's cross keys/values for every decoder layer, one buffer
        # of the largest bucket's rows that every bucket writes a prefix of (graphs on or off).
        items.append(Need(f"encoder pass: cross keys/values out, {dims.n_text_layer} layers x batch {enc}",
                          2 * dims.n_text_layer * enc * dims.n_audio_ctx * dims.n_text_state * elem))
    if cuda_graphs:
        dec = doubling(rows)
        # The plain steps' logits are what the decoder graphs hold. The greedy steps' graphs, and the chunk
        # graphs (engine's chunk_graphs: decode_chunk greedy steps + history writes per graph), return
        # nothing: they write the step buffers and the history above. Their intermediates are one step's,
        # freed step by step inside the capture, where the pool gives them back to the next step of the same
        # graph, and to later captures (graphs sharing a pool replay one at a time), so a chunk graph needs
        # no more of the pool than the greedy graph of its bucket: nothing to add.
        items.append(Need(f"decoder graphs: logits of batch {dec}", sum(dec) * dims.n_vocab * 4))
        eb = doubling(enc)
        items.append(Need(f"encoder graphs: audio in, features out, batch {eb}",
                          sum(eb) * (N_SAMPLES * 4 + dims.n_audio_ctx * dims.n_audio_state * elem)))
        if prefill_graphs:
            items += prefill_graph_needs(dims, elem, eb)
        if align_graphs:
            items += align_graph_needs(dims, elem, alignment_heads)
    items.append(Need("cuBLAS workspace (the engine's stream)", workspace_bytes))
    # One admission of `enc` utterances (with the cross keys/values made in the encoder's graph, its
    # projections come out of the graphs' pool, which the encoder's own activations exceed).
    items.append(Need(f"largest step transient, estimated (admitting {enc})", step_transient_bytes(dims, elem, enc),
                      transient=True))
    return EngineNeed("Whisper", "whisper_kv_fraction", items)


def step_transient_bytes(dims: ModelDims, elem: int, enc: int) -> int:
    """The room the memory plan keeps for one step's transients: an admission of `enc` utterances (their
    audio on the device, the features gathered per row, for beams, and one layer's cross key or value
    projection, and the prefill's float32 logits with softmax). The word timings' forced passes are
    grouped to fit in it (`WhisperEngine._align`)."""
    return enc * (N_SAMPLES * 4 + 2 * dims.n_audio_ctx * dims.n_text_state * elem + 3 * 4 * dims.n_vocab)


def prefill_graph_needs(dims: ModelDims, elem: int, buckets: list[int]) -> list[Need]:
    """What the admission's prefill graphs (fast.Prefills) hold, counted from what they allocate:

    - the static input block, [rows, slot + PREFILL_GRAPH_TOKENS tokens] int64;
    - per graph, its static outputs (the last position's float32 logits [b, vocab] and the no-speech
      probabilities [b]): one graph per row bucket for each of the two prompt lengths serving meets
      (the SOT sequence with and without <|notimestamps|>; warm-up admits both at every size);
    - the largest capture's transients: the logits [b, T, vocab] in the model's dtype and as float32,
      a layer's cross keys and values gathered for b rows [b, audio positions, width] (freed layer by
      layer), and the softmax at <|startoftranscript|> [b, vocab] float32 (the activations of T
      positions are negligible). They come out of the engine's graph pool, which keeps what it reserves
      from the eager allocator; but by then that pool holds the blocks freed by the encoder capture of
      the same bucket (captured first: warm-up captures every encoder bucket before any admission, and
      an admission encodes before it prefills), whose activations ([b, audio positions, 4 x width] for
      the MLP alone) are larger, so as a rule the prefill captures reserve nothing new. They are counted
      as a step transient: the plan keeps room for the largest of those, which the admission's eager
      transient already exceeds, so the plan's total grows by the held item alone
      (tests/test_daemon_gpu.py's plan check passed with the graphs on: H100, 2026-11-27).
    """
    rows, t = buckets[-1], PREFILL_GRAPH_TOKENS
    outputs = 2 * sum(buckets) * (dims.n_vocab + 1) * 4
    transient = rows * (t * dims.n_vocab * (elem + 4) + 2 * dims.n_audio_ctx * dims.n_text_state * elem
                        + dims.n_vocab * 4)
    return [Need(f"prefill graphs: inputs, last logits out, batch {buckets} x 2 prompt lengths",
                 rows * (1 + t) * 8 + outputs),
            Need(f"prefill graphs: the largest capture's transients (batch {rows})", transient, transient=True)]


def align_graph_needs(dims: ModelDims, elem: int, heads: int) -> list[Need]:
    """What the word timings' forced-pass graphs (fast.AlignmentPasses) hold, counted from what they
    allocate: the static input block [rows, slot + tokens] int64 and the one pair of outputs every graph
    writes a corner of, at the largest bucket: the activations [rows, tokens, width] in the model's dtype
    and the heads' scores [rows, heads, tokens, audio positions] float32. The largest capture's transients
    (the scores once more, per layer then joined; a layer's cross keys and values gathered for its rows;
    the heads' keys as float32) come out of the engine's graph pool, as the prefill graphs' do, and are
    counted as a step transient."""
    rows, t, a = ALIGN_GRAPH_ROWS[-1], ALIGN_GRAPH_TOKENS[-1], dims.n_audio_ctx
    scores = rows * heads * t * a * 4
    head_width = dims.n_text_state // dims.n_text_head
    return [Need(f"word-timing graphs: inputs, activations and {heads} heads' scores out, "
                 f"{rows} rows x {t} tokens", rows * (1 + t) * 8 + rows * t * dims.n_text_state * elem + scores),
            Need(f"word-timing graphs: the largest capture's transients ({rows} rows)",
                 2 * scores + rows * a * (2 * dims.n_text_state * elem + heads * head_width * 4), transient=True)]


def _alignment_heads(heads: list[tuple[int, int]] | None, dims: ModelDims, where: str) -> list[tuple[int, int]]:
    """The (layer, head) pairs word timings read: `heads` (the checkpoint's or openai-whisper's), else the
    default for these dimensions, checked and sorted by layer (CheckpointError where they do not fit)."""
    try:
        return check_heads(heads or default_alignment_heads(dims), dims, where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _official_heads(name: str, dims: ModelDims) -> list[tuple[int, int]] | None:
    """openai-whisper's alignment heads when a checkpoint's name is an official model's
    (`tiny.en.pt`, a `faster-whisper-tiny.en` or `whisper-tiny.en` directory) and its table fits."""
    for prefix in ("faster-whisper-", "whisper-", ""):
        if name.startswith(prefix):
            heads = official_alignment_heads(name[len(prefix):], dims)
            if heads:
                return heads
    return None


class WhisperEngine:
    """`ASREngine` over our PyTorch Whisper. Create it with `WhisperEngine.load(...)`."""

    backend = "torch"
    memory_need: EngineNeed | None = None  # set by load(): what it holds on its device

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, *, model_name: str = "whisper",
                 max_batch: int = 8, max_encoder_batch: int | None = None, cuda_graphs: bool = True,
                 max_queue: int | None = None, decode_chunk: int | None = None,
                 compile_encoder: bool | None = None, attn_backend: str | None = None,
                 fast_decoder: bool | None = None, compile_decoder: bool | None = None,
                 alignment_heads: list[tuple[int, int]] | None = None, prefill_graphs: bool | None = None,
                 cross_in_encoder: bool | None = None, chunk_graphs: bool | None = None,
                 align_graphs: bool | None = None, stopping_chunks: bool | None = None,
                 decode_ahead: bool | None = None, skip_ended: bool | None = None):
        if tokenizer.n_vocab != model.dims.n_vocab:
            raise CheckpointError(f"tokenizer has {tokenizer.n_vocab} tokens but the model {model.dims.n_vocab}")
        self.model = model.eval().requires_grad_(False)
        self.tok = tokenizer
        self.dims = model.dims
        self.model_name = model_name
        self.device = str(model.device)
        self.dtype = model.dtype
        self.is_cuda = model.device.type == "cuda"
        self.max_batch = max_batch
        # An admission never takes more requests than there are rows: encoder buckets (graphs, each
        # holding its input and output) past max_batch would be memory nothing uses.
        self.max_encoder_batch = min(max_encoder_batch or (16 if self.is_cuda else 4), max_batch)
        self.max_queue = max_queue
        # (decoder layer, head) pairs whose cross-attention gives word timings (timing.py).
        self.alignment_heads = _alignment_heads(alignment_heads, self.dims, model_name)
        self.cache = model.allocate_cache(max_batch)
        self.suppress = Suppression.build(tokenizer, self.dims.n_vocab, model.device)
        self._queue: dict[int, _Active] = {}
        self._active: dict[int, _Active] = {}
        self._owner: list[tuple[_Active, int] | None] = [None] * max_batch  # row -> (request, beam)
        self._n = 0  # live rows, always packed at 0.._n-1
        self._stash: list[EngineOutput] = []
        self._order = itertools.count()
        self._private_ids = itertools.count(-1, -1)
        self._warming = False
        self._admitting: list[_Active] = []  # the group being admitted (its faults are held to it)
        self._layout = 0  # counts changes of which request holds which row (a chunk launched ahead checks it)
        self._ahead: Chunk | None = None  # the chunk launched ahead of the one being read (decode_ahead)
        # Chunks that stop on the device (STOPPING_CHUNKS_DEFAULT): CUDA graphs of chunks, and a torch that
        # captures conditional nodes.
        if chunk_graphs is None:
            chunk_graphs = chunk_graphs_default()  # (read on every device: a misspelt value is refused everywhere)
        if stopping_chunks is None:
            stopping_chunks = stopping_chunks_default()
        stopping_chunks = stopping_chunks and self.is_cuda and cuda_graphs and chunk_graphs
        if stopping_chunks and not conditional_nodes_supported():
            log.warning("whisper: VOICED_WHISPER_STOPPING_CHUNKS=1 needs CUDA graph conditional nodes, which torch %s "
                        "does not capture; chunks come back to the host every %d steps", torch.__version__, PLAIN_CHUNK)
            stopping_chunks = False
        # Greedy steps between host syncs. On CUDA a sync stalls the queue of kernels, so 8 steps run
        # blind (a row that ends mid-chunk computes a few tokens nobody reads); on the CPU a sync is
        # free and every wasted step costs a full step, so each token is looked at as it comes.
        self.decode_chunk = max(1, decode_chunk if decode_chunk is not None
                                else default_decode_chunk(self.is_cuda, stopping_chunks))
        # Each greedy step's token and log-probability, [row, step, (token, log-prob)], read back in one
        # copy per chunk. float64 holds both exactly (token ids < 2**53, float32 log-probabilities).
        self._hist = torch.zeros(max_batch, self.decode_chunk, 2, dtype=torch.float64, device=model.device)
        self._hist_copies = HistoryCopies(self._hist)
        # All of the engine's GPU work runs on one stream of its own, graph captures included (why:
        # fast.CudaGraphs). CUDA graphs: per batch-size bucket, the encoder, one plain decoder step
        # and one fused greedy step, and with chunk_graphs a chunk of decode_chunk greedy steps with
        # their history writes (captured at warm-up only: `warmup`, `_greedy_chunk`).
        self.cuda_graphs = cuda_graphs and self.is_cuda
        # (Its capture's two eager pre-runs take rows from position 0 to 2 x decode_chunk - 1.)
        self.chunk_graphs = self.cuda_graphs and chunk_graphs and 2 * self.decode_chunk <= self.dims.n_text_ctx
        self.stopping_chunks = stopping_chunks and self.chunk_graphs
        # Decode-ahead (decode_ahead_default): by default only on a GPU, where the host's work between chunks
        # leaves it idle; on the CPU the steps run on the host's own time, so it would only add wasted steps.
        # Not with chunks that stop on the device: how many steps one ran is known only once it is read.
        if decode_ahead is None:
            decode_ahead = decode_ahead_default() and self.is_cuda
        self.decode_ahead = decode_ahead and not self.stopping_chunks
        self.buckets = doubling(max_batch) if self.is_cuda else []
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device=model.device) if self.is_cuda else None
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.fast_encoder = self._fast_encoder(compile_encoder, attn_backend,
                                               cross_in_encoder_default() if cross_in_encoder is None else cross_in_encoder)
        if self.cuda_graphs:
            self.fast_encoder.graphs = CudaGraphs(self._stream, pool)
        self.int8 = model.decoder.output_projection is not None  # cpu.quantize_int8_ ran
        self.fast_decoder = self._fast_decoder(fast_decoder, compile_decoder)
        self._decoder: FastDecoder | TextDecoder = self.fast_decoder or model.decoder
        if skip_ended is None:
            skip_ended = skip_ended_default()  # (read on every device, as chunk_graphs)
        self.steps = DecoderSteps(self._decoder, self.cache, self.dims.n_text_ctx, max_batch, model.device,
                                  self.suppress.always, tokenizer.eot,
                                  CudaGraphs(self._stream, pool) if self.cuda_graphs else None, self._hist,
                                  compile_tail=self.fast_decoder is not None and self.fast_decoder.compiled_tail,
                                  stopping=self.stopping_chunks,
                                  skip_ended=skip_ended)
        # On a GPU the admission's prefill of SOT sequences runs padded to its encoder bucket (fast.Prefills),
        # graphed or not, so that the graph and the eager pass run the very same kernels (an unpadded pass
        # rounds differently, enough to flip a bf16 near-tie); the graph is one replay per (prompt length,
        # bucket) instead of ~25 torch calls per layer.
        if prefill_graphs is None:
            prefill_graphs = prefill_graphs_default()
        self.prefills = (Prefills(model.decoder, self.cache, self.encoder_buckets(), tokenizer.no_speech,
                                  CudaGraphs(self._stream, pool) if prefill_graphs and self.cuda_graphs else None)
                         if self.is_cuda else None)
        # The word timings' forced pass from CUDA graphs (fast.AlignmentPasses).
        if align_graphs is None:
            align_graphs = align_graphs_default()
        self.align_passes = (AlignmentPasses(model.decoder, self.cache, self.alignment_heads, tokenizer.eot,
                                             CudaGraphs(self._stream, pool))
                             if align_graphs and self.cuda_graphs else None)
        # The host side of `steps.inputs`, written through numpy (no torch call per value): pinned on
        # CUDA and sent in one copy; on the CPU the steps' block itself.
        self._host_inputs = (torch.zeros(4, max_batch, dtype=torch.long, pin_memory=True) if self.is_cuda
                             else self.steps.inputs)
        self._host_np = self._host_inputs.numpy()
        # The admitted audio's staging block (`_audio`; pinned on CUDA), kept: a fresh pinned [n, 30 s] block
        # per admission cost ~5 ms of host time before the encoder could start (whisper_bench --timeline,
        # H200, session 23).
        self._host_audio: torch.Tensor | None = None  # made at the first admission, grown when too small
        self._audio_sent = torch.cuda.Event() if self.is_cuda else None  # the copy that last read it
        if self._stream is not None:
            # The weights (moved, fused), caches and buffers above were queued on the creating thread's
            # stream; kernels on the engine's own stream must not overtake those fills and copies.
            self._stream.wait_stream(torch.cuda.current_stream(model.device))
        log.info("whisper engine %s on %s (%s%s): %d slots, %.1f MiB of KV cache, cuda graphs %s (prefill %s, "
                 "greedy %s), cross K/V %s, decoder step %s", model_name, self.device,
                 str(self.dtype).replace("torch.", ""), ", int8 GEMMs" if self.int8 else "", max_batch,
                 max_batch * KVCache.bytes_per_slot(self.dims, self.dtype) / 2**20, self.cuda_graphs,
                 "graphed" if self.prefills is not None and self.prefills.graphs is not None else "eager",
                 f"{self.decode_chunk} steps per graph" if self.chunk_graphs else "a graph per step",
                 "in the encoder pass" if self.fast_encoder is not None and self.fast_encoder.cross else "per layer",
                 self.decoder_path)

    def _fast_encoder(self, compile_encoder: bool | None, attn_backend: str | None,
                      cross_in_encoder: bool) -> FastEncoder | None:
        """GPU encoder: fused QKV, optional compiled layers; run per batch-size bucket (padded or split
        into buckets) so the graph path and the eager path see the same shapes. compile_encoder None:
        `compile_encoder_default` (compiled per bucket in warmup() in float32, eager in half precision).
        cross_in_encoder: its pass also projects the features to every decoder layer's cross keys/values, into one
        buffer of the largest bucket's rows (`_copy_cross`)."""
        if not self.is_cuda:
            return None
        compile_encoder = compile_encoder_default(self.dtype) if compile_encoder is None else compile_encoder
        if attn_backend is None:
            attn_backend = encoder_attention_default(self.dtype, torch.cuda.get_device_capability(self.model.device))
        add_norm = encoder_add_norm_default() and decode_linear.supported(self.dtype, self.model.device)
        return FastEncoder(self.model.encoder, self.dims.n_mels, attn_backend, compile_encoder,
                           cross=self.model.decoder if cross_in_encoder else None,
                           cross_rows=self.encoder_buckets()[-1], add_norm=add_norm)

    def _fast_decoder(self, fast_decoder: bool | None, compile_decoder: bool | None) -> FastDecoder | None:
        """GPU decoder step: fused self-attention QKV, one function per layer, and (compile_decoder,
        on by default with it) that function compiled per batch bucket in warmup(): a step at batch 1
        is ~100 kernels of a few microseconds, and their count, not bandwidth, sets its time.
        fast_decoder=False keeps the modules' step (the reference; for comparisons). The CPU runs the
        fused step too (fewer ops per step: p50 latency 1073 against 1163 ms per utterance for tiny.en
        on our 2-core machine) but never compiles it: its steps attend over exactly as many positions
        as needed, a new shape (a recompile) at every step, and a compiled step measured no faster
        there (the step is bound by memory traffic, cpu.py)."""
        if not self.is_cuda:
            column_major_embedding_(self.model.decoder)  # (cpu.py: the logits' memory order)
        fast_decoder = True if fast_decoder is None else fast_decoder
        compile_decoder = fast_decoder and self.is_cuda and compile_decoder is not False
        if not fast_decoder:
            return None
        gemv = gemv_decoder_default() and gemv_supported(self.model.decoder, self.dtype, self.device)
        # (the switches read first: a misspelt value is refused on the CPU too)
        tail, fewer = compiled_tail_default(), fewer_step_kernels_default()
        return FastDecoder(self.model.decoder, compile_decoder and not gemv, gemv=gemv,
                           compile_tail=tail and compile_decoder, fewer_kernels=fewer)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, name_or_path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None, *,
             max_batch: int | None = None, kv_cache_bytes: int | None = None, cuda_graphs: bool = True,
             max_encoder_batch: int | None = None, max_queue: int | None = None,
             decode_chunk: int | None = None, cache_root: Path | None = None,
             compile_encoder: bool | None = None, attn_backend: str | None = None,
             fast_decoder: bool | None = None, compile_decoder: bool | None = None,
             memory_limit: tuple[int, float] | None = None, prefill_graphs: bool | None = None,
             cross_in_encoder: bool | None = None, chunk_graphs: bool | None = None,
             align_graphs: bool | None = None, decode_ahead: bool | None = None,
             skip_ended: bool | None = None) -> WhisperEngine:
        """Load an official name (from the model cache), an OpenAI `.pt`, a Hugging Face or a
        CTranslate2 (faster-whisper) directory.

        device: "cpu", "cuda" or "cuda:N". dtype: default float16 on CUDA, float32 on CPU; "int8"
        (CPU only) runs the many-row products (encoder, cross-attention key/value projections, output
        projection) as dynamically quantized int8 GEMMs (cpu.py): faster, approximate.
        max_batch: decoder rows (a beam-search request takes `beam_size` rows); None or 0: 8 on CPU, and on
        CUDA the most of 64, 32, 16, ... whose need fits memory_limit (footprint.rows_that_fit).
        kv_cache_bytes: a memory budget for the self+cross KV caches; the row count is the smaller of what
        it allows and max_batch. compile_encoder: the GPU encoder's layers compiled; None:
        `compile_encoder_default` (compiled in float32, eager in half precision, unless
        VOICED_WHISPER_COMPILE_ENCODER is 1 or 0). compile_decoder: the GPU
        decoder path, None meaning on for CUDA; fast_decoder: the fused decoder step, None meaning on (see __init__).
        memory_limit: (free GPU bytes, the [memory] whisper_kv_fraction): the computed need
        (`memory_need`) is checked against that share before the weights go to the GPU; a need above it
        is refused (EngineError naming the setting). prefill_graphs: replay the admission's decoder prefill
        (SOT sequences, encoder-batch buckets) from CUDA graphs captured at warm-up; None: on, unless
        VOICED_WHISPER_PREFILL_GRAPHS=0. cross_in_encoder: every decoder layer's cross keys/values made in
        the encoder's pass (its graph) on a GPU; None: on, unless VOICED_WHISPER_CROSS_IN_ENCODER=0.
        chunk_graphs: on a GPU with cuda_graphs, a whole chunk of `decode_chunk` greedy steps (with their
        history writes) replayed as one CUDA graph per batch bucket, captured at warm-up, instead of one
        replay and two writes per step (the served tokens are the same bits); a chunk cut short by a row's
        length limit, or a bucket warm-up did not capture, runs step by step. None: CHUNK_GRAPHS_DEFAULT
        (on), unless VOICED_WHISPER_CHUNK_GRAPHS is 1 or 0. align_graphs: the word timings' forced pass from
        CUDA graphs captured at warm-up (fast.AlignmentPasses); None: ALIGN_GRAPHS_DEFAULT (on), unless
        VOICED_WHISPER_ALIGN_GRAPHS is 1 or 0. attn_backend: the GPU encoder's attention ("flash", "cudnn",
        "efficient", "math"); None: `encoder_attention_default` (torch's choice, unless
        VOICED_WHISPER_FLASH_ENCODER=1 pins flash in half precision). decode_ahead: the next chunk of greedy
        steps launched before the last one is read back (chunks.py); None: `decode_ahead_default` on a GPU (on
        unless VOICED_WHISPER_DECODE_AHEAD=0), off on the CPU. skip_ended: with the GEMV decoder step, a greedy
        step whose rows have all ended does none of its kernels' work; None: `skip_ended_default`.
        """
        if prefill_graphs is None:
            prefill_graphs = prefill_graphs_default()
        prefill_graphs = prefill_graphs and cuda_graphs and device.startswith("cuda")
        if cross_in_encoder is None:
            cross_in_encoder = cross_in_encoder_default()
        cross_in_encoder = cross_in_encoder and device.startswith("cuda")
        path = resolve(name_or_path, cache_root)
        ckpt = read_checkpoint(path)
        dims = ckpt.dims
        model = build_model(dims, ckpt.state, str(path))
        tok = ckpt.tokenizer()
        int8 = dtype == "int8"
        dtype = _weights_dtype(dtype, device)
        cuda = device.startswith("cuda")
        if align_graphs is None:
            align_graphs = align_graphs_default()
        align_graphs = align_graphs and cuda_graphs and cuda
        name = path.stem if path.is_file() else path.name
        heads = _alignment_heads(ckpt.alignment_heads or _official_heads(name, dims), dims, name)
        rows = rows_in_budget(max_batch or (AUTO_GPU_ROWS if cuda else 8), kv_cache_bytes,
                              KVCache.bytes_per_slot(dims, dtype), owner="ASR", row="decoder row")
        weight_bytes, workspace = tensor_bytes(model, dtype), stream_workspace_bytes(device) if cuda else 0

        def need_at(rows: int) -> EngineNeed:
            return memory_need(dims, dtype, weight_bytes, rows, cuda=cuda, max_encoder_batch=max_encoder_batch,
                               cuda_graphs=cuda_graphs,
                               decode_chunk=decode_chunk if decode_chunk is not None
                               else default_decode_chunk(cuda, stopping_chunks_default()),
                               workspace_bytes=workspace, prefill_graphs=prefill_graphs,
                               cross_in_encoder=cross_in_encoder, align_graphs=align_graphs,
                               alignment_heads=len(heads))

        rows, need = rows_that_fit(rows, need_at, memory_limit, "ASR decoder", fit=cuda and not max_batch)
        check_memory_limit(need, memory_limit)  # before anything goes to the GPU
        model = model.to(device=device, dtype=dtype)
        if int8:
            quantize_int8_(model)
        engine = cls(model, tok, model_name=name, max_batch=rows, max_encoder_batch=max_encoder_batch,
                     cuda_graphs=cuda_graphs, max_queue=max_queue, decode_chunk=decode_chunk,
                     compile_encoder=compile_encoder, attn_backend=attn_backend, fast_decoder=fast_decoder,
                     compile_decoder=compile_decoder, alignment_heads=heads, prefill_graphs=prefill_graphs,
                     cross_in_encoder=cross_in_encoder, chunk_graphs=chunk_graphs, align_graphs=align_graphs,
                     decode_ahead=decode_ahead, skip_ended=skip_ended)
        engine.memory_need = need
        engine.checkpoint_format = ckpt.format
        return engine

    @property
    def languages(self) -> tuple[str, ...]:
        """What this checkpoint transcribes: Whisper's languages, or English alone for `.en` models."""
        return self.tok.language_codes if self.tok.multilingual else ("en",)

    @property
    def decoder_path(self) -> str:
        """Which decoder step runs: "reference" (the modules), "fused", "fused, compiled" or "GEMV kernels"."""
        if self.fast_decoder is None:
            return "reference"
        if self.fast_decoder.gemv:
            return "GEMV kernels"
        return "fused, compiled" if self.fast_decoder.compiled else "fused"

    # ------------------------------------------------------------------------------ the contract
    def submit(self, request_id: int, request: ASRRequest) -> None:
        """Queue a request. Raises EngineError for one that can never be served, CapacityError when
        the queue is full."""
        if request_id in self._queue or request_id in self._active:
            raise EngineError(f"request id {request_id} is already in use")
        audio = np.asarray(request.audio, dtype=np.float32)
        if audio.ndim != 1:
            raise EngineError(f"audio must be mono (1-D), got shape {audio.shape}")
        if audio.shape[0] > N_SAMPLES:
            raise EngineError(f"audio is {audio.shape[0] / SAMPLE_RATE:.1f} s; Whisper takes at most 30 s per "
                              "request (split longer speech)")
        plan = DecodePlan.from_options(request.options, self.tok, self.dims.n_text_ctx)
        if plan.beam_size > self.max_batch:
            raise EngineError(f"beam_size {plan.beam_size} exceeds this engine's {self.max_batch} decoder rows")
        if self.max_queue is not None and len(self._queue) >= self.max_queue:
            raise CapacityError(f"the speech recognition queue is full ({self.max_queue} waiting); retry later")
        dec = RequestDecoder(self.tok, plan, self.dims.n_text_ctx, self.dims.n_audio_ctx)
        self._queue[request_id] = _Active(request_id, ASRRequest(audio, request.options), dec, [],
                                          audio.shape[0] / SAMPLE_RATE, next(self._order))

    def cancel(self, request_id: int) -> None:
        """Forget a request now; its rows are free for the next step. Unknown ids are ignored."""
        if self._queue.pop(request_id, None) is not None:
            return
        req = self._active.pop(request_id, None)
        if req is not None:
            self._release([req])

    def has_work(self) -> bool:
        return bool(self._queue or self._active or self._stash)

    def active_requests(self) -> int:
        return len(self._queue) + len(self._active)

    @property
    def free_rows(self) -> int:
        return self.max_batch - self._n

    def transcribe(self, request: ASRRequest) -> Transcript:
        """Decode one request to the end (other requests in flight keep going; their outputs are
        kept for the next `step()`)."""
        rid = next(self._private_ids)
        self.submit(rid, request)
        while True:
            try:
                outputs = self.step()
            except Exception as e:
                self.cancel(rid)
                raise EngineError(f"speech recognition failed: {type(e).__name__}: {e}") from e
            for out in outputs:
                if out.request_id == rid:
                    if out.error:
                        raise EngineError(out.error)
                    return out.value
                self._stash.append(out)

    def step(self) -> list[EngineOutput]:
        """Raises only when the rows' shared forward pass fails (no request can be blamed); then
        nothing has advanced and no output is lost, so the scheduler can drop one and step again.
        Faults that can be pinned on a request (its admission, its tokens) fail that request alone."""
        return finish(self.step_parts())

    def step_parts(self) -> StepParts:
        """`step`, yielding where it waits for the GPU: after launching a decode chunk, and after
        launching an admission's encoder and prefill (engines/base.py)."""
        outputs, self._stash = self._stash, []
        if not self._queue and not self._active:
            return outputs
        try:
            outputs += yield from resumed_in(self._step(), self._in_context)
        except BaseException:
            self._stash = outputs + self._stash
            raise
        return outputs

    # ------------------------------------------------------------------------------- internals
    def on_stream(self) -> contextlib.AbstractContextManager:
        """Run on the engine's CUDA stream (a no-op on CPU)."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _in_context(self) -> contextlib.AbstractContextManager:
        """What the engine's work runs under: inference mode, on the engine's stream."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(self.on_stream())
        return stack

    def _step(self) -> StepParts:
        outputs: list[EngineOutput] = []
        try:
            ahead = self._ahead
            if ahead is not None and ahead.layout != self._layout:
                # Launched ahead before the rows changed (requests finished, left or came in): its tokens go to
                # the requests still here before the rows' inputs are loaded from the host again.
                self._ahead = None
                outputs += self._drop(self._read_chunk(ahead))
                outputs += yield from self._finish()
            failed: list[tuple[_Active, Exception]] = []
            if self._n:
                # One forward pass for every row: a failure here raises (see `step`).
                greedy = self._greedy_rows()
                if greedy is not None:
                    failed = yield from self._greedy_chunk(self._n, greedy)
                else:
                    reqs = [self._owner[r][0] for r in range(self._n) if self._owner[r][1] == 0]
                    logits = self._decode(self._n)
                    yield
                    failed = self._select(logits, reqs, 0)
            outputs += self._drop(failed)
            outputs += yield from self._finish()
            outputs += yield from self._admit_new()
        except BaseException:
            self._stash += outputs  # kept for the next step
            raise
        return outputs

    def _admit_new(self) -> StepParts:
        """Admission, with its faults held to the admitted: a group that fails (out of memory, or a
        fault no one can be blamed for) goes back to the queue to be admitted one by one, and a
        request that fails alone is the one that caused it."""
        self._admitting = []
        try:
            admitted = self._admit()
            if admitted is None:
                return []
            reqs, logits, no_speech = admitted
            base = reqs[0].rows[0]
            choice = launch_choice(logits, reqs, base, self.suppress, self.tok.eot, no_speech)
            # With decode-ahead, the rows' next chunk goes in behind the choice, before the host reads it.
            self._ahead = self._launch_first_chunk(choice, base)
            yield  # the encoder, prefill and token choice are launched (and maybe the next chunk)
            failed = apply_choice(choice, reqs, base, self.cache)
        except BaseException as e:
            self._ahead = None  # launched from first tokens the host has not taken: the next chunk starts anew
            if not isinstance(e, Exception):
                raise
            group = self._admitting
            if not group:
                raise  # nothing was admitted: no one to hold it to
            for req in group:
                self._active.pop(req.rid, None)
            self._release([r for r in group if r.rows])
            if len(group) == 1:
                log.error("whisper: admitting request %s failed", group[0].rid, exc_info=e)
                return [fault_output(group[0].rid, "speech recognition", e)]
            log.warning("whisper: admitting %d requests together failed (%s: %s); admitting them one by one",
                        len(group), type(e).__name__, str(e))  # not e: a kept record would keep its frames' tensors
            for req in group:
                req.solo = True
                self._queue[req.rid] = req
            return []
        return self._drop(failed) + (yield from self._finish())

    def _drop(self, failed: list[tuple[_Active, Exception]]) -> list[EngineOutput]:
        """Fail requests a fault was pinned on, freeing their rows; the others go on."""
        for req, e in failed:
            log.error("whisper: request %s failed", req.rid, exc_info=e)
            self._active.pop(req.rid, None)
        self._release([req for req, _ in failed if req.rows])
        return [fault_output(req.rid, "speech recognition", e) for req, e in failed]

    def _select(self, logits: torch.Tensor, reqs: list[_Active], base: int,
                no_speech: torch.Tensor | None = None) -> list[tuple[_Active, Exception]]:
        """Token choice for `reqs` (row r at logits[r - base]; token_choice.py; an admission's no-speech
        probabilities come back with the tokens); returns the requests whose tokens failed (the others
        have advanced)."""
        return choose_tokens(logits, reqs, base, self.suppress, self.tok.eot, self.cache, no_speech)

    def _greedy_rows(self) -> list[_Active] | None:
        """The requests of rows 0.._n-1 in row order when every one is greedy without timestamps (token choice
        can run on the device, several steps at a time: `_greedy_chunk`), else None."""
        reqs = [self._owner[r][0] for r in range(self._n)]
        plans = [q.dec.plan for q in reqs]
        return reqs if all(p.beam_size == 1 and not p.timestamps for p in plans) else None

    def _row_inputs(self, n: int) -> tuple[list[int], list[int]]:
        toks, pos = [0] * n, [0] * n
        for r in range(n):
            req, j = self._owner[r]
            toks[r] = req.dec.beams[j][-1]
            pos[r] = req.dec.position()
        return toks, pos

    def _load_inputs(self, n: int, rows: list[list[int]]) -> int:
        """Copy per-row inputs (token, position[, min-length countdown]) into the steps' static buffers.

        Returns the batch size to run: n on CPU; on GPU, n padded to a bucket (padded rows get
        position 0 of free slots, which nobody reads).
        """
        k = len(rows)
        self._host_np[:k, :n] = rows
        if not self.is_cuda:  # the host block is the steps' own
            return n
        b = next(x for x in self.buckets if x >= n)
        self._host_np[:k, n:b] = 0
        self._host_np[0, n:b] = self.tok.eot  # padding rows have ended from the start (`DecoderSteps`)
        # Reusing the pinned block is safe: the previous step's copy out of it finished before that
        # step read its results back.
        self.steps.inputs[:k, :b].copy_(self._host_inputs[:k, :b], non_blocking=True)
        return b

    def _decode(self, n: int) -> torch.Tensor:
        """One plain decoder step for rows 0..n-1; logits [n, vocab] (token choice on the host)."""
        toks, pos = self._row_inputs(n)
        b = self._load_inputs(n, [toks, pos])
        if not self.is_cuda:
            # CPU: attend only as far as the longest row; no mask when every row is at one position.
            kv_len = max(pos) + 1
            return self._decoder.step(self.steps.tok[:n], self.steps.pos[:n], self.cache, kv_len,
                                      masked=min(pos) != kv_len - 1)
        # GPU: always attend over the whole context with a mask, so the eager path and the graph run
        # the very same kernels.
        return self.steps.run("plain", b)[:n]

    def _greedy_chunk(self, n: int, reqs: list[_Active]) -> StepParts:
        """Up to `decode_chunk` greedy steps for rows 0..n-1 with one host sync at the end.

        The chunk never runs a row past its length limit (max_new_tokens / the text context), so
        every position stays inside the cache; a row that emits end-of-text mid-chunk computes a
        few tokens nobody reads, and they are dropped here. Returns the requests whose tokens failed;
        yields once, between launching the chunk and reading it back (step_parts).

        With `decode_ahead`, the chunk read here may be the one the previous step launched ahead, and the
        next one is launched before this one is read (`_launch_ahead`).
        """
        chunk, self._ahead = self._ahead, None
        try:
            if chunk is None:
                chunk = self._launch_chunk(n, reqs)
            self._ahead = self._launch_ahead(chunk)
            yield  # launched
            return self._read_chunk(chunk)
        except BaseException:
            # Launched from a chunk that is not applied: the next chunk starts from the host's state instead.
            self._ahead = None
            raise

    def _launch_chunk(self, n: int, reqs: list[_Active], first: torch.Tensor | None = None) -> Chunk:
        """A chunk for rows 0..n-1 from the host's state of their requests (`reqs`, row order). `first`: the
        tokens of the last len(first) rows (just admitted) chosen on the device and not yet read back
        (`_launch_first_chunk`): those rows start one token further than the host knows, from these."""
        new = 0 if first is None else first.shape[0]
        k_max = self._chunk_steps(reqs, new)
        toks, pos = self._row_inputs(n - new)
        sampled = [q.dec.n_sampled + (i >= n - new) for i, q in enumerate(reqs)]
        pos += [q.dec.position() + 1 for q in reqs[n - new:]]
        minleft = [max(0, q.dec.plan.min_new_tokens - k) for q, k in zip(reqs, sampled)]
        # (a stopping chunk's step limit, on its real rows; the padding rows get 0)
        b = self._load_inputs(n, [toks + [0] * new, pos, minleft] + ([[k_max] * n] if self.stopping_chunks else []))
        if new:
            self.steps.tok[n - new:n].copy_(first)
        return self._run_chunk(reqs, b, k_max, min(pos), max(pos))

    def _chunk_steps(self, reqs: list[_Active], new: int = 0) -> int:
        """How many steps a chunk from the host's state runs for rows `reqs`: decode_chunk, or fewer where a row
        has less room (the last `new` of them one token further than the host knows: `_launch_chunk`)."""
        k_max = self.decode_chunk
        if self.stopping_chunks and self._queue:
            k_max = min(k_max, QUEUED_CHUNK)  # come back soon enough to admit the waiting
        return min(k_max, *(q.dec.room() - (i >= len(reqs) - new) for i, q in enumerate(reqs)))

    def _launch_first_chunk(self, choice: Choice, base: int) -> Chunk | None:
        """With decode-ahead, the first chunk of every row right after an admission's token choice is launched
        (rows base.._n-1 are the admitted, their first tokens `choice.greedy` on the device), before the host
        reads the choice: what the next step would launch once the host had read it. None unless every row is
        greedy without timestamps and has room for a token more."""
        n, reqs = self._n, self._greedy_rows()
        if (not self.decode_ahead or reqs is None or choice.greedy.shape[0] != n - base
                or self._chunk_steps(reqs, n - base) < 1):
            return None
        try:
            return self._launch_chunk(n, reqs, choice.greedy)
        except Exception:
            # A fault of the rows' shared step, not of the admission: the next step launches this chunk again
            # from the host's state, where a fault is held to the rows as `step` says.
            log.debug("whisper: the first chunk after an admission failed to launch", exc_info=True)
            return None

    def _launch_ahead(self, chunk: Chunk) -> Chunk | None:
        """The chunk after `chunk` for the same rows, launched now from the inputs `chunk` leaves on the device
        (its steps advance them: `DecoderSteps.greedy`), or None: with `decode_ahead` off, while requests wait
        (they are admitted after the chunk being read, not after one more), or when a row has no room left after
        `chunk`. A row that ends in `chunk` computes a chunk nobody reads."""
        if not self.decode_ahead or self._queue or chunk.layout != self._layout:
            return None
        k = min(self.decode_chunk, min(q.dec.room() for q in chunk.reqs) - chunk.steps)
        if k < 1:
            return None
        return self._run_chunk(chunk.reqs, chunk.bucket, k, chunk.lo + chunk.steps, chunk.hi + chunk.steps)

    def _run_chunk(self, reqs: list[_Active], b: int, k_max: int, lo: int, hi: int) -> Chunk:
        """k_max greedy steps of bucket b from the steps' inputs on the device, then their history's copy to the
        host queued (`HistoryCopies`). On a GPU each step is a greedy graph replay and two history writes
        (3 torch calls a step); with `chunk_graphs`, a full chunk (no row near its limit) of a bucket warm-up
        captured is one replay of the chunk graph instead: the same kernels in the same order
        (`DecoderSteps.chunk`), so the same bits. A shorter chunk, or a bucket without its graph, runs step by
        step (never captured here: `DecoderSteps.capture`). lo / hi: the rows' lowest and highest position at the
        first step (the CPU attends exactly that far)."""
        if self._chunk_replay(k_max, b):
            self.steps.run("chunk", b)  # decode_chunk steps and their history writes: one call
        else:
            # Views made once per chunk, not per step: every torch call from Python is a GIL round trip.
            tok, lp = self.steps.tok[:b], self.steps.lp[:b]
            hist_tok, hist_lp = self._hist[:b, :, 0], self._hist[:b, :, 1]
            for k in range(k_max):
                if self.is_cuda:
                    self.steps.run("greedy", b)
                else:  # as in _decode: exact context length, no mask when rows are aligned
                    self.steps.greedy(b, kv_len=hi + k + 1, masked=lo != hi)
                hist_tok[:, k] = tok
                hist_lp[:, k] = lp
        hist, landed = self._hist_copies.send(len(reqs), k_max)
        return Chunk(reqs, k_max, lo, hi, b, hist, landed, self._layout)

    def _read_chunk(self, chunk: Chunk) -> list[tuple[_Active, Exception]]:
        """Apply a launched chunk's tokens to those of its requests still here (one left or finished since a
        chunk launched ahead of it: `_step`) once its history is on the host: the chunk's one sync (none when no
        one is left to read it). Returns the requests whose tokens failed."""
        here = [(i, q) for i, q in enumerate(chunk.reqs) if self._active.get(q.rid) is q]
        if not here:
            return []
        hist = chunk.wait()
        return advance_greedy([q for _, q in here], [i for i, _ in here], hist)

    def _chunk_replay(self, k_max: int, b: int) -> bool:
        """Whether this chunk of k_max steps for bucket b is one replay of its chunk graph: with
        chunk_graphs, a full chunk (any chunk, when chunks stop on the device at their rows' limit), and a
        graph warm-up captured (a missing one is never captured here). A full chunk is as long as the graph's,
        the history's length (what decode_chunk was at warm-up: a benchmark that lowers decode_chunk afterwards,
        whisper_bench's chunk-1 latency, runs step by step)."""
        full = k_max <= self._hist.shape[1] if self.stopping_chunks else k_max == self._hist.shape[1]
        return self.chunk_graphs and full and self.steps.has_graph("chunk", b)

    def warmup(self) -> None:
        """Make every shape the engine will run now (only while idle), so no request pays a
        first-time cost: the decoder step (compiled layers and graphs) of every bucket, the encoder
        (compiled layers and graphs) of every encoder batch bucket, and the admission work (cross
        keys/values, language detection and prefill, token choice) for every admission size
        1..max_encoder_batch, which also captures the prefill graphs (when on) of every encoder bucket
        for both prompt lengths serving meets (with and without <|notimestamps|>), and the chunk graphs
        (when on) of every bucket: only here, from rows at position 0, never while serving."""
        if self._n or self._queue or not self.is_cuda:
            return
        steps = self.steps
        with torch.inference_mode(), self.on_stream():
            for t in (steps.tok, steps.pos, steps.minleft):
                t.zero_()
            if self.cuda_graphs:
                kinds = ("plain", "greedy", "chunk") if self.chunk_graphs else ("plain", "greedy")
                for b in self.buckets:
                    for kind in kinds:
                        if (kind, b) not in steps.graphs:
                            self._capture_step(kind, b)
            elif self.fast_decoder is not None and self.fast_decoder.compiled:
                for b in self.buckets:  # compile every bucket's step (the plain and greedy steps share it)
                    steps.plain(b)
            for b in self.encoder_buckets():
                if self.cuda_graphs:
                    if ("encoder", b) not in self.fast_encoder.graphs:
                        self.fast_encoder.capture(b, self.dtype)
                else:
                    self._encode_bucket(torch.zeros(b, N_SAMPLES, device=self.model.device), b)
            # Admission at every size: with a language (prefill only) and without (detection first).
            # (The encoder itself is skipped there: its bucket shapes are warm already.)
            silence = np.zeros(SAMPLE_RATE // 10, dtype=np.float32)
            ids = itertools.count(-10_000_000, -1)
            self._warming = True
            try:
                for n in range(1, min(self.max_encoder_batch, self.max_batch) + 1):
                    for lang, ts in (("en", False), (None, False), ("en", True)):
                        for _ in range(n):
                            self.submit(next(ids), ASRRequest(silence, ASROptions(language=lang, timestamps=ts,
                                                                                  max_new_tokens=1)))
                        while self._queue or self._active:
                            finish(self._step())
            finally:
                self._warming = False
            self._warm_word_timings()
            torch.cuda.synchronize()

    def _capture_step(self, kind: str, b: int) -> None:
        try:
            self.steps.capture(kind, b)
        except Exception as e:
            if kind == "chunk" and self.stopping_chunks:  # (not yet run on a GPU: say what to turn off)
                raise EngineError(f"capturing the stopping chunk graph of batch {b} failed ({type(e).__name__}: {e}); "
                                  "unset VOICED_WHISPER_STOPPING_CHUNKS") from e
            raise

    # ------------------------------------------------------------------------------ admission
    def encoder_buckets(self) -> list[int]:
        return doubling(self.max_encoder_batch)

    def _encode_bucket(self, audio: torch.Tensor, b: int) -> torch.Tensor:
        """Features [b, A, D] of audio [b, N_SAMPLES] (padded windows), by graph or eagerly."""
        return self.fast_encoder.run(audio, b, self.dtype)

    def _encode_into_cache(self, audio: torch.Tensor, chosen: list[_Active]) -> None:
        """Encoder over audio [n, N_SAMPLES] of `chosen`, then every layer's cross keys/values into each
        request's rows. With the cross keys/values made in the encoder's pass (`cross_in_encoder`), that pass
        (one graph replay per bucket) leaves them for all layers in `fast_encoder.cross_out`, which
        `_copy_cross` copies into the cache with one call per tensor; else `_write_cross` projects them."""
        model, dev = self.model, self.model.device
        if not self.is_cuda:
            mel = log_mel_spectrogram(audio, self.dims.n_mels).to(self.dtype)
            self._write_cross(model.encoder(mel), chosen)
            return
        in_pass = self.fast_encoder.cross_out is not None
        start = 0
        for b in encoder_pieces(len(chosen), self.encoder_buckets()):
            part = chosen[start:start + b]
            x = audio[start:start + len(part)]
            if len(part) < b:
                x = torch.cat([x, x.new_zeros(b - len(part), x.shape[1])])
            # Warming up, shapes only: zeros stand in for the features. In the encoder's pass every bucket
            # ran already (captured, or once eagerly), so the buffer holds finite numbers that stand in.
            if in_pass:
                if not self._warming:
                    self._encode_bucket(x, b)
                self._copy_cross(part)
            else:
                if self._warming:
                    features = torch.zeros(b, self.dims.n_audio_ctx, self.dims.n_audio_state, dtype=self.dtype,
                                           device=dev)
                else:
                    features = self._encode_bucket(x, b)
                self._write_cross(features, part)
            start += len(part)

    def _write_cross(self, features: torch.Tensor, part: list[_Active]) -> None:
        """Every layer's cross keys/values of `features` [>= len(part), A, D] into the rows of `part`
        (feature i for each of request i's beams). The indices go to the device without a sync."""
        dev = self.model.device
        rows = [x for r in part for x in r.rows]
        if len(rows) == len(part):  # one row each (no beams): the features in order, as a view
            features = features[:len(part)]
        else:
            features = features[to_device([i for i, r in enumerate(part) for _ in r.rows], dev)]
        self.model.decoder.write_cross(self.cache, to_device(rows, dev), features)

    def _copy_cross(self, part: list[_Active]) -> None:
        """Copy the cross keys/values the encoder's pass left in `fast_encoder.cross_out` ([k | v, layer,
        row, A, D], row i: request i's audio) into the cache rows of `part`, every layer at once: one
        `index_copy_` per tensor along the slot dimension, once per beam index (beam j of each request;
        a request with fewer beams writes its last row again, the same values: any copy that lands is
        right). The slots go to the device without a sync."""
        n = len(part)
        beams = max(len(r.rows) for r in part)
        slots = to_device([[r.rows[min(j, len(r.rows) - 1)] for r in part] for j in range(beams)], self.model.device)
        k, v = self.fast_encoder.cross_out[:, :, :n].unbind(0)  # [L, n, A, D] each
        for j in range(beams):
            self.cache.cross_k.index_copy_(1, slots[j], k)
            self.cache.cross_v.index_copy_(1, slots[j], v)

    def _admit(self) -> tuple[list[_Active], torch.Tensor, torch.Tensor] | None:
        """Move queued requests into free rows; returns them, their first-step logits and their no-speech
        probabilities (row order)."""
        chosen = self._choose_admissions()
        if not chosen:
            return None
        self._admitting = chosen
        self._give_rows(chosen)
        self._encode_into_cache(self._audio(chosen), chosen)
        self._detect_languages([r for r in chosen if r.dec.plan.language is None])
        return chosen, *self._prefill(chosen)

    def _choose_admissions(self) -> list[_Active]:
        """Queued requests for the free rows, highest priority first, at most max_encoder_batch; a
        request marked solo goes in alone."""
        free = self.max_batch - self._n
        chosen: list[_Active] = []
        for req in sorted(self._queue.values(), key=lambda r: (-r.request.options.priority, r.order)):
            if len(chosen) >= self.max_encoder_batch or (chosen and chosen[0].solo):
                break
            if req.solo and chosen:
                continue  # it goes in alone, at a later step
            if req.dec.plan.beam_size <= free:
                chosen.append(req)
                free -= req.dec.plan.beam_size
        return chosen

    def _give_rows(self, chosen: list[_Active]) -> None:
        """Move `chosen` from the queue into rows _n.. (one per beam)."""
        for req in chosen:
            del self._queue[req.rid]
            req.rows = list(range(self._n, self._n + req.dec.plan.beam_size))
            for j, r in enumerate(req.rows):
                self._owner[r] = (req, j)
            self._n += len(req.rows)
            self._active[req.rid] = req
        self._layout += 1

    def _audio(self, chosen: list[_Active]) -> torch.Tensor:
        """The requests' audio as padded 30 s windows [n, N_SAMPLES] on the model's device. Only the
        longest request's span crosses to the device, laid out on the host through numpy (no torch call per
        request) in the kept staging block (pinned on CUDA) and sent in one copy; the padding to 30 s is
        made on the device. `submit` refused anything longer than a window."""
        lens = [r.request.audio.shape[0] for r in chosen]
        n, width = len(chosen), max(lens)
        if self.is_cuda:
            # The previous admission's copy has read the block by now (its tokens were read back since):
            # the wait is a guard that costs nothing.
            self._audio_sent.synchronize()
        if self._host_audio is None or self._host_audio.numel() < n * width:
            self._host_audio = torch.empty(max(n, self.max_encoder_batch) * N_SAMPLES, pin_memory=self.is_cuda)
        # Each row is written whole (its audio, then zeros to `width`): nothing of an earlier admission's
        # longer audio is left in it.
        host = self._host_audio[:n * width].view(n, width)
        host_np = host.numpy()
        for i, r in enumerate(chosen):
            host_np[i, :lens[i]] = r.request.audio
            host_np[i, lens[i]:] = 0
        if self.is_cuda:
            host = host.to(self.model.device, non_blocking=True)
            self._audio_sent.record(torch.cuda.current_stream(self.model.device))
        return torch.nn.functional.pad(host, (0, N_SAMPLES - width))

    def _detect_languages(self, detect: list[_Active]) -> None:
        """Language detection (language.py) for the requests that did not give theirs."""
        if not detect:
            return
        found = detect_languages(self.model.decoder, self.tok, self.cache, [r.rows[0] for r in detect])
        for r, (language, probs) in zip(detect, found):
            r.dec.language_probs = probs
            r.dec.plan.language = language

    def _prefill(self, chosen: list[_Active]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the initial tokens of `chosen`, grouped by length (they differ only with prompts);
        returns the logits of their last positions and the no-speech probability at
        <|startoftranscript|>, both in row order, on the device (read back with the tokens: `_select`)."""
        tok, dev = self.tok, self.model.device
        base = chosen[0].rows[0]
        groups: dict[int, list[_Active]] = {}
        for r in chosen:
            groups.setdefault(len(r.dec.start(r.dec.plan.language)), []).append(r)
        # One group (no prompts: the usual case) holds the rows base.. in order: its results are the answer.
        n = sum(len(r.rows) for r in chosen)
        out = None if len(groups) == 1 else torch.empty(n, self.dims.n_vocab, device=dev)
        no_speech = None if len(groups) == 1 else torch.empty(n, device=dev)
        for length, group in groups.items():
            grows = [x for r in group for x in r.rows]
            sot = {r.dec.sot_index for r in group}
            if self.prefills is not None and self.prefills.covers(length, sot, len(grows)):
                last, group_no_speech = self.prefills.run([r.dec.initial for r in group for _ in r.rows], grows)
            else:
                toks = to_device([r.dec.initial for r in group for _ in r.rows], dev)
                logits = self.model.decoder.prefill(toks, to_device(grows, dev), self.cache)
                if len(sot) == 1:
                    at_sot = logits[:, sot.pop()]
                else:
                    sot_idx = to_device([r.dec.sot_index for r in group for _ in r.rows], dev)
                    at_sot = logits.gather(1, sot_idx[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
                last, group_no_speech = logits[:, -1], at_sot.softmax(dim=-1)[:, tok.no_speech]
            if out is None:
                return last, group_no_speech
            at = to_device([g - base for g in grows], dev)
            out[at] = last
            no_speech[at] = group_no_speech
        return out, no_speech

    def _finish(self) -> StepParts:
        """Report finished requests and free their rows (yields while word timings run on the GPU)."""
        finished = [q for q in self._active.values() if q.dec.done]
        outputs, timed = [], []
        for req in finished:
            del self._active[req.rid]
            try:
                result = req.dec.result(req.seconds)
            except Exception as e:  # turning this request's tokens into text: its fault alone
                log.error("whisper: request %s failed", req.rid, exc_info=e)
                outputs.append(fault_output(req.rid, "speech recognition", e))
                continue
            if req.request.options.word_timestamps and result.tokens and not self._warming:
                timed.append((req, result))
            else:
                outputs.append(EngineOutput(req.rid, result, True))
        try:
            outputs += yield from self._with_words(timed)
        finally:
            self._release(finished)
        return outputs

    def _with_words(self, timed: list[tuple[_Active, Transcript]]) -> StepParts:
        """The outputs of finished requests that asked for word timings, all of a step's together."""
        if not timed:
            return []
        try:
            found = yield from self._words(timed)
        except Exception as e:
            if len(timed) > 1:  # one request's fault must not fail the others: each again on its own
                outputs = []
                for item in timed:
                    outputs += yield from self._with_words([item])
                return outputs
            log.error("whisper: request %s failed", timed[0][0].rid, exc_info=e)
            return [fault_output(timed[0][0].rid, "speech recognition", e)]
        return [EngineOutput(req.rid, result, True) for req, result in found]

    def _words(self, timed: list[tuple[_Active, Transcript]]) -> StepParts:
        """Each finished request's result with its word timings (its rows still hold its audio's cross
        keys/values), the probability of end-of-text after its text and that of the sentence ending
        right after its last word (the same forced pass has the logits for all three)."""
        forced = []
        for req, result in timed:
            plan = req.dec.plan
            text = [t for t in result.tokens if t < self.tok.eot]
            audio = req.request.audio
            if plan.timestamps and result.segments:
                spans = [SegmentSpan(s.start, s.end, s.tokens) for s in result.segments]
            else:
                spans = [SegmentSpan(0.0, audio.shape[0] // HOP_LENGTH * HOP_LENGTH / SAMPLE_RATE, text)]
            forced.append(_Forced.of(self.tok, req.rows[0], plan.language, plan.task, text, spans, audio))
        for (req, result), aligned in zip(timed, (yield from self._align(forced))):
            if aligned is None:
                result.words, result.end_prob, result.stop_prob = [], None, None
                continue
            per_segment, result.words, result.end_prob, result.stop_prob = aligned
            if req.dec.plan.timestamps and result.segments:
                # As openai-whisper's transcribe() does with word timestamps on: a segment runs from its
                # first word's start to its last word's end (what srt/vtt subtitles show).
                k = 0
                for seg, seg_words in zip(result.segments, per_segment):
                    if seg_words:
                        seg.start, seg.end = result.words[k].start_s, result.words[k + len(seg_words) - 1].end_s
                    k += len(seg_words)
        return timed

    def _align(self, forced: list[_Forced]) -> StepParts:
        """The forced passes of each request's text over its audio: (each span's words, all words fitted
        to the audio's pauses, end-of-text probability after the text, probability of a sentence end
        right after the last word), or None where the text does not fit the decoder. As few passes as
        ALIGN_GROUP_BYTES allows, one readback each; the time warping on the GPU (dtw_kernel) or, on the
        host, all requests' at once. Yields while each pass runs (returns a list: None or the above)."""
        fits = []
        for k, f in enumerate(forced):
            if len(f.tokens) > self.dims.n_text_ctx:  # only with max_new_tokens near the whole context
                log.warning("no word timings: %d text tokens do not fit the decoder's %d positions with the prompt",
                            len(f.text), self.dims.n_text_ctx)
            else:
                fits.append(k)
        a, d = self.cache.cross_k.shape[2:]
        per_position = self.dims.n_vocab * 4 * 2 + len(self.alignment_heads) * a * 4 * 3  # logits, scores
        per_request = a * d * (2 * self.cache.cross_k.element_size() + 4)  # a layer's gathered cross k/v
        most = ALIGN_GRAPH_ROWS[-1] if self.align_passes is not None else len(fits)  # (a graph's rows at most)
        budget = ALIGN_GROUP_BYTES
        if self.is_cuda:
            budget = min(budget, step_transient_bytes(self.dims, self.dtype.itemsize, self.max_encoder_batch))
        groups, size = [], 0
        for k in fits:
            need = per_request + per_position * len(forced[k].tokens)
            if not groups or size + need > budget or len(groups[-1]) == most:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += need
        passes = []
        for group in groups:
            passes.append((group, (yield from self._forced_pass([forced[k] for k in group]))))
        on_host = iter(dtw_many([-w for _, (_, _, warps) in passes for w in warps if isinstance(w, np.ndarray)]))
        out: list[tuple | None] = [None] * len(forced)
        for group, (token_probs, probs, warps) in passes:
            for k, tp, (end_prob, stop_prob), w in zip(group, token_probs, probs, warps):
                f = forced[k]
                path = next(on_host) if isinstance(w, np.ndarray) else w  # (the kernel's path; None: no text)
                per_segment = word_timings(self.tok, f.language, f.spans, path, tp)
                words = fit_to_pauses([w for seg in per_segment for w in seg], f.audio)
                out[k] = per_segment, words, end_prob, stop_prob
        return out

    def _forced_pass(self, group: list[_Forced]) -> StepParts:
        """One decoder pass over `group`'s forced sequences: per request its text tokens' probabilities,
        (end-of-text probability, sentence-end probability) and its time warping: the path, where the GPU
        warps (dtw_kernel), else the attention matrix for the host to warp (None without text); all read
        back in one copy, after a yield (the shared engine thread launches the other engine's work while
        the pass runs)."""
        tok, dev = self.tok, self.model.device
        seqs = [f.tokens for f in group]
        t = max(len(x) for x in seqs)
        graphed = self.align_passes.bucket(len(group), t) if self.align_passes is not None else None
        if graphed is not None:
            t = graphed[1]  # the rows padded to the graph's tokens
        # The logits read: each position that predicts a text token or end-of-text (the last of a
        # request's rows); where the last word's letters end is one of them.
        at, base = [], []
        for r, f in enumerate(group):
            base.append(len(at))
            at.extend(r * t + len(f.prefix) - 1 + j for j in range(len(f.text) + 1))
        # Every index the pass reads, in one copy to the device: the padded token rows, the cache rows, the
        # positions read, each one's text token (0 at the end rows: not read), where each request's text
        # ends, and where its last word's letters end.
        ends = [b + len(f.text) for b, f in zip(base, group)]
        after = [b + last_word_end(tok, f.text) for b, f in zip(base, group)]
        parts = ([y for x in seqs for y in x + [tok.eot] * (t - len(x))], [f.row for f in group], at,
                 [y for f in group for y in (*f.text, 0)], ends, after, [*tok.sentence_end_tokens, tok.eot])
        tokens, rows, at_d, targets, ends_d, after_d, stops = to_device(np.concatenate(parts), dev).split(
            [len(p) for p in parts])
        if graphed is not None:
            x, scores = self.align_passes.run(tokens.view(len(group), t), rows, graphed)
        else:
            x, scores = self.model.decoder.alignment_hidden(tokens.view(len(group), t), rows, self.cache,
                                                            self.alignment_heads)
        logits = self.model.decoder.alignment_logits(x, at_d)
        token_probs = logits[:, :tok.eot].softmax(dim=-1).gather(1, targets[:, None])[:, 0]
        # Over the text tokens and end-of-text (timestamps and other specials cannot follow here).
        end = logits[ends_d, :tok.eot + 1].softmax(dim=-1)[:, tok.eot]
        # Right after the last word's letters (where Whisper chose its final punctuation): the text stopping
        # (a full stop, question or exclamation mark, ellipsis, end-of-text) against more words or a comma.
        stop = logits[after_d, :tok.eot + 1].softmax(dim=-1)[:, stops].sum(-1)
        mats = [attention_matrix(scores[r, :, :len(seqs[r])], len(f.prefix), f.audio.shape[0] // HOP_LENGTH)
                if f.text else None for r, f in enumerate(group)]
        with_text = [m for m in mats if m is not None]
        warp = dtw_kernel.launch(with_text) if with_text and dtw_kernel.supported(dev) else None
        flat = torch.cat([token_probs.double(), end.double(), stop.double(),
                          *([warp.double().flatten()] if warp is not None else [m.double().flatten() for m in with_text])])
        yield  # the pass is launched
        flat = flat.cpu().numpy()  # its one readback
        n = len(at)
        probs, end_stop = flat[:n], list(zip(flat[n:n + len(group)].tolist(), flat[n + len(group):n + 2 * len(group)].tolist()))
        offset = n + 2 * len(group)
        if warp is not None:
            found = iter(dtw_kernel.paths(flat[offset:].reshape(warp.shape).astype(np.int64)))
            warps = [None if m is None else next(found) for m in mats]
        else:
            warps = []
            for m in mats:
                warps.append(None if m is None else flat[offset:offset + m.numel()].reshape(m.shape))
                offset += 0 if m is None else m.numel()
        token_probs = [probs[b:b + len(f.text)].tolist() for b, f in zip(base, group)]
        return token_probs, end_stop, warps

    def _warm_word_timings(self) -> None:
        """One forced word-timing pass on row 0 (warm-up's audio): a smart-turn caller's first pause asks
        for word timings, and on an H100 that first pass paid ~1 s of first-time kernel loading and set
        up (issue 25's e2e run at 1 caller: a 1,063 ms step, then 100-160 ms). On a GPU the time warping's
        kernel is compiled for every block size here too, and the forced pass's graphs (when on) captured."""
        audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
        text = self.tok.encode(" One, two, three.")
        if self.align_passes is not None:
            self.align_passes.capture()
        finish(self._align([_Forced.of(self.tok, 0, "en", "transcribe", text, [SegmentSpan(0.0, 1.0, text)], audio)]))
        dtw_kernel.warm(self.model.device)

    def _release(self, leaving: list[_Active]) -> None:
        """Free the rows of `leaving` and pack the live rows back to 0..n-1."""
        if not leaving:
            return
        self._layout += 1
        for req in leaving:
            for r in req.rows:
                self._owner[r] = None
            req.rows = []
        occupied = [self._owner[r] is not None for r in range(self._n)]
        moves = compaction(occupied)
        if moves:
            dev = self.cache.self_k.device
            self.cache.move(to_device([h for _, h in moves], dev), to_device([m for m, _ in moves], dev))
            for m, h in moves:
                req, j = self._owner[m]
                req.rows[j] = h
                self._owner[h], self._owner[m] = (req, j), None
        self._n = sum(occupied)


def _weights_dtype(dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    """The model's dtype from `load`'s: "int8" (a CPU mode) keeps float32 weights (quantized after)."""
    if dtype == "int8":
        if device != "cpu":
            raise EngineError("dtype int8 is a CPU mode (int8 GEMMs on the CPU); on a GPU use float16")
        if not int8_available():
            raise EngineError("dtype int8 needs torch's x86/fbgemm quantized kernels, which this torch build "
                              "lacks; use float32")
        dtype = torch.float32
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    dtype = parse_dtype(dtype, f"one of {', '.join(DTYPES)} or int8 (CPU)")
    return dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
