"""Speech on a CPU needs the espeak-ng program (Piper's phonemizer): the image has it, and `make run`
installs it where it is missing (the Makefile's run-deps), or says in one line that the daemon will
listen only. run-deps runs here with a PATH of stand-ins: espeak-ng present or not, apt-get present,
failing or absent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_trtllm_docker import runs

ROOT = Path(__file__).resolve().parents[1]
LISTEN_ONLY = "needs the espeak-ng program"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def test_the_image_installs_espeak_ng():
    assert any("apt-get install" in r and "espeak-ng" in r.split() for r in runs())


def _run_deps(tmp_path: Path, espeak: bool, apt: str | None) -> tuple[str, list[str]]:
    """`make run-deps` with only these programs on PATH; (its output, the apt-get calls made)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for tool in ("sh", "id", "make"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    stand_ins = {"sudo": 'exec "$@"'}
    if espeak:
        stand_ins["espeak-ng"] = "exit 0"
    if apt is not None:
        stand_ins["apt-get"] = f'echo "$@" >> {calls}; exit {0 if apt == "works" else 100}'
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "run-deps"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": str(bin_dir)})
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr, calls.read_text().splitlines() if calls.exists() else []


def test_make_run_installs_espeak_ng_where_it_is_missing(tmp_path):
    [run] = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("run:")]
    assert "run-deps" in run.split()
    out, calls = _run_deps(tmp_path, espeak=False, apt="works")
    assert calls == ["update -qq", "install -y -qq espeak-ng"] and LISTEN_ONLY not in out


def test_make_run_leaves_a_machine_with_espeak_ng_alone(tmp_path):
    out, calls = _run_deps(tmp_path, espeak=True, apt="works")
    assert calls == [] and out == ""


@pytest.mark.parametrize("apt", [None, "fails"])
def test_without_apt_or_when_it_fails_make_run_says_the_daemon_will_listen_only(tmp_path, apt):
    out, _ = _run_deps(tmp_path, espeak=False, apt=apt)
    assert out.count("\n") == 1 and LISTEN_ONLY in out and "will listen only" in out
