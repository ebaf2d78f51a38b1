"""GPU-only checks of the graphed packed prefill (skipped without CUDA), on the tiny random checkpoint:
a CUDA graph of the pass writes the same KV cache and gives the same last hidden states, bit for bit in
bf16, as the same layers launched without a graph, for several packings; and requests joining a running
batch (their prefill graphs captured while other requests' rows are live) decode the same tokens as
with the prefill ungraphed."""

from __future__ import annotations

import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from tests.test_spark_gpu import JOINS, MAX_BATCH, MAX_SEQ, greedy_differences, requests, run
from voiced.engines.spark.engine import PREFILL_BUCKET, SparkTTSEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (prompt lengths, cache rows): one prompt, three of different lengths, exactly a bucket (no padding),
# two long ones. None reaches the cache's end, where padding positions clamp and repeat (their writes
# to one entry race, in either path).
PACKINGS = [((45,), (0,)), ((17, 130, 5), (2, 0, 3)), ((64,), (1,)), ((300, 150), (3, 1))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


def prompts_for(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 151643, (n,), generator=g).tolist() for n in lengths]


def prefill(lm, prompts, slots, use_graph: bool):
    """Zeroed caches, one packed pass; the normed last hidden states and every layer's cache."""
    for k, v in zip(lm.k_caches, lm.v_caches):
        k.zero_()
        v.zero_()
    h = lm.prefill_many(prompts, list(slots), pad_to=PREFILL_BUCKET, use_graph=use_graph)
    torch.cuda.synchronize()
    return h.clone(), [k.clone() for k in lm.k_caches], [v.clone() for v in lm.v_caches]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-modules"])
def test_graphed_prefill_is_the_ungraphed_pass_bit_for_bit(ckpt, tmp_path, compiled):
    """Compares, in bf16, the graphed packed prefill with the same pass launched without a graph
    (compiled layers as served, and the eager modules): last hidden states and both caches of every
    layer, all rows (padding writes included), exactly equal; each packing's graph is captured on its
    first pass and replayed on a second packing of the same padded length."""
    engine = SparkTTSEngine.load(ckpt, device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, voices_dir=tmp_path,
                                 compile_lm=compiled)
    lm = engine.lm
    assert lm.compiled == compiled and next(lm.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for i, (lengths, slots) in enumerate(PACKINGS):
            n = -(-sum(lengths) // PREFILL_BUCKET) * PREFILL_BUCKET
            for seed in (i, 100 + i):  # the first pass captures the graph of length n, the second replays it
                prompts = prompts_for(lengths, seed)
                want = prefill(lm, prompts, slots, use_graph=False)
                got = prefill(lm, prompts, slots, use_graph=True)
                assert n in lm._prefill_graphs, f"no graph of {n} tokens was captured"
                what = f"{len(lengths)} prompt(s) of {lengths} tokens in rows {slots}, padded to {n}"
                assert torch.equal(got[0], want[0]), (
                    f"{what}: last hidden states differ, max |diff| {(got[0] - want[0]).abs().max().item():.3g}")
                for layer, (kg, kw, vg, vw) in enumerate(zip(got[1], want[1], got[2], want[2])):
                    assert torch.equal(kg, kw) and torch.equal(vg, vw), f"{what}: layer {layer}'s cache differs"
                assert got[0].abs().sum() > 0 and any(k.abs().sum() > 0 for k in got[1])


def test_requests_joining_decode_the_same_tokens_with_graphed_prefills(ckpt, tmp_path):
    """Four requests joining a running batch (greedy, then seeded sampling), on an engine that was not
    warmed up: each prefill graph is captured when its length is first met, while other requests'
    cache rows are live. Their tokens equal those of the same engine with its prefill ungraphed (decode
    steps graphed in both)."""
    kw = dict(device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ)
    graphed = SparkTTSEngine.load(ckpt, voices_dir=tmp_path / "a", **kw)
    plain = SparkTTSEngine.load(ckpt, voices_dir=tmp_path / "b", **kw)
    plain.lm.prefill_graph_tokens = 0  # every prefill ungraphed
    for top_k in (1, 50):
        reqs = requests(top_k=top_k)
        got, want = run(graphed, reqs, JOINS), run(plain, reqs, JOINS)
        problems = greedy_differences(got, want)
        assert not problems, f"top_k={top_k}, graphed vs ungraphed prefill:\n" + "\n".join(problems)
    assert graphed.lm._prefill_graphs and not plain.lm._prefill_graphs
    assert all(len(r.tokens) > 0 for r in got.values())
