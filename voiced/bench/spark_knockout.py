"""What each kind of kernel costs inside the Spark LM's graphed decode step: the step with one kind left out.

    voiced bench spark-knockout [--out FILE] [none attention combine norms out-down gate-up qkv head]

A batch-1 decode step is ~200 kernels in a chain, each starting while the one before it drains
(programmatic launch), so a kernel's time alone (`voiced bench spark-kernels`) does not say what it adds
to the step. Here the engine's decode step (sampled, graphed, as `voiced bench spark-env` measures it)
runs with one kind of kernel replaced by nothing, and the difference to the full step is what that kind
costs in the chain: an upper bound on what fusing it away or making it faster could give.

- attention: the attention kernel and its combine (the q heads of the q/k/v output stand in for its output);
- combine: the split attention's combine kernel alone;
- norms: the residual add + RMS norm after each output and down projection (the residual itself is passed on);
- out-down: the output and down projections (one split of zeros is reduced by the norm);
- gate-up: the gate/up projection with SwiGLU (zeros);
- qkv: the q/k/v projection (zeros);
- head: the speech-token head (zeros).

The tokens are meaningless with a kind left out (the sampler draws from whatever the step computes); only
the times count. Step ms at 1, 16 and 64 rows, median of 3; random full-size weights (Spark-TTS-0.5B).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from voiced.bench import spark_bench as sb
from voiced.engines.kernels import decode_attention, decode_linear
from voiced.engines.spark import sampling

KINDS = ("none", "attention", "combine", "norms", "out-down", "gate-up", "qkv", "head")


class _NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _zeros(*shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype or like.dtype, device=like.device)


@contextlib.contextmanager
def left_out(kind: str):
    """The decode kernels of `kind` replaced by nothing for the block (module attributes, looked up at each
    call, so graphs captured inside the block hold the step without them)."""
    lin = decode_linear.linear

    def attention(qkv, *args, **kwargs):
        dims = kwargs.get("dims", args[6] if len(args) > 6 else None)
        return qkv[:, : dims[0] * dims[2]]

    patches = {
        "none": [],
        "attention": [(decode_attention, "triton_attention", attention)],
        "combine": [(decode_attention, "_combine", _NoLaunch())],
        "norms": [(decode_linear, "add_norm", lambda partials, x, ln, eps: x)],
        "out-down": [(decode_linear, "linear_partials",
                      lambda x, w, **kw: _zeros(1, x.shape[0], w.shape[0], like=x, dtype=torch.float32))],
        "gate-up": [(decode_linear, "swiglu_linear", lambda h, w, **kw: _zeros(h.shape[0], w.shape[0] // 2, like=h))],
        # q/k/v is the one projection with a bias; the head (sampling's) passes block_n=128 and no bias
        "qkv": [(decode_linear, "linear",
                 lambda x, w, bias=None, **kw: _zeros(x.shape[0], w.shape[0], like=x) if bias is not None
                 else lin(x, w, bias, **kw))],
        "head": [(decode_linear, "linear",
                  lambda x, w, bias=None, **kw: _zeros(x.shape[0], w.shape[0], like=x) if kw.get("block_n") == 128
                  else lin(x, w, bias, **kw))],
    }[kind]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, fn in patches:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (checked here, not by `choices`: argparse tests an empty or default nargs="*" list against the
    # choices as one value, and Python 3.11 and 3.12 differ in how)
    ap.add_argument("kinds", nargs="*", metavar="KIND", help=f"kinds to leave out, of {', '.join(KINDS)} "
                                                              "(default: every kind)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        ap.error(f"unknown kind {', '.join(unknown)}: choose from {', '.join(KINDS)}")
    kinds = [k for k in args.kinds or KINDS if k != "none"]
    args.kinds = ["none", *kinds]  # the full step first: every other kind is measured against it
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("spark_knockout needs a CUDA GPU")
    if sampling.decode_linear is not decode_linear:
        raise SystemExit("spark_knockout: the sampler's head no longer goes through decode_linear")
    kinds = args.kinds
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        eng = sb.build("cuda", torch.bfloat16, torch.bfloat16, 64, 1024, Path(tmp))
        eng.lm.compile_decode()  # as the engine's warm-up does; `build` leaves the LM eager
        if not eng.lm.fused_linear:
            raise SystemExit("spark_knockout: the LM's decode step does not run the GEMV kernels here")
        prompt = torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(0)).cuda()
        full: dict[int, float] = {}
        for kind in kinds:
            with left_out(kind):
                eng.lm.compile_decode()  # every decode graph captured again, under this kind left out
                t0 = time.perf_counter()
                r: dict = {"left_out": kind}
                for b in (1, 16, 64):
                    times = [sb.steps_decode(eng, prompt, 96, 50, use_graph=True, batch=b)[1] for _ in range(3)]
                    ms = round(1000 * statistics.median(times), 3)
                    r[f"step_ms_b{b}"] = ms
                    if kind == "none":
                        full[b] = ms
                    else:
                        r[f"costs_ms_b{b}"] = round(full[b] - ms, 3)
                r["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
        eng.lm.compile_decode()  # (graphs of the full step again, for anything after)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
