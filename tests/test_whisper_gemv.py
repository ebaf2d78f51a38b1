"""Whisper's decoder step through the shared GEMV and attention kernels (`FastDecoder(gemv=True)`, the GPU's
step) on the CPU, under Triton's interpreter (in a child process: TRITON_INTERPRET=1
is read when a kernel is defined): over several steps of two rows at different positions, the logits and the
keys/values written are the modules' step's (`TextDecoder.step`) within float32 rounding, and greedy picks
the same tokens; the attention kernel's two Whisper modes (no rope, and cross-attention over the audio's keys
and values) against torch, with their spans split over programs; the GELU projection and the layer-norm
epilogue against torch; the encoder with its residual adds and layer norms fused the same way (the GPU's
eager encoder). tests/test_whisper_gpu.py runs the step on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import run_interpreted

H, D = 4, 32  # a small decoder's heads and head size


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _child() -> dict:
    from voiced.engines.kernels import decode_attention as da
    from voiced.engines.kernels import decode_linear as dl
    from voiced.engines.whisper.audio import N_SAMPLES, log_mel_spectrogram
    from voiced.engines.whisper.fast_decoder import FastDecoder, _heads_view
    from voiced.engines.whisper.fast_encoder import FastEncoder
    from voiced.engines.whisper.model import KVCache, ModelDims, Whisper

    out: dict = {}
    g = torch.Generator().manual_seed(0)
    # the attention kernel without rope, and as cross-attention, one program per (row, head) and split
    out["attention"] = []
    width, ctx, audio = H * D, 256, 200
    for b, sms, pos in [(1, 1, [40]), (2, 8, [0, 199]), (3, 32, [5, 64, 255])]:
        cache = torch.randn(4, ctx, width, generator=g), torch.randn(4, ctx, width, generator=g)
        cross = torch.randn(4, audio, width, generator=g), torch.randn(4, audio, width, generator=g)
        qkv = torch.randn(b, 3 * width, generator=g)
        positions = torch.tensor(pos)
        k_got, v_got = cache[0].clone(), cache[1].clone()
        got = da.triton_attention(qkv, None, None, _heads_view(k_got, H), _heads_view(v_got, H), positions, ctx,
                                  (H, H, D), sms=sms)
        k_want, v_want = cache[0].clone(), cache[1].clone()
        q, k, v = qkv.view(b, 3, H, D).unbind(1)
        want = []
        for r in range(b):
            k_want[r, pos[r]], v_want[r, pos[r]] = k[r].reshape(-1), v[r].reshape(-1)
            keys = k_want[r, : pos[r] + 1].view(-1, H, D).transpose(0, 1)
            values = v_want[r, : pos[r] + 1].view(-1, H, D).transpose(0, 1)
            want.append(F.scaled_dot_product_attention(q[r][:, None], keys, values).reshape(-1))
        want = torch.stack(want)
        q_cross = torch.randn(b, width, generator=g)
        got_cross = da.triton_attention(q_cross, None, None, _heads_view(cross[0], H), _heads_view(cross[1], H),
                                        positions, audio, (H, H, D), sms=sms, cross=True)
        want_cross = F.scaled_dot_product_attention(q_cross.view(b, H, 1, D), cross[0][:b].view(b, audio, H, D).transpose(1, 2),
                                                    cross[1][:b].view(b, audio, H, D).transpose(1, 2)).reshape(b, -1)
        # never split (Whisper's self-attention): one program per (row, head) over up to 256 positions
        k_one, v_one = cache[0].clone(), cache[1].clone()
        got_one = da.triton_attention(qkv, None, None, _heads_view(k_one, H), _heads_view(v_one, H), positions, ctx,
                                      (H, H, D), sms=sms, split=False)
        out["attention"].append({"case": [b, sms], "splits": da.split_plan(b, H, ctx, sms)[1],
                                 "self": _rel(got, want), "cache": bool(torch.equal(k_got, k_want) and torch.equal(v_got, v_want)),
                                 "cross": _rel(got_cross, want_cross), "unsplit": _rel(got_one, want),
                                 "unsplit_cache": bool(torch.equal(k_one, k_want) and torch.equal(v_one, v_want))})
    # the GELU projection and the bias + residual + layer norm epilogue
    out["epilogues"] = []
    for m in (1, 5):
        x, w, bias = torch.randn(m, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
        resid, ln_w, ln_b = torch.randn(m, 70, generator=g), torch.rand(70, generator=g) + 0.5, torch.randn(70, generator=g)
        want_x, want_h = dl.reference_add_layer_norm(resid, F.linear(x, w, bias), ln_w, ln_b, 1e-5)
        got_x = resid.clone()
        got_h = dl.add_layer_norm(dl.linear_partials(x, w, sms=8), got_x, bias, ln_w, ln_b, 1e-5)
        out["epilogues"].append({"gelu": _rel(dl.linear(x, w, bias, gelu=True), F.gelu(F.linear(x, w, bias))),
                                 "x": _rel(got_x, want_x), "h": _rel(got_h, want_h)})
    # the whole step against the modules', two rows at different positions, six steps
    torch.manual_seed(1)
    dims = ModelDims(n_mels=80, n_audio_ctx=48, n_audio_state=H * D, n_audio_head=H, n_audio_layer=1, n_vocab=300,
                     n_text_ctx=32, n_text_state=H * D, n_text_head=H, n_text_layer=2)
    model = Whisper(dims).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    dec = model.decoder
    caches = []
    with torch.no_grad():
        features = torch.randn(2, dims.n_audio_ctx, dims.n_audio_state)
        for _ in range(2):
            cache = KVCache.allocate(dims, 2, torch.float32, "cpu")
            dec.write_cross(cache, torch.arange(2), features)
            dec.prefill(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), torch.arange(2), cache)
            caches.append(cache)
        gemv = FastDecoder(dec, gemv=True)
        tokens, positions, worst, same = torch.tensor([11, 12]), torch.tensor([5, 9]), 0.0, True
        for _ in range(6):
            want = dec.step(tokens, positions, caches[0], dims.n_text_ctx)
            got = gemv.step(tokens, positions, caches[1], dims.n_text_ctx)
            worst = max(worst, _rel(got, want))
            same &= bool(torch.equal(got.argmax(-1), want.argmax(-1)))
            tokens, positions = want.argmax(-1), positions + 1
    out["step"] = {"logits": worst, "argmax_equal": same,
                   "self_cache": max(_rel(a, b) for a, b in ((caches[1].self_k, caches[0].self_k),
                                                              (caches[1].self_v, caches[0].self_v)))}
    # skipping a step whose rows have all ended (stop_id): a row still going makes the step the very one without
    # the check (logits and keys/values, bit for bit); all rows ended, it writes nothing
    with torch.no_grad():
        end = 299
        skip = {}
        for case, toks in (("none ended", [11, 12]), ("one ended", [end, 12]), ("all ended", [end, end])):
            tokens, positions = torch.tensor(toks), torch.tensor([11, 15])
            plain_cache = KVCache.allocate(dims, 2, torch.float32, "cpu")
            for t in (plain_cache.self_k, plain_cache.self_v, plain_cache.cross_k, plain_cache.cross_v):
                t.copy_(torch.randn(t.shape, generator=g))
            gated_cache = KVCache.allocate(dims, 2, torch.float32, "cpu")
            for a, b in zip((gated_cache.self_k, gated_cache.self_v, gated_cache.cross_k, gated_cache.cross_v),
                            (plain_cache.self_k, plain_cache.self_v, plain_cache.cross_k, plain_cache.cross_v)):
                a.copy_(b)
            before = plain_cache.self_k.clone(), plain_cache.self_v.clone()
            want = gemv.step(tokens, positions, plain_cache, dims.n_text_ctx)
            got = gemv.step(tokens, positions, gated_cache, dims.n_text_ctx, stop_id=end)
            skip[case] = {"logits_equal": bool(torch.equal(got, want)),
                          "cache_equal": bool(torch.equal(gated_cache.self_k, plain_cache.self_k)
                                              and torch.equal(gated_cache.self_v, plain_cache.self_v)),
                          "cache_untouched": bool(torch.equal(gated_cache.self_k, before[0])
                                                  and torch.equal(gated_cache.self_v, before[1]))}
    out["skip_ended"] = skip
    # the greedy choice in the head's GEMV (`greedy_head`) against `greedy_advance` over the same logits: several
    # programs along the vocabulary, equal maxima within a program and across two, the always-suppressed mask, a
    # countdown that holds end-of-text back, a row that has ended; and then the GEMV step's chunk against the
    # modules' step's
    from voiced.engines.whisper.decoder_steps import DecoderSteps
    from voiced.engines.whisper.token_choice import greedy_advance
    with torch.no_grad():
        vocab, width, rows, eot = 300, 96, 5, 257
        h, w = torch.randn(rows, width, generator=g), torch.randn(vocab, width, generator=g) * 0.1
        w[40] = w[41] = w[150] = h[0].sign() * 3  # row 0: three equal maxima, two in one block, one in another
        w[eot] = h[1].sign() * 3  # row 1: end-of-text would lead, but its countdown holds it back
        w[77] = h[3].sign() * 3  # row 3: 77 would lead, but it is always suppressed
        always = torch.zeros(vocab, dtype=torch.bool)
        always[[77, 78, 290]] = True
        inputs = torch.tensor([[5, 6, eot, 8, 9], [3, 4, 5, 6, 7], [0, 2, 0, 0, 1]])
        want_in, want_lp = inputs.clone(), torch.zeros(rows)
        greedy_advance(F.linear(h, w), always, eot, want_in, want_lp)
        got_in, got_lp, hist = inputs.clone(), torch.zeros(rows), torch.zeros(rows, 4, 2, dtype=torch.float64)
        dl.greedy_head(h, w, always, eot, got_in, got_lp, hist[:, 2], block_n=32)
        out["greedy_head"] = {"inputs": bool(torch.equal(got_in, want_in)), "lp": _rel(got_lp, want_lp),
                              "row0": int(got_in[0, 0]), "row1_not_eot": int(got_in[0, 1]) != eot,
                              "hist": bool(torch.equal(hist[:, 2, 0], got_in[0].double())
                                           and torch.equal(hist[:, 2, 1], got_lp.double())),
                              "hist_elsewhere": bool((hist[:, [0, 1, 3]] == 0).all())}
        # a batch past one program's 64 rows (the engine's buckets go to 256)
        many = 70
        h = torch.randn(many, width, generator=g)
        inputs = torch.stack([torch.randint(0, vocab, (many,), generator=g), torch.randint(0, 20, (many,), generator=g),
                              torch.randint(0, 3, (many,), generator=g)])
        inputs[0, ::7] = eot
        want_in, want_lp = inputs.clone(), torch.zeros(many)
        greedy_advance(F.linear(h, w), always, eot, want_in, want_lp)
        got_in, got_lp = inputs.clone(), torch.zeros(many)
        dl.greedy_head(h, w, always, eot, got_in, got_lp, block_n=32)
        out["greedy_head_many"] = {"inputs": bool(torch.equal(got_in, want_in)), "lp": _rel(got_lp, want_lp)}
        chunks = {}
        for name, decoder in (("plain", dec), ("fused", FastDecoder(dec, gemv=True))):
            cache = KVCache.allocate(dims, 2, torch.float32, "cpu")
            dec.write_cross(cache, torch.arange(2), features)
            dec.prefill(torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), torch.arange(2), cache)
            st = DecoderSteps(decoder, cache, dims.n_text_ctx, 2,
                              torch.device("cpu"), torch.zeros(dims.n_vocab, dtype=torch.bool), dims.n_vocab - 1,
                              hist=torch.zeros(2, 6, 2, dtype=torch.float64))
            st.inputs[:3] = torch.tensor([[11, 12], [5, 9], [0, 3]])
            st.chunk(2)
            chunks[name] = (st.hist.clone(), st.inputs.clone(), st.fused)
        out["fused_chunk"] = {"fused": chunks["fused"][2] and not chunks["plain"][2],
                              "tokens": bool(torch.equal(chunks["fused"][0][..., 0], chunks["plain"][0][..., 0])),
                              "inputs": bool(torch.equal(chunks["fused"][1], chunks["plain"][1])),
                              "lp": _rel(chunks["fused"][0][..., 1], chunks["plain"][0][..., 1])}
    # the encoder with each residual add and the norm after it in the same kernel, against its plain eager layers
    # and the module's forward: one 30 s window (1,500 positions: interpreted, ~10 s a layer), two layers
    edims = ModelDims(n_mels=80, n_audio_ctx=1500, n_audio_state=H * D, n_audio_head=H, n_audio_layer=2,
                      n_vocab=300, n_text_ctx=32, n_text_state=H * D, n_text_head=H, n_text_layer=1)
    enc = Whisper(edims).eval().encoder
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0, 0.2)
        audio = torch.randn(1, N_SAMPLES, generator=g) * 0.1
        audio[:, N_SAMPLES // 3:] = 0  # a 10 s utterance, padded as the engine pads it
        fused = FastEncoder(enc, edims.n_mels, add_norm=True)(audio, torch.float32)
        plain = FastEncoder(enc, edims.n_mels)(audio, torch.float32)
        module = enc(log_mel_spectrogram(audio, edims.n_mels))
    out["encoder"] = {"vs_plain": _rel(fused, plain), "vs_module": _rel(fused, module)}
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_whisper_gemv", timeout=900)


def test_attention_kernel_without_rope_and_across_to_the_audio(interpreted):
    """Whisper's self-attention (its new key and value written at the row's position, attending to 0..pos)
    and cross-attention (all of the audio's positions, nothing written) through the Spark LM's kernel,
    within float32 rounding of torch's attention, with one program per (row, head) and spans split; and the
    self-attention never split (one program over every position up to the row's, several blocks of them)."""
    for case in interpreted["attention"]:
        assert case["self"] <= 1e-5 and case["cross"] <= 1e-5 and case["cache"], case
        assert case["unsplit"] <= 1e-5 and case["unsplit_cache"], case
    assert {c["splits"] > 1 for c in interpreted["attention"]} == {True, False}


def test_gelu_projection_and_layer_norm_epilogue(interpreted):
    for row in interpreted["epilogues"]:
        assert max(row.values()) <= 1e-5, row


def test_decoder_step_through_the_kernels_equals_the_modules(interpreted):
    """Six steps of a small decoder (two rows at different positions, audio keys/values and prompts
    prefilled by the modules): the GEMV step's logits and the keys/values it writes equal the modules'
    within float32 rounding, and the greedy tokens are the same."""
    step = interpreted["step"]
    assert step["logits"] <= 1e-4 and step["self_cache"] <= 1e-5 and step["argmax_equal"], step


def test_a_step_whose_rows_have_all_ended_does_nothing(interpreted):
    """The step's ended-rows check (`stop_id`): while any row's token is not end-of-text, the step with it gives the
    step without it bit for bit (logits, keys and values written), one ended row included; once every row's is,
    its kernels return at their top: no key or value is written."""
    skip = interpreted["skip_ended"]
    for case in ("none ended", "one ended"):
        assert skip[case]["logits_equal"] and skip[case]["cache_equal"] and not skip[case]["cache_untouched"], skip
    assert skip["all ended"]["cache_untouched"] and not skip["all ended"]["cache_equal"], skip


def test_the_greedy_choice_in_the_head_is_the_token_choice(interpreted):
    """`decode_linear.greedy_head` (the GEMV step's greedy choice): the tokens, positions and
    countdowns `greedy_advance` leaves from the same logits, exactly, over blocks of the vocabulary: the first of
    equal maxima (two in one block, one in another), the always-suppressed mask, end-of-text held back by a
    countdown, a row that has ended keeping end-of-text; the log-probabilities within float32 rounding, written
    into the chunk's step of the history given and nowhere else; and for 70 rows, more than one program's. A chunk
    of GEMV steps choosing this way decodes the tokens of a chunk of the modules' steps (the reference), its
    log-probabilities within float32 rounding."""
    got = interpreted["greedy_head"]
    assert got["inputs"] and got["lp"] <= 1e-5 and got["row0"] == 40 and got["row1_not_eot"], got
    assert got["hist"] and got["hist_elsewhere"], got
    many = interpreted["greedy_head_many"]
    assert many["inputs"] and many["lp"] <= 1e-5, many
    chunk = interpreted["fused_chunk"]
    assert chunk["fused"] and chunk["tokens"] and chunk["inputs"] and chunk["lp"] <= 1e-5, chunk


def test_encoder_with_fused_residual_add_and_norm_equals_its_layers(interpreted):
    """The eager GPU encoder (each residual add and the layer norm after it one kernel, the
    last norm the encoder's final one) gives the features of the plain eager layers and of the module's forward
    within float32 rounding."""
    enc = interpreted["encoder"]
    assert enc["vs_plain"] <= 1e-5 and enc["vs_module"] <= 1e-5, enc


if __name__ == "__main__":
    print(json.dumps(_child()))
