"""The GPU arrangements (fused QKV, per-layer functions) compute the reference encoder and decoder step.

They only run on CUDA in the engine, but they are plain torch, so their arithmetic is checked here
in float32 on the CPU against `AudioEncoder.forward` and `TextDecoder.step`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import assert_float32_close, make_openai_checkpoint, random_state_dict, tiny_dims

from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.audio import N_SAMPLES, log_mel_spectrogram
from voiced.engines.whisper.engine import (
    WhisperEngine,
    _Active,
    align_graph_needs,
    build_model,
    memory_need,
    prefill_graph_needs,
)
from voiced.engines.whisper.fast import (
    ALIGN_GRAPH_ROWS,
    ALIGN_GRAPH_TOKENS,
    SMALL_BATCH,
    FastDecoder,
    FastEncoder,
    Prefills,
)
from voiced.engines.whisper.model import KVCache


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
    features, exactly (the same Linear calls); a smaller bucket writes its own prefix. The engine's
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
        eng.fast_encoder = FastEncoder(eng.model.encoder, dims.n_mels, cross=eng.model.decoder, cross_rows=4)
        eng.fast_encoder.cross_out.normal_(generator=torch.Generator().manual_seed(1))
        part = [_Active(i, None, None, rows, 0.0, i) for i, rows in enumerate([[2, 3, 4], [5], [6, 7]])]
        eng._copy_cross(part)
        kv = eng.fast_encoder.cross_out
        for i, r in enumerate(part):
            for row in r.rows:
                assert torch.equal(eng.cache.cross_k[:, row], kv[0, :, i]) and torch.equal(eng.cache.cross_v[:, row], kv[1, :, i])
        others = [0, 1, 8, 9, 10, 11]
        assert not eng.cache.cross_k[:, others].any() and not eng.cache.cross_v[:, others].any()


def test_the_cross_keys_values_buffer_is_counted_in_the_memory_need():
    """With the cross keys/values made in the encoder's pass, its buffer (every decoder layer, the largest
    encoder bucket's rows) is held on a GPU with the graphs on or off; not without them, nor on the CPU."""
    dims = tiny_dims(n_mels=80, n_text_layer=3)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16)
    want = 2 * 3 * 16 * dims.n_audio_ctx * dims.n_text_state * 2

    def held(**more) -> list[tuple[int, bool]]:
        return [(n.bytes, n.transient) for n in memory_need(dims, **kw, **more).items if "cross keys/values out" in n.what]

    for graphs in (True, False):
        assert held(cuda=True, cuda_graphs=graphs, cross_in_encoder=True) == [(want, False)]
        assert held(cuda=True, cuda_graphs=graphs) == []
    assert held(cuda=False, cross_in_encoder=True) == []


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
    from voiced.bench.whisper_bench import test_audio

    ckpt = make_openai_checkpoint(tmp_path, n_mels=80, seed=11, eot_boost=9.0)
    ref = WhisperEngine.load(ckpt, max_batch=6, fast_decoder=False)
    fast = WhisperEngine.load(ckpt, max_batch=6)
    assert ref.fast_decoder is None and fast.fast_decoder is not None and not fast.fast_decoder.compiled
    opts = [ASROptions(language="en", max_new_tokens=20), ASROptions(language="en", max_new_tokens=16, beam_size=3),
            ASROptions(language="en", max_new_tokens=16, timestamps=True)]
    for audio, o in zip(test_audio(3, seconds=3.0, seed=2), opts):
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
    engine's memory need on a GPU only when they are on, and nothing changes on the CPU."""
    dims = tiny_dims(n_mels=80)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16)
    off, on = (memory_need(dims, cuda=True, prefill_graphs=p, **kw) for p in (False, True))
    added = [n for n in on.items if n.what not in {m.what for m in off.items}]
    assert [n.what.split(":")[0] for n in added] == ["prefill graphs", "prefill graphs"]
    assert sum(n.bytes for n in added) == sum(n.bytes for n in prefill_graph_needs(dims, 2, [1, 2, 4, 8, 16]))
    assert all(n.bytes > 16 * dims.n_vocab * 4 for n in added)
    # the capture transients come from the graph pool's reuse of the encoder's: no growth of the total
    # beyond the held inputs and outputs while the admission's own transient is the larger
    assert on.total - off.total == sum(n.bytes for n in added if not n.transient)
    cpu = [memory_need(dims, cuda=False, prefill_graphs=p, **kw).items for p in (False, True)]
    assert cpu[0] == cpu[1]


def test_word_timing_graphs_are_counted_in_the_memory_need():
    """The word-timing graphs' inputs and one bucket's outputs (held, growing with the heads read) and their
    capture transients (a step transient) enter the memory need on a GPU only when they are on."""
    dims = tiny_dims(n_mels=80)
    kw = dict(dtype=torch.float16, weight_bytes=1000, max_batch=64, max_encoder_batch=16, cuda=True)
    off = memory_need(dims, align_graphs=False, alignment_heads=6, **kw)
    on = {h: memory_need(dims, align_graphs=True, alignment_heads=h, **kw) for h in (3, 6)}
    added = [n for n in on[6].items if n.what not in {m.what for m in off.items}]
    assert [n.transient for n in added] == [False, True]
    assert all(n.what.startswith("word-timing graphs") for n in added)
    assert sum(n.bytes for n in added) == sum(n.bytes for n in align_graph_needs(dims, 2, 6))
    held = added[0].bytes
    # the largest bucket's scores, float32 per head and audio position, and its activations in float16
    rows, t = ALIGN_GRAPH_ROWS[-1], ALIGN_GRAPH_TOKENS[-1]
    assert held == rows * (1 + t) * 8 + rows * t * (dims.n_text_state * 2 + 6 * dims.n_audio_ctx * 4)
    assert on[6].total - on[3].total >= rows * t * 3 * dims.n_audio_ctx * 4
    assert [n.what for n in memory_need(dims, align_graphs=True, alignment_heads=6, **{**kw, "cuda": False}).items] \
        == [n.what for n in memory_need(dims, align_graphs=False, **{**kw, "cuda": False}).items]


def test_word_timing_graphs_setting(monkeypatch, tmp_path):
    """VOICED_WHISPER_ALIGN_GRAPHS=1 / 0 when set, else engine.ALIGN_GRAPHS_DEFAULT (on since measured live on a
    GPU); on the CPU (no CUDA graphs) the engine has no graphed pass and its plan counts none, whatever is asked."""
    from voiced.engines.whisper import engine as engine_mod

    monkeypatch.delenv("VOICED_WHISPER_ALIGN_GRAPHS", raising=False)
    assert engine_mod.ALIGN_GRAPHS_DEFAULT is True and engine_mod.align_graphs_default() is True
    for env, want in (("1", True), ("0", False), (" 0 ", False), ("", True)):
        monkeypatch.setenv("VOICED_WHISPER_ALIGN_GRAPHS", env)
        assert engine_mod.align_graphs_default() is want, env
    monkeypatch.setenv("VOICED_WHISPER_ALIGN_GRAPHS", "no")
    with pytest.raises(ValueError, match="VOICED_WHISPER_ALIGN_GRAPHS='no'"):
        engine_mod.align_graphs_default()
    monkeypatch.setenv("VOICED_WHISPER_ALIGN_GRAPHS", "1")
    ckpt = make_openai_checkpoint(tmp_path, seed=4)
    eng = WhisperEngine.load(ckpt, max_batch=2, align_graphs=True)
    assert eng.align_passes is None
    assert not any(n.what.startswith("word-timing graphs") for n in eng.memory_need.items)


def test_chunk_graphs_setting(monkeypatch, tmp_path):
    """VOICED_WHISPER_CHUNK_GRAPHS=1 / 0 when set, else engine.CHUNK_GRAPHS_DEFAULT (on since measured on a
    GPU); on the CPU (no CUDA graphs) the engine never takes the chunk graph path, whatever is asked."""
    from voiced.engines.whisper import engine as engine_mod

    monkeypatch.delenv("VOICED_WHISPER_CHUNK_GRAPHS", raising=False)
    assert engine_mod.CHUNK_GRAPHS_DEFAULT is True and engine_mod.chunk_graphs_default() is True
    for env, want in (("1", True), ("0", False), (" 1 ", True), ("", True)):
        monkeypatch.setenv("VOICED_WHISPER_CHUNK_GRAPHS", env)
        assert engine_mod.chunk_graphs_default() is want, env
    monkeypatch.setattr(engine_mod, "CHUNK_GRAPHS_DEFAULT", False)
    monkeypatch.delenv("VOICED_WHISPER_CHUNK_GRAPHS")
    assert engine_mod.chunk_graphs_default() is False
    monkeypatch.setenv("VOICED_WHISPER_CHUNK_GRAPHS", "0")
    assert engine_mod.chunk_graphs_default() is False
    monkeypatch.setenv("VOICED_WHISPER_CHUNK_GRAPHS", "1")
    ckpt = make_openai_checkpoint(tmp_path, seed=4)
    assert not WhisperEngine.load(ckpt, max_batch=2).chunk_graphs
    assert not WhisperEngine.load(ckpt, max_batch=2, chunk_graphs=True).chunk_graphs


def test_a_row_that_chose_end_of_text_keeps_it_as_its_token():
    """The greedy step's bookkeeping (`greedy_advance`): a row whose token is end-of-text keeps it, whatever it
    computes after its end, while the others take their choices (end-of-text included) and every row's position
    and countdown advance; so a step's tokens alone tell whether all of its rows have ended (VOICED_WHISPER_
    SKIP_ENDED)."""
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


def test_skipping_ended_steps_and_fewer_step_kernels_settings(monkeypatch, tmp_path):
    """VOICED_WHISPER_SKIP_ENDED and VOICED_WHISPER_FEWER_STEP_KERNELS: 1 / 0 when set, else their defaults,
    misspelt values refused; both concern the GEMV step, so a CPU engine never skips a step, whatever is asked."""
    from voiced.engines.whisper import engine as engine_mod

    for name, read in (("VOICED_WHISPER_SKIP_ENDED", engine_mod.skip_ended_default),
                       ("VOICED_WHISPER_FEWER_STEP_KERNELS", engine_mod.fewer_step_kernels_default)):
        monkeypatch.delenv(name, raising=False)
        default = read()
        for env, want in (("1", True), ("0", False), ("", default)):
            monkeypatch.setenv(name, env)
            assert read() is want, (name, env)
        monkeypatch.setenv(name, "yes please")
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)
    ckpt = make_openai_checkpoint(tmp_path, seed=4)
    assert not WhisperEngine.load(ckpt, max_batch=2, skip_ended=True).steps.skip_ended


def _steps_fixture(chunk: int, b: int, seed: int = 3):
    """Two `DecoderSteps` over equal caches (random history, every slot's cross keys/values) with their
    own history buffers, rows at different positions and minimum-length countdowns."""
    from voiced.engines.whisper.fast import DecoderSteps

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


@pytest.mark.parametrize("stop", ["end_of_text", "limit"])
def test_a_stopping_chunk_stops_where_a_real_row_ends_or_at_its_limit(stop):
    """A stopping chunk (`DecoderSteps.stopping`; eagerly here, each conditional step by reading `live`) runs the
    plain chunk's very steps until a real row (one with a step limit) chooses end-of-text, or its limit is
    reached, and no step after: its history holds the plain chunk's tokens up to there and -1 after, and its
    inputs and caches are those of a plain chunk that long. A padding row (limit 0) choosing end-of-text does
    not stop it."""
    chunk, b = 8, 4
    plain, stopping = _steps_fixture(chunk, b)
    with torch.inference_mode():
        plain.minleft.zero_()  # (end-of-text is then never suppressed: which id it is changes no choice)
        plain.chunk(b)
    toks = plain.hist[:, :, 0].long()
    real = b - 1
    if stop == "end_of_text":
        # the first (step, real row) whose token no real row chose before: made end-of-text, it ends the chunk there
        seen: set[int] = set()
        at = None
        for k in range(chunk):
            fresh = [int(t) for t in toks[:real, k] if int(t) not in seen]
            if k > 0 and fresh:
                at, eot = k, fresh[0]
                break
            seen.update(int(t) for t in toks[:real, k])
        assert at is not None and at < chunk - 1
        want_steps, limit = at + 1, chunk
    else:
        eot = next(t for t in range(plain.always.shape[0]) if t not in set(toks.flatten().tolist()))
        want_steps = limit = 5
    again, stopping = _steps_fixture(want_steps, b)  # a plain chunk of exactly the steps that should run
    with torch.inference_mode():
        for s in (again, stopping):
            s.minleft.zero_()
            s.eot = eot
        again.chunk(b)
        stopping.hist = torch.zeros(b, chunk, 2, dtype=torch.float64)
        stopping.stopping = True
        stopping.limit[:real] = limit
        stopping.chunk(b)
    assert stopping.count.item() == want_steps and not stopping.live.item()
    assert torch.equal(stopping.hist[:, :want_steps], again.hist)
    assert (stopping.hist[:, want_steps:, 0] == -1).all()
    assert torch.equal(stopping.inputs[:3], again.inputs[:3]) and torch.equal(stopping.lp, again.lp)
    assert torch.equal(stopping.cache.self_k, again.cache.self_k)
    # the padding row's own end-of-text is ignored: made the padding row's first token, nothing changes
    pad, pad_ref = _steps_fixture(chunk, b)
    with torch.inference_mode():
        for s in (pad, pad_ref):
            s.minleft.zero_()
            s.eot = int(toks[real, 0])
            s.hist = torch.zeros(b, chunk, 2, dtype=torch.float64)
        assert int(toks[real, 0]) not in set(toks[:real].flatten().tolist())  # (so only the padding row ends)
        pad.stopping = True
        pad.limit[:real] = chunk
        pad.chunk(b)
        pad_ref.chunk(b)
    assert pad.count.item() == chunk and torch.equal(pad.hist, pad_ref.hist)


def test_a_chunk_graph_is_never_captured_by_run():
    """With graphs, `run("chunk", b)` of a bucket warm-up did not capture refuses (its pre-runs would advance
    live rows past their limits); the plain and greedy steps may still be captured on first use."""
    from voiced.engines.whisper.fast import CudaGraphs

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
    eng.chunk_graphs = True
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


def test_stopping_chunks_serve_the_same_tokens_in_one_chunk_until_a_row_ends(tmp_path):
    """Chunks that stop on the device (VOICED_WHISPER_STOPPING_CHUNKS), on the CPU with the chunk graph faked
    as above: every chunk, short ones included, is one chunk run; it stops at the first row's length limit, or
    at its first end-of-text, or after QUEUED_CHUNK steps while requests wait; and the engine serves the tokens
    it serves without chunks, forced lengths and free ones alike."""
    from voiced.engines.whisper import engine as engine_mod

    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(16000 * (1 + i % 3))).astype(np.float32) for i in range(5)]

    def serve(eng, opts: list[ASROptions]) -> dict[int, list[int]]:
        return _serve(eng, clips, opts)

    def stopping(ckpt, max_batch):
        eng = WhisperEngine.load(ckpt, max_batch=max_batch, decode_chunk=engine_mod.STOPPING_CHUNK)
        runs = _fake_chunk_graph(eng, True)
        eng.stopping_chunks = eng.steps.stopping = True
        return eng, runs

    # forced lengths: 12, 19 and 8 tokens to go after the admission's: chunks of 8 (request 2's limit), 4, 7
    forced = [ASROptions(language="en", max_new_tokens=t, min_new_tokens=t) for t in (13, 20, 9)]
    ckpt = make_openai_checkpoint(tmp_path / "forced", seed=5)
    want = serve(WhisperEngine.load(ckpt, max_batch=4, decode_chunk=8), forced)
    eng, runs = stopping(ckpt, 4)
    assert serve(eng, forced) == want
    assert runs == [("chunk", 3)] + [("step", 3)] * 8 + [("chunk", 2)] + [("step", 2)] * 4 + [("chunk", 1)] + \
        [("step", 1)] * 7
    # free lengths (a checkpoint that ends its texts early), more requests than rows: every chunk ends where a row
    # chose end-of-text, or after QUEUED_CHUNK steps while some wait
    ckpt = make_openai_checkpoint(tmp_path / "free", seed=5, eot_boost=8.0)
    free = [ASROptions(language="en", max_new_tokens=40) for _ in clips]
    want = serve(WhisperEngine.load(ckpt, max_batch=2, decode_chunk=8), free)
    assert sorted(len(t) for t in want.values())[0] < 20  # some end at end-of-text, well before 40 tokens
    eng, runs = stopping(ckpt, 2)
    chunks: list[tuple[int, int, bool]] = []  # (steps run, the chunk's limit, whether requests waited)
    chunk = eng.steps.chunk

    def counted_chunk(b: int) -> None:
        waiting = bool(eng._queue)
        chunk(b)
        chunks.append((int(eng.steps.count), int(eng.steps.limit[0]), waiting))

    eng.steps.chunk = counted_chunk
    assert serve(eng, free) == want
    assert all(limit <= engine_mod.QUEUED_CHUNK for _, limit, waiting in chunks if waiting)
    assert any(limit > engine_mod.QUEUED_CHUNK for _, limit, waiting in chunks if not waiting)
    assert any(n < limit for n, limit, _ in chunks), chunks  # stopped at a row's end-of-text
    assert sum(n for n, _, _ in chunks) == sum(1 for kind, _ in runs if kind == "step")


def test_the_gpu_encoder_s_layers_are_eager_in_half_precision_and_compiled_in_float32(monkeypatch):
    """Unset, VOICED_WHISPER_COMPILE_ENCODER leaves the GPU encoder's layers eager in float16 and bfloat16 (faster
    on an H200, session 27) and compiled in float32 (the reference mode: openai-whisper's tokens); =0 runs them
    eagerly on contiguous activations, =1 compiles, whatever the dtype; a misspelt value is refused, naming the
    variable."""
    from voiced.engines.whisper.engine import compile_encoder_default

    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    monkeypatch.delenv("VOICED_WHISPER_COMPILE_ENCODER", raising=False)
    assert [compile_encoder_default(d) for d in dtypes] == [False, False, True]
    monkeypatch.setenv("VOICED_WHISPER_COMPILE_ENCODER", "0")
    assert not any(compile_encoder_default(d) for d in dtypes)
    monkeypatch.setenv("VOICED_WHISPER_COMPILE_ENCODER", "1")
    assert all(compile_encoder_default(d) for d in dtypes)
    monkeypatch.setenv("VOICED_WHISPER_COMPILE_ENCODER", "off")
    with pytest.raises(ValueError, match="VOICED_WHISPER_COMPILE_ENCODER"):
        compile_encoder_default(torch.float16)


def test_the_encoder_s_fused_add_norm_is_on_unless_turned_off_and_only_for_eager_layers(monkeypatch):
    """Unset, VOICED_WHISPER_ENCODER_ADD_NORM is on (faster on an H200, session 28); =0 turns it off; a misspelt
    value is refused, naming the variable. Compiled layers never take it (the compiler fuses on its own)."""
    from voiced.engines.whisper.engine import encoder_add_norm_default
    from voiced.engines.whisper.fast import FastEncoder
    from voiced.engines.whisper.model import ModelDims, Whisper

    monkeypatch.delenv("VOICED_WHISPER_ENCODER_ADD_NORM", raising=False)
    assert encoder_add_norm_default() is True
    monkeypatch.setenv("VOICED_WHISPER_ENCODER_ADD_NORM", "0")
    assert encoder_add_norm_default() is False
    monkeypatch.setenv("VOICED_WHISPER_ENCODER_ADD_NORM", "yes please")
    with pytest.raises(ValueError, match="VOICED_WHISPER_ENCODER_ADD_NORM"):
        encoder_add_norm_default()
    dims = ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=300,
                     n_text_ctx=32, n_text_state=64, n_text_head=4, n_text_layer=1)
    enc = Whisper(dims).encoder
    assert FastEncoder(enc, 80, add_norm=True).add_norm
    assert not FastEncoder(enc, 80, add_norm=True, compile_layers=True).add_norm


def test_the_eager_encoder_runs_its_layers_on_contiguous_activations():
    """Uncompiled (the CPU, or VOICED_WHISPER_COMPILE_ENCODER=0 on a GPU), every encoder layer gets its activations
    contiguous, not in the convolutions' transposed layout that an eager residual add would keep through every
    layer (on an H200 one large-v3-turbo layer ran 0.212 instead of 0.162 ms at batch 1 so), and the features
    stay the reference forward's."""
    from voiced.engines.whisper.fast import encoder_layer

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


def test_the_gpu_encoder_s_attention_is_pinned_to_flash_only_when_asked(monkeypatch):
    """VOICED_WHISPER_FLASH_ENCODER=1 pins it to flash attention where flash runs (fp16/bf16, compute
    capability >= 8.0); float32, older GPUs and the CPU keep torch's choice, as does the default (with flash,
    the suite's tiny checkpoints decode an utterance differently alone and batched); a misspelt value is refused,
    naming the variable."""
    from voiced.engines.whisper.engine import encoder_attention_default as pick

    monkeypatch.delenv("VOICED_WHISPER_FLASH_ENCODER", raising=False)
    assert pick(torch.float16, (9, 0)) is None
    monkeypatch.setenv("VOICED_WHISPER_FLASH_ENCODER", "1")
    assert pick(torch.float16, (9, 0)) == pick(torch.bfloat16, (8, 0)) == "flash"
    assert pick(torch.float32, (9, 0)) is None and pick(torch.float16, (7, 5)) is None
    assert pick(torch.float16, None) is None
    monkeypatch.setenv("VOICED_WHISPER_FLASH_ENCODER", "yes")
    with pytest.raises(ValueError, match="VOICED_WHISPER_FLASH_ENCODER"):
        pick(torch.float16, (9, 0))
