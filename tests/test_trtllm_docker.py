"""The TensorRT-LLM image recipe (Dockerfile, engines/entrypoint.sh, engines/image_pins.py), read and run
in the parts that run without Docker (issue 16.6). Docker itself is not available here: the image build
and a container start are not exercised (docs/TRTLLM.md says so)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from voiced.engines.trtllm import versions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
NVIDIA_ENTRYPOINT = "/opt/nvidia/nvidia_entrypoint.sh"
# What NVIDIA's tensorrt-llm/release:1.0.0 holds, from its sources (docs/TRTLLM.md, "The image"):
# docker/common/install.sh upgrades the base image's protobuf with `protobuf>=4.25.8` when the image
# is built (summer 2025: the 6.3x line); the grpcio family that accepts protobuf 6 ends at 1.80.x.
IMAGE_PROTOBUF = "6.32.0"
GRPC_LINES_FOR_PROTOBUF_6 = ("1.74.0", "1.80.1")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def runs() -> list[str]:
    return [args for ins, args in dockerfile() if ins == "RUN"]


def test_the_image_is_the_release_the_runners_were_checked_against():
    froms = [args for ins, args in dockerfile() if ins == "FROM"]
    assert froms == [versions.CONTAINER_IMAGE]


def test_the_images_own_entrypoint_runs_first_and_hands_over_to_ours():
    """NVIDIA's entrypoint sets up the CUDA compatibility libraries on hosts with older drivers, then
    execs its arguments; replacing it loses that."""
    (entry,) = [args for ins, args in dockerfile() if ins == "ENTRYPOINT"]
    argv = json.loads(entry)  # exec form: no shell in between to swallow signals
    assert argv[0] == NVIDIA_ENTRYPOINT
    assert argv[1:] == ["/opt/voiced/engines/entrypoint.sh"]
    copies = [args.split() for ins, args in dockerfile() if ins == "COPY"]
    assert any("engines/entrypoint.sh" in c[:-1] and c[-1] == "./engines/" for c in copies)
    assert ("WORKDIR", "/opt/voiced") in dockerfile()


def test_entrypoint_is_valid_shell_and_ends_by_exec_ing_the_daemon():
    path = ROOT / "engines" / "entrypoint.sh"
    assert os.stat(path).st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(path)], check=True)
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.strip().startswith("#")]
    assert lines[-1] == 'exec voiced serve "${serve_args[@]}" "$@"'
    assert NVIDIA_ENTRYPOINT not in path.read_text()  # chained by the Dockerfile, not called twice


def test_pip_check_runs_after_every_install():
    steps = runs()
    installs = [i for i, r in enumerate(steps) if re.search(r"\bpip install\b", r)]
    checks = [i for i, r in enumerate(steps) if re.search(r"\bpip check\b", r)]
    assert installs and checks and max(checks) > max(installs)


def test_the_install_holds_the_images_versions():
    """Every install is constrained by the pins engines/image_pins.py writes from the image."""
    steps = runs()
    (pins,) = [r for r in steps if "image_pins.py" in r]
    target = re.search(r"> *(\S+)", pins).group(1)
    for r in steps:
        for cmd in re.split(r"&&|;", r):
            if re.search(r"\bpip install\b", cmd):
                assert f"-c {target}" in cmd, cmd
    assert steps.index(pins) < min(i for i, r in enumerate(steps) if re.search(r"\bpip install\b", r))


def test_stubs_are_regenerated_for_the_images_protobuf_before_voiced_is_installed():
    """The committed stubs carry the gencode version of the grpcio-tools that made them; protobuf refuses
    gencode newer than its runtime, so the image (protobuf 6.x) gets stubs made by a grpcio-tools that
    accepts its protobuf."""
    steps = runs()
    gen = next(i for i, r in enumerate(steps) if "proto/generate.py" in r)
    install = next(i for i, r in enumerate(steps) if re.search(r"pip install[^&;]* \"?\.(\[\w+\])?\"? ", r + " "))
    assert gen < install
    assert "grpcio-tools" in steps[gen] and "pip uninstall -y grpcio-tools" in steps[gen]


def image_pins(tmp_path: Path, installed: dict[str, str], *extra: str) -> list[str]:
    """Run engines/image_pins.py against our pyproject as if `installed` were the image's packages."""
    site = tmp_path / "site"
    for name, version in installed.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    code = ("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
            f"sys.path.insert(0, {str(site)!r}); sys.argv = sys.argv[1:]; "
            f"exec(open({str(ROOT / 'engines' / 'image_pins.py')!r}).read())")
    out = subprocess.run([sys.executable, "-c", code, "image_pins.py", str(ROOT / "pyproject.toml"), *extra],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


def test_image_pins_hold_what_the_image_has_except_grpc(tmp_path):
    pins = image_pins(tmp_path, {"protobuf": IMAGE_PROTOBUF, "numpy": "1.26.4", "grpcio": "1.71.0",
                                 "grpcio-tools": "1.71.0", "tqdm": "4.67.1", "torch": "2.8.0a0+5228986c39.nv25.6",
                                 "safetensors": "0.5.3"}, "safetensors", "pyyaml")
    assert sorted(pins) == sorted([f"protobuf=={IMAGE_PROTOBUF}", "numpy==1.26.4", "tqdm==4.67.1",
                                   "safetensors==0.5.3"])


def fake_pip(tmp_path: Path, before: str, after: str) -> dict:
    """A `pip` whose `check` prints `before` on its first call and `after` on later ones (exit 1 if any)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "calls"
    script = bin_dir / "pip"
    script.write_text(f"""#!/bin/sh
[ "$1" = check ] || exit 0
if [ -e {state} ]; then out={shlex.quote(after)}; else out={shlex.quote(before)}; touch {state}; fi
if [ -z "$out" ]; then echo "No broken requirements found."; exit 0; fi
printf '%s\\n' "$out"; exit 1
""")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "BUILD_STATE": str(tmp_path / "state")}


@pytest.mark.parametrize(("before", "after", "ok"), [
    ("", "", True),
    ("torchvision 0.23.0a0 requires torch==2.8.0a0, but you have torch 2.8.0a0+5228986c39.nv25.6.",
     "torchvision 0.23.0a0 requires torch==2.8.0a0, but you have torch 2.8.0a0+5228986c39.nv25.6.", True),
    ("", "tensorrt-llm 1.0.0 has requirement protobuf<7, but you have protobuf 7.35.1.", False),
    ("torchvision 0.23.0a0 requires torch==2.8.0a0, but you have torch 2.8.0a0+5228986c39.nv25.6.",
     "torchvision 0.23.0a0 requires torch==2.8.0a0, but you have torch 2.8.0a0+5228986c39.nv25.6.\n"
     "onnx 1.18.0 has requirement protobuf>=4.25.1, but you have protobuf 3.20.3.", False),
])
def test_the_pip_check_steps_fail_only_on_what_the_install_broke(tmp_path, before, after, ok):
    """The base image may carry complaints of its own (NVIDIA's builds of torch and friends); the build
    fails on any complaint that was not there before voiced was installed. The RUN lines are run as
    Docker runs them (sh -c) with a stand-in `pip`."""
    steps = [r for r in runs() if re.search(r"\bpip check\b", r)]
    assert len(steps) == 2  # before anything is installed, and after
    env = fake_pip(tmp_path, before, after)
    first = subprocess.run(["sh", "-c", steps[0]], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    last = subprocess.run(["sh", "-c", steps[1]], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert (last.returncode == 0) == ok, last.stdout + last.stderr
    if not ok:
        assert after.splitlines()[-1] in last.stderr and "installing voiced" in last.stderr


def test_our_floors_admit_the_images_protobuf():
    """`pip install .` must not move the image's protobuf (6.x) to 7.x."""
    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    assert deps["protobuf"].specifier.contains(IMAGE_PROTOBUF)
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        for version in GRPC_LINES_FOR_PROTOBUF_6:
            assert deps[name].specifier.contains(version), (name, version)
