"""`voiced serve` makes torch's OpenMP threads wait passively: spinning, they starved each other on a CPU
whose cores were busy, and callers' decodes ran at half speed (docs/BENCHMARKS.md, 2026-11-27, session
12). Checked in a fresh process, as the daemon starts: libgomp reports the policy it took when torch
loaded (OMP_DISPLAY_ENV)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

STARTS_AS_SERVE = (
    "from voiced.cli.serve import passive_openmp_waits\n"
    "passive_openmp_waits()\n"
    "import torch\n"
    "torch.ones(64, 64) @ torch.ones(64, 64)\n"
)


def _spins(env_policy: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", STARTS_AS_SERVE], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    lines = [line for line in (out.stderr + out.stdout).splitlines() if "GOMP_SPINCOUNT" in line]
    if not lines:
        pytest.skip("this torch's OpenMP does not report its settings (not libgomp)")
    return int(lines[0].split("=")[1].strip().strip("'"))


def test_the_daemon_s_openmp_threads_wait_passively_unless_the_operator_says_otherwise():
    assert _spins(None) == 0
    assert _spins("ACTIVE") > 300_000  # the operator's choice is kept
