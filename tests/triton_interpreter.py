"""Triton kernels on the CPU: a test module's checks run in a child process under Triton's interpreter
(TRITON_INTERPRET=1 is read when a kernel is defined, so it cannot be turned on inside a process that
has imported the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_interpreted(module: str, timeout: float) -> dict:
    """`python -m module` with the interpreter on; the JSON its last line of output prints."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
