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
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voiced.engines.base import SAMPLE_RATE, ASRRequest, CapacityError, EngineError, EngineOutput, Transcript

from .audio import N_SAMPLES, log_mel_spectrogram, pad_or_trim
from .checkpoint import CheckpointError, load_checkpoint, tokenizer_search_dirs
from .decoding import DecodePlan, RequestDecoder, Suppression
from .model import KVCache, ModelDims, Whisper
from .registry import resolve
from .tokenizer import WhisperTokenizer

log = logging.getLogger(__name__)

NEG_INF = float("-inf")


@dataclass
class _Active:
    rid: int
    request: ASRRequest
    dec: RequestDecoder
    rows: list[int]
    seconds: float
    order: int


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


class WhisperEngine:
    """`ASREngine` over our PyTorch Whisper. Create it with `WhisperEngine.load(...)`."""

    backend = "torch"

    def __init__(self, model: Whisper, tokenizer: WhisperTokenizer, *, model_name: str = "whisper",
                 max_batch: int = 8, max_encoder_batch: int | None = None, cuda_graphs: bool = True,
                 max_queue: int | None = None):
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
        self.max_encoder_batch = max_encoder_batch or (16 if self.is_cuda else 4)
        self.max_queue = max_queue
        self.cache = model.allocate_cache(max_batch)
        self.suppress = Suppression.build(tokenizer, self.dims.n_vocab, model.device)
        self._queue: dict[int, _Active] = {}
        self._active: dict[int, _Active] = {}
        self._owner: list[tuple[_Active, int] | None] = [None] * max_batch  # row -> (request, beam)
        self._n = 0  # live rows, always packed at 0.._n-1
        self._stash: list[EngineOutput] = []
        self._order = itertools.count()
        self._private_ids = itertools.count(-1, -1)
        # CUDA graphs: one per batch-size bucket, fed through static input buffers.
        self.cuda_graphs = cuda_graphs and self.is_cuda
        self.buckets = self._buckets(max_batch) if self.is_cuda else []
        if self.is_cuda:
            self._tok_buf = torch.zeros(max_batch, dtype=torch.long, device=model.device)
            self._pos_buf = torch.zeros(max_batch, dtype=torch.long, device=model.device)
            self._host_buf = torch.zeros(2, max_batch, dtype=torch.long).pin_memory()
            self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
            self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        log.info("whisper engine %s on %s (%s): %d slots, %.1f MiB of KV cache, cuda graphs %s", model_name,
                 self.device, str(self.dtype).replace("torch.", ""), max_batch,
                 max_batch * KVCache.bytes_per_slot(self.dims, self.dtype) / 2**20, self.cuda_graphs)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, name_or_path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None, *,
             max_batch: int | None = None, kv_cache_bytes: int | None = None, cuda_graphs: bool = True,
             max_encoder_batch: int | None = None, max_queue: int | None = None,
             cache_root: Path | None = None) -> WhisperEngine:
        """Load an official name (from the model cache), an OpenAI `.pt` or a Hugging Face directory.

        device: "cpu", "cuda" or "cuda:N". dtype: default float16 on CUDA, float32 on CPU.
        max_batch: decoder rows (a beam-search request takes `beam_size` rows); default 8 on CPU,
        64 on CUDA. kv_cache_bytes: a memory budget for the self+cross KV caches; the row count is
        the smaller of what it allows and max_batch.
        """
        path = resolve(name_or_path, cache_root)
        dims, state = load_checkpoint(path)
        model = build_model(dims, state, str(path))
        tok = WhisperTokenizer.load(dims.multilingual, dims.num_languages, tokenizer_search_dirs(path, cache_root))
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
        if isinstance(dtype, str):
            dtype = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                     "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}[dtype]
        dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
        model = model.to(device=device, dtype=dtype)
        rows = max_batch or (64 if device.startswith("cuda") else 8)
        if kv_cache_bytes is not None:
            fit = kv_cache_bytes // KVCache.bytes_per_slot(dims, dtype)
            if fit < 1:
                raise EngineError(f"a KV-cache budget of {kv_cache_bytes / 2**20:.0f} MiB holds no decoder row; "
                                  f"one row needs {KVCache.bytes_per_slot(dims, dtype) / 2**20:.1f} MiB")
            rows = min(rows, int(fit))
        name = path.stem if path.is_file() else path.name
        return cls(model, tok, model_name=name, max_batch=rows, max_encoder_batch=max_encoder_batch,
                   cuda_graphs=cuda_graphs, max_queue=max_queue)

    @staticmethod
    def _buckets(max_batch: int) -> list[int]:
        out, b = [], 1
        while b < max_batch:
            out.append(b)
            b *= 2
        return out + [max_batch]

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
            for out in self.step():
                if out.request_id == rid:
                    if out.error:
                        raise EngineError(out.error)
                    return out.value
                self._stash.append(out)

    def step(self) -> list[EngineOutput]:
        outputs, self._stash = self._stash, []
        if not self._queue and not self._active:
            return outputs
        try:
            with torch.inference_mode():
                outputs += self._step()
        except (EngineError, torch.cuda.OutOfMemoryError, RuntimeError) as e:
            # A failure inside a batched step cannot be pinned on one request: fail them all, free
            # every row, and keep the engine usable for new work.
            log.exception("whisper step failed")
            failed = list(self._active.values())
            self._active.clear()
            self._release(failed)
            outputs += [EngineOutput(r.rid, None, True, f"speech recognition failed: {e}") for r in failed]
        return outputs

    # ------------------------------------------------------------------------------- internals
    def _step(self) -> list[EngineOutput]:
        n_old = self._n
        parts = []
        if n_old:
            parts.append(self._decode(n_old))
        admitted = self._admit()
        if admitted is not None:
            parts.append(admitted)
        if not parts:
            return []
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self._select(logits)

    def _row_inputs(self, n: int) -> tuple[list[int], list[int]]:
        toks, pos = [0] * n, [0] * n
        for r in range(n):
            req, j = self._owner[r]
            toks[r] = req.dec.beams[j][-1]
            pos[r] = req.dec.position()
        return toks, pos

    def _decode(self, n: int) -> torch.Tensor:
        toks, pos = self._row_inputs(n)
        step = self.model.decoder.step
        if not self.is_cuda:
            # CPU: attend only as far as the longest row; no mask when every row is at one position.
            kv_len = max(pos) + 1
            t = torch.tensor(toks, device=self.device)
            p = torch.tensor(pos, device=self.device)
            return step(t, p, self.cache, kv_len, masked=min(pos) != kv_len - 1)
        # GPU: pad to a bucket and always attend over the whole context with a mask, so the eager
        # path and the graph run the very same kernels (and padded rows only touch free slots).
        b = next(x for x in self.buckets if x >= n)
        # Through a pinned staging buffer: reusing it is safe, the previous step's copy finished
        # before that step read its tokens back.
        host = self._host_buf
        host.zero_()
        host[0, :n] = torch.tensor(toks)
        host[1, :n] = torch.tensor(pos)
        self._tok_buf[:b].copy_(host[0, :b], non_blocking=True)
        self._pos_buf[:b].copy_(host[1, :b], non_blocking=True)
        if not self.cuda_graphs:
            return step(self._tok_buf[:b], self._pos_buf[:b], self.cache, self.dims.n_text_ctx)[:n]
        if b not in self._graphs:
            self._capture(b)
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]

    def _capture(self, b: int) -> None:
        """Record the decoder step for batch bucket `b` from the static input buffers.

        Warm-up runs write the same keys/values the real step will (the buffers already hold this
        step's inputs), and padded rows write only into free slots, so capturing mid-stream is safe.
        """
        step = self.model.decoder.step
        args = (self._tok_buf[:b], self._pos_buf[:b], self.cache, self.dims.n_text_ctx)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step(*args)
        self._graphs[b] = (graph, out)
        log.debug("captured decoder step graph for batch %d", b)

    def warmup(self) -> None:
        """Capture every bucket's CUDA graph now (only while idle), so no request pays for it."""
        if not self.cuda_graphs or self._n:
            return
        with torch.inference_mode():
            self._tok_buf.zero_()
            self._pos_buf.zero_()
            for b in self.buckets:
                if b not in self._graphs:
                    self._capture(b)
            torch.cuda.synchronize()

    def _admit(self) -> torch.Tensor | None:
        """Move queued requests into free rows; returns their first-step logits (row order)."""
        if not self._queue:
            return None
        free = self.max_batch - self._n
        chosen: list[_Active] = []
        for req in sorted(self._queue.values(), key=lambda r: (-r.request.options.priority, r.order)):
            if len(chosen) >= self.max_encoder_batch:
                break
            if req.dec.plan.beam_size <= free:
                chosen.append(req)
                free -= req.dec.plan.beam_size
        if not chosen:
            return None
        for req in chosen:
            del self._queue[req.rid]
            req.rows = list(range(self._n, self._n + req.dec.plan.beam_size))
            for j, r in enumerate(req.rows):
                self._owner[r] = (req, j)
            self._n += len(req.rows)
            self._active[req.rid] = req
        model, tok, dev = self.model, self.tok, self.model.device
        # Encoder over the new audio, then every layer's cross keys/values into each request's rows.
        audio = torch.stack([pad_or_trim(torch.from_numpy(r.request.audio)) for r in chosen]).to(dev)
        mel = log_mel_spectrogram(audio, self.dims.n_mels).to(self.dtype)
        features = model.encoder(mel)
        source = torch.tensor([i for i, r in enumerate(chosen) for _ in r.rows], device=dev)
        rows = torch.tensor([x for r in chosen for x in r.rows], device=dev)
        model.decoder.write_cross(self.cache, rows, features[source])
        # Language detection: the distribution after <|startoftranscript|> alone, over language tokens.
        detect = [r for r in chosen if r.dec.plan.language is None]
        if detect:
            first_rows = torch.tensor([r.rows[0] for r in detect], device=dev)
            sot = torch.full((len(detect), 1), tok.sot, dtype=torch.long, device=dev)
            lang_logits = model.decoder.prefill(sot, first_rows, self.cache)[:, 0]
            only_langs = torch.full_like(lang_logits, NEG_INF)
            ids = list(tok.language_tokens)
            only_langs[:, ids] = lang_logits[:, ids]
            best = only_langs.argmax(dim=-1).tolist()
            probs = only_langs.softmax(dim=-1)[:, ids].cpu().tolist()
            for r, b, p in zip(detect, best, probs):
                r.dec.language_probs = dict(zip(tok.language_codes, p))
                r.dec.plan.language = tok.language_codes[b - tok.sot - 1]
        # Prefill the initial tokens, grouped by length (they differ only with prompts).
        out = torch.empty(sum(len(r.rows) for r in chosen), self.dims.n_vocab, device=dev)
        base = chosen[0].rows[0]
        groups: dict[int, list[_Active]] = {}
        for r in chosen:
            groups.setdefault(len(r.dec.start(r.dec.plan.language)), []).append(r)
        for group in groups.values():
            toks = torch.tensor([r.dec.initial for r in group for _ in r.rows], device=dev)
            grows = [x for r in group for x in r.rows]
            logits = model.decoder.prefill(toks, torch.tensor(grows, device=dev), self.cache)
            sot_idx = torch.tensor([r.dec.sot_index for r in group for _ in r.rows], device=dev)
            at_sot = logits[torch.arange(len(grows), device=dev), sot_idx]
            no_speech = at_sot.softmax(dim=-1)[:, tok.no_speech].tolist()
            k = 0
            for r in group:
                r.dec.no_speech_prob = no_speech[k]
                k += len(r.rows)
            out[torch.tensor(grows, device=dev) - base] = logits[:, -1]
        return out

    def _select(self, logits: torch.Tensor) -> list[EngineOutput]:
        """Filter, pick tokens for all rows, advance every request; returns finished ones."""
        dev = logits.device
        logits.masked_fill_(self.suppress.always, NEG_INF)
        reqs = list(self._active.values())
        # The per-request rules, batched: one indexing op for all first steps (no blank / end-of-text
        # first) and one for all rows still under their minimum length; timestamp rules per request.
        first = [r for q in reqs if q.dec.n_sampled == 0 for r in q.rows]
        if first:
            logits[torch.tensor(first, device=dev)[:, None], torch.tensor(self.suppress.blank, device=dev)] = NEG_INF
        short = [r for q in reqs if q.dec.n_sampled < q.dec.plan.min_new_tokens for r in q.rows]
        if short:
            logits[torch.tensor(short, device=dev), self.tok.eot] = NEG_INF
        for req in reqs:
            if req.dec.plan.timestamps:
                idx = torch.tensor(req.rows, device=dev)
                sub = logits[idx]
                req.dec.timestamp_rules(sub)
                logits[idx] = sub
        greedy = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen_lp = logprobs.gather(1, greedy[:, None])[:, 0]
        beam_tops: dict[int, tuple[list, list]] = {}
        for k in sorted({r.dec.plan.beam_size for r in reqs if r.dec.plan.beam_size > 1}):
            rows = [x for r in reqs if r.dec.plan.beam_size == k for x in r.rows]
            vals, ids = logprobs[torch.tensor(rows, device=dev)].topk(k + 1, dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
            for i, row in enumerate(rows):
                beam_tops[row] = (vals[i], ids[i])
        greedy_l, lp_l = greedy.tolist(), chosen_lp.tolist()
        finished: list[_Active] = []
        for req in reqs:
            d = req.dec
            if d.plan.beam_size == 1:
                r = req.rows[0]
                d.update_greedy(greedy_l[r], lp_l[r])
            else:
                src = d.update_beam([beam_tops[r][0] for r in req.rows], [beam_tops[r][1] for r in req.rows])
                if not d.done and src != list(range(len(src))):
                    dst = torch.tensor(req.rows, device=dev)
                    self.cache.move(dst, dst[torch.tensor(src, device=dev)], self_only=True)
            if d.done:
                finished.append(req)
        outputs = []
        for req in finished:
            del self._active[req.rid]
            outputs.append(EngineOutput(req.rid, req.dec.result(req.seconds), True))
        self._release(finished)
        return outputs

    def _release(self, leaving: list[_Active]) -> None:
        """Free the rows of `leaving` and pack the live rows back to 0..n-1."""
        if not leaving:
            return
        for req in leaving:
            for r in req.rows:
                self._owner[r] = None
            req.rows = []
        live = self._n - sum(1 for r in range(self._n) if self._owner[r] is None)
        holes = [r for r in range(live) if self._owner[r] is None]
        movers = [r for r in range(live, self._n) if self._owner[r] is not None]
        if holes:
            dev = self.cache.self_k.device
            self.cache.move(torch.tensor(holes, device=dev), torch.tensor(movers, device=dev))
            for h, m in zip(holes, movers):
                req, j = self._owner[m]
                req.rows[j] = h
                self._owner[h], self._owner[m] = (req, j), None
        self._n = live
