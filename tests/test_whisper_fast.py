"""The GPU arrangements (fused QKV, per-layer functions) compute the reference encoder and decoder step.

They only run on CUDA in the engine, but they are plain torch, so their arithmetic is checked here
in float32 on the CPU against `AudioEncoder.forward` and `TextDecoder.step`.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import assert_float32_close, make_openai_checkpoint, random_state_dict, tiny_dims

from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.align_graphs import ALIGN_GRAPH_ROWS, ALIGN_GRAPH_TOKENS
from voiced.engines.whisper.audio import N_SAMPLES, log_mel_spectrogram
from voiced.engines.whisper.checkpoint import build_model
from voiced.engines.whisper.engine import WhisperEngine, _Active
from voiced.engines.whisper.fast_decoder import SMALL_BATCH, FastDecoder
from voiced.engines.whisper.fast_encoder import FastEncoder
from voiced.engines.whisper.memory import align_graph_needs, memory_need, prefill_graph_needs
from voiced.engines.whisper.model import KVCache
from voiced.engines.whisper.prefill_graphs import Prefills


def test_fast_encoder_equals_reference_forward():
    dims = tiny_dims(n_mels=128)
    model = build_model(dims, random_state_dict(dims, seed=3)).eval()
    g = torch.Generator().manual_seed(0)
    audio = 0.1 * torch.randn(3, N_SAMPLES, generator=g)
    with torch.inference_mode():
        ref = model.encoder(log_mel_spectrogram(audio, dims.n_mels))
        got = FastEncoder(model.encoder, dims.n_mels)(audio, torch.float32)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_encoder_pass_leaves_the_cross_keys_values_write_cross_makes(tmp_path):
    """The encoder pass with the decoder's cross projections (`FastEncoder.encode`, the GPU's pass, here in
    float32 on the CPU) leaves in `cross_out[:, :, :b]` what `TextDecoder.write_cross` writes for the same
    features, exactly (the same Linear calls); a smaller bucket writes its own prefix. The admission's
    `_copy_cross` copies them into an admission's rows (requests of 3, 1 and 2 beams: every beam row
    holds its request's), touching no other slot."""
    dims = tiny_dims(n_mels=80, n_text_layer=3)
    model = build_model(dims, random_state_dict(dims, seed=4)).eval().requires_grad_(False)
    enc = FastEncoder(model.encoder, dims.n_mels, cross=model.decoder, cross_rows=4)
    assert enc.cross_out.shape == (2, 3, 4, dims.n_audio_ctx, dims.n_text_state)
    audio = 0.1 * torch.randn(4, N_SAMPLES, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for b in (4, 2):
            features = enc.run(audio[:b], b, torch.float32)  # no graphs: the same pass eagerly
            cache = model.allocate_cache(b)
            model.decoder.write_cross(cache, torch.arange(b), features)
            assert torch.equal(enc.cross_out[0, :, :b], cache.cross_k) and torch.equal(enc.cross_out[1, :, :b], cache.cross_v)
        ckpt = make_openai_checkpoint(tmp_path, seed=4, n_text_layer=3)
        eng = WhisperEngine.load(ckpt, max_batch=12)
        enc = eng.admission.fast_encoder = FastEncoder(eng.model.encoder, dims.n_mels, cross=eng.model.decoder,
                                                       cross_rows=4)
        enc.cross_out.normal_(generator=torch.Generator().manual_seed(1))
        part = [_Active(i, None, None, rows, 0.0, i, N_SAMPLES) for i, rows in enumerate([[2, 3, 4], [5], [6, 7]])]
        eng.admission._copy_cross(part)
        kv = enc.cross_out
        for i, r in enumerate(part):
            for row in r.rows:
                assert torch.equal(eng.cache.cross_k[:, row], kv[0, :, i]) and torch.equal(eng.cache.cross_v[:, row], kv[1, :, i])
        others = [0, 1, 8, 9, 10, 11]
        assert not eng.cache.cross_k[:, others].any() and not eng.cache.cross_v[:, others].any()


def test_the_cross_keys_values_buffer_is_counted_in_the_memory_need():
    """The encoder pass's cross keys/values buffer (every decoder layer, the largest encoder bucket's rows) is
    held on a GPU with the graphs or without them; not on the CPU, whose modules write the cache directly."""
    dims = tiny_dims(n_mels=80, n_text_layer=3)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16)
    want = 2 * 3 * 16 * dims.n_audio_ctx * dims.n_text_state * 2

    def held(**more) -> list[tuple[int, bool]]:
        return [(n.bytes, n.transient) for n in memory_need(dims, **kw, **more).items if "cross keys/values out" in n.what]

    for graphs in (True, False):
        assert held(cuda=True, cuda_graphs=graphs) == [(want, False)]
    assert held(cuda=False) == []


def _decoder_fixture(seed: int = 3, slots: int = 6):
    """A tiny random model and a cache with every slot's cross keys/values and a random self
    history (so rows at different positions attend over different, non-zero keys)."""
    dims = tiny_dims(n_mels=80, n_text_layer=3)
    model = build_model(dims, random_state_dict(dims, seed=seed)).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    cache = model.allocate_cache(slots)
    with torch.inference_mode():
        features = torch.randn(slots, dims.n_audio_ctx, dims.n_audio_state, generator=g)
        model.decoder.write_cross(cache, torch.arange(slots), features)
        cache.self_k.normal_(generator=g)
        cache.self_v.normal_(generator=g)
    return dims, model, cache


def _clone(cache: KVCache) -> KVCache:
    return KVCache(*(t.clone() for t in (cache.self_k, cache.self_v, cache.cross_k, cache.cross_v)))


# (positions per row, kv_len, masked): rows apart with the exact context, rows apart over the whole
# context (the GPU engine's shape), and rows in step without a mask. The two paths differ by float32
# rounding only (the step's written-out self-attention sums in another order than SDPA): they must agree
# as far as float32 determines the reference step (`assert_float32_close`: a few times how far the
# reference moves when its weights and cache move by float32's unit roundoff). Differences under FLOOR
# pass without measuring that; a wrong mask or row is O(1) off.
FLOOR = 1e-4


def _flat(cache: KVCache) -> torch.Tensor:
    return torch.cat([t.flatten() for t in (cache.self_k, cache.self_v, cache.cross_k, cache.cross_v)])


def _unflat(flat: torch.Tensor, like: KVCache) -> KVCache:
    parts, at = [], 0
    for t in (like.self_k, like.self_v, like.cross_k, like.cross_v):
        parts.append(flat[at : at + t.numel()].view_as(t).clone())
        at += t.numel()
    return KVCache(*parts)


def _reference_steps(like: KVCache, steps: list[tuple], out: str = "logits"):
    """A `quantity` for `assert_float32_close`: (model, flattened cache) -> the reference decoder's logits
    after `steps` ((tokens, positions, kv_len, masked) each, in order), or its self keys and values."""

    def quantity(model, flat):
        cache = _unflat(flat, like)
        with torch.inference_mode():
            for tokens, pos, kv, masked in steps:
                logits = model.decoder.step(tokens, pos, cache, kv, masked)
        if out == "logits":
            return logits.numpy()
        return torch.stack([cache.self_k, cache.self_v]).numpy()

    return quantity


STEP_CASES = [([3, 0, 7, 5], 8, True), ([3, 0, 7, 5, 1], 448, True), ([6, 6, 6], 7, False), ([0], 1, False),
              # more rows than SMALL_BATCH: the step attends through SDPA instead of written out
              ([i % 9 for i in range(SMALL_BATCH + 1)], 448, True)]


@pytest.mark.parametrize("positions,kv_len,masked", STEP_CASES)
def test_fast_decoder_step_equals_reference_step(positions, kv_len, masked):
    """The GPU step's per-layer function (fused QKV, precomputed additive mask), uncompiled, against
    `TextDecoder.step` in float32: the same logits and the same keys/values written, over three
    consecutive steps (each reads what the previous ones wrote)."""
    dims, model, cache = _decoder_fixture(slots=max(6, len(positions)))
    fast = FastDecoder(model.decoder)
    ref_cache, fast_cache = _clone(cache), _clone(cache)
    g = torch.Generator().manual_seed(7)
    pos = torch.tensor(positions)
    steps = []
    for k in range(3):
        tokens = torch.randint(0, dims.n_vocab, (len(positions),), generator=g)
        steps.append((tokens, pos + k, min(kv_len + k, dims.n_text_ctx), masked))
        with torch.inference_mode():
            ref = model.decoder.step(*steps[-1][:2], ref_cache, *steps[-1][2:])
            got = fast.step(*steps[-1][:2], fast_cache, *steps[-1][2:])
        assert got.shape == ref.shape == (len(positions), dims.n_vocab)
        assert_float32_close(got.numpy(), ref.numpy(), model, _flat(cache), _reference_steps(cache, steps), FLOOR)
    assert_float32_close(torch.stack([fast_cache.self_k, fast_cache.self_v]).numpy(),
                         torch.stack([ref_cache.self_k, ref_cache.self_v]).numpy(), model, _flat(cache),
                         _reference_steps(cache, steps, out="keys"), FLOOR)


def test_fused_qkv_keeps_one_copy_of_the_weights():
    """The modules' query/key/value parameters become views into the fused tensors: the reference
    path computes what it did before, fusing again reuses them, and loading weights writes through."""
    dims, model, cache = _decoder_fixture()
    tokens, slots = torch.tensor([[50258, 50259, 50359]] * 2), torch.tensor([0, 1])
    with torch.inference_mode():
        before = model.decoder.prefill(tokens, slots, _clone(cache))
        fast = FastDecoder(model.decoder)
        after = model.decoder.prefill(tokens, slots, _clone(cache))
    assert torch.equal(before, after)
    attn = model.decoder.blocks[0].attn
    w_qkv, b_qkv = fast.layers[0][2], fast.layers[0][3]
    assert attn.key.weight.data_ptr() == w_qkv[dims.n_text_state].data_ptr()
    assert torch.equal(b_qkv[dims.n_text_state: 2 * dims.n_text_state], torch.zeros(dims.n_text_state))
    assert FastDecoder(model.decoder).layers[0][2] is w_qkv
    other = random_state_dict(dims, seed=9)
    model.load_state_dict(other, strict=False)
    assert torch.equal(w_qkv[: dims.n_text_state], other["decoder.blocks.0.attn.query.weight"])
    step = (tokens[:, 0], torch.tensor([4, 2]), 5, True)
    with torch.inference_mode():
        ref = model.decoder.step(step[0], step[1], _clone(cache), 5)
        got = fast.step(step[0], step[1], _clone(cache), 5)
    assert_float32_close(got.numpy(), ref.numpy(), model, _flat(cache), _reference_steps(cache, [step]), FLOOR)


def test_engine_with_fast_decoder_transcribes_like_the_reference(tmp_path):
    """The whole engine on the CPU with the fused decoder step (its default there too): the same tokens
    as the reference step for greedy decoding, beam search (cache reordering) and timestamps."""
    from voiced.engines.random_weights import chirps

    ckpt = make_openai_checkpoint(tmp_path, n_mels=80, seed=11, eot_boost=9.0)
    ref = WhisperEngine.load(ckpt, max_batch=6, fast_decoder=False)
    fast = WhisperEngine.load(ckpt, max_batch=6)
    assert ref.fast_decoder is None and fast.fast_decoder is not None and not fast.fast_decoder.compiled
    opts = [ASROptions(language="en", max_new_tokens=20), ASROptions(language="en", max_new_tokens=16, beam_size=3),
            ASROptions(language="en", max_new_tokens=16, timestamps=True)]
    for audio, o in zip(chirps(3, seconds=3.0, seed=2), opts):
        assert fast.transcribe(ASRRequest(audio, o)).tokens == ref.transcribe(ASRRequest(audio, o)).tokens


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_compiled_decoder_layer_traces_as_one_graph():
    """`torch.compile(fullgraph=True)` of the per-layer step function (what the GPU engine does per
    batch bucket): it traces without graph breaks and stays close to the reference (inductor's CPU
    kernels round differently; the GPU's compiled path is compared against eager in the GPU bench)."""
    dims, model, cache = _decoder_fixture()
    fast = FastDecoder(model.decoder, compile_layers=True)
    tokens, pos = torch.tensor([1000, 50, 7]), torch.tensor([3, 0, 5])
    ref_cache, fast_cache = _clone(cache), _clone(cache)
    with torch.inference_mode():
        ref = model.decoder.step(tokens, pos, ref_cache, 448)
        got = fast.step(tokens, pos, fast_cache, 448)
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert (ref_cache.self_k - fast_cache.self_k).abs().max().item() <= 1e-3


def test_prefills_padded_pass_writes_what_the_prefill_writes():
    """`Prefills` (the pass the admission's prefill graphs record, here run eagerly) pads a group to its
    bucket by repeating the last row: in float32 on the CPU its last logits, no-speech probabilities and
    self-cache rows equal `TextDecoder.prefill`'s of the unpadded group (to float32 rounding: the
    padded group's GEMMs have other shapes), and no other slot is written.
    (Graph replay against this pass, bit for bit: tests/test_whisper_gpu.py.)"""
    dims, model, cache = _decoder_fixture(slots=8)
    dec = model.decoder
    no_speech = dims.n_vocab - 1510  # any id: the probability is read at one vocabulary column
    prefills = Prefills(dec, cache, [1, 2, 4, 8], no_speech)
    g = torch.Generator().manual_seed(1)
    for slots in ([5], [6, 1, 3], [0, 7, 2, 4, 6]):  # padded to 1, 4 and 8 rows
        for t in (1, 3, 4):
            tokens = torch.randint(0, dims.n_vocab, (len(slots), t), generator=g)
            tokens[:, 0] = dims.n_vocab - 1  # position 0 stands for <|startoftranscript|>
            with torch.inference_mode():
                for k in (cache.self_k, cache.self_v):
                    k.zero_()
                last, ns = prefills.run(tokens.tolist(), slots)
                got = cache.self_k.clone(), cache.self_v.clone()
                for k in (cache.self_k, cache.self_v):
                    k.zero_()
                ref = dec.prefill(tokens, torch.tensor(slots), cache)
            # float32 rounding apart at most (a padded group is a GEMM of another shape, whose summation
            # order depends on the CPU's BLAS kernels): within 5e-5 of the largest logit
            close = dict(rtol=1e-4, atol=1e-4)
            scale = ref[:, -1].abs().max().item()
            torch.testing.assert_close(last, ref[:, -1], rtol=0, atol=5e-5 * scale)
            torch.testing.assert_close(ns, ref[:, 0].softmax(dim=-1)[:, no_speech], **close)
            torch.testing.assert_close(got, (cache.self_k, cache.self_v), **close)
            others = [s for s in range(8) if s not in slots]
            assert not got[0][:, others].any() and not got[1][:, others].any(), (slots, t)
            assert prefills.covers(t, {0}, len(slots)) and not prefills.covers(t, {1}, len(slots))
    assert not prefills.covers(5, {0}, 1) and not prefills.covers(3, {0}, 9)


def test_prefill_graphs_are_counted_in_the_memory_need():
    """The prefill graphs' inputs and outputs (held) and capture transients (a step transient) enter the
    engine's memory need on a GPU with CUDA graphs; an eager GPU engine and the CPU hold none."""
    dims = tiny_dims(n_mels=80)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16)
    on = memory_need(dims, cuda=True, **kw)
    added = [n for n in on.items if n.what.startswith("prefill graphs")]
    assert [n.transient for n in added] == [False, True]
    assert sum(n.bytes for n in added) == sum(n.bytes for n in prefill_graph_needs(dims, 2, [1, 2, 4, 8, 16]))
    assert all(n.bytes > 16 * dims.n_vocab * 4 for n in added)
    # the capture transients come from the graph pool's reuse of the encoder's: no growth of the total
    # beyond the held inputs and outputs while the admission's own transient is the larger
    without = [n for n in on.items if not n.what.startswith("prefill graphs")]
    assert on.total - sum(n.bytes for n in added if not n.transient) == sum(n.bytes for n in without if not n.transient) \
        + max(n.bytes for n in without if n.transient)
    for eager in (memory_need(dims, cuda=True, cuda_graphs=False, **kw), memory_need(dims, cuda=False, **kw)):
        assert not any(n.what.startswith("prefill graphs") for n in eager.items)


def test_word_timing_graphs_are_counted_in_the_memory_need():
    """The word-timing graphs' inputs and one bucket's outputs (held, growing with the heads read) and their
    capture transients (a step transient) enter the memory need on a GPU with CUDA graphs."""
    dims = tiny_dims(n_mels=80)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16, cuda=True)
    on = {h: memory_need(dims, alignment_heads=h, **kw) for h in (3, 6)}
    added = [n for n in on[6].items if n.what.startswith("word-timing graphs")]
    assert [n.transient for n in added] == [False, True]
    assert sum(n.bytes for n in added) == sum(n.bytes for n in align_graph_needs(dims, 2, 6))
    held = added[0].bytes
    # the largest bucket's scores, float32 per head and audio position, and its activations in float16
    rows, t = ALIGN_GRAPH_ROWS[-1], ALIGN_GRAPH_TOKENS[-1]
    assert held == rows * (1 + t) * 8 + rows * t * (dims.n_text_state * 2 + 6 * dims.n_audio_ctx * 4)
    assert on[6].total - on[3].total >= rows * t * 3 * dims.n_audio_ctx * 4
    for eager in (memory_need(dims, alignment_heads=6, **{**kw, "cuda_graphs": False}),
                  memory_need(dims, alignment_heads=6, **{**kw, "cuda": False})):
        assert not any(n.what.startswith("word-timing graphs") for n in eager.items)


def test_a_cpu_engine_runs_no_graphs_and_counts_none(tmp_path):
    """On the CPU the engine replays nothing from CUDA graphs (no word-timing or chunk graphs, no decode-ahead)
    and its memory need counts no graph."""
    eng = WhisperEngine.load(make_openai_checkpoint(tmp_path, seed=4), max_batch=2)
    rt = eng.runtime
    assert not (rt.cuda_graphs or rt.chunk_graphs or rt.decode_ahead or rt.gemv) and eng.decode_chunk == 1
    assert eng.words.passes is None and eng.prefills is None and eng.fast_encoder is None
    assert not any("graphs" in n.what for n in eng.memory_need.items)


def test_a_row_that_chose_end_of_text_keeps_it_as_its_token():
    """The greedy step's bookkeeping (`greedy_advance`): a row whose token is end-of-text keeps it, whatever it
    computes after its end, while the others take their choices (end-of-text included) and every row's position
    and countdown advance; so a step's tokens alone tell whether all of its rows have ended (the GEMV step's
    kernels skip such a step)."""
    from voiced.engines.whisper.token_choice import greedy_advance

    eot, always = 9, torch.zeros(10, dtype=torch.bool)
    inputs = torch.tensor([[eot, 3, 4], [5, 6, 7], [0, 2, 0]])  # tokens, positions, minimum-length countdowns
    lp = torch.zeros(3)
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    logits[2, eot] = 6.0
    greedy_advance(logits, always, eot, inputs, lp)
    assert inputs.tolist() == [[eot, 7, eot], [6, 7, 8], [-1, 1, -1]]
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    greedy_advance(logits, always, eot, inputs, lp)
    assert inputs[0].tolist() == [eot, 4, eot]


def _steps_fixture(chunk: int, b: int, seed: int = 3):
    """Two `DecoderSteps` over equal caches (random history, every slot's cross keys/values) with their
    own history buffers, rows at different positions and minimum-length countdowns."""
    from voiced.engines.whisper.decoder_steps import DecoderSteps

    dims, model, cache = _decoder_fixture(seed=seed, slots=b)
    fast = FastDecoder(model.decoder)
    always = torch.zeros(dims.n_vocab, dtype=torch.bool)
    always[dims.n_vocab - 50:] = True
    eot = dims.n_vocab - 100
    g = torch.Generator().manual_seed(seed)
    inputs = torch.stack([torch.randint(0, eot, (b,), generator=g), torch.randint(0, 40, (b,), generator=g),
                          torch.randint(0, 4, (b,), generator=g)])
    out = []
    for c in (cache, _clone(cache)):
        s = DecoderSteps(fast, c, dims.n_text_ctx, b, torch.device("cpu"), always, eot,
                         hist=torch.zeros(b, chunk, 2, dtype=torch.float64))
        s.inputs[:3].copy_(inputs)
        out.append(s)
    return out


@pytest.mark.parametrize("chunk,b", [(8, 3), (1, 2), (4, SMALL_BATCH + 1)])
def test_decoder_steps_chunk_is_the_engines_per_step_loop(chunk, b):
    """`DecoderSteps.chunk` (what the chunk graph records) against the engine's per-step loop on the GPU
    path (`greedy` over the whole context with a mask, then the two history writes), on the CPU in float32:
    the same calls in the same order, so exactly the same history, step buffers and caches."""
    a, ref = _steps_fixture(chunk, b)
    with torch.inference_mode():
        a.chunk(b)
        tok, lp, hist_tok, hist_lp = ref.tok[:b], ref.lp[:b], ref.hist[:b, :, 0], ref.hist[:b, :, 1]
        for k in range(chunk):
            ref.greedy(b)
            hist_tok[:, k] = tok
            hist_lp[:, k] = lp
    assert torch.equal(a.hist, ref.hist) and torch.equal(a.inputs, ref.inputs) and torch.equal(a.lp, ref.lp)
    assert torch.equal(a.cache.self_k, ref.cache.self_k) and torch.equal(a.cache.self_v, ref.cache.self_v)
    assert (a.hist[:, :, 1] < 0).all() and len(set(a.hist[:, :, 0].flatten().tolist())) > 1


def test_a_chunk_graph_is_never_captured_by_run():
    """With graphs, `run("chunk", b)` of a bucket warm-up did not capture refuses (its pre-runs would advance
    live rows past their limits); the plain and greedy steps may still be captured on first use."""
    from voiced.engines.whisper.cuda_graphs import CudaGraphs

    a, _ = _steps_fixture(8, 2)
    a.graphs = CudaGraphs(None, None)
    assert not a.has_graph("chunk", 2)
    with pytest.raises(RuntimeError, match="warm-up"):
        a.run("chunk", 2)
    a.graphs = None
    assert not a.has_graph("chunk", 2)


def _fake_chunk_graph(eng: WhisperEngine, captured: bool) -> list[tuple[str, int]]:
    """Turn a CPU engine's chunk graphs on, with `run("chunk", b)` the eager `DecoderSteps.chunk` (and the
    graph there for every bucket when `captured`); returns the list where every chunk run and every greedy
    step go, as ("chunk" | "step", batch)."""
    steps, runs = eng.steps, []
    greedy = steps.greedy
    eng.runtime = dataclasses.replace(eng.runtime, chunk_graphs=True)
    steps.has_graph = lambda kind, b: captured and kind == "chunk"

    def run(kind: str, b: int) -> None:
        runs.append((kind, b))
        steps.chunk(b)

    def counted(b: int, *a, **kw) -> None:
        runs.append(("step", b))
        greedy(b, *a, **kw)

    steps.run, steps.greedy = run, counted
    return runs


def _serve(eng: WhisperEngine, clips: list[np.ndarray], opts: list[ASROptions]) -> dict[int, list[int]]:
    """Request i (clip i, options i) all submitted at once, stepped until every one is served: their tokens."""
    for i, o in enumerate(opts):
        eng.submit(i, ASRRequest(clips[i], o))
    out = {}
    while eng.has_work():
        out.update({o.request_id: o.value.tokens for o in eng.step()})
    return out


def test_only_full_chunks_of_captured_buckets_take_the_chunk_graph(tmp_path):
    """The engine's choice between one chunk replay and the per-step loop, on the CPU with the chunk
    graph faked (the eager `DecoderSteps.chunk` stands in for its replay): a full chunk (decode_chunk
    steps) of a bucket with a graph takes it; a chunk cut short near a row's length limit, and any
    chunk of a bucket without a graph, run step by step. Rows at different lengths finish mid-chunk and
    the tokens are what the engine serves without the chunk path."""
    ckpt = make_openai_checkpoint(tmp_path, seed=5)
    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(16000 * (1 + i))).astype(np.float32) for i in range(3)]
    lengths = [13, 20, 9]  # chunks of 8 after the admission's first token: 8 + 4 | 8 + 8 + 3 | 8
    opts = [ASROptions(language="en", max_new_tokens=t, min_new_tokens=t) for t in lengths]

    def serve(eng) -> dict[int, list[int]]:
        return _serve(eng, clips, opts)

    want = serve(WhisperEngine.load(ckpt, max_batch=4, decode_chunk=8))
    assert [len(want[i]) for i in range(3)] == lengths
    for captured in (True, False):
        eng = WhisperEngine.load(ckpt, max_batch=4, decode_chunk=8)
        runs = _fake_chunk_graph(eng, captured)
        got = serve(eng)
        assert got == want, f"chunk graph {'captured' if captured else 'missing'}"
        # Step 1 admits all three (first token each); then rows of 12, 19 and 8 tokens to go: one full chunk
        # (request 2 finishes with it); then 4 to go for request 0 (a short chunk: step by step), then 7
        # for request 1 alone. The chunk's eager stand-in makes its 8 steps through `greedy` too.
        tail = [("step", 3)] * 8 + [("step", 2)] * 4 + [("step", 1)] * 7
        assert runs == ([("chunk", 3)] if captured else []) + tail


def test_the_runtime_on_a_gpu_is_the_fast_path_and_its_encoder_follows_the_dtype(monkeypatch):
    """What a GPU engine runs (`WhisperRuntime.resolve`, here with the kernels' GPU check stood in for): CUDA
    graphs of every kind, chunks of 8 greedy steps decoded ahead, the GEMV step (else the compiled fused layer),
    the compiled tail; the encoder's layers eager with the fused add + norm in float16 and bfloat16, compiled in
    float32 (the reference mode: openai-whisper's tokens). Without CUDA graphs, no chunk graphs; on the CPU,
    nothing of it, one step a chunk."""
    from voiced.engines.whisper import options

    dims = tiny_dims(n_mels=80)
    monkeypatch.setattr(options.decode_linear, "supported", lambda dtype, device: True)
    for gemv in (True, False):
        monkeypatch.setattr(options, "gemv_supported", lambda *a, gemv=gemv: gemv)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            rt = options.WhisperRuntime.resolve(dims, dtype, "cuda", max_batch=64)
            assert rt.cuda and rt.cuda_graphs and rt.chunk_graphs and rt.decode_ahead and rt.compile_tail
            assert (rt.decode_chunk, rt.max_encoder_batch) == (8, 16)
            assert rt.gemv == gemv and rt.compile_decoder == (not gemv)
            assert rt.compile_encoder == (dtype == torch.float32) and rt.encoder_add_norm == (dtype != torch.float32)
    eager = options.WhisperRuntime.resolve(dims, torch.float16, "cuda", max_batch=64, cuda_graphs=False)
    assert not eager.cuda_graphs and not eager.chunk_graphs and eager.decode_ahead
    reference = options.WhisperRuntime.resolve(dims, torch.float16, "cuda", fast_decoder=False)
    assert not (reference.gemv or reference.compile_decoder or reference.compile_tail)
    cpu = options.WhisperRuntime.resolve(dims, torch.float32, "cpu", max_batch=8)
    assert not (cpu.cuda_graphs or cpu.chunk_graphs or cpu.decode_ahead or cpu.gemv or cpu.compile_decoder
                or cpu.compile_tail or cpu.compile_encoder or cpu.encoder_add_norm)
    assert (cpu.decode_chunk, cpu.max_encoder_batch) == (1, 4)


def test_compiled_encoder_layers_never_take_the_fused_add_norm():
    """The compiler fuses a compiled layer's adds and norms on its own: the fused add + norm is for eager layers."""
    from voiced.engines.whisper.model import ModelDims, Whisper

    dims = ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=300,
                     n_text_ctx=32, n_text_state=64, n_text_head=4, n_text_layer=1)
    enc = Whisper(dims).encoder
    assert FastEncoder(enc, 80, add_norm=True).add_norm
    assert not FastEncoder(enc, 80, add_norm=True, compile_layers=True).add_norm


def test_the_eager_encoder_runs_its_layers_on_contiguous_activations():
    """Uncompiled (half precision on a GPU), every encoder layer gets its activations contiguous, not in the
    convolutions' transposed layout that an eager residual add would keep through every layer (a large-v3-turbo
    layer ~25 % slower so), and the features stay the reference forward's."""
    from voiced.engines.whisper.fast_encoder import encoder_layer

    dims = tiny_dims(n_mels=80)
    model = build_model(dims, random_state_dict(dims, seed=1)).eval()
    seen = []

    def layer(x, *args):
        seen.append(x.is_contiguous())
        return encoder_layer(x, *args)

    enc = FastEncoder(model.encoder, dims.n_mels)
    enc._layer = layer
    audio = 0.1 * torch.randn(2, N_SAMPLES, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = enc(audio, torch.float32)
        ref = model.encoder(log_mel_spectrogram(audio, dims.n_mels))
    assert seen == [True] * dims.n_audio_layer
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
