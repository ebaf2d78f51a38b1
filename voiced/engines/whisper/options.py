"""How a Whisper engine runs on its device (`WhisperRuntime`): one typed object resolved once, from the
engine's settings, the device and the dtype, and read by the engine and by its memory need.

On a GPU everything that can replay from CUDA graphs does (decoder steps, chunks of greedy steps, the
encoder with the cross keys/values of every decoder layer, the admission's prefill, the word timings'
forced pass); on the CPU nothing does, and each token is looked at as it comes. Only `cuda_graphs=False`
and `fast_decoder=False` (the modules' own step) turn the GPU path back into the eager reference, for
tests and benchmarks that compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voiced.config import ASR_WINDOWS as WINDOWS
from voiced.engines.base import EngineError
from voiced.engines.dtypes import DTYPES, parse_dtype
from voiced.engines.kernels import decode_linear

from .cpu import int8_available
from .fast_decoder import gemv_supported
from .model import ModelDims

# Greedy steps between host syncs on a GPU: a sync stalls the queue of kernels, so 8 steps run blind (a row
# that ends mid-chunk computes a few tokens nobody reads). On the CPU a sync is free and every wasted step
# costs a full step: one.
GPU_CHUNK = 8
# Encoder rows an admission takes at most when not told: on a GPU 16 (the encoder's bucket graphs, each
# holding its input and output), on the CPU 4.
GPU_ENCODER_BATCH, CPU_ENCODER_BATCH = 16, 4


@dataclass(frozen=True)
class WhisperRuntime:
    """What a `WhisperEngine` runs, resolved by `resolve`."""

    cuda: bool
    max_batch: int  # decoder rows
    max_encoder_batch: int  # utterances one admission encodes together, at most
    max_queue: int | None  # requests waiting to be admitted, at most (None: no limit)
    decode_chunk: int  # greedy steps between host syncs
    cuda_graphs: bool  # steps, encoder, prefills and word-timing passes replayed from CUDA graphs (a GPU)
    # A chunk of decode_chunk greedy steps and their history writes as one CUDA graph (captured at warm-up per
    # batch bucket) instead of 3 torch calls a step, each of which waits to win the GIL back under load.
    chunk_graphs: bool
    # The next chunk launched from the inputs the last one left on the device before the host reads that one
    # back, so the GPU does not wait out the host's token bookkeeping at every chunk boundary (one utterance
    # 15.5 ms against 16.2-17.4 without). Only on a GPU: on the CPU the steps run on the host's own time.
    decode_ahead: bool
    fast_decoder: bool  # the fused step (`FastDecoder`); False: the modules' reference step
    gemv: bool  # the fused step through the shared GEMV kernels (`FastDecoder`'s `gemv`)
    compile_decoder: bool  # the fused step's layer compiled (a GPU without the GEMV kernels)
    compile_tail: bool  # the greedy choice and the GEMV step's embeddings compiled (a GPU)
    # The encoder's layers compiled in float32, where its exactness tests against openai-whisper need the
    # compiled layers' rounding; eager in half precision, where a compiled layer is slower (one large-v3-turbo
    # utterance 17.9 ms against 16.0-16.6 eager).
    compile_encoder: bool
    # Eager encoder layers with each residual add and the layer norm after it one kernel (where the decode
    # kernels run): encoder throughput 171 against 167 utt/s.
    encoder_add_norm: bool
    # The encoder hears each admission's audio in a window sized to its clip (clip_window.py), not 30 s
    # (`window="auto"` on a CPU): there the 30 s window's encoder is most of a decode (base, 3 s of
    # speech on two cores: 1.02 s a decode against 0.72 s in a 20 s window, the same WER), and a pause's decode
    # slower than the gap between two sentences merges them into one turn. Results then differ from
    # openai-whisper's (`window="full"` keeps them); a GPU runs the 30 s window its encoder graphs and bucketed
    # batches are built for (a decode there is ~15 ms).
    clip_window: bool

    @classmethod
    def resolve(cls, dims: ModelDims, dtype: torch.dtype, device: torch.device | str, *, max_batch: int = 8,
                max_encoder_batch: int | None = None, max_queue: int | None = None, decode_chunk: int | None = None,
                cuda_graphs: bool = True, fast_decoder: bool = True,
                decode_ahead: bool | None = None, window: str = "full") -> WhisperRuntime:
        """decode_ahead None: on a GPU only (True runs it on the CPU too, as tests of its logic do). window:
        WINDOWS."""
        cuda = torch.device(device).type == "cuda"
        if window not in WINDOWS:
            raise EngineError(f"window {window!r}: use {' or '.join(WINDOWS)}")
        decode_chunk = max(1, decode_chunk if decode_chunk is not None else GPU_CHUNK if cuda else 1)
        graphs = cuda_graphs and cuda
        gemv = fast_decoder and gemv_supported(dims.n_text_head, dims.n_text_state, dtype, device)
        compile_encoder = cuda and dtype == torch.float32
        return cls(
            cuda=cuda, max_batch=max_batch,
            # An admission never takes more requests than there are rows.
            max_encoder_batch=min(max_encoder_batch or (GPU_ENCODER_BATCH if cuda else CPU_ENCODER_BATCH), max_batch),
            max_queue=max_queue, decode_chunk=decode_chunk, cuda_graphs=graphs,
            # (a chunk graph's capture runs it twice eagerly first, from position 0 to 2 x decode_chunk - 1)
            chunk_graphs=graphs and 2 * decode_chunk <= dims.n_text_ctx,
            decode_ahead=cuda if decode_ahead is None else decode_ahead,
            fast_decoder=fast_decoder, gemv=gemv, compile_decoder=fast_decoder and cuda and not gemv,
            compile_tail=fast_decoder and cuda, compile_encoder=compile_encoder,
            encoder_add_norm=cuda and not compile_encoder and decode_linear.supported(dtype, device),
            clip_window=window == "auto" and not cuda)


def weights_dtype(dtype: torch.dtype | str | None, device: str) -> torch.dtype:
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
