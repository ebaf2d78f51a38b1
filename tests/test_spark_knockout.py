"""`voiced bench spark-knockout`'s kernels left out (the bench itself needs a GPU): inside `left_out` the
engines' module attributes give what stands in for each kind, with the shapes the step goes on with, and
every one is back afterwards, also when the block fails."""

from __future__ import annotations

import pytest
import torch

from voiced.bench import spark_knockout as sk
from voiced.bench.spark_knockout import KINDS, left_out
from voiced.engines.kernels import decode_attention, decode_linear


def test_each_kind_stands_in_with_the_step_s_shapes_and_is_put_back(monkeypatch):
    before = {name: getattr(mod, name) for mod, name in ((decode_attention, "triton_attention"),
                                                          (decode_attention, "_combine"), (decode_linear, "add_norm"),
                                                          (decode_linear, "linear_partials"),
                                                          (decode_linear, "swiglu_linear"), (decode_linear, "linear"))
              if hasattr(mod, name)}
    qkv, x, w = torch.randn(3, (14 + 4) * 64), torch.randn(3, 896), torch.randn(1152, 896)
    with left_out("attention"):
        out = decode_attention.triton_attention(qkv, None, None, None, None, None, 10, (14, 2, 64))
        assert out.shape == (3, 14 * 64) and torch.equal(out, qkv[:, : 14 * 64])
    with left_out("norms"):
        assert decode_linear.add_norm(None, x, None, 1e-6) is x
    with left_out("out-down"):
        assert decode_linear.linear_partials(x, torch.randn(896, 896)).shape == (1, 3, 896)
    with left_out("gate-up"):
        assert decode_linear.swiglu_linear(x, torch.randn(2 * 4864, 896)).shape == (3, 4864)
    with left_out("qkv"):  # the projection with a bias is zeros; one without (the head's) still runs
        assert not decode_linear.linear(x, w, torch.randn(1152)).any()
    calls = []
    monkeypatch.setattr(decode_linear, "linear", lambda *a, **kw: calls.append(kw) or "ran")
    with left_out("qkv"):
        assert decode_linear.linear(x, w, block_n=128) == "ran" and calls == [{"block_n": 128}]
    with pytest.raises(RuntimeError), left_out("head"):
        assert not decode_linear.linear(x, w, block_n=128).any()
        assert decode_linear.linear(x, w, torch.randn(1152)) == "ran"
        raise RuntimeError("a failing block")
    monkeypatch.undo()
    after = {name: getattr(mod, name) for mod, name in ((decode_attention, "triton_attention"),
                                                         (decode_attention, "_combine"), (decode_linear, "add_norm"),
                                                         (decode_linear, "linear_partials"),
                                                         (decode_linear, "swiglu_linear"), (decode_linear, "linear"))
             if hasattr(mod, name)}
    assert after == before
    assert set(KINDS) >= {"none", "attention", "combine", "norms", "out-down", "gate-up", "qkv", "head"}


def test_the_command_line_measures_the_full_step_first_and_every_kind_by_default():
    assert sk.parse_args([]).kinds == list(sk.KINDS)
    assert sk.parse_args(["head", "norms"]).kinds == ["none", "head", "norms"]
    assert sk.parse_args(["none", "qkv"]).kinds == ["none", "qkv"]
    with pytest.raises(SystemExit):
        sk.parse_args(["mlp"])
