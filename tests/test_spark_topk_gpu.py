"""The sampler's top-k kernels on a GPU (skipped without CUDA): at the speech ids' width (~13.5k, slices of 848)
and batch 1 to 64, with ties, masked ids and a row with fewer allowed ids than k, the candidates are the k
largest values (torch.topk's, bit for bit) with their ids, lower ids first between equal values, also from the
head's bfloat16 output with the phase mask the kernel adds; and `sample`
replayed from a CUDA graph draws what it draws eagerly, and what it draws through torch.topk."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.test_spark_topk_kernel import expected, logits_of
from voiced.engines.spark import sampling, topk_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_kernel_candidates_on_a_gpu(rows):
    x = logits_of(rows, 13_563, seed=rows)
    gx = x.cuda()
    assert topk_kernel.enabled(gx, 64, 16)
    vals, ids = sampling.top_k_candidates(gx, 64)
    want_vals, want_ids = expected(x, 64)
    assert np.array_equal(vals.cpu().numpy(), want_vals)
    assert np.array_equal(ids.cpu().numpy(), want_ids)
    assert torch.equal(vals, torch.topk(gx, 64).values)


@pytest.mark.parametrize("rows", [1, 64])
def test_kernel_adds_the_phase_mask_to_the_head_s_bfloat16_output(rows):
    x = logits_of(rows, 13_563, seed=rows + 1).to(torch.bfloat16)
    wide = torch.zeros(2, 14_000)
    wide[0, 1_000:] = float("-inf")  # as the engine's: globals, then semantic tokens, a slice of a wider mask
    wide[1, :1_200] = float("-inf")
    bias, phase = wide[:, 300:13_863], torch.arange(rows) % 2
    vals, ids = sampling.top_k_candidates(x.cuda(), 64, bias=bias.cuda(), phase=phase.cuda())
    want_vals, want_ids = expected(x.float() + bias[phase], 64)
    assert np.array_equal(vals.cpu().numpy(), want_vals)
    assert np.array_equal(ids.cpu().numpy(), want_ids)


def test_sample_from_a_graph_draws_the_eager_and_the_torch_topk_tokens(monkeypatch):
    b, v = 8, 13_563
    x = torch.randn(b, v, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    args = [torch.full((b,), 0.8, device="cuda"), torch.full((b,), 50, device="cuda"),
            torch.full((b,), 0.95, device="cuda"), torch.arange(b, device="cuda")]
    steps = torch.zeros(b, dtype=torch.long, device="cuda")
    draw = functools.partial(sampling.sample, draw=torch.compile(sampling.draw_candidates, dynamic=None))
    assert topk_kernel.enabled(x, 64, 16)
    out = {}
    for mode, enabled in (("1", topk_kernel.enabled), ("0", lambda *a: False)):  # the kernels, torch.topk
        monkeypatch.setattr(topk_kernel, "enabled", enabled)
        out[mode] = [draw(x, *args, steps + s, candidates=64, id_offset=151_665) for s in range(4)]
    monkeypatch.undo()
    static = steps.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        draw(x, *args, static, candidates=64, id_offset=151_665)  # warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            tok = draw(x, *args, static, candidates=64, id_offset=151_665)
    replayed = []
    for s in range(4):
        static.fill_(s)
        graph.replay()
        replayed.append(tok.clone())
    torch.cuda.synchronize()
    for s in range(4):
        assert torch.equal(out["1"][s], out["0"][s]), s
        assert torch.equal(replayed[s], out["1"][s]), s
    assert not torch.equal(out["1"][0], out["1"][1])
