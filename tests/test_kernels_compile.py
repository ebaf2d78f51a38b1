"""The decode step's Triton kernels compile for the GPUs they run on, here without one: every configuration
the engines launch (the Spark LM's attention with rope, one split or several; Whisper's self- and
cross-attention without rope; the GEMVs with a bias, SwiGLU, GELU or split along K; both norms after a
split product; the sampler's top-k rounds with and without the phase mask), compiled ahead of time by
Triton for Hopper (sm_90, with programmatic launch) and Ampere (sm_80, without) down to machine code.
The interpreter tests check the arithmetic; this is what catches a kernel Triton cannot compile, which
otherwise only a GPU run would show (CI has none)."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget

from voiced.engines.kernels import decode_attention as da  # noqa: E402
from voiced.engines.kernels import decode_linear as dl  # noqa: E402
from voiced.engines.spark import topk_kernel  # noqa: E402


def _ptr(t: str) -> str:
    return "*" + t


ATTEND = dict(qkv_ptr=_ptr("bf16"), cos_ptr=_ptr("fp32"), sin_ptr=_ptr("fp32"), k_ptr=_ptr("bf16"),
              v_ptr=_ptr("bf16"), pos_ptr=_ptr("i64"), out_ptr=_ptr("bf16"), part_ptr=_ptr("fp32"),
              ml_ptr=_ptr("fp32"), stride_qkv="i32", stride_cb="i32", stride_ch="i32", stride_ct="i32", per="i32",
              n_splits="i32", l_offset="i32", scale="fp32", kv_len="i32")
SPARK_HEADS = dict(H=14, KV=2, G=7, GP=16, D=64, BLOCK=da.BLOCK_N)
WHISPER_HEADS = dict(H=20, KV=20, G=1, GP=16, D=64, BLOCK=da.BLOCK_N)
ADD_NORM = dict(part_ptr=_ptr("fp32"), x_ptr=_ptr("bf16"), ln_ptr=_ptr("bf16"), h_ptr=_ptr("bf16"), S="i32",
                M="i32", N="i32", stride_xm="i32", eps="fp32", bias_ptr=_ptr("bf16"), ln_b_ptr=_ptr("bf16"))
GEMV = dict(x_ptr=_ptr("bf16"), w_ptr=_ptr("bf16"), b_ptr=_ptr("bf16"), out_ptr=_ptr("bf16"), M="i32", N="i32",
            K="i32", k_per="i32", stride_xm="i32", stride_os="i32")
COMBINE = dict(part_ptr=_ptr("fp32"), ml_ptr=_ptr("fp32"), out_ptr=_ptr("bf16"), n_splits="i32", l_offset="i32")
NO_EPILOGUE = dict(HAS_BIAS=False, SWIGLU=False, PARTIAL=False, GELU=False, **dl.NO_GREEDY)
PICK = dict(part_ptr=_ptr("fp32"), inputs_ptr=_ptr("i64"), stride_in="i32", lp_ptr=_ptr("fp32"),
            hist_ptr=_ptr("fp64"), stride_hist="i32", M="i32", P="i32", eot="i32")

CASES = {
    "spark attention, split": (da._attend, ATTEND, dict(SPARK_HEADS, ONE_SPLIT=False, ROPE=True, CROSS=False)),
    "spark attention, one split": (da._attend, ATTEND, dict(SPARK_HEADS, ONE_SPLIT=True, ROPE=True, CROSS=False)),
    "whisper self-attention": (da._attend, dict(ATTEND, cos_ptr=_ptr("bf16"), sin_ptr=_ptr("bf16")),
                               dict(WHISPER_HEADS, ONE_SPLIT=False, ROPE=False, CROSS=False)),
    "whisper cross-attention": (da._attend, dict(ATTEND, cos_ptr=_ptr("bf16"), sin_ptr=_ptr("bf16")),
                                dict(WHISPER_HEADS, ONE_SPLIT=False, ROPE=False, CROSS=True)),
    "combine": (da._combine, COMBINE, dict(KV=2, G=7, GP=16, D=64, SB=8)),
    "rms norm after a split product": (dl._add_norm, ADD_NORM, dict(LAYER=False, BLOCK=1024, S_BLOCK=8)),
    "layer norm after a split product": (dl._add_norm, ADD_NORM, dict(LAYER=True, BLOCK=2048, S_BLOCK=8)),
    "gemv with bias": (dl._gemv, GEMV, dict(NO_EPILOGUE, HAS_BIAS=True)),
    "gemv swiglu": (dl._gemv, GEMV, dict(NO_EPILOGUE, SWIGLU=True)),
    "gemv split along K": (dl._gemv, dict(GEMV, out_ptr=_ptr("fp32")), dict(NO_EPILOGUE, PARTIAL=True)),
    "gemv gelu": (dl._gemv, GEMV, dict(NO_EPILOGUE, HAS_BIAS=True, GELU=True)),
    "gemv with the greedy choice": (dl._gemv, dict(GEMV, out_ptr=_ptr("fp32"), always_ptr=_ptr("i1"),
                                                   minleft_ptr=_ptr("i64"), eot="i32"),
                                    dict(HAS_BIAS=False, SWIGLU=False, PARTIAL=False, GELU=False, GREEDY=True)),
    "greedy pick": (dl._greedy_pick, PICK, dict(HIST=True, P_BLOCK=512)),
    "greedy pick, no history": (dl._greedy_pick, PICK, dict(HIST=False, P_BLOCK=512)),
}


def _compile(fn, signature: dict, constants: dict, target, num_stages: int | None = None, divisible: tuple = ()):
    """Compiled as a launch specializes it: every pointer 16-byte aligned (as torch allocates), and the integer
    arguments named in `divisible` multiples of 16 (without these hints Triton neither vectorizes the loads nor
    pipelines the loops, and the shared memory would not be what runs)."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: signature.get(n, "constexpr") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or n in divisible]
    src = compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constants.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = {"num_warps": 4} if num_stages is None else {"num_warps": 4, "num_stages": num_stages}
    kernel = compiler.compile(src, target=target, options=options)
    assert kernel.asm.get("cubin"), "no machine code"
    return kernel


@pytest.mark.parametrize("stop", [0, 16], ids=["", "skipping ended steps"])
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_kernel_compiles(case, arch, stop):
    """Every kernel of the decoder step also with the check that skips a step whose rows have all ended
    (`decode_attention.stop_args`: an early return at the kernel's top, after its programmatic-launch wait)."""
    fn, signature, constants = CASES[case]
    constants = dict(constants)
    if fn is dl._gemv:
        constants.update(BLOCK_M=16, BLOCK_N=16, BLOCK_K=dl.BLOCK_K, IEEE=False)
    if "PDL" in inspect.signature(fn.fn).parameters:
        constants["PDL"] = arch >= 90
    if "STOP" not in inspect.signature(fn.fn).parameters:
        if stop:
            pytest.skip("a kernel a step runs whether or not its rows have ended")
    elif stop:
        signature = dict(signature, stop_ptr=_ptr("i64"), stop_id="i32")
        constants["STOP"] = stop
    else:
        constants.update(stop_ptr=None, stop_id=0, STOP=0)
    _compile(fn, signature, constants, GPUTarget("cuda", arch, 32))


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("kind", ["q/k/v", "gate/up", "down, split"])
def test_gemv_pipeline_depth_fits_a_hopper_block(kind, rows):
    """The GEMVs at the pipeline depth the engines launch them with compile for sm_90 within the shared memory
    one block may have there (227 KiB), pipelined (their tiles staged in shared memory), at Spark's tiles for
    one row and for 64."""
    bm = dl._rows_block(rows)
    block_n, cols, want = {"q/k/v": (16, 16, 4), "gate/up": (64, 128, 3), "down, split": (32, 32, 3)}[kind]
    stages = dl._stages(bm, cols, 2, want, 227 * 1024 - dl.SMEM_RESERVE)
    constants = dict(NO_EPILOGUE, SWIGLU=kind == "gate/up", PARTIAL=kind == "down, split", BLOCK_M=bm,
                     BLOCK_N=block_n, BLOCK_K=dl.BLOCK_K, IEEE=False, PDL=True, stop_ptr=None, stop_id=0, STOP=0)
    signature = dict(GEMV, out_ptr=_ptr("fp32")) if kind == "down, split" else GEMV
    kernel = _compile(dl._gemv, signature, constants, GPUTarget("cuda", 90, 32), num_stages=stages,
                      divisible=("K", "k_per", "stride_xm"))
    assert kernel.metadata.shared <= 227 * 1024, (stages, kernel.metadata.shared)
    if stages > 2:  # pipelined: the loop's tiles staged in shared memory, one buffer per stage but the last
        assert kernel.metadata.shared >= (stages - 1) * (bm + cols) * dl.BLOCK_K * 2, (stages, kernel.metadata.shared)


@pytest.mark.parametrize("bias", [False, True])
def test_top_k_kernels_compile(bias):
    target = GPUTarget("cuda", 90, 32)
    _compile(topk_kernel._slice_top, dict(x_ptr=_ptr("bf16"), bias_ptr=_ptr("fp32"), phase_ptr=_ptr("i64"),
                                          key_ptr=_ptr("i64"), V="i32", W="i32", stride_x="i32", stride_bias="i32"),
             dict(K=64, HAS_BIAS=bias, BLOCK=1024), target)
    _compile(topk_kernel._merge_top, dict(key_ptr=_ptr("i64"), val_ptr=_ptr("fp32"), id_ptr=_ptr("i64"), V="i32"),
             dict(K=64, N=1024, BLOCK=1024), target)


def test_triton_keeps_fusing_multiply_adds_whatever_its_version_s_default(tmp_path):
    """Importing the kernels' Triton pins fused multiply-adds (what every kernel figure and exactness test was
    measured with) instead of leaving it to the version's default, which Triton 3.10 turns off; Triton 3.9 warns
    about an unset default, and with the pin it does not. An operator's own TRITON_DEFAULT_FP_FUSION is kept."""
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if not hasattr(getattr(triton, "knobs", None), "language"):
        pytest.skip("this Triton has no language knobs")
    probe = ("import warnings; warnings.simplefilter('error')\n"
             "from voiced.engines.triton_lang import triton\n"
             "print(triton.knobs.language.fp_fusion_enabled(None))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**env, "TRITON_DEFAULT_FP_FUSION": "0"})
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-2000:]
