"""The multi-step decode path (sampling inside the step, packed prefill, sliced head) against the plain
one-step-at-a-time path: same tokens, same logits, and the engine's vocoder priority."""

from __future__ import annotations

import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from voiced.engines.base import TTSOptions, TTSRequest
from voiced.engines.spark.sampling import PhaseSampler, candidate_bucket, sample
from voiced.engines.spark.served_lm import load_served_lm


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def lm(ckpt):
    return load_served_lm(ckpt / "LLM", "cpu", torch.float32)


def test_packed_prefill_equals_one_prompt_at_a_time(lm):
    torch.manual_seed(0)
    prompts = [torch.randint(0, 166000, (n,)) for n in (17, 5, 30)]
    lm.setup_cache(max_batch=4, max_seq=64)
    single = [lm.prefill(p, slot) for p, slot in zip(prompts, (2, 0, 3))]
    caches = [k.clone() for k in lm.k_caches]
    lm.setup_cache(max_batch=4, max_seq=64)
    h = lm.prefill_many(prompts, [2, 0, 3])
    packed = lm.lm_head(h).float()
    for a, b in zip(single, packed):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for slot, p in zip((2, 0, 3), prompts):
        for a, b in zip(caches, lm.k_caches):
            assert torch.allclose(a[slot, :, : len(p)], b[slot, :, : len(p)], atol=1e-5)



def test_packed_prefill_is_each_prompt_prefilled_alone(lm):
    """Three prompts of different lengths packed into one pass (padded to 64 tokens), sent as id lists
    the way the engine sends them: each row's cache and last logits match prefilling that prompt alone
    (float32), the ids as tensors give exactly the same, and what lies past each prompt
    in its row is only the padding's (written past the last prompt only)."""
    torch.manual_seed(7)
    prompts = [torch.randint(0, 166000, (n,)) for n in (17, 5, 30)]
    slots = [2, 0, 3]
    alone = {}
    for p, s in zip(prompts, slots):
        lm.setup_cache(max_batch=4, max_seq=96)
        logits = lm.prefill(p, s)
        alone[s] = (logits, [k[s, :, : len(p)].clone() for k in lm.k_caches])
    lm.setup_cache(max_batch=4, max_seq=96)
    h = lm.prefill_many([p.tolist() for p in prompts], slots, pad_to=64)
    got = lm.lm_head(h).float()
    cache = [k.clone() for k in lm.k_caches]
    for i, (p, s) in enumerate(zip(prompts, slots)):
        assert torch.allclose(got[i], alone[s][0], atol=1e-4, rtol=1e-4), f"prompt {i}: last logits"
        for layer, (a, b) in enumerate(zip(cache, alone[s][1])):
            assert torch.allclose(a[s, :, : len(p)], b, atol=1e-5), f"prompt {i} (row {s}), layer {layer}"
    assert all(k[1].abs().sum() == 0 for k in cache), "row 1 was not prefilled: nothing may be written there"
    assert all(k[2, :, 17:].abs().sum() == 0 and k[0, :, 5:].abs().sum() == 0 for k in cache)
    assert all(k[3, :, 30:42].abs().sum() > 0 and k[3, :, 42:].abs().sum() == 0 for k in cache), \
        "the 12 padding tokens go to the last prompt's row, right after it"
    lm.setup_cache(max_batch=4, max_seq=96)
    assert torch.equal(lm.prefill_many(prompts, slots, pad_to=64), h)
    assert all(torch.equal(a, b) for a, b in zip(lm.k_caches, cache))

def _bias(v: int, lo: int, hi: int) -> torch.Tensor:
    """Phase 0 allows [lo, lo+40) (the "globals"), phase 1 allows [lo+40, hi)."""
    b = torch.full((2, v), float("-inf"))
    b[0, lo : lo + 40] = 0
    b[1, lo + 40 : hi] = 0
    return b


@pytest.mark.parametrize("top_k", [1, 50])
def test_run_steps_equals_decode_then_sample_per_step(lm, top_k):
    """k steps with the sampler inside the step (sliced head, phase switch after 3 "globals") give
    exactly the tokens of one plain decode + full-vocabulary sample per step."""
    v = lm.config.vocab_size
    lo, hi = 151645, 151645 + 300
    bias = _bias(v, lo, hi)
    pick = PhaseSampler(lo, hi, bias[:, lo:hi], candidate_bucket([top_k], hi - lo), from_phase=0, to_phase=1,
                        g_lo=lo, g_hi=lo + 40, n_needed=3)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 151000, (n,)) for n in (9, 14)]
    seeds, phases = [5, 6], [0, 1]
    n_steps = 7

    # reference: one step at a time, full logits
    lm.setup_cache(max_batch=2, max_seq=64)
    want = [[], []]
    tok, pos, ng, ph = [], [len(p) for p in prompts], [0, 0], list(phases)
    for i, p in enumerate(prompts):
        logits = lm.prefill(p, i)[None] + bias[ph[i]]
        tok.append(int(sample(logits, torch.tensor([0.8]), torch.tensor([top_k]), torch.tensor([0.95]),
                              torch.tensor([seeds[i]]), torch.tensor([0]))[0]))
    for step in range(n_steps + 1):
        for i in range(2):
            want[i].append(tok[i])
            if ph[i] == 0 and lo <= tok[i] < lo + 40:
                ng[i] += 1
                ph[i] = 1 if ng[i] >= 3 else 0
        if step == n_steps:
            break
        logits = lm.decode(torch.tensor(tok), torch.tensor(pos)) + bias[torch.tensor(ph)]
        tok = sample(logits, torch.full((2,), 0.8), torch.full((2,), top_k), torch.full((2,), 0.95),
                     torch.tensor(seeds), torch.full((2,), step + 1)).tolist()
        pos = [q + 1 for q in pos]

    # the multi-step path
    lm.setup_cache(max_batch=2, max_seq=64)
    h = lm.prefill_many(prompts, [0, 1])
    st = lm.state
    ints = torch.tensor([[0, 0], [len(p) for p in prompts], [0, 0], phases, [0, 0], seeds, [top_k] * 2])
    st.load(ints, torch.tensor([[0.8, 0.8], [0.95, 0.95]]))
    first = [int(pick(lm, h[i : i + 1], st, slice(i, i + 1))[0]) for i in range(2)]
    out = lm.run_steps(pick, 2, n_steps, max_pos=max(len(p) for p in prompts))
    got = [[first[i], *out[i].tolist()] for i in range(2)]
    assert got == want
    assert st.phase.tolist() == ph and st.n_global.tolist() == ng and st.steps.tolist() == [n_steps + 1] * 2
    assert st.positions.tolist() == [len(p) + n_steps for p in prompts]


def test_first_tokens_of_any_row_count_compile_nothing_on_a_compiled_lm(lm, monkeypatch):
    """The decode steps' draw is compiled, once per batch bucket; torch compiles it once per row count,
    so the first tokens (a prefill step's prompts, any count of them) must not take it: 64 counts of them
    made a GPU daemon's start-up ~6 minutes longer. A decode step still takes it."""
    from voiced.engines.spark import sampling

    compiled_calls = []

    def counting(*args, **kwargs):
        compiled_calls.append(args[0].shape[0])
        return sampling.draw_step(*args, **kwargs)

    monkeypatch.setattr(sampling, "compiled_draw_step", lambda: counting)
    lo, hi = 151645, 151645 + 300
    bias = _bias(lm.config.vocab_size, lo, hi)
    pick = PhaseSampler(lo, hi, bias[:, lo:hi], candidate_bucket([50], hi - lo), from_phase=0, to_phase=1,
                        g_lo=lo, g_hi=lo + 40, n_needed=3)
    lm.setup_cache(max_batch=8, max_seq=64)
    h = lm.prefill_many([torch.arange(5 + i) for i in range(8)], list(range(8)))
    monkeypatch.setattr(type(lm), "compiled", property(lambda self: True))
    for m in (1, 3, 5, 8):
        st = lm.state
        st.load(torch.tensor([[0] * 8, [9] * 8, [0] * 8, [0] * 8, [0] * 8, list(range(8)), [50] * 8]),
                torch.tensor([[0.8] * 8, [0.95] * 8]))
        got = pick(lm, h[:m], st, slice(0, m)).tolist()
        scattered = pick(lm, h[:m], st, torch.arange(m).flip(0)).tolist()
        assert len(got) == len(scattered) == m and all(lo <= t < hi for t in got + scattered)
    assert compiled_calls == []
    lm.run_steps(pick, 2, 1, max_pos=20, use_graph=False)  # a decode step does take it
    assert compiled_calls == [2]


def test_candidate_bucket():
    assert candidate_bucket([50, 1], 13000) == 64
    assert candidate_bucket([100], 13000) == 128
    assert candidate_bucket([0], 13000) == 1024
    assert candidate_bucket([50], 40) == 40


def test_first_chunks_are_decoded_before_bulk_chunks_of_requests_ahead_of_real_time(ckpt, tmp_path, monkeypatch):
    from voiced.engines.spark import vocoder_schedule
    from voiced.engines.spark.engine import SparkTTSEngine

    engine = SparkTTSEngine.load(ckpt, device="cpu", max_batch=2, max_seq_len=1024, voices_dir=tmp_path)
    engine.submit(1, TTSRequest("A long reply that keeps going.", TTSOptions(seed=1, max_seconds=4.0,
                                                                              first_chunk_tokens=4, chunk_tokens=4)))
    first_at = {}
    steps = 0
    decoded: list[set[int]] = []
    kinds: list[str | None] = []
    monkeypatch.setattr(vocoder_schedule, "VOCODER_SLACK_S", -1e9)  # request 1 counts as far ahead of real time
    while engine.has_work():
        if steps == 12:
            engine.submit(2, TTSRequest("Hi.", TTSOptions(seed=2, max_seconds=2.0, first_chunk_tokens=4)))
        outs = engine.step()
        kinds.append(engine.last_step["kind"])
        decoded.append({o.request_id for o in outs if o.value.samples.size})
        for o in outs:
            if o.value.samples.size:
                first_at.setdefault(o.request_id, steps)
        steps += 1
    step2 = first_at[2]
    # the step that released request 2's first chunk released nothing of request 1 (it was ahead)
    assert decoded[step2] == {2}
    assert any(1 in d for d in decoded[step2 + 1 :])
    # and while request 2 was decoding toward that chunk, request 1's chunks waited (no vocoder step
    # came between request 2's decode steps)
    assert not any(1 in d for d in decoded[12:step2])
    assert kinds[12:step2].count("vocode") == 0 and kinds[12:step2].count("decode") >= 1


def test_pure_layer_function_equals_the_modules(lm):
    """`layer_decode` (what compile_decode compiles) computes what the modules compute."""
    from voiced.engines.spark.qwen2 import layer_decode

    torch.manual_seed(2)
    p = torch.randint(0, 166000, (12,))
    outs = []
    for fused in (False, True):
        lm.setup_cache(max_batch=2, max_seq=64)
        lm.prefill(p, 1)
        if fused:
            lm.compile_decode(compile=False)  # the uncompiled function: CPU CI compiles nothing
            assert lm._layer_fn is layer_decode and not lm.compiled
        outs.append(lm.decode(torch.tensor([3, 7]), torch.tensor([0, 12])))
    lm._layer_fn = lm._prefill_fn = None
    # same arithmetic up to float rounding (fused GEMMs, attention written out instead of SDPA)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-5)
    # the modules' weights are views into the fused tensors (no second copy), so both paths keep
    # using the same numbers
    a = lm.model.layers[0].self_attn
    assert a.k_proj.weight.untyped_storage().data_ptr() == a.q_proj.weight.untyped_storage().data_ptr()


def test_pure_prefill_function_equals_the_modules(lm):
    """`layer_prefill` (what compile_decode compiles for packed prompts) fills the cache and gives the
    last hidden states the modules give, for prompts of different lengths packed with padding."""
    torch.manual_seed(4)
    prompts = [torch.randint(0, 166000, (n,)) for n in (5, 11, 3)]
    results = []
    for fused in (False, True):
        lm._layer_fn = lm._prefill_fn = None
        lm.setup_cache(max_batch=4, max_seq=64)
        if fused:
            lm.compile_decode(compile=False)
        h = lm.prefill_many(prompts, [2, 0, 1], pad_to=8)
        results.append((h, [k[:3, :, :11].clone() for k in lm.k_caches]))
    lm._layer_fn = lm._prefill_fn = None
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=2e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
