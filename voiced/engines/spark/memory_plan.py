"""The Spark engine's part of the daemon's GPU memory plan (voiced.memory_plan): what `load` with
given settings will hold, computed from the checkpoint's configs alone (modules built on the meta
device) before anything goes to the GPU."""

from __future__ import annotations

import torch

from voiced.engines.rows import doubling, rows_in_budget
from voiced.memory_plan import EngineNeed, Need, stream_workspace_bytes, tensor_bytes

from . import vocoder_schedule
from .bicodec import BiCodec, BiCodecConfig
from .checkpoint import SparkCheckpoint
from .lm_steps import DECODE_STEPS, PREFILL_BUCKET, PREFILL_STEP_TOKENS, padded_to, prefill_bytes, prefill_io_bytes
from .prompt import longest_prompt
from .qwen2 import Qwen2Config, Qwen2LM


def kv_row_bytes(cfg, max_seq_len: int, lm_dtype: torch.dtype) -> int:
    """The LM's KV cache for one request (row) of max_seq_len positions."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * max_seq_len * lm_dtype.itemsize


def rows_for_budget(cfg, max_batch: int, max_seq_len: int, lm_dtype: torch.dtype, kv_cache_bytes: int | None) -> int:
    """max_batch, capped by what a KV-cache budget from the daemon's memory plan holds (none: 0 or None)."""
    return rows_in_budget(max_batch, kv_cache_bytes or None, kv_row_bytes(cfg, max_seq_len, lm_dtype),
                          owner="TTS", row=f"request of {max_seq_len} tokens")


def vocoder_step_bytes(codec_config, dtype: torch.dtype) -> int:
    """The transient of the largest vocoder step: VOCODER_STEP_TOKENS window tokens, as
    VOCODER_STEP_WINDOWS windows (every batch bucket x padded length a step decodes holds at most that
    many tokens, and the activations grow with tokens), measured on the meta device."""
    from voiced.memory_plan import peak_live_bytes

    from .streaming import decode_windows

    b = vocoder_schedule.VOCODER_STEP_WINDOWS
    length = vocoder_schedule.VOCODER_STEP_TOKENS // b
    with torch.device("meta"):
        codec = BiCodec(codec_config).to(dtype).eval().requires_grad_(False)
        ids = torch.zeros(b, length, dtype=torch.long)
        spk = torch.zeros(b, codec_config.speaker_out_dim, dtype=dtype)
    with torch.no_grad():
        return peak_live_bytes(lambda: decode_windows(codec, ids, spk, [length] * b))


def memory_need(cfg, lm_dtype: torch.dtype, lm_bytes: int, codec_bytes: int, max_batch: int, max_seq_len: int, *,
                cuda: bool, graphs: bool = True, decode_steps: int = DECODE_STEPS, workspace_bytes: int = 0,
                vocoder_bytes: int = 0, vocoder_graph_bytes: int = 0, vocoder_graph_pool_bytes: int = 0,
                vocoder_graph_count: int = 0) -> EngineNeed:
    """What `SparkTTSEngine.load(...)` with these settings holds on its device (see voiced.memory_plan).
    vocoder_bytes: the largest vocoder step's transient (`vocoder_step_bytes`). With vocoder graphs on
    (vocoder_graph_count of them), instead: vocoder_graph_bytes, their shared inputs and output
    (`vocoder_graphs.held_bytes`), and vocoder_graph_pool_bytes, what their pool holds for good
    (`vocoder_graphs.pool_bytes_planned`): the one segment reserved at the first capture, the largest
    captured decode's activations (meta device) plus a measured allowance for cuDNN's convolution workspace
    (120.5 MiB, taken through PyTorch's allocator) and fragmentation, and the small pool's 2 MiB segments.
    Without the reserve the caching allocator would size each new segment for the request that makes it and
    never merge segments, so a decode whose tensors grow layer by layer would leave a segment per size (772
    MiB for a 425 MiB peak at full size). This also bounds the eager warm-up's transient."""
    kv = max_batch * kv_row_bytes(cfg, max_seq_len, lm_dtype)
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
        n = len(doubling(max_batch, 1)) * len(doubling(max_seq_len, 256))
        items.append(Need(f"decode graphs ({n}): sampled tokens", n * max_batch * decode_steps * 8))
    items.append(Need("cuBLAS workspaces (the default stream, the capture stream)", 2 * workspace_bytes))
    # The longest prefill: a pack of PREFILL_STEP_TOKENS, or one prompt as long as submit accepts.
    longest = max(PREFILL_STEP_TOKENS, min(max_seq_len, padded_to(longest_prompt(max_seq_len), PREFILL_BUCKET)))
    if graphs:
        # Every graph of the LM allocates from one pool (ServedLM.graph_pool), which keeps the largest
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
    if vocoder_graph_count:
        items.append(Need(f"vocoder graphs ({vocoder_graph_count}): shared inputs and output", vocoder_graph_bytes))
        items.append(Need("vocoder graphs' pool: one reserved segment (the largest decode's activations, "
                          "cuDNN workspace, fragmentation; measured allowance) and small segments",
                          vocoder_graph_pool_bytes))
    elif vocoder_bytes:
        items.append(Need(f"step transient: vocoder, {vocoder_schedule.VOCODER_STEP_TOKENS} window tokens",
                          vocoder_bytes, transient=True))
    return EngineNeed("Spark-TTS", "tts_kv_fraction", items)


def plan(ckpt: SparkCheckpoint, device: str, lm_dtype: torch.dtype, codec_dtype: torch.dtype, max_batch: int,
         max_seq_len: int, use_cuda_graphs: bool = True, decode_steps: int = DECODE_STEPS,
         vocoder_graphs: bool = False) -> EngineNeed:
    """The engine's memory need from the checkpoint's configs alone (max_batch: the rows it will hold,
    after any KV-cache budget)."""
    cfg = Qwen2Config.from_json(ckpt.llm_dir / "config.json")
    codec_cfg = BiCodecConfig.from_yaml(ckpt.bicodec_dir / "config.yaml", ckpt.root_config)
    with torch.device("meta"):
        lm_bytes = tensor_bytes(Qwen2LM(cfg), lm_dtype)
        codec_bytes = tensor_bytes(BiCodec(codec_cfg), codec_dtype)
    cuda = str(device).startswith("cuda")
    graphs: dict = {}
    if cuda and vocoder_graphs:
        from voiced.engines.base import TTSOptions

        from . import vocoder_graphs as vg

        with torch.device("meta"):
            codec = BiCodec(codec_cfg).to(codec_dtype).eval().requires_grad_(False)
        opts = TTSOptions()  # warm-up captures the shapes of the default chunk sizes
        shapes = vocoder_schedule.window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, codec.receptive_radius())
        graphs = {"vocoder_graph_count": len(shapes),
                  "vocoder_graph_bytes": vg.held_bytes(shapes, codec_cfg.speaker_out_dim, codec_dtype.itemsize),
                  "vocoder_graph_pool_bytes": vg.pool_bytes_planned(codec, shapes)}
    return memory_need(cfg, lm_dtype, lm_bytes, codec_bytes, max_batch, max_seq_len, cuda=cuda,
                       graphs=use_cuda_graphs, decode_steps=decode_steps,
                       workspace_bytes=stream_workspace_bytes(device) if cuda else 0,
                       # with graphs, their pool's row replaces the eager step's transient
                       vocoder_bytes=vocoder_step_bytes(codec_cfg, codec_dtype) if cuda and not graphs else 0,
                       **graphs)
