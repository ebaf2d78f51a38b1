"""Triton, where the install has it: the GPU kernels' language (triton, triton.language), or None.

Triton comes with the CUDA builds of torch (it is torch.compile's GPU backend), the only place the
engines' kernels run; an install without it takes each kernel's torch or numpy path. So it is looked
up here, not declared as a requirement (tests/test_dependencies.py reads a static import as one).
"""

from __future__ import annotations

import importlib
import os

# Triton contracts a multiply and an add into one fused multiply-add unless told not to; 3.9 warns that its
# default turns to not fusing in 3.10. Every figure and every exactness test of the kernels here was measured
# with fusion (Triton 3.6 on the GPUs), so that is pinned for this process (torch.compile's Triton kernels
# included) rather than left to a version's default; an operator's own setting is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None
