"""The sampler's top-k kernels (voiced/engines/spark/topk_kernel.py) on the CPU, under Triton's interpreter (in a
child process: TRITON_INTERPRET=1 is read when a kernel is defined): for rows of the speech slice's width and
others, with ties, masked (-inf) ids and rows with fewer allowed ids than k, the candidates are the k largest
values with their ids, lower ids first between equal values, and the values are torch.topk's bit for bit
(also from bfloat16 logits with a phase mask the kernel adds itself);
and the tokens `sample` draws through them are those it draws through torch.topk.
tests/test_spark_gpu.py runs the kernels on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.triton_interpreter import run_interpreted

# (rows, vocabulary, k): the smallest row the two-round path takes at the default bucket, and at a smaller k
# rows whose width is not a multiple of the 16 slices (the interpreter sorts slowly: the speech ids' ~13.5k,
# slices of 848, are tests/test_spark_gpu.py's)
CASES = [(2, 4_096, 64), (3, 2_000, 16), (2, 1_100, 16)]


def logits_of(rows: int, v: int, seed: int) -> torch.Tensor:
    """float32 rows: half of them rounded to one decimal (many equal values), a third of the ids masked
    (-inf, as the phase mask does), and the last row with only 5 allowed ids (fewer than k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g)
    x[::2] = torch.round(x[::2] * 10) / 10 + 0.0  # (+ 0.0: no -0.0, whose order against 0.0 is the bits')
    x[torch.rand(rows, v, generator=g) < 0.33] = float("-inf")
    if rows > 1:
        keep = torch.randperm(v, generator=g)[:5]
        last = torch.full((v,), float("-inf"))
        last[keep] = x[-1, keep]
        x[-1] = last
    return x


def expected(x: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest by value, lower ids first between equal values (numpy's stable sort)."""
    a = x.numpy()
    order = np.stack([np.lexsort((np.arange(a.shape[1]), -a[r])) for r in range(a.shape[0])])[:, :k]
    return np.take_along_axis(a, order, 1), order


def _child() -> dict:
    from voiced.engines.spark import sampling, topk_kernel

    wrong = []
    for seed, (rows, v, k) in enumerate(CASES):
        x = logits_of(rows, v, seed)
        assert topk_kernel.enabled(x, k, 16)
        vals, ids = sampling.top_k_candidates(x, k)
        want_vals, want_ids = expected(x, k)
        ref_vals, _ = torch.topk(x, k)
        if not (np.array_equal(vals.numpy(), want_vals) and np.array_equal(ids.numpy(), want_ids)
                and torch.equal(vals, ref_vals)):
            wrong.append([rows, v, k])
    # the head's bfloat16 output with the rows' phase mask added by the kernel (the mask a column slice of a
    # wider one, as the engine's): the candidates of `logits.float() + bias[phase]`
    x16 = logits_of(3, 2_000, 7).to(torch.bfloat16)
    wide = torch.zeros(2, 2_500)
    wide[0, 1_250:] = float("-inf")
    wide[1, :550] = float("-inf")
    bias, phase = wide[:, 250:2_250], torch.tensor([1, 0, 1])
    vals, ids = sampling.top_k_candidates(x16, 16, bias=bias, phase=phase)
    want_vals, want_ids = expected(x16.float() + bias[phase], 16)
    masked = [np.array_equal(vals.numpy(), want_vals), np.array_equal(ids.numpy(), want_ids)]
    # sample's draw through the kernels and through torch.topk (rows without ties: the same candidates)
    x = torch.randn(3, 2_000, generator=torch.Generator().manual_seed(9))
    args = (torch.tensor([0.8, 0.0, 1.2]), torch.tensor([8, 8, 0]), torch.tensor([0.95, 0.95, 0.5]),
            torch.tensor([1, 2, 3]))
    tokens = {}
    kernels = topk_kernel.enabled
    for mode, enabled in (("kernels", kernels), ("torch.topk", lambda *a: False)):
        topk_kernel.enabled = enabled
        tokens[mode] = [sampling.sample(x, *args, torch.tensor([s] * 3), candidates=16, id_offset=151_665).tolist()
                        for s in range(2)]
    topk_kernel.enabled = kernels
    return {"wrong": wrong, "masked": masked, "tokens": tokens}


@pytest.mark.slow
def test_kernel_candidates_are_the_k_largest_and_sample_draws_the_same():
    got = run_interpreted("tests.test_spark_topk_kernel", timeout=900)
    assert got["wrong"] == []
    assert got["masked"] == [True, True]
    assert got["tokens"]["kernels"] == got["tokens"]["torch.topk"]
    assert got["tokens"]["kernels"][0] != got["tokens"]["kernels"][1]  # steps draw differently: not a constant


def test_what_the_kernels_take(monkeypatch):
    """The kernels never take the CPU outside the interpreter, nor a k past their bucket or not a power of
    two, nor integer or float64 logits, nor slices narrower than k; they take float32, bfloat16 and float16
    logits."""
    from voiced.engines.spark import topk_kernel

    x = torch.zeros(1, 13_563)
    assert not topk_kernel.enabled(x, 64, 16)  # (a CPU tensor, no interpreter)
    monkeypatch.setattr(topk_kernel, "interpreted", lambda: True)  # as in the interpreter's child process
    assert topk_kernel.enabled(x, 64, 16) == (topk_kernel.triton is not None)
    assert not topk_kernel.enabled(x, 128, 16) and not topk_kernel.enabled(x, 48, 16)
    assert all(topk_kernel.enabled(x.to(dt), 64, 16) == (topk_kernel.triton is not None)
               for dt in (torch.bfloat16, torch.float16))
    assert not topk_kernel.enabled(x.double(), 64, 16) and not topk_kernel.enabled(x.long(), 64, 16)
    assert not topk_kernel.enabled(x[:, :800], 64, 16)


if __name__ == "__main__":
    import json

    print(json.dumps(_child()))
