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

This module holds the step loop and a request's way through it; the rest has a module of its own:
served_lm.py (the LM as served: compiled layers, packed prefills, decode steps with their sampling, all
replayed from CUDA graphs, lm_graphs.py), qwen2.py (the model), sampling.py, streaming.py (chunked decoding),
prompt.py (sentences and the LM's prompt), request.py (the request record, its State, the phases),
lm_steps.py (decode steps per round trip, packed-prefill sizes), vocoder_schedule.py (when the vocoder
runs, whom it serves first, which windows it batches: the policy), warmup.py, memory_plan.py (what
`load` will hold on the GPU) and reference.py (a cloned voice's tokens from its recording).
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import record_function

from voiced.engines.base import (
    SAMPLE_RATE,
    AudioChunk,
    EngineError,
    EngineOutput,
    StepParts,
    TTSOptions,
    TTSRequest,
    fault_output,
    finish,
    resumed_in,
)
from voiced.engines.dtypes import parse_dtype
from voiced.engines.rows import compaction, to_device
from voiced.memory_plan import AUTO_GPU_ROWS, EngineNeed, check_memory_limit, rows_that_fit

from . import lm_steps, vocoder_schedule
from .bicodec import BiCodec, load_bicodec
from .checkpoint import SparkCheckpoint, SpecialTokens, TextTokenizer, load_special_tokens, resolve
from .lm_steps import DECODE_STEPS, PREFILL_BUCKET
from .memory_plan import plan, rows_for_budget
from .prompt import N_GLOBAL, TOKENS_PER_SECOND, build_prompt, longest_prompt, split_text
from .qwen2 import Qwen2Config
from .reference import ReferenceTokenizer, voice_store
from .request import PHASE_GLOBAL, PHASE_SEMANTIC, Request, State, phase_bias, semantic_phase_markers
from .sampling import PhaseSampler, candidate_bucket
from .served_lm import ServedLM, load_served_lm
from .streaming import ChunkPlanner
from .vocoder_schedule import VocoderSchedule
from .voices import LANGUAGES, Voice
from .warmup import warm_up

log = logging.getLogger(__name__)

# A sentence whose speech runs far past any plausible length is a runaway (a sampled loop that never
# reaches <|im_end|>); end it and move on rather than spend the request's whole budget on it.
SEGMENT_BASE_S, SEGMENT_S_PER_CHAR = 3.0, 0.3
GLOBAL_PHASE_LIMIT = N_GLOBAL + 64  # a controllable prompt that has not produced its speaker by then failed
SPEAKER_CACHE = 64  # speaker vectors kept (see SparkTTSEngine._speaker)
PHASES = ("prefill", "decode", "vocode")


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


class SparkTTSEngine:
    """Spark-TTS-0.5B in PyTorch. Build with `SparkTTSEngine.load(...)`; drive from one thread."""

    backend = "torch"
    languages = LANGUAGES
    memory_need: EngineNeed | None = None  # set by load(): what it holds on its device

    def __init__(self, checkpoint: SparkCheckpoint, lm: ServedLM, codec: BiCodec, tokenizer: TextTokenizer,
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
        # The vocoder's window decodes replayed from CUDA graphs captured at warm-up (vocoder_graphs.py): one
        # host call instead of ~400 kernel launches a vocoder turn.
        self.vocoder_graphs = self.use_cuda_graphs
        self.radius = codec.receptive_radius()
        self.segment_base_s, self.segment_s_per_char = SEGMENT_BASE_S, SEGMENT_S_PER_CHAR
        if decode_steps < 1:
            raise EngineError("decode_steps must be at least 1")
        self.decode_steps = decode_steps
        lm.setup_cache(max_batch, max_seq_len)
        self._bias = phase_bias(special, lm.config.vocab_size, device)
        # Every id any phase allows lies in [lo, hi): the head only computes that slice. The slice of
        # `_bias` is a view, so later edits to `_bias` (`force_reply_lengths`) still apply.
        allowed = torch.isfinite(self._bias).any(0).nonzero()[:, 0]
        self._vocab_lo, self._vocab_hi = int(allowed.min()), int(allowed.max()) + 1
        self._samplers: dict[int, PhaseSampler] = {}
        self._speakers: dict[tuple[int, ...], torch.Tensor] = {}  # _speaker's cache, oldest first
        pin = str(device).startswith("cuda")
        # The decode state's host side (StepState's field order), written through numpy views: filling
        # it costs no torch call per row or field, then two copies send it (`_load_state`).
        self._host_ints = torch.zeros(7, max_batch, dtype=torch.long, pin_memory=pin)
        self._host_floats = torch.zeros(2, max_batch, dtype=torch.float32, pin_memory=pin)
        self._ints_np, self._floats_np = self._host_ints.numpy(), self._host_floats.numpy()
        self._queue: list[Request] = []
        self._active: list[Request] = []  # index == cache row
        self._arrival = itertools.count()
        self._order: dict[int, int] = {}
        self._last_kind = PHASES[-1]
        self._jumped = False  # the last step was a first prefill taken out of turn (see `step`)
        # What the last step did (tests, profiling): its kind and how much work.
        self.last_step: dict = {}
        self.vocoder = VocoderSchedule(codec, device, self.radius)
        self.vocoder_work = self.vocoder.work
        self._tokenize_reference = ReferenceTokenizer(codec, checkpoint, device)  # wav2vec2 on first use
        self.voices = voice_store(checkpoint, self._tokenize_reference, voices_dir)

    # ------------------------------------------------------------------------------- loading

    @classmethod
    def load(cls, name_or_path: str | Path = "spark-tts-0.5b", device: str | None = None,
             dtype: str | torch.dtype | None = None, max_batch: int | None = None, voices_dir: str | Path | None = None,
             kv_cache_bytes: int | None = None, max_seq_len: int = 4096, codec_dtype: str | torch.dtype | None = None,
             use_cuda_graphs: bool = True, decode_steps: int = DECODE_STEPS,
             compile_lm: bool | None = None, memory_limit: tuple[int, float] | None = None) -> SparkTTSEngine:
        """Load a Spark-TTS-0.5B directory (or the cached model by name).

        max_batch: the requests (rows) decoded together; None or 0: 16 on CPU, and on CUDA the most of 64, 32,
            16, ... whose need fits memory_limit (memory_plan.rows_that_fit).
        dtype: the LM's (default bf16 on GPU, fp32 on CPU; fp16 is refused: it overflows in this LM).
        kv_cache_bytes: a budget from the daemon's memory plan; it caps max_batch for max_seq_len.
        use_cuda_graphs: on a GPU, replay the LM's decode steps, packed prefills and the vocoder's window decodes
            from CUDA graphs (False: the same steps launched kernel by kernel, the reference the graphs are
            tested against).
        compile_lm: torch.compile the decode and prefill layers (fused kernels: a decode step ~2.5x faster;
            ~20 s more warm-up; the daemon's `[tts] compile`). None: on for CUDA when Triton is installed.
            Tokens match the uncompiled path up to bf16 rounding.
        memory_limit: (free GPU bytes, the [memory] tts_kv_fraction): the computed need (`memory_plan.plan`) is
            checked against that share before anything goes to the GPU; above it, an EngineError naming the setting.
        """
        ckpt = resolve(name_or_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = device.startswith("cuda")
        lm_dtype = parse_dtype(dtype, "bfloat16 or float32") or (torch.bfloat16 if cuda else torch.float32)
        if lm_dtype == torch.float16:
            raise EngineError("fp16 is unusable for the Spark-TTS LM (activations overflow); use bfloat16 or float32")
        # BiCodec in bf16 on the GPU: its convolutions at 1536 channels are most of a chunk's cost and
        # run on the tensor cores in bf16; fp32 on the CPU, where streamed == offline is checked exactly.
        c_dtype = parse_dtype(codec_dtype, "bfloat16 or float32") or (torch.bfloat16 if cuda else torch.float32)
        tokenizer = TextTokenizer(ckpt.llm_dir)
        special = load_special_tokens(ckpt.llm_dir, tokenizer)
        wanted = max_batch or (AUTO_GPU_ROWS if cuda else 16)
        rows = rows_for_budget(Qwen2Config.from_json(ckpt.llm_dir / "config.json"), wanted, max_seq_len,
                               lm_dtype, kv_cache_bytes)
        if rows < wanted:
            log.info("TTS KV budget fits %d concurrent requests (asked for %d)", rows, wanted)
        vocoder_graphs = cuda and use_cuda_graphs

        def need_at(rows: int):
            return plan(ckpt, device, lm_dtype, c_dtype, rows, max_seq_len, use_cuda_graphs, decode_steps,
                        vocoder_graphs)

        rows, need = rows_that_fit(rows, need_at, memory_limit, "TTS", fit=cuda and not max_batch)
        check_memory_limit(need, memory_limit)  # before anything goes to the GPU
        lm = load_served_lm(ckpt.llm_dir, device, lm_dtype)
        if lm.config.vocab_size < special.semantic_base + special.n_semantic:
            raise EngineError(f"{ckpt.llm_dir}: vocab_size {lm.config.vocab_size} has no room for the BiCodec tokens")
        codec = load_bicodec(ckpt.bicodec_dir, ckpt.root_config, device, c_dtype)
        if compile_lm is None:
            compile_lm = cuda and _has_triton()
        if compile_lm:
            lm.compile_decode()
        engine = cls(ckpt, lm, codec, tokenizer, special, device=device, max_batch=rows, max_seq_len=max_seq_len,
                     voices_dir=voices_dir, use_cuda_graphs=use_cuda_graphs, model_name=ckpt.root.name,
                     decode_steps=decode_steps)
        engine.memory_need = need
        return engine

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
        Nothing to do on the CPU. Skipped while requests are in flight (it uses their cache rows).
        The pieces are in warmup.py."""
        if self.has_work() or not str(self.device).startswith("cuda"):
            return
        warm_up(self, first_chunk_tokens, chunk_tokens)

    # ------------------------------------------------------------------ benchmarking on random weights

    def force_reply_lengths(self) -> None:
        """Benchmarks on random weights: make every reply as long as its duration cap (`max_seconds`),
        as a trained model's long replies are. In the semantic phase only semantic tokens may be
        sampled (random weights would end at once, or loop on a marker token that carries no audio),
        and no sentence is cut as a runaway. For benchmarking only: replies stop being speech."""
        for t in semantic_phase_markers(self.special):
            self._bias[PHASE_SEMANTIC, t] = float("-inf")
        self.segment_base_s = 1e6

    def use_random_voice(self, seed: int = 0) -> list[int]:
        """Benchmarks on random weights: every voice name resolves to one cloned voice, a speaker of
        N_GLOBAL global tokens drawn with `seed` (no prompt continuation), here and for whoever
        resolves voices through `self.voices` (the doors). Returns the speaker's global ids."""
        speaker = torch.randint(0, 4096, (N_GLOBAL,), generator=torch.Generator().manual_seed(seed)).tolist()
        self.voices.only = Voice("bench", "cloned", global_ids=speaker)
        return speaker

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
        req = Request(request_id, opts, voice, segments, seed,
                      max_semantic=max(1, int(opts.max_seconds * TOKENS_PER_SECOND)), t_submit=time.perf_counter())
        longest = max(len(self._prompt(req, i)) for i in range(len(segments)))
        if longest > longest_prompt(self.max_seq_len):
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

    def step(self) -> list[EngineOutput]:
        return finish(self.step_parts())

    def step_parts(self) -> StepParts:
        """`step`, yielding where it waits for the GPU: after launching a prefill's, a decode's or a
        vocoder turn's work, before reading its tokens or audio back (engines/base.py)."""
        return resumed_in(self._step(), torch.no_grad)

    def _step(self) -> StepParts:
        outputs: list[EngineOutput] = []
        self._admit()
        if not self._active:
            self.last_step = {"kind": None}
            return outputs
        now = time.perf_counter()
        # For a request alone, which kind runs depends only on what is pending, never on the clock: it is
        # stepped the same way (and its windows batched the same way) in the daemon and in `synthesize`.
        ready = self.vocoder.ready_rows(self._active, now)
        work = {"prefill": any(r.state is State.PREFILL for r in self._active),
                "decode": any(r.state is State.DECODING for r in self._active),
                "vocode": bool(ready)}
        if work["vocode"] and work["decode"] and vocoder_schedule.first_chunk_decoding(self._active):
            # A caller is waiting for the first sound of a reply: its decode steps go back to back,
            # and the others' chunks wait while their audio stays VOCODER_SLACK_S ahead of playback.
            work["vocode"] = vocoder_schedule.urgent(self._active, now)
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
            yield from self._prefill_step(outputs)
        elif kind == "decode":
            yield from self._decode_step(outputs)
        else:
            with record_function("spark.vocode"):
                turn = self.vocoder.launch(ready, now, self._order, self._active, self.last_step)
            try:
                yield
            except BaseException:  # closed unread (the thread stopping): the windows go back
                turn.roll_back()
                raise
            with record_function("spark.vocode"):
                outputs += self._vocode(*self.vocoder.collect(turn))
        return outputs

    def _first_prefill_waiting(self) -> bool:
        """Some request in the batch waits for the prefill of its first sentence (no audio of it yet)."""
        return any(r.state is State.PREFILL and r.seg == 0 and r.t_first_chunk is None for r in self._active)

    def _prefill_step(self, outputs: list[EngineOutput]) -> StepParts:
        """Prefill the rows starting a segment (one packed pass), then sample each one's first token.

        This is where a request joins the batch, so its faults are held to the requests prefilled: one
        alone fails; a group goes back to be prefilled one by one (see `_prefill_failed`)."""
        with record_function("spark.prefill"):
            fresh, hidden = self._prefill_fresh(outputs)
        if not fresh or not self._active:
            return
        try:
            with record_function("spark.prefill"):
                pick = self._sampler([r.options.top_k for r in self._active])
                self._load_state()
                # The first token of each new segment, from its prompt's last hidden state: one sampler
                # call for all of them (row by row, ~150 torch calls a request), on their rows of
                # the state: a slice when they are consecutive (new requests take the rows at the end),
                # else an index.
                slots = [r.slot for r in fresh]
                consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
                rows = slice(slots[0], slots[0] + len(slots)) if consecutive else to_device(slots, self.device)
                picked = pick(self.lm, hidden, self.lm.state, rows)
            yield
            first = picked.tolist()  # the step's one sync
        except Exception as e:
            self._prefill_failed(fresh, e, outputs)
            return
        for r, token in list(zip(fresh, first)):
            if r.slot < 0:  # released meanwhile: another request's fault moved nothing of it
                continue
            try:
                self._advance(r, token)
            except Exception as e:  # this request's token: its fault alone
                outputs.append(self._fault(r, e))
        self.last_step["prefilled"] = len(fresh)

    def _prefill_failed(self, group: list[Request], error: Exception, outputs: list[EngineOutput]) -> None:
        """A prefill (a request joining the batch) failed: alone, the request caused it; in a group (out
        of memory, or a fault none of them can be blamed for), each is prefilled alone next."""
        if len(group) == 1:
            outputs.append(self._fault(group[0], error))
            return
        log.warning("prefill of %d requests together failed (%s: %s); prefilling them one by one",
                    len(group), type(error).__name__, str(error))  # not the error: a kept log record would keep its frames
        for r in group:
            r.solo = True
            r.state = State.PREFILL

    def _decode_step(self, outputs: list[EngineOutput]) -> StepParts:
        """`decode_steps` decode steps for rows 0..n-1; only the decoding rows take their tokens (a row
        waiting for its prefill or for its last windows runs along as padding: what it writes lies past
        its position, and what it samples is dropped). A failure of the shared pass raises with no row
        advanced (`_load_state` rewrites every row's inputs next time); a row's own tokens failing
        fails that request alone."""
        with record_function("spark.decode"):
            pick = self._sampler([r.options.top_k for r in self._active])
            self._load_state()
            n = len(self._active)
            rows = [r for r in self._active if r.state is State.DECODING]
            out = self.lm.run_steps(pick, n, self.decode_steps, max_pos=max(r.pos for r in rows),
                                    use_graph=self.use_cuda_graphs)
        yield
        with record_function("spark.readback"):
            tokens = out.tolist()  # the step's one sync: every row's new tokens
        for r, row_tokens in [(r, tokens[r.slot]) for r in rows]:  # slots move when one fails
            if r.slot < 0:
                continue
            try:
                for t in row_tokens:
                    if r.sentence_over:
                        break  # sampled past its end: dropped
                    r.pos += 1
                    self._advance(r, t)
            except Exception as e:  # this request's tokens: its fault alone
                outputs.append(self._fault(r, e))
        self.last_step["decoded_rows"] = len(rows)

    def _prefill_fresh(self, outputs: list[EngineOutput]) -> tuple[list[Request], torch.Tensor | None]:
        """Prefill rows that start a segment, highest priority first, packed into one pass of at most
        PREFILL_STEP_TOKENS (at least one prompt); returns the requests and their prompts' last hidden
        states [n, C] (None when there were none)."""
        waiting = sorted((r for r in self._active if r.state is State.PREFILL),
                         key=lambda r: (-r.options.priority, self._order.get(r.rid, 0)))
        group: list[tuple[Request, list[int]]] = []
        size = 0
        for r in waiting:
            if group and (group[0][0].solo or r.solo):
                if group[0][0].solo:
                    break
                continue  # it goes in alone, at a later step
            try:
                ids = self._prompt(r, r.seg)
                if group and size + len(ids) > lm_steps.PREFILL_STEP_TOKENS:
                    break
                group.append((r, self._begin_segment(r, ids)))
                size += len(ids)
            except EngineError as e:  # the request cannot be served (its prompt is too long)
                outputs.append(self._fail(r, str(e)))
            except Exception as e:  # one request's fault must not stop the others
                log.exception("prefill failed for request %s", r.rid)
                outputs.append(self._fault(r, e))
        if not group:
            return [], None
        try:
            # the ids go as they are: the LM packs them into one host block, sent in one copy
            hidden = self.lm.prefill_many([ids for _, ids in group], [r.slot for r, _ in group],
                                          pad_to=PREFILL_BUCKET, use_graph=self.use_cuda_graphs)
        except Exception as e:
            log.error("prefill failed for requests %s", [r.rid for r, _ in group], exc_info=e)
            self._prefill_failed([r for r, _ in group], e, outputs)
            return [], None
        self.last_step["prefill_tokens"] = size
        return [r for r, _ in group], hidden

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
        ints, floats = self._ints_np, self._floats_np
        ints[:] = 0
        ints[6] = 1
        floats[:] = 1.0
        top = self.max_seq_len - 1
        if self._active:
            # numpy, not torch: element by element this is ~700 dispatcher calls at 64 rows (3.7 ms of the
            # TTS thread's host time per decode step).
            slots = [r.slot for r in self._active]
            ints[:, slots] = np.array(
                [[r.last, min(r.pos, top), r.steps, r.phase, len(r.global_ids), r.seed, int(r.options.top_k)]
                 for r in self._active], dtype=ints.dtype).T
            floats[:, slots] = np.array(
                [[float(r.options.temperature), float(r.options.top_p)] for r in self._active], dtype=floats.dtype).T
        self.lm.state.load(self._host_ints, self._host_floats)

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

    def _prompt(self, r: Request, seg: int) -> list[int]:
        return build_prompt(self.special, self.tokenizer.encode, r.voice, r.segments[seg], r.global_ids)

    def _admit(self) -> None:
        """Queued requests into the free rows, highest priority first."""
        if not self._queue or len(self._active) >= self.max_batch:
            return
        self._queue.sort(key=lambda r: (-r.options.priority, self._order.get(r.rid, 0)))
        free = self.max_batch - len(self._active)
        chosen, self._queue = self._queue[:free], self._queue[free:]
        self._give_rows(chosen)

    def _give_rows(self, chosen: list[Request]) -> None:
        """Give each of `chosen` the next row; its sentence's prefill comes next."""
        for r in chosen:
            r.slot = len(self._active)
            self._active.append(r)
            if r.voice.kind == "cloned":
                r.global_ids = list(r.voice.global_ids or [])
            r.state = State.PREFILL

    def _begin_segment(self, r: Request, ids: list[int] | None = None) -> list[int]:
        """Reset r for its next sentence and return that sentence's prompt ids (prefilled by the caller)."""
        ids = self._prompt(r, r.seg) if ids is None else ids
        if len(ids) >= self.max_seq_len:
            raise EngineError(f"the prompt needs {len(ids)} tokens but the engine holds {self.max_seq_len} per request")
        r.prompt_tokens += len(ids)
        r.phase = PHASE_GLOBAL if (r.voice.kind == "preset" and not r.global_ids) else PHASE_SEMANTIC
        r.phase_steps = 0
        r.semantic = []
        chars = len(r.segments[r.seg])
        r.segment_cap = max(1, int((self.segment_base_s + self.segment_s_per_char * chars) * TOKENS_PER_SECOND))
        r.planner = ChunkPlanner(self.radius, r.options.first_chunk_tokens, r.options.chunk_tokens)
        if r.global_ids and r.speaker is None:
            r.speaker = self._speaker(r.global_ids)
        r.pos = len(ids)
        r.state = State.DECODING
        return ids

    def _speaker(self, global_ids: list[int]) -> torch.Tensor:
        """The speaker vector of these global ids, kept for the last SPEAKER_CACHE speakers: a
        registered voice's requests reuse it instead of paying a copy and the speaker decoder's small
        kernels in their prefill step (the vector is read-only downstream)."""
        key = tuple(global_ids)
        spk = self._speakers.pop(key, None)
        if spk is None:
            spk = self.codec.speaker_vector(to_device([global_ids], self.device))[0]
        self._speakers[key] = spk  # most recent last
        while len(self._speakers) > SPEAKER_CACHE:
            del self._speakers[next(iter(self._speakers))]
        return spk

    def _advance(self, r: Request, t: int) -> None:
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
                r.state = State.STOPPED
                r.global_ids = []
        elif sp.is_semantic(t):
            r.semantic.append(t - sp.semantic_base)
            r.total_semantic += 1
            if r.total_semantic >= r.max_semantic:
                r.state = State.STOPPED  # duration cap: stop the whole request
            elif len(r.semantic) >= r.segment_cap:
                log.warning("request %s: sentence %d ran past %d tokens without ending; moving on",
                            r.rid, r.seg, r.segment_cap)
                r.state = State.SENTENCE_END
        elif t in (sp.eos, sp.end_semantic):
            r.state = State.SENTENCE_END
        if r.pos >= self.max_seq_len and r.state is State.DECODING:
            r.state = State.SENTENCE_END

    def _vocode(self, rows: list[Request], pending: dict[int, list[np.ndarray]]) -> list[EngineOutput]:
        """Emit a vocoder turn's audio (`VocoderSchedule.launch` chose and queued the windows of `rows`,
        `collect` read back `pending`), and move a request whose sentence has gone out on to its next
        sentence, or end it."""
        outputs: list[EngineOutput] = []
        for r in rows:
            if r.slot < 0:
                continue
            pieces = pending.get(id(r), [])
            # The sentence is over once its last window has gone out.
            done = r.sentence_over and (r.planner is None or r.planner.emitted >= len(r.semantic))
            final = done and (r.state is State.STOPPED or r.seg + 1 >= len(r.segments))
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
                r.state = State.PREFILL
        return outputs

    def _fail(self, r: Request, message: str) -> EngineOutput:
        self._release(r)
        return EngineOutput(r.rid, None, final=True, error=message)

    def _fault(self, r: Request, error: Exception) -> EngineOutput:
        """A fault pinned on request r: it fails alone, the others go on."""
        log.error("speech synthesis request %s failed", r.rid, exc_info=error)
        self._release(r)
        return fault_output(r.rid, "speech synthesis", error)

    def _release(self, r: Request) -> None:
        """Free r's row and keep rows compact: the last active row moves into the hole."""
        self._order.pop(r.rid, None)
        if r not in self._active:
            return
        rows = self._active
        for src, dst in compaction([x is not r for x in rows]):
            mover = rows[src]
            self.lm.move_slot(mover.slot, dst, min(mover.pos, self.max_seq_len))
            mover.slot = dst
            rows[dst] = mover
        rows.pop()
        r.slot = -1

    # ------------------------------------------------------------------- voice registration

    def add_voice(self, name: str, audio: np.ndarray, transcript: str):
        return self.voices.add(name, audio, transcript)

    def list_voices(self):
        return self.voices.list()

    def delete_voice(self, name: str) -> bool:
        return self.voices.delete(name)


def _has_triton() -> bool:
    # triton comes with torch where torch.compile can use it; only its presence matters here.
    return importlib.util.find_spec("triton") is not None

