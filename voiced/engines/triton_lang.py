"""Triton, where the install has it: the GPU kernels' language (triton, triton.language), or None.

Triton comes with the CUDA builds of torch (it is torch.compile's GPU backend), the only place the
engines' kernels run; an install without it takes each kernel's torch or numpy path. So it is looked
up here, not declared as a requirement (tests/test_dependencies.py reads a static import as one).
"""

from __future__ import annotations

import importlib

try:
    triton = importlib.import_module("triton")
    tl = importlib.import_module("triton.language")
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None
