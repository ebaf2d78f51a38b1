"""The Whisper ASR engine: continuous batching over static KV-cache slots.

Each request owns `beam_size` rows ("slots") of the preallocated caches from admission until it
finishes or is cancelled. Live rows are kept packed at 0..n-1 (a leaving request's holes are filled
by moving the last rows down), so a decoder step is always "rows 0..n-1", which is what lets one
CUDA graph per batch-size bucket serve any mix of requests. One `step()`:

1. runs one decoder step for every request already sampling (rows 0..n-1): for greedy rows a chunk of
   steps whose tokens are chosen on the device, read back once;
2. admits queued requests into free rows (admission.py: log-mel + encoder, cross-attention keys/values
   into their slots, language detection where asked, and a prefill of their initial tokens, whose last
   logits are their first sampling step);
3. filters the logits of all rows and picks tokens (greedy arg-max, or beam search per request),
   with one device->host copy; finished requests leave and free their rows, after their word timings.

So requests join and leave between steps, and a cancelled request's rows are free at once.

Beside this module: options.py (what the engine runs on its device), memory.py (what it holds there),
admission.py, chunks.py (chunks of greedy steps in flight, and decode-ahead), words.py (word timings),
warmup.py, decoder_steps.py / fast_decoder.py / fast_encoder.py / prefill_graphs.py / align_graphs.py (the
GPU paths and their CUDA graphs), token_choice.py (filtering logits and choosing tokens for a batch),
decoding.py (the per-request rules). model.py is the eager reference.
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
from voiced.engines.rows import compaction, doubling, rows_in_budget, to_device
from voiced.memory_plan import (
    AUTO_GPU_ROWS,
    EngineNeed,
    check_memory_limit,
    rows_that_fit,
    stream_workspace_bytes,
    tensor_bytes,
)

from .admission import Admission, choose_admissions
from .align_graphs import AlignmentPasses
from .audio import HOP_LENGTH, N_SAMPLES
from .checkpoint import CheckpointError, build_model, read_checkpoint
from .chunks import Chunk, HistoryCopies
from .clip_window import clip_plan, repeating
from .cpu import column_major_embedding_, quantize_int8_
from .cuda_graphs import CudaGraphs
from .decoder_steps import DecoderSteps
from .decoding import DecodePlan, RequestDecoder, Suppression
from .fast_decoder import FastDecoder
from .fast_encoder import FastEncoder
from .memory import memory_need
from .model import KVCache, TextDecoder, Whisper
from .options import WhisperRuntime, weights_dtype
from .prefill_graphs import Prefills
from .registry import resolve
from .token_choice import Choice, advance_greedy, apply_choice, choose_tokens, launch_choice
from .tokenizer import WhisperTokenizer
from .warmup import warm_up
from .words import WordTimings, check_alignment_heads, official_heads

log = logging.getLogger(__name__)


@dataclass
class _Active:
    rid: int
    request: ASRRequest
    dec: RequestDecoder
    rows: list[int]
    seconds: float
    order: int
    window: int  # the samples of the window its encoder hears (N_SAMPLES, or sized to its clip on a CPU)
    bound: int | None = None  # its clip window's token bound (clip_window.window_tokens), where below its own
    solo: bool = False  # admitted alone: its group's admission failed and the culprit is being found


class WhisperEngine:
    """`ASREngine` over our PyTorch Whisper. Create it with `WhisperEngine.load(...)`."""

    backend = "torch"
    memory_need: EngineNeed | None = None  # set by load(): what it holds on its device

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, *, model_name: str = "whisper",
                 max_batch: int = 8, max_encoder_batch: int | None = None, cuda_graphs: bool = True,
                 max_queue: int | None = None, decode_chunk: int | None = None, fast_decoder: bool = True,
                 alignment_heads: list[tuple[int, int]] | None = None, decode_ahead: bool | None = None,
                 window: str = "full"):
        """The settings as `WhisperRuntime.resolve` takes them; `load` documents them."""
        if tokenizer.n_vocab != model.dims.n_vocab:
            raise CheckpointError(f"tokenizer has {tokenizer.n_vocab} tokens but the model {model.dims.n_vocab}")
        self.model = model.eval().requires_grad_(False)
        self.tok = tokenizer
        self.dims = model.dims
        self.model_name = model_name
        self.device = str(model.device)
        self.dtype = model.dtype
        self.is_cuda = model.device.type == "cuda"
        rt = self.runtime = WhisperRuntime.resolve(
            self.dims, self.dtype, model.device, max_batch=max_batch, max_encoder_batch=max_encoder_batch,
            max_queue=max_queue, decode_chunk=decode_chunk, cuda_graphs=cuda_graphs, fast_decoder=fast_decoder,
            decode_ahead=decode_ahead, window=window)
        self.max_batch, self.max_encoder_batch, self.max_queue = max_batch, rt.max_encoder_batch, max_queue
        self.decode_chunk = rt.decode_chunk  # (a benchmark may lower it after warm-up: such chunks run step by step)
        # (decoder layer, head) pairs whose cross-attention gives word timings (timing.py).
        self.alignment_heads = check_alignment_heads(alignment_heads, self.dims, model_name)
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
        # Each greedy step's token and log-probability, [row, step, (token, log-prob)], read back in one
        # copy per chunk. float64 holds both exactly (token ids < 2**53, float32 log-probabilities).
        self._hist = torch.zeros(max_batch, self.decode_chunk, 2, dtype=torch.float64, device=model.device)
        self._hist_copies = HistoryCopies(self._hist)
        self.buckets = doubling(max_batch) if self.is_cuda else []
        # All of the engine's GPU work runs on one stream of its own, graph captures included (why:
        # cuda_graphs.CudaGraphs), and all its graphs share one memory pool.
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device=model.device) if self.is_cuda else None
        pool = torch.cuda.graph_pool_handle() if rt.cuda_graphs else None

        def graphs() -> CudaGraphs | None:
            return CudaGraphs(self._stream, pool) if rt.cuda_graphs else None

        self.fast_encoder = None
        if self.is_cuda:
            self.fast_encoder = FastEncoder(model.encoder, self.dims.n_mels, rt.compile_encoder, cross=model.decoder,
                                            cross_rows=self.encoder_buckets()[-1], add_norm=rt.encoder_add_norm)
            self.fast_encoder.graphs = graphs()
        self.int8 = model.decoder.output_projection is not None  # cpu.quantize_int8_ ran
        self.fast_decoder = self._fast_decoder()
        self._decoder: FastDecoder | TextDecoder = self.fast_decoder or model.decoder
        self.steps = DecoderSteps(self._decoder, self.cache, self.dims.n_text_ctx, max_batch, model.device,
                                  self.suppress.always, tokenizer.eot, graphs(), self._hist,
                                  compile_tail=rt.compile_tail and self.fast_decoder is not None)
        # The admission's prefill of SOT sequences on a GPU: one graph replay per (prompt length, bucket)
        # instead of ~25 torch calls per layer.
        self.prefills = (Prefills(model.decoder, self.cache, self.encoder_buckets(), tokenizer.no_speech, graphs())
                         if self.is_cuda else None)
        self.admission = Admission(model, self.cache, tokenizer, self.encoder_buckets(), self.fast_encoder,
                                   self.prefills)
        align_passes = (AlignmentPasses(model.decoder, self.cache, self.alignment_heads, tokenizer.eot, graphs())
                        if rt.cuda_graphs else None)
        self.words = WordTimings(model, self.cache, tokenizer, self.alignment_heads, align_passes,
                                 self.max_encoder_batch)
        # The host side of `steps.inputs`, written through numpy (no torch call per value): pinned on
        # CUDA and sent in one copy; on the CPU the steps' block itself.
        self._host_inputs = (torch.zeros(3, max_batch, dtype=torch.long, pin_memory=True) if self.is_cuda
                             else self.steps.inputs)
        self._host_np = self._host_inputs.numpy()
        if self._stream is not None:
            # The weights (moved, fused), caches and buffers above were queued on the creating thread's
            # stream; kernels on the engine's own stream must not overtake those fills and copies.
            self._stream.wait_stream(torch.cuda.current_stream(model.device))
        log.info("whisper engine %s on %s (%s%s): %d slots, %.1f MiB of KV cache, cuda graphs %s (%s), decoder step %s, "
                 "%s", model_name, self.device, str(self.dtype).replace("torch.", ""), ", int8 GEMMs" if self.int8 else "",
                 max_batch, max_batch * KVCache.bytes_per_slot(self.dims, self.dtype) / 2**20, rt.cuda_graphs,
                 f"{self.decode_chunk} steps per graph" if rt.chunk_graphs else "a graph per step", self.decoder_path,
                 "encoder window sized to the clip" if rt.clip_window else "encoder window 30 s")

    def _fast_decoder(self) -> FastDecoder | None:
        """The decoder step: fused self-attention QKV and one function per layer (`FastDecoder`); on a GPU
        through the GEMV kernels, or else that function compiled per batch bucket in warmup(): a step at batch 1
        is ~100 kernels of a few microseconds, and their count, not bandwidth, sets its time. None: the modules'
        step (the reference; `fast_decoder=False`). The CPU runs the fused step too (fewer ops per step: p50
        latency 1073 against 1163 ms per utterance for tiny.en on two cores) but never compiles it: its steps
        attend over exactly as many positions as needed, a new shape (a recompile) at every step, and a compiled
        step is no faster there (the step is bound by memory traffic, cpu.py)."""
        if not self.is_cuda:
            column_major_embedding_(self.model.decoder)  # (cpu.py: the logits' memory order)
        rt = self.runtime
        if not rt.fast_decoder:
            return None
        return FastDecoder(self.model.decoder, rt.compile_decoder, gemv=rt.gemv, compile_tail=rt.compile_tail)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, name_or_path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None, *,
             max_batch: int | None = None, kv_cache_bytes: int | None = None, cuda_graphs: bool = True,
             max_encoder_batch: int | None = None, max_queue: int | None = None,
             decode_chunk: int | None = None, cache_root: Path | None = None, fast_decoder: bool = True,
             memory_limit: tuple[int, float] | None = None, decode_ahead: bool | None = None,
             window: str = "full") -> WhisperEngine:
        """Load an official name (from the model cache), an OpenAI `.pt`, a Hugging Face or a
        CTranslate2 (faster-whisper) directory.

        device: "cpu", "cuda" or "cuda:N". dtype: default float16 on CUDA, float32 on CPU; "int8"
        (CPU only) runs the many-row products (encoder, cross-attention key/value projections, output
        projection) as dynamically quantized int8 GEMMs (cpu.py): faster, approximate.
        max_batch: decoder rows (a beam-search request takes `beam_size` rows); None or 0: 8 on CPU, and on
        CUDA the most of 64, 32, 16, ... whose need fits memory_limit (memory_plan.rows_that_fit).
        kv_cache_bytes: a memory budget for the self+cross KV caches; the row count is the smaller of what
        it allows and max_batch. max_encoder_batch: utterances one admission encodes together (16 on a GPU, 4
        on the CPU). max_queue: requests waiting, at most (CapacityError past it). decode_chunk: greedy steps
        between host syncs (8 on a GPU, 1 on the CPU). memory_limit: (free GPU bytes, the [memory]
        whisper_kv_fraction): the computed need (memory.memory_need) is checked against that share before the
        weights go to the GPU; a need above it is refused (EngineError naming the setting).
        cuda_graphs=False / fast_decoder=False: the eager path / the modules' reference step, for comparisons.
        decode_ahead: None on a GPU only (options.WhisperRuntime). window: "full" (Whisper's 30 s: results as
        openai-whisper's) or "auto" (on a CPU a window sized to the clip, clip_window.py, faster and approximate; 30 s
        on a GPU: the daemon's default, asr.window).
        """
        path = resolve(name_or_path, cache_root)
        ckpt = read_checkpoint(path)
        dims = ckpt.dims
        model = build_model(dims, ckpt.state, str(path))
        tok = ckpt.tokenizer()
        int8 = dtype == "int8"
        dtype = weights_dtype(dtype, device)
        cuda = device.startswith("cuda")
        name = path.stem if path.is_file() else path.name
        heads = check_alignment_heads(ckpt.alignment_heads or official_heads(name, dims), dims, name)
        rows = rows_in_budget(max_batch or (AUTO_GPU_ROWS if cuda else 8), kv_cache_bytes,
                              KVCache.bytes_per_slot(dims, dtype), owner="ASR", row="decoder row")
        weight_bytes, workspace = tensor_bytes(model, dtype), stream_workspace_bytes(device) if cuda else 0
        settings = dict(max_encoder_batch=max_encoder_batch, max_queue=max_queue, decode_chunk=decode_chunk,
                        cuda_graphs=cuda_graphs, fast_decoder=fast_decoder, decode_ahead=decode_ahead,
                        window=window)

        def need_at(rows: int) -> EngineNeed:
            rt = WhisperRuntime.resolve(dims, dtype, device, max_batch=rows, **settings)
            return memory_need(dims, dtype, weight_bytes, rows, cuda=cuda, max_encoder_batch=rt.max_encoder_batch,
                               cuda_graphs=rt.cuda_graphs, decode_chunk=rt.decode_chunk, workspace_bytes=workspace,
                               alignment_heads=len(heads))

        rows, need = rows_that_fit(rows, need_at, memory_limit, "ASR decoder", fit=cuda and not max_batch)
        check_memory_limit(need, memory_limit)  # before anything goes to the GPU
        model = model.to(device=device, dtype=dtype)
        if int8:
            quantize_int8_(model)
        engine = cls(model, tok, model_name=name, max_batch=rows, alignment_heads=heads, **settings)
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
        window, bound = N_SAMPLES, None
        if self.runtime.clip_window:
            window, bound, plan.sample_len = clip_plan(audio.shape[0], plan.sample_len)
        if plan.beam_size > self.max_batch:
            raise EngineError(f"beam_size {plan.beam_size} exceeds this engine's {self.max_batch} decoder rows")
        if self.max_queue is not None and len(self._queue) >= self.max_queue:
            raise CapacityError(f"the speech recognition queue is full ({self.max_queue} waiting); retry later")
        dec = RequestDecoder(self.tok, plan, self.dims.n_text_ctx, self.dims.n_audio_ctx)
        self._queue[request_id] = _Active(request_id, ASRRequest(audio, request.options), dec, [],
                                          audio.shape[0] / SAMPLE_RATE, next(self._order), window, bound)

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

        With decode-ahead (`runtime.decode_ahead`), the chunk read here may be the one the previous step launched ahead, and the
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
        b = self._load_inputs(n, [toks + [0] * new, pos, minleft])
        if new:
            self.steps.tok[n - new:n].copy_(first)
        return self._run_chunk(reqs, b, k_max, min(pos), max(pos))

    def _chunk_steps(self, reqs: list[_Active], new: int = 0) -> int:
        """How many steps a chunk from the host's state runs for rows `reqs`: decode_chunk, or fewer where a row
        has less room (the last `new` of them one token further than the host knows: `_launch_chunk`)."""
        return min(self.decode_chunk, *(q.dec.room() - (i >= len(reqs) - new) for i, q in enumerate(reqs)))

    def _launch_first_chunk(self, choice: Choice, base: int) -> Chunk | None:
        """With decode-ahead, the first chunk of every row right after an admission's token choice is launched
        (rows base.._n-1 are the admitted, their first tokens `choice.greedy` on the device), before the host
        reads the choice: what the next step would launch once the host had read it. None unless every row is
        greedy without timestamps and has room for a token more."""
        n, reqs = self._n, self._greedy_rows()
        if (not self.runtime.decode_ahead or reqs is None or choice.greedy.shape[0] != n - base
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
        (its steps advance them: `DecoderSteps.greedy`), or None: without decode-ahead, while requests wait
        (they are admitted after the chunk being read, not after one more), or when a row has no room left after
        `chunk`. A row that ends in `chunk` computes a chunk nobody reads."""
        if not self.runtime.decode_ahead or self._queue or chunk.layout != self._layout:
            return None
        k = min(self.decode_chunk, min(q.dec.room() for q in chunk.reqs) - chunk.steps)
        if k < 1:
            return None
        return self._run_chunk(chunk.reqs, chunk.bucket, k, chunk.lo + chunk.steps, chunk.hi + chunk.steps)

    def _run_chunk(self, reqs: list[_Active], b: int, k_max: int, lo: int, hi: int) -> Chunk:
        """k_max greedy steps of bucket b from the steps' inputs on the device, then their history's copy to the
        host queued (`HistoryCopies`). On a GPU each step is a greedy graph replay and two history writes
        (3 torch calls a step); with chunk graphs, a full chunk (no row near its limit) of a bucket warm-up
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
        chunk graphs, a full chunk, and a graph warm-up captured (a missing one is never captured here). A full
        chunk is as long as the graph's, the history's length (what decode_chunk was at warm-up: a benchmark that
        lowers decode_chunk afterwards, whisper_bench's chunk-1 latency, runs step by step)."""
        return self.runtime.chunk_graphs and k_max == self._hist.shape[1] and self.steps.has_graph("chunk", b)

    def warmup(self) -> None:
        """Make every shape the engine will run now (only while idle), so no request pays a
        first-time cost: the decoder step (compiled layers and graphs) of every bucket, the encoder
        (compiled layers and graphs) of every encoder batch bucket, and the admission work (cross
        keys/values, language detection and prefill, token choice) for every admission size
        1..max_encoder_batch, which also captures the prefill graphs of every encoder bucket for both
        prompt lengths serving meets (with and without <|notimestamps|>), the chunk graphs of every
        bucket (only here, never while serving) and the word timings' graphs (warmup.py)."""
        if self._n or self._queue or not self.is_cuda:
            return
        with torch.inference_mode(), self.on_stream():
            warm_up(self)

    # ------------------------------------------------------------------------------ admission
    def encoder_buckets(self) -> list[int]:
        return doubling(self.max_encoder_batch)

    def _admit(self) -> tuple[list[_Active], torch.Tensor, torch.Tensor] | None:
        """Move queued requests into free rows; returns them, their first-step logits and their no-speech
        probabilities (row order)."""
        window = next(iter(self._active.values())).window if self._active else None
        chosen = choose_admissions(self._queue.values(), window, self.max_batch - self._n, self.max_encoder_batch)
        if not chosen:
            return None
        self._admitting = chosen
        if not self._active and self.runtime.clip_window:
            self.cache.window(chosen[0].window // (2 * HOP_LENGTH))
        self._give_rows(chosen)
        return chosen, *self.admission.run(chosen, self._warming)

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
            if req.window < N_SAMPLES and repeating(result.compression_ratio, len(result.tokens), req.bound):
                self._decode_again_in_full(req)
                continue
            if req.request.options.word_timestamps and result.tokens and not self._warming:
                timed.append((req, result))
            else:
                outputs.append(EngineOutput(req.rid, result, True))
        try:
            outputs += yield from self.words.with_words(timed)
        finally:
            self._release(finished)
        return outputs

    def _decode_again_in_full(self, req: _Active) -> None:
        """Queue `req`, which looped in its clip's window (clip_window.py), again, first in its line, to be
        decoded afresh in the 30 s window."""
        log.info("whisper: request %s repeated itself in a %.0f s window: decoding it again in 30 s", req.rid,
                 req.window / SAMPLE_RATE)
        plan = DecodePlan.from_options(req.request.options, self.tok, self.dims.n_text_ctx)
        dec = RequestDecoder(self.tok, plan, self.dims.n_text_ctx, self.dims.n_audio_ctx)
        self._queue[req.rid] = _Active(req.rid, req.request, dec, [], req.seconds, req.order, N_SAMPLES)

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
