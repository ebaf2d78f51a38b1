"""The Spark-TTS LM (our Qwen2) against transformers' Qwen2ForCausalLM with the same random weights."""

from __future__ import annotations

import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from voiced.engines.spark.qwen2 import Qwen2Config, Qwen2LM, load_qwen2
from voiced.engines.spark.sampling import sample, uniform_noise


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def models(ckpt):
    from transformers import Qwen2ForCausalLM

    ours = load_qwen2(ckpt / "LLM", "cpu", torch.float32)
    ref = Qwen2ForCausalLM.from_pretrained(ckpt / "LLM", dtype=torch.float32).eval()
    return ours, ref


def test_logits_match_transformers_prefill_and_cached_decode(models):
    ours, ref = models
    ours.setup_cache(max_batch=2, max_seq=128)
    torch.manual_seed(0)
    prompt = torch.randint(0, 166000, (23,))
    with torch.no_grad():
        full = ref(prompt[None]).logits[0]
    assert torch.allclose(ours.forward_full(prompt[None])[0], full, atol=1e-4, rtol=1e-4)
    got = ours.prefill(prompt, slot=1)
    assert torch.allclose(got, full[-1], atol=1e-4, rtol=1e-4)
    # three cached decode steps in row 1, while row 0 carries an unrelated request
    ours.prefill(torch.randint(0, 166000, (7,)), slot=0)
    seq = prompt.tolist()
    nxt = int(full[-1].argmax())
    for i in range(3):
        seq.append(nxt)
        logits = ours.decode(torch.tensor([5, nxt]), torch.tensor([7 + i, len(seq) - 1]))
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(logits[1], want, atol=1e-4, rtol=1e-4)
        nxt = int(want.argmax())


def test_greedy_tokens_identical_to_transformers_generate_with_batching(models):
    """Two requests of different lengths decoded together (rows joining at different times) give
    exactly the tokens `generate(do_sample=False)` gives each alone; top-k 1 through our sampler."""
    ours, ref = models
    ours.setup_cache(max_batch=2, max_seq=256)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 166000, (n,)) for n in (31, 12)]
    n_new = 24
    want = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                               max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    ones = dict(temperature=torch.tensor([0.8]), top_k=torch.tensor([1]), top_p=torch.tensor([0.95]),
                seeds=torch.tensor([7]), steps=torch.tensor([0]))
    got = [[], []]
    # request 0 starts; request 1 joins five tokens later
    got[0].append(int(sample(ours.prefill(prompts[0], 0)[None], **ones)[0]))
    pos = [len(prompts[0]), None]
    for step in range(n_new + 5):
        if step == 5:
            got[1].append(int(sample(ours.prefill(prompts[1], 1)[None], **ones)[0]))
            pos[1] = len(prompts[1])
            continue
        live = [i for i in (0, 1) if pos[i] is not None and len(got[i]) < n_new]
        if not live:
            break
        rows = 2 if pos[1] is not None else 1
        toks = torch.tensor([got[i][-1] if pos[i] is not None else 0 for i in range(rows)])
        poss = torch.tensor([pos[i] if pos[i] is not None else 0 for i in range(rows)])
        logits = ours.decode(toks, poss)
        k = logits.shape[0]
        nxt = sample(logits, torch.full((k,), 0.8), torch.ones(k, dtype=torch.long), torch.full((k,), 0.95),
                     torch.zeros(k, dtype=torch.long), torch.zeros(k, dtype=torch.long))
        for i in live:
            got[i].append(int(nxt[i]))
            pos[i] += 1
    assert got[0][:n_new] == want[0]
    assert got[1][:n_new] == want[1]


def test_move_slot_keeps_a_request_decoding_identically(models):
    ours, _ = models
    ours.setup_cache(max_batch=3, max_seq=64)
    p = torch.randint(0, 166000, (10,))
    ours.prefill(p, 2)
    a = ours.decode(torch.tensor([0, 0, 42]), torch.tensor([0, 0, 10]))[2]
    ours.setup_cache(max_batch=3, max_seq=64)
    ours.prefill(p, 2)
    ours.move_slot(2, 0, 10)
    b = ours.decode(torch.tensor([42]), torch.tensor([10]))[0]
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_sampler_is_seeded_and_respects_top_k_top_p():
    torch.manual_seed(0)
    v = 50
    logits = torch.randn(1, v) * 2
    args = lambda seed, step, k, p, t=1.0: (torch.tensor([t]), torch.tensor([k]), torch.tensor([p]),  # noqa: E731
                                           torch.tensor([seed]), torch.tensor([step]))
    draws = [int(sample(logits, *args(3, s, 0, 1.0))[0]) for s in range(4000)]
    assert draws == [int(sample(logits, *args(3, s, 0, 1.0))[0]) for s in range(4000)]  # reproducible
    assert draws != [int(sample(logits, *args(4, s, 0, 1.0))[0]) for s in range(4000)]  # seed matters
    freq = torch.bincount(torch.tensor(draws), minlength=v).float() / len(draws)
    probs = torch.softmax(logits[0], -1)
    assert (freq - probs).abs().max() < 0.03  # an exact draw from softmax(logits)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    assert {int(sample(logits, *args(1, s, 5, 1.0))[0]) for s in range(500)} <= top5
    order = torch.argsort(logits[0], descending=True)
    keep = int((torch.cumsum(probs[order], 0) < 0.5).sum()) + 1
    nucleus = set(order[:keep].tolist())
    assert {int(sample(logits, *args(1, s, 0, 0.5))[0]) for s in range(500)} <= nucleus
    assert int(sample(logits, *args(1, 0, 1, 1.0))[0]) == int(logits.argmax())
    assert int(sample(logits, *args(1, 0, 50, 1.0, t=0.0))[0]) == int(logits.argmax())


def test_uniform_noise_is_a_pure_function_of_its_inputs():
    ids = torch.arange(1000)[None].repeat(2, 1)
    u = uniform_noise(torch.tensor([5, 5]), torch.tensor([9, 9]), ids)
    assert torch.equal(u[0], u[1]) and (u > 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.05


def test_config_reads_published_and_transformers5_layouts(tmp_path):
    import json

    from tests.spark_fixtures import llm_config

    raw = llm_config()
    (tmp_path / "a.json").write_text(json.dumps(raw))
    raw5 = dict(raw)
    raw5.pop("rope_theta")
    raw5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    (tmp_path / "b.json").write_text(json.dumps(raw5))
    assert Qwen2Config.from_json(tmp_path / "a.json") == Qwen2Config.from_json(tmp_path / "b.json")
    full = Qwen2Config()
    assert (full.head_dim, full.num_attention_heads // full.num_key_value_heads) == (64, 7)
    with torch.device("meta"):
        m = Qwen2LM(full)
    n = sum(p.numel() for p in m.parameters())
    assert 490e6 < n < 510e6  # Qwen2.5-0.5B with the vocabulary padded to 166000


def test_two_round_top_k_picks_what_one_topk_picks():
    """The sampler's candidates over a long row (two rounds of topk) are torch.topk's, in its order,
    including rows where a phase mask leaves only a few ids allowed."""
    from voiced.engines.spark.sampling import top_k_candidates

    torch.manual_seed(3)
    logits = torch.randn(4, 13_531)
    logits[1, 5000:] = float("-inf")  # a phase that allows a slice only
    logits[2, 17:] = float("-inf")  # fewer allowed ids than candidates
    for k in (64, 128):
        vals, idx = top_k_candidates(logits, k)
        want_vals, want_idx = torch.topk(logits, k)
        assert torch.equal(vals, want_vals)
        finite = want_vals.isfinite()
        assert torch.equal(idx[finite], want_idx[finite])
        assert (idx < logits.shape[1]).all()
    # a sampled draw over the long row is the same as over plain topk candidates
    args = (torch.tensor([0.8] * 4), torch.tensor([50] * 4), torch.tensor([0.95] * 4), torch.tensor([7] * 4))
    for step in range(20):
        a = sample(logits, *args, torch.tensor([step] * 4), candidates=64)
        b = sample(logits[:, :1000].contiguous(), *args, torch.tensor([step] * 4), candidates=64)
        assert torch.equal(a[2:3], b[2:3])  # row 2's allowed ids all lie in the first 1000
