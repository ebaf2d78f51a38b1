"""What a Whisper engine holds on its device (`memory_need`), counted from what it allocates: the one place
the memory plan (voiced.memory_plan) and `WhisperEngine.load`'s row count read it from."""

from __future__ import annotations

import torch

from voiced.engines.rows import doubling
from voiced.memory_plan import EngineNeed, Need

from .align_graphs import ALIGN_GRAPH_ROWS, ALIGN_GRAPH_TOKENS
from .audio import N_FFT, N_SAMPLES
from .model import KVCache, ModelDims
from .prefill_graphs import PREFILL_GRAPH_TOKENS


def memory_need(dims: ModelDims, dtype: torch.dtype, weight_bytes: int, max_batch: int, *, cuda: bool,
                max_encoder_batch: int | None = None, cuda_graphs: bool = True, decode_chunk: int = 8,
                workspace_bytes: int = 0, alignment_heads: int = 0) -> EngineNeed:
    """What a `WhisperEngine` of these dimensions, dtype and weights (`weight_bytes` on the device) with
    `max_batch` decoder rows holds on its device, as its `WhisperRuntime` runs it (cuda, the encoder batch,
    CUDA graphs, a chunk's steps); see voiced.memory_plan. alignment_heads: how many the word timings read
    (their forced pass's graphs hold their scores). workspace_bytes: cuBLAS's on the engine's stream."""
    rows = max_batch
    items = [Need("weights", weight_bytes),
             Need(f"KV cache: self {dims.n_text_ctx} + cross {dims.n_audio_ctx} positions x {rows} rows",
                  rows * KVCache.bytes_per_slot(dims, dtype)),
             # token, position, min-length countdown, log-prob, chunk history; the suppression mask
             Need("step buffers", rows * (3 * 8 + 4 + decode_chunk * 16) + dims.n_vocab)]
    if not cuda:
        return EngineNeed("Whisper", "whisper_kv_fraction", items)
    enc = min(max_encoder_batch or 16, rows)
    elem = dtype.itemsize
    items.append(Need("mel filterbank", dims.n_mels * (N_FFT // 2 + 1) * 4))
    # FastEncoder.cross_out: the encoder pass's cross keys/values for every decoder layer, one buffer of the
    # largest bucket's rows that every bucket writes a prefix of (graphs or not).
    items.append(Need(f"encoder pass: cross keys/values out, {dims.n_text_layer} layers x batch {enc}",
                      2 * dims.n_text_layer * enc * dims.n_audio_ctx * dims.n_text_state * elem))
    if cuda_graphs:
        dec = doubling(rows)
        # The plain steps' logits are what the decoder graphs hold. The greedy steps' graphs, and the chunk
        # graphs (decode_chunk greedy steps + history writes per graph), return nothing: they write the step
        # buffers and the history above. Their intermediates are one step's, freed step by step inside the
        # capture, where the pool gives them back to the next step of the same graph, and to later captures
        # (graphs sharing a pool replay one at a time), so a chunk graph needs no more of the pool than the
        # greedy graph of its bucket: nothing to add.
        items.append(Need(f"decoder graphs: logits of batch {dec}", sum(dec) * dims.n_vocab * 4))
        eb = doubling(enc)
        items.append(Need(f"encoder graphs: audio in, features out, batch {eb}",
                          sum(eb) * (N_SAMPLES * 4 + dims.n_audio_ctx * dims.n_audio_state * elem)))
        items += prefill_graph_needs(dims, elem, eb)
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
    grouped to fit in it (`words.WordTimings`)."""
    return enc * (N_SAMPLES * 4 + 2 * dims.n_audio_ctx * dims.n_text_state * elem + 3 * 4 * dims.n_vocab)


def prefill_graph_needs(dims: ModelDims, elem: int, buckets: list[int]) -> list[Need]:
    """What the admission's prefill graphs (prefill_graphs.Prefills) hold, counted from what they allocate:

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
      transient already exceeds, so the plan's total grows by the held item alone (tests/test_daemon_gpu.py
      checks the plan against what the engines hold).
    """
    rows, t = buckets[-1], PREFILL_GRAPH_TOKENS
    outputs = 2 * sum(buckets) * (dims.n_vocab + 1) * 4
    transient = rows * (t * dims.n_vocab * (elem + 4) + 2 * dims.n_audio_ctx * dims.n_text_state * elem
                        + dims.n_vocab * 4)
    return [Need(f"prefill graphs: inputs, last logits out, batch {buckets} x 2 prompt lengths",
                 rows * (1 + t) * 8 + outputs),
            Need(f"prefill graphs: the largest capture's transients (batch {rows})", transient, transient=True)]


def align_graph_needs(dims: ModelDims, elem: int, heads: int) -> list[Need]:
    """What the word timings' forced-pass graphs (align_graphs.AlignmentPasses) hold, counted from what they
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
