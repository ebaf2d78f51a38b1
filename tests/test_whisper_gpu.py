"""GPU-only checks of the Whisper engine (skipped without CUDA): CUDA graphs against eager steps in
float16 and bfloat16 (decoder steps, encoder with its cross keys/values, the admission's prefill), the
float32 GPU path against openai-whisper, and `rows.to_device`'s pinned staging ring. Tiny random checkpoints in
OpenAI's format; espeak-ng speech (rendered beforehand where espeak-ng is missing: tests/speech.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import make_openai_checkpoint, openai_reference_model, speech

from tests.gpu_phrases import BATCH, REFERENCE, WHISPER
from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.rows import _PinnedRing, to_device
from voiced.engines.whisper.align_graphs import ALIGN_GRAPH_ROWS, ALIGN_GRAPH_TOKENS
from voiced.engines.whisper.audio import N_SAMPLES, pad_or_trim
from voiced.engines.whisper.engine import WhisperEngine, _Active
from voiced.engines.whisper.fast_encoder import FastEncoder
from voiced.engines.whisper.model import decode_attention_kernels
from voiced.engines.whisper.prefill_graphs import Prefills

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def differences(got: dict, want: dict, got_name: str, want_name: str) -> str:
    """Where two {request: tokens} results part, request by request (empty when equal)."""
    lines = []
    for rid in sorted(set(got) | set(want), key=str):
        a, b = got.get(rid), want.get(rid)
        if a == b:
            continue
        if a is None or b is None:
            lines.append(f"request {rid}: only in {want_name if a is None else got_name}")
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines.append(f"request {rid}: first difference at token {i} of {len(a)} / {len(b)}: "
                     f"{got_name} {a[max(0, i - 2) : i + 3]} vs {want_name} {b[max(0, i - 2) : i + 3]}")
    return "\n".join(lines)


def joining_and_leaving(eng: WhisperEngine, clips: list[np.ndarray]) -> dict[int, list[int]]:
    """Requests 0..2 join a running batch one per step and leave at different lengths (10, 15, 20
    tokens); request 3 joins once request 0 has left."""
    pending = [(i, ASRRequest(c, ASROptions(language="en", max_new_tokens=10 + 5 * i))) for i, c in enumerate(clips)]
    late = (3, ASRRequest(clips[0][::-1].copy(), ASROptions(language="en", max_new_tokens=12)))
    out: dict[int, list[int]] = {}
    while pending or late or eng.has_work():
        if pending:
            eng.submit(*pending.pop(0))
        if late and 0 in out:
            eng.submit(*late)
            late = None
        out.update({o.request_id: o.value.tokens for o in eng.step()})
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    return [speech(t, d) for t in WHISPER]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cuda_graphs_match_eager_single_and_joining_leaving(tmp_path, clips, dtype):
    """Compares the greedy tokens of the served path (warmed up: the encoder eager in half precision, the
    fused decoder step, CUDA graphs) with the same engine stepping eagerly (no graphs): three single requests
    forced to 24 tokens, then requests joining and leaving a running batch."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    graphs = WhisperEngine.load(ckpt, device="cuda", dtype=dtype, max_batch=8, max_encoder_batch=4)
    graphs.warmup()
    eager = WhisperEngine.load(ckpt, device="cuda", dtype=dtype, max_batch=8, max_encoder_batch=4, cuda_graphs=False)
    assert graphs.runtime.cuda_graphs and not eager.runtime.cuda_graphs and graphs.dtype == eager.dtype == dtype
    o = ASROptions(language="en", max_new_tokens=24, min_new_tokens=24)
    single_g = {i: graphs.transcribe(ASRRequest(c, o)).tokens for i, c in enumerate(clips)}
    single_e = {i: eager.transcribe(ASRRequest(c, o)).tokens for i, c in enumerate(clips)}
    assert single_g == single_e, "single requests, graphs vs eager:\n" + differences(single_g, single_e, "graphs", "eager")
    assert len({tuple(t) for t in single_g.values()}) == 3, "different audio must give different tokens"
    batch_g, batch_e = joining_and_leaving(graphs, clips), joining_and_leaving(eager, clips)
    assert sorted(batch_g) == [0, 1, 2, 3]
    assert batch_g == batch_e, "joining/leaving, graphs vs eager:\n" + differences(batch_g, batch_e, "graphs", "eager")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_the_served_encoder_gives_the_plain_layers_features(tmp_path, clips, dtype):
    """The served encoder (graphs, buckets of 1 and 4; each residual add and the layer norm after it one kernel)
    gives the features of the plain eager layers (`encoder_layer`, no graphs) within half-precision rounding (the
    residual stream is the same bits; only the layer norms' sums run in another order), and a batch of four its
    rows alone."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    eng = WhisperEngine.load(ckpt, device="cuda", dtype=dtype, max_batch=8, max_encoder_batch=4)
    eng.warmup()
    assert eng.fast_encoder.add_norm and not eng.fast_encoder.compiled
    plain = FastEncoder(eng.model.encoder, eng.dims.n_mels)
    audio = torch.stack([pad_or_trim(torch.from_numpy(c)) for c in clips + clips[:1]]).cuda()
    feats = {}
    with torch.inference_mode(), eng.on_stream():
        for name, enc in (("served", eng.fast_encoder), ("plain", plain)):
            feats[name] = (enc.run(audio, 4, dtype).clone(), enc.run(audio[:1], 1, dtype).clone())
    torch.cuda.synchronize()
    (fused4, fused1), (plain4, plain1) = feats["served"], feats["plain"]
    scale = plain4.float().abs().max()
    assert (fused4.float() - plain4.float()).abs().max() / scale < 2e-2
    assert (fused1.float() - plain1.float()).abs().max() / scale < 2e-2
    assert not torch.equal(fused4[0], fused4[1])


def test_cuda_graphs_match_eager_full_batch(tmp_path):
    """16 different utterances decoded together: graph replay and eager steps pick the same tokens
    (both run the same kernels; see WhisperEngine's cuBLAS note), and the encoder graph equals the
    eager encoder bucket for bucket."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=5)
    rng = np.random.default_rng(0)
    base = speech(BATCH, tmp_path)
    clips = [(base * rng.uniform(0.3, 1.5) + 0.01 * rng.standard_normal(base.size)).astype(np.float32)
             for _ in range(16)]
    graphs = WhisperEngine.load(ckpt, device="cuda", max_batch=16, max_encoder_batch=16)
    graphs.warmup()
    eager = WhisperEngine.load(ckpt, device="cuda", max_batch=16, max_encoder_batch=16, cuda_graphs=False)
    eager.warmup()
    o = ASROptions(language="en", max_new_tokens=32, min_new_tokens=32)
    out = {}
    for eng, name in ((graphs, "g"), (eager, "e")):
        for i, c in enumerate(clips):
            eng.submit(i, ASRRequest(c, o))
        res = {}
        while eng.has_work():
            res.update({r.request_id: r.value.tokens for r in eng.step()})
        out[name] = res
    assert out["g"] == out["e"], "batch of 16, graphs vs eager:\n" + differences(out["g"], out["e"], "graphs", "eager")
    with torch.inference_mode(), graphs.on_stream():  # both encoders on one stream, input made on it too
        x = torch.randn(4, 480000, device="cuda") * 0.1
        a = graphs.fast_encoder.run(x, 4, graphs.dtype).clone()
        b = eager.fast_encoder.run(x, 4, eager.dtype).clone()
        # compared on the stream that wrote them (the default stream does not wait for the engine's)
        same, diff = torch.equal(a, b), (a - b).abs().max().item()
    assert same, f"encoder bucket 4, graph vs eager: max |diff| {diff:.3g}"


def test_fast_decoder_step_is_the_default_and_close_to_the_reference(tmp_path):
    """On CUDA the engine's decoder step is the one through the GEMV kernels; in fp16 its logits lie, on average
    over eight inputs, no further than twice as far from the exact (fp32) step as the modules' own fp16 step does
    (tests/test_whisper_fast.py and tests/test_whisper_gemv.py pin the arithmetic in fp32). Held to fp32 rather
    than to the fp16 step, and on average: over 40 random inputs the GEMV step's largest error is 1.3 % of the
    largest logit at the median (5.2 % at most) and the modules' fp16 step's 1.0 % (4.5 %); one input's ratio
    ranges 0.27-4.3, so a bound per input, or on the two fp16 steps' difference (up to 3.9 %), fails on rounding
    alone now and then. A race or a wrong kernel is far outside it (16.8)."""
    path = "GEMV kernels"
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=6)
    fast = WhisperEngine.load(ckpt, device="cuda", max_batch=8)
    ref = WhisperEngine.load(ckpt, device="cuda", max_batch=8, fast_decoder=False)
    exact = WhisperEngine.load(ckpt, device="cuda", dtype=torch.float32, max_batch=8, fast_decoder=False)
    assert fast.decoder_path == path and ref.decoder_path == "reference"
    # All engines are driven from fast's stream below; the others' caches were zeroed on the default stream
    # after fast's stream was made: let those fills finish first.
    torch.cuda.synchronize()
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode(), fast.on_stream():
        errs, roundings = [], []
        for _ in range(8):  # eight inputs: rounding's share varies much from one to the next
            feats = torch.randn(8, 1500, fast.dims.n_audio_state, device="cuda", generator=generator).half()
            logits = []
            for eng in (fast, ref, exact):
                eng.model.decoder.write_cross(eng.cache, torch.arange(8, device="cuda"), feats.to(eng.dtype))
                eng.steps.tok[:8] = torch.arange(8, device="cuda") + 1000
                eng.steps.pos[:8] = 0
                logits.append(eng.steps.plain(8).float())
            a, b, c = logits
            # Read on the stream that wrote them. The engines' stream is a non-blocking side stream: the
            # default stream does not wait for it, so a difference taken there (as this test once did) can
            # read a result before its last kernel wrote it (a fresh allocation: zeros), whenever the host
            # runs ahead of the GPU (a cold process).
            scale = c.abs().max().item()
            errs.append((a - c).abs().max().item() / scale)
            roundings.append((b - c).abs().max().item() / scale)
    assert sum(errs) <= 2 * sum(roundings), (
        f"{path} step vs fp32: max |diff| / max |logit| {[round(e, 4) for e in errs]}, more than twice the fp16 "
        f"modules' step's {[round(r, 4) for r in roundings]} on average")


@pytest.mark.parametrize("n_mels,seed", [(80, 0), (128, 2)])
def test_float32_gpu_path_equals_openai_whisper(tmp_path, n_mels, seed):
    """Compares the GPU engine in float32 (warmed up: compiled encoder, the decoder step through the GEMV
    kernels; CUDA graphs) with openai-whisper's own model and decode (float32, CPU) on the same checkpoint and
    audio: greedy tokens, 48 at most, English and German."""
    whisper = pytest.importorskip("whisper")
    from voiced.engines.whisper.audio import window_features

    path = make_openai_checkpoint(tmp_path, n_mels=n_mels, seed=seed)
    engine = WhisperEngine.load(path, device="cuda", dtype=torch.float32, max_batch=4, max_encoder_batch=2)
    engine.warmup()
    assert engine.dtype == torch.float32 and engine.runtime.cuda_graphs
    assert engine.decoder_path == "GEMV kernels"
    ref = openai_reference_model(path)
    ours, theirs = {}, {}
    for name, (voice, text) in REFERENCE.items():
        audio = speech(text, tmp_path, voice=voice)
        r = whisper.decode(ref, window_features(audio, n_mels),
                           whisper.DecodingOptions(fp16=False, language=name, without_timestamps=True, sample_len=48))
        theirs[name] = r.tokens
        ours[name] = engine.transcribe(ASRRequest(audio, ASROptions(language=name, max_new_tokens=48))).tokens
    assert ours == theirs, "GPU float32 vs openai-whisper:\n" + differences(ours, theirs, "ours", "openai-whisper")
    assert ours["en"] != ours["de"], "different audio must give different tokens"


# (cache slots, prompt length) of the prefill graph checks on 16 rows with encoder buckets 1, 2, 4, 8:
# single rows, scattered slots padded to a bucket (3 -> 4, 5 -> 8), and every bucket boundary (1, 2, 4,
# 8 rows, no padding), with the SOT sequence with (4 tokens) and without (3) <|notimestamps|>.
PREFILL_CASES = [([5], 4), ([0], 3), ([15], 4), ([9, 2, 14], 4), ([3, 11, 6, 0, 13], 3), ([12, 4], 4),
                 ([1, 7, 10, 2], 3), ([14, 0, 9, 5, 3, 12, 8, 6], 4)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_prefill_graph_is_the_eager_prefill_bit_for_bit(tmp_path, dtype):
    """The admission's prefill replayed from its CUDA graph (`Prefills` with graphs, captured on first
    use and replayed on a second group of the same shape) against the same padded pass launched without
    a graph: last-position logits, no-speech probabilities and every layer's self keys/values of all 16
    slots, exactly equal; at a bucket boundary (no padding) also against `TextDecoder.prefill` itself.
    Cross keys/values of every slot are random and different, so a row reading another slot's audio
    shows."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=7)
    eng = WhisperEngine.load(ckpt, device="cuda", dtype=dtype, max_batch=16, max_encoder_batch=8)
    assert eng.prefills is not None and eng.prefills.graphs is not None and eng.encoder_buckets() == [1, 2, 4, 8]
    cache, dec, tok = eng.cache, eng.model.decoder, eng.tok
    eager = Prefills(dec, cache, eng.encoder_buckets(), tok.no_speech)  # the same pass, no graph
    g = torch.Generator().manual_seed(0)
    torch.cuda.synchronize()  # the caches were zeroed on the default stream; all below runs on the engine's
    with torch.inference_mode(), eng.on_stream():
        feats = torch.randn(16, eng.dims.n_audio_ctx, eng.dims.n_audio_state, generator=g).to("cuda", dtype)
        dec.write_cross(cache, torch.arange(16, device="cuda"), feats)

        def pass_of(prefills: Prefills, tokens: list[list[int]], slots: list[int]):
            cache.self_k.zero_()
            cache.self_v.zero_()
            last, ns = prefills.run(tokens, slots)
            return last.clone(), ns.clone(), cache.self_k.clone(), cache.self_v.clone()

        for slots, t in PREFILL_CASES:
            n = len(slots)
            b = next(x for x in eng.encoder_buckets() if x >= n)
            for seed in (0, 1):  # the first group captures (t, b)'s graph, the second replays it on other inputs
                langs = torch.randint(0, len(tok.language_codes), (n,), generator=g).tolist()
                tokens = [tok.sot_sequence(tok.language_codes[i], "transcribe") + [tok.no_timestamps] * (t == 4)
                          for i in langs]
                assert all(len(x) == t for x in tokens)
                got = pass_of(eng.prefills, tokens, slots)
                assert (f"prefill {t}", b) in eng.prefills.graphs
                want = pass_of(eager, tokens, slots)
                what = f"{n} row(s) in slots {slots} (bucket {b}), {t} tokens, group {seed}"
                for name, x, y in zip(("last logits", "no-speech", "self keys", "self values"), got, want):
                    assert torch.equal(x, y), f"{what}: {name} differ, max |diff| {(x - y).abs().max().item():.3g}"
                assert got[0].abs().sum() > 0 and got[2][:, slots, :t].abs().sum() > 0
                others = [s for s in range(16) if s not in slots]
                assert not got[2][:, others].any() and not got[3][:, others].any(), f"{what}: other slots written"
                if n == b:  # no padding: the very call the engine makes with the graphs off (same kernels)
                    cache.self_k.zero_()
                    cache.self_v.zero_()
                    with decode_attention_kernels(True):
                        logits = dec.prefill(torch.tensor(tokens, device="cuda"), torch.tensor(slots, device="cuda"),
                                             cache)
                    ref = (logits[:, -1], logits[:, 0].softmax(dim=-1)[:, tok.no_speech], cache.self_k, cache.self_v)
                    for name, x, y in zip(("last logits", "no-speech", "self keys", "self values"), got, ref):
                        assert torch.equal(x, y), f"{what}, TextDecoder.prefill: {name} differ"
    # one graph per (prompt length, bucket) the cases meet, no more
    assert len(eng.prefills.graphs) == len({(t, next(x for x in (1, 2, 4, 8) if x >= len(s))) for s, t in PREFILL_CASES})


def mixed_admissions(eng: WhisperEngine, clips: list[np.ndarray]) -> dict[int, list[int]]:
    """Admissions that mix prompt lengths in one group: with and without timestamps (two graphed
    prefills in one admission), a text prompt (its prefill eager) and language detection."""
    opts = [ASROptions(language="en", max_new_tokens=16), ASROptions(language="en", timestamps=True, max_new_tokens=16),
            ASROptions(language=None, max_new_tokens=16), ASROptions(language="en", initial_prompt="Hello there.",
                                                                     max_new_tokens=16)]
    for i, o in enumerate(opts):
        eng.submit(100 + i, ASRRequest(clips[i % len(clips)], o))
    out: dict[int, list[int]] = {}
    while eng.has_work():
        out.update({o.request_id: o.value.tokens for o in eng.step()})
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_prefill_graphs_serve_the_same_tokens(tmp_path, clips, dtype):
    """The served engine (warmed up, its prefill from graphs) decodes the same greedy tokens as the eager engine
    (no graphs): single requests, requests joining and leaving a running batch, and admissions mixing prompt
    lengths. Warm-up captured every prefill graph serving met (serving captured none)."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    kw = dict(device="cuda", dtype=dtype, max_batch=8, max_encoder_batch=4)
    on = WhisperEngine.load(ckpt, **kw)
    off = WhisperEngine.load(ckpt, cuda_graphs=False, **kw)
    # Eagerly the prefill runs the same padded pass (an unpadded one rounds differently, enough to flip a bf16
    # near-tie).
    assert on.prefills.graphs is not None and off.prefills is not None and off.prefills.graphs is None
    on.warmup()
    off.warmup()
    warm = len(on.prefills.graphs)
    assert warm == 2 * len(on.encoder_buckets()), "warm-up: a graph per encoder bucket for both prompt lengths"
    o = ASROptions(language="en", max_new_tokens=24, min_new_tokens=24)
    single_on = {i: on.transcribe(ASRRequest(c, o)).tokens for i, c in enumerate(clips)}
    single_off = {i: off.transcribe(ASRRequest(c, o)).tokens for i, c in enumerate(clips)}
    assert single_on == single_off, "single requests, graphs vs eager:\n" + differences(
        single_on, single_off, "on", "off")
    batch_on, batch_off = joining_and_leaving(on, clips), joining_and_leaving(off, clips)
    assert sorted(batch_on) == [0, 1, 2, 3]
    assert batch_on == batch_off, "joining/leaving, graphs vs eager:\n" + differences(
        batch_on, batch_off, "on", "off")
    mixed_on, mixed_off = mixed_admissions(on, clips), mixed_admissions(off, clips)
    assert mixed_on == mixed_off, "mixed admissions, graphs vs eager:\n" + differences(
        mixed_on, mixed_off, "on", "off")
    assert len(on.prefills.graphs) == warm, "serving captured a prefill graph warm-up had not"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cross_kv_of_the_encoder_graph_are_the_per_layer_projections_bit_for_bit(tmp_path, dtype):
    """The encoder pass leaves every decoder layer's cross keys/values in `fast_encoder.cross_out`: replayed
    from each bucket's graph, and run eagerly (graphs off), they equal `block.cross_attn.key/value` of the
    pass's features exactly (the same Linear calls), and a bucket's replay after a larger one's leaves its
    own rows. `Admission._copy_cross` then puts them into the cache rows of an admission, beams included (one
    request of 3 beams, one of 1, one of 2): each row holds its request's keys/values, no other slot is
    written."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=8)
    kw = dict(device="cuda", dtype=dtype, max_batch=16, max_encoder_batch=8)
    graphs = WhisperEngine.load(ckpt, **kw)
    eager = WhisperEngine.load(ckpt, cuda_graphs=False, **kw)
    assert graphs.encoder_buckets() == [1, 2, 4, 8] and graphs.fast_encoder.graphs is not None
    assert eager.fast_encoder.graphs is None
    blocks = graphs.model.decoder.blocks
    torch.cuda.synchronize()  # the caches were zeroed on the default stream; all below runs on graphs' stream
    with torch.inference_mode(), graphs.on_stream():
        x = torch.randn(8, 480000, device="cuda") * 0.1
        for b in (8, 2, 4, 1):  # a smaller bucket after a larger one writes its own prefix of the buffer
            outs = []
            for eng in (graphs, eager):
                features = eng.fast_encoder.run(x[:b], b, eng.dtype).clone()
                outs.append((features, eng.fast_encoder.cross_out[:, :, :b].clone()))
            (fg, kv_g), (fe, kv_e) = outs
            assert torch.equal(fg, fe), f"bucket {b}: encoder features, graph vs eager"
            want = torch.stack([torch.stack([blk.cross_attn.key(fg) for blk in blocks]),
                                torch.stack([blk.cross_attn.value(fg) for blk in blocks])])
            for name, got in (("graph", kv_g), ("eager", kv_e)):
                assert torch.equal(got, want), (f"bucket {b}, {name}: cross keys/values differ from the per-layer "
                                                f"projections, max |diff| {(got - want).abs().max().item():.3g}")
            assert want.abs().sum() > 0
        # An admission of three requests with 3, 1 and 2 beams in rows 5.. of the cache (bucket 4: padded).
        graphs.fast_encoder.run(torch.cat([x[:3], x.new_zeros(1, x.shape[1])]), 4, graphs.dtype)
        kv = graphs.fast_encoder.cross_out[:, :, :3].clone()
        part = [_Active(i, None, None, rows, 0.0, i, N_SAMPLES) for i, rows in enumerate([[5, 6, 7], [8], [9, 10]])]
        graphs.cache.cross_k.zero_()
        graphs.cache.cross_v.zero_()
        graphs.admission._copy_cross(part)
        for i, r in enumerate(part):
            for row in r.rows:
                assert torch.equal(graphs.cache.cross_k[:, row], kv[0, :, i]), f"request {i}, row {row}: keys"
                assert torch.equal(graphs.cache.cross_v[:, row], kv[1, :, i]), f"request {i}, row {row}: values"
        others = [s for s in range(16) if s not in range(5, 11)]
        assert not graphs.cache.cross_k[:, others].any() and not graphs.cache.cross_v[:, others].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_beams_and_greedy_admitted_together_decode_alike_with_graphs_on_and_off(tmp_path, clips, dtype):
    """Served tokens with every graph (encoder + cross keys/values, prefill, steps) and eagerly, for admissions that mix beam search (its rows' cross
    keys/values copied once per beam index) with greedy requests, and requests joining and leaving a
    running batch."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    kw = dict(device="cuda", dtype=dtype, max_batch=8, max_encoder_batch=4)
    on = WhisperEngine.load(ckpt, **kw)
    off = WhisperEngine.load(ckpt, cuda_graphs=False, **kw)
    on.warmup()
    off.warmup()
    opts = [ASROptions(language="en", beam_size=3, max_new_tokens=12), ASROptions(language="en", max_new_tokens=16),
            ASROptions(language="en", beam_size=2, max_new_tokens=10)]
    got = {}
    for eng, name in ((on, "on"), (off, "off")):
        for i, o in enumerate(opts):
            eng.submit(i, ASRRequest(clips[i % len(clips)], o))
        res = {}
        while eng.has_work():
            res.update({r.request_id: r.value.tokens for r in eng.step()})
        got[name] = res
    assert sorted(got["on"]) == [0, 1, 2]
    assert got["on"] == got["off"], "beams + greedy, graphs on vs off:\n" + differences(got["on"], got["off"], "on", "off")
    batch_on, batch_off = joining_and_leaving(on, clips), joining_and_leaving(off, clips)
    assert batch_on == batch_off, "joining/leaving, graphs on vs off:\n" + differences(batch_on, batch_off, "on", "off")


def test_to_device_staging_ring_never_hands_out_a_block_still_being_read():
    """`to_device` through its pinned ring: values and shapes as `torch.tensor` gives them (a list, equal
    lists, an int array, larger than a block), with the stream held busy so that the copies queue: many
    more calls than the ring has blocks, each with other values, all arrive intact (a block whose copy has
    not run is not refilled) and the host never waited for the stream."""
    import time

    from voiced.engines import rows

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert torch.equal(to_device([3, 1, 2], "cuda").cpu(), torch.tensor([3, 1, 2]))
        torch.cuda._sleep(2_000_000_000)  # ~1 s or more of GPU time queued ahead of every copy below
        t0 = time.perf_counter()
        sent = []
        for i in range(3 * _PinnedRing.SLOTS):
            values = [[i, i + 1, i + 2], [-i, 7, 2**40 + i]] if i % 3 else np.arange(i, i + 5, dtype=np.int32)
            sent.append((values, to_device(values, "cuda")))
        big = list(range(_PinnedRing.SLOT_LONGS + 1))
        sent.append((big, to_device(big, torch.device("cuda"))))
        host_s = time.perf_counter() - t0
        done_early = torch.cuda.current_stream().query()
        got = [t.cpu() for _, t in sent]  # waits for the stream
        assert all(e.query() for e in rows._ring(torch.device("cuda")).events)  # every block's copy has run
    assert not done_early and host_s < 0.5, f"the host waited on the stream ({host_s:.2f} s)"
    for (values, _), t in zip(sent, got):
        want = torch.tensor(np.asarray(values), dtype=torch.long)
        assert t.dtype == torch.long and torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_chunk_graph_replay_is_the_per_step_graphs_bit_for_bit(tmp_path, dtype):
    """One replay of a bucket's chunk graph (what a full chunk runs,
    captured at warm-up) against the engine's per-step loop from the same state (decode_chunk replays of
    the greedy graph, each followed by the two history writes): the history buffer (tokens and
    log-probabilities of every step), the step buffers (token, position, countdown, log-probability) and
    every layer's self keys/values of all slots, exactly equal, for every bucket (1..16 rows: written-out
    attention and SDPA), rows at scattered positions with some still under their minimum length. Cross
    keys/values of every slot are random and different, so a row reading another slot's audio shows."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=9)
    eng = WhisperEngine.load(ckpt, device="cuda", dtype=dtype, max_batch=16, max_encoder_batch=4)
    assert eng.runtime.chunk_graphs and eng.decode_chunk == 8 and eng.buckets == [1, 2, 4, 8, 16]
    eng.warmup()
    steps, cache = eng.steps, eng.cache
    assert all(steps.has_graph("chunk", b) for b in eng.buckets), "warm-up captures a chunk graph per bucket"
    g = torch.Generator().manual_seed(0)
    torch.cuda.synchronize()  # warm-up's last work; all below runs on the engine's stream
    with torch.inference_mode(), eng.on_stream():
        feats = torch.randn(16, eng.dims.n_audio_ctx, eng.dims.n_audio_state, generator=g).to("cuda", dtype)
        eng.model.decoder.write_cross(cache, torch.arange(16, device="cuda"), feats)
        for b in eng.buckets:
            cache.self_k.copy_(torch.randn(cache.self_k.shape, generator=g).to(dtype))
            cache.self_v.copy_(torch.randn(cache.self_v.shape, generator=g).to(dtype))
            inputs = torch.stack([torch.randint(0, eng.tok.eot, (16,), generator=g),
                                  torch.randint(0, eng.dims.n_text_ctx - 9, (16,), generator=g),
                                  torch.randint(0, 6, (16,), generator=g)]).cuda()
            start = [t.clone() for t in (cache.self_k, cache.self_v)]
            results = []
            for path in ("chunk", "steps"):
                for t, v in zip((cache.self_k, cache.self_v), start):
                    t.copy_(v)
                steps.inputs.copy_(inputs)
                steps.lp.zero_()
                eng._hist.fill_(float("nan"))
                if path == "chunk":
                    steps.run("chunk", b)
                else:
                    hist_tok, hist_lp = eng._hist[:b, :, 0], eng._hist[:b, :, 1]
                    for k in range(eng.decode_chunk):
                        steps.run("greedy", b)
                        hist_tok[:, k] = steps.tok[:b]
                        hist_lp[:, k] = steps.lp[:b]
                results.append([t.clone() for t in (eng._hist[:b], steps.inputs[:, :b], steps.lp[:b], cache.self_k,
                                                    cache.self_v)])
            for name, x, y in zip(("history", "step inputs", "log-probs", "self keys", "self values"), *results):
                assert torch.equal(x, y), f"bucket {b}: {name} differ, chunk replay vs per-step graphs"
            hist = results[0][0]
            assert not hist.isnan().any() and (hist[:, :, 1] <= 0).all()
            assert torch.equal(results[0][1][1], inputs[1, :b] + eng.decode_chunk)


def chunk_mix(eng: WhisperEngine, clips: list[np.ndarray]) -> dict[int, tuple]:
    """Twelve requests of 16 rows, four admitted per step while the others decode (rows joining), of lengths
    apart (full chunks, and chunks cut short near a row's limit), half free to end on their own (rows that
    finish mid-chunk), so the batch runs through buckets 16, 8, 4, 2, 1 as they leave; tokens and the
    average log-probability (the sum of every served log-probability, in float32) per request."""
    out: dict[int, tuple] = {}
    pending = []
    for i in range(12):
        c = clips[i % len(clips)]
        n = 9 + 3 * i
        pending.append((200 + i, ASRRequest((c * (0.6 + 0.07 * i)).astype(np.float32),
                                            ASROptions(language="en", max_new_tokens=n,
                                                       min_new_tokens=n if i % 2 else 0))))
    while pending or eng.has_work():
        for _ in range(4):
            if pending:
                eng.submit(*pending.pop(0))
        out.update({o.request_id: (o.value.tokens, o.value.avg_logprob) for o in eng.step()})
    return out


def counting_runs(eng: WhisperEngine) -> dict[str, int]:
    """From now on, how many step runs `eng` makes of each kind ("chunk", "greedy", ...), filled as it serves."""
    kinds: dict[str, int] = {}
    run = eng.steps.run

    def counted(kind, b):
        kinds[kind] = kinds.get(kind, 0) + 1
        return run(kind, b)
    eng.steps.run = counted
    return kinds


def same_single_requests(on: WhisperEngine, off: WhisperEngine, clips: list[np.ndarray]) -> None:
    """Each clip alone, forced to 24 tokens: the same tokens and average log-probabilities from both engines."""
    o = ASROptions(language="en", max_new_tokens=24, min_new_tokens=24)
    single_on = {i: (r.tokens, r.avg_logprob) for i, c in enumerate(clips) for r in [on.transcribe(ASRRequest(c, o))]}
    single_off = {i: (r.tokens, r.avg_logprob) for i, c in enumerate(clips) for r in [off.transcribe(ASRRequest(c, o))]}
    same_served(single_on, single_off, "single requests")


def same_served(on: dict[int, tuple], off: dict[int, tuple], what: str) -> None:
    """{request: (tokens, average log-probability)} from the served engine (`on`) equal to the one it is compared
    with (`off`: the eager engine, or the served one without decode-ahead): the same tokens, the average
    log-probabilities within 1e-5 (the same kernels run)."""
    tok_on, tok_off = ({k: v[0] for k, v in d.items()} for d in (on, off))
    assert tok_on == tok_off, f"{what}:\n" + differences(tok_on, tok_off, "served", "compared")
    lp = {k: (on[k][1], off[k][1]) for k in on if abs(on[k][1] - off[k][1]) > 1e-5}
    assert not lp, f"{what}: average log-probabilities (served, compared) apart: {lp}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_chunk_graphs_serve_the_same_tokens(tmp_path, clips, dtype):
    """The served engine (warmed up, chunks of greedy steps replayed from their graphs) decodes the same greedy
    tokens, with the same average log-probabilities (`same_served`), as the eager engine (no graphs): single
    requests, requests joining and leaving a running batch, and a mix of twelve requests joining four at a time,
    finishing mid-chunk and at their limits, through every bucket. The chunk graphs served (counted), warm-up
    captured one per bucket and serving captured none."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    kw = dict(device="cuda", dtype=dtype, max_batch=16, max_encoder_batch=4)
    on = WhisperEngine.load(ckpt, **kw)
    off = WhisperEngine.load(ckpt, cuda_graphs=False, **kw)
    assert on.runtime.chunk_graphs and not off.runtime.chunk_graphs
    on.warmup()
    off.warmup()
    warm = len(on.steps.graphs)
    assert warm == 3 * len(on.buckets), "warm-up: a plain, a greedy and a chunk graph per bucket"
    kinds = counting_runs(on)
    same_single_requests(on, off, clips)
    assert kinds.get("chunk", 0) >= 2 * len(clips), "a 24-token request is two full chunks and a short one"
    batch_on, batch_off = joining_and_leaving(on, clips), joining_and_leaving(off, clips)
    assert sorted(batch_on) == [0, 1, 2, 3]
    assert batch_on == batch_off, "joining/leaving, graphs vs eager:\n" + differences(
        batch_on, batch_off, "graphs", "eager")
    mix_on, mix_off = chunk_mix(on, clips), chunk_mix(off, clips)
    assert len(mix_on) == 12
    same_served(mix_on, mix_off, "twelve joining")
    assert kinds.get("greedy", 0) > 0, "short chunks ran step by step"
    assert len(on.steps.graphs) == warm, "serving captured a decoder graph warm-up had not"


def test_word_timings_of_requests_finishing_together_are_each_alone(tmp_path, clips):
    """On CUDA (graphs, float16) the requests finishing in one step go through one forced word-timing
    pass: each gets the words, times and end probabilities it gets alone."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    eng = WhisperEngine.load(ckpt, device="cuda", max_batch=8, max_encoder_batch=4)
    eng.warmup()
    o = ASROptions(language="en", max_new_tokens=20, min_new_tokens=20, word_timestamps=True)
    alone = [eng.transcribe(ASRRequest(c, o)) for c in clips]
    for i, c in enumerate(clips):
        eng.submit(i, ASRRequest(c, o))
    together = {}
    while eng.has_work():
        together.update({r.request_id: r.value for r in eng.step()})
    for i, want in enumerate(alone):
        got = together[i]
        assert want.words and [(w.word, w.start_s, w.end_s) for w in got.words] == \
            [(w.word, w.start_s, w.end_s) for w in want.words], i
        assert [w.probability for w in got.words] == pytest.approx([w.probability for w in want.words], rel=1e-2)
        assert (got.end_prob, got.stop_prob) == pytest.approx((want.end_prob, want.stop_prob), rel=1e-2, abs=1e-3)


def test_word_timing_graphs_give_the_eager_pass_s_words(tmp_path, clips):
    """The forced word-timing pass replayed from its CUDA graphs (captured at warm-up) gives the words and times
    of the same engine's eager pass (`alignment_hidden`, its graphs set aside), for one request and for three
    finishing together; the memory plan counts what the graphs hold."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    o = ASROptions(language="en", max_new_tokens=20, min_new_tokens=20, word_timestamps=True)
    out = {}
    eng = WhisperEngine.load(ckpt, device="cuda", max_batch=8, max_encoder_batch=4)
    eng.warmup()
    passes = eng.words.passes  # every bucket captured at warm-up, and what they hold is what the memory plan counts
    assert len(passes.graphs) == len(ALIGN_GRAPH_ROWS) * len(ALIGN_GRAPH_TOKENS)
    held = [n for n in eng.memory_need.items if n.what.startswith("word-timing graphs") and not n.transient]
    assert [n.bytes for n in held] == [sum(t.nbytes for t in (passes.inputs, passes.hidden, passes.scores))]
    for mode in ("graphs", "eager"):
        eng.words.passes = passes if mode == "graphs" else None
        alone = [eng.transcribe(ASRRequest(clips[0], o))]
        for i, c in enumerate(clips):
            eng.submit(i, ASRRequest(c, o))
        together = {}
        while eng.has_work():
            together.update({r.request_id: r.value for r in eng.step()})
        out[mode] = [[(w.word, w.start_s, w.end_s) for w in r.words] for r in alone + [together[i] for i in range(3)]]
    assert all(out["graphs"]) and out["graphs"] == out["eager"]


def test_unset_rows_are_the_most_the_memory_share_holds(tmp_path):
    """`max_batch` unset (the daemon's default, 0) on a GPU: 64 decoder rows where the engine's share of the
    free memory holds them, else the most of 32, 16, ... that it does, and the engine holds what its need
    says. The shares here are made from the engine's own needs at 16 and 32 rows."""
    ckpt = make_openai_checkpoint(tmp_path, seed=2)
    free = torch.cuda.mem_get_info()[0]
    big = WhisperEngine.load(ckpt, device="cuda", memory_limit=(free, 0.25), cuda_graphs=False)
    assert big.max_batch == 64 and big.memory_need.total <= free * 0.25
    need = {rows: WhisperEngine.load(ckpt, device="cuda", max_batch=rows, cuda_graphs=False).memory_need.total
            for rows in (16, 32)}
    assert need[16] < need[32] < big.memory_need.total
    share = (need[16] + need[32]) / 2 / free  # holds 16 rows, not 32
    small = WhisperEngine.load(ckpt, device="cuda", memory_limit=(free, share), cuda_graphs=False)
    assert small.max_batch == 16 and small.memory_need.total == need[16]
    assert small.cache.cross_k.shape[1] == 16  # the cache is sized by the rows taken


def test_decode_ahead_serves_the_same_tokens(tmp_path, clips):
    """Decode-ahead (the GPU's default): the served engine, launching the next chunk from the inputs
    the last one left on the device before it reads that one back (the history through pinned copies and their
    events), decodes what it decodes without: single requests bit for bit (the same rows run the same graphs),
    requests joining and leaving, and twelve joining four at a time (the same tokens; their average
    log-probabilities to half-precision rounding, since a chunk launched ahead runs rows beside some that have
    left since, in a larger bucket). Chunks were launched ahead, and serving captured no graph."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    kw = dict(device="cuda", dtype=torch.float16, max_batch=16, max_encoder_batch=4)
    on = WhisperEngine.load(ckpt, decode_ahead=True, **kw)
    off = WhisperEngine.load(ckpt, decode_ahead=False, **kw)
    assert on.runtime.decode_ahead and not off.runtime.decode_ahead
    on.warmup()
    off.warmup()
    warm = len(on.steps.graphs)
    launched = []
    launch = on._launch_ahead

    def counted(chunk):
        nxt = launch(chunk)
        launched.append(nxt is not None)
        return nxt
    on._launch_ahead = counted
    same_single_requests(on, off, clips)
    assert sum(launched) >= 2 * len(clips), "a 24-token request: one chunk from the host, two launched ahead"
    batch_on, batch_off = joining_and_leaving(on, clips), joining_and_leaving(off, clips)
    assert batch_on == batch_off, "joining/leaving, ahead vs not:\n" + differences(batch_on, batch_off, "ahead", "not")
    mix_on, mix_off = chunk_mix(on, clips), chunk_mix(off, clips)
    tok_on, tok_off = ({k: v[0] for k, v in d.items()} for d in (mix_on, mix_off))
    assert len(tok_on) == 12 and tok_on == tok_off, "twelve joining:\n" + differences(tok_on, tok_off, "ahead", "not")
    for k in mix_on:
        assert mix_on[k][1] == pytest.approx(mix_off[k][1], abs=2e-3), k
    assert len(on.steps.graphs) == warm, "serving captured a decoder graph warm-up had not"


def _end_by_themselves(eng: WhisperEngine, allowed: int = 24) -> None:
    """A random checkpoint's greedy text almost never chooses end-of-text: here every token but `allowed` fixed
    ones and end-of-text is suppressed, and end-of-text's (tied) embedding is made 4 times longer, so that its
    logit leads at some steps, and requests end on their own after a spread of lengths, as real speech does, and
    not only at their length limit. The same for every engine of a checkpoint (the device's suppression mask and
    embedding, which the graphs read, changed in place)."""
    always = eng.suppress.always
    keep = torch.zeros_like(always)
    keep[torch.arange(1000, 1000 + 50 * allowed, 50, device=always.device)] = True
    keep[eng.tok.eot] = True
    with torch.no_grad():
        always.copy_(always | ~keep)
        eng.model.decoder.token_embedding.weight[eng.tok.eot] *= 4


def test_requests_ending_on_their_own_are_served_as_eagerly_and_their_ended_steps_do_nothing(tmp_path, clips):
    """The served engine (graphs, decode-ahead, the GEMV step that skips a step whose rows all hold end-of-text),
    its requests ending on their own, decodes what the eager engine decodes (`same_served`), alone, joining and
    leaving, and twelve joining four at a time; and the steps after a lone request's end do nothing on the GPU:
    none of them writes a key into its cache slot (the chunk launched ahead of the read that finds the end would
    write up to a chunk of them)."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    kw = dict(device="cuda", dtype=torch.float16, max_batch=16, max_encoder_batch=4)
    on = WhisperEngine.load(ckpt, **kw)
    off = WhisperEngine.load(ckpt, cuda_graphs=False, **kw)
    assert on.steps.fused and on.runtime.decode_ahead
    for eng in (on, off):
        eng.warmup()
        _end_by_themselves(eng)
    opts = ASROptions(language="en", max_new_tokens=100)
    written, lengths = {}, {}
    for name, eng in (("on", on), ("off", off)):
        for i, c in enumerate(clips):
            keys = eng.cache.self_k[0][0]  # the first layer's keys of slot 0 (a lone request's row)
            keys.zero_()
            r = eng.transcribe(ASRRequest(c, opts))
            torch.cuda.synchronize()
            written[name, i] = int((keys != 0).any(-1).sum())
            lengths[name, i] = (r.tokens, r.avg_logprob)
    same_served({i: lengths["on", i] for i in range(len(clips))}, {i: lengths["off", i] for i in range(len(clips))},
                "single requests")
    ended = [i for i in range(len(clips)) if len(lengths["on", i][0]) < 100]
    assert ended, f"no request ended on its own: {lengths}"
    for i in ended:
        assert written["on", i] <= 4 + len(lengths["on", i][0]), (i, written, lengths)
    batch_on, batch_off = joining_and_leaving(on, clips), joining_and_leaving(off, clips)
    assert batch_on == batch_off, "joining/leaving:\n" + differences(batch_on, batch_off, "graphs", "eager")
    mix_on, mix_off = chunk_mix(on, clips), chunk_mix(off, clips)
    same_served(mix_on, mix_off, "twelve joining")
    assert any(len(t) < 9 + 3 * (k - 200) for k, (t, _) in mix_on.items()), "none of the mix ended on its own"
