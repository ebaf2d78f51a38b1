"""The install `make run` makes brings every module the daemon imports; the client's install, the client's.

`make test` installs the dev extras too (transformers, openai-whisper, ...), so running the code under
test proves nothing about what a user's `make run` install holds. These tests read what the installs
declare (the `voiced` distribution's metadata with the extra the Makefile names; client/pyproject.toml)
and every import in the source (an AST scan, imports inside functions included), and name each module
a user's install would lack. A requirement counts only when declared directly: a package that some
other requirement happens to pull in today may not tomorrow.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from voiced.config import tomllib
from voiced.extras import EXTRAS, MissingExtra, missing_extra

ROOT = Path(__file__).resolve().parents[1]
# Not part of what `voiced serve|speak|transcribe|voices` run: the benchmarks (the `bench` extra) and the
# TensorRT-LLM backend (the `trtllm` extra, on NVIDIA's container).
NOT_RUN = ("voiced/bench/", "voiced/engines/trtllm/", "voiced/cli/bench.py")
OWN = {"voiced", "voiced_client"}  # pyproject.toml's packages.find takes both into the `voiced` distribution


def run_extra() -> str:
    """The extra `make run` installs, from the Makefile (the one place it is written)."""
    makefile = (ROOT / "Makefile").read_text()
    m = re.search(r"^RUN_EXTRA\s*:?=\s*(\S+)\s*$", makefile, re.M)
    assert m, "the Makefile names no RUN_EXTRA"
    install = re.search(r"^\.run-installed:.*?\n((?:\t.*\n)+)", makefile.replace("$(VENV)/", ""), re.M)
    assert install and '-e ".[$(RUN_EXTRA)]"' in install.group(1), "`make run` does not install .[$(RUN_EXTRA)]"
    return m.group(1)


def third_party_imports(paths: list[Path], own: set[str]) -> dict[str, list[str]]:
    """Top-level module -> where it is imported ("path:line"), stdlib and the project's own left out."""
    found: dict[str, list[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def daemon_sources() -> list[Path]:
    return [p for p in sorted((ROOT / "voiced").rglob("*.py"))
            if not str(p.relative_to(ROOT)).startswith(NOT_RUN)]


@cache
def voiced_metadata_requires() -> tuple[str, ...]:
    """Requires-Dist of the `voiced` distribution as pip installs it from this checkout.

    The installed distribution's metadata when it was installed (editable) from this checkout after
    pyproject.toml last changed, which is what `make test` leaves; otherwise (a venv shared between
    checkouts, or pyproject.toml edited since) the metadata setuptools writes for this checkout, through
    the same PEP 517 hook pip calls.
    """
    for dist in md.distributions(name="voiced"):  # a checkout's voiced.egg-info may come first on the path
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
            meta = Path(dist._path) / "METADATA"  # type: ignore[attr-defined]
            if url.rstrip("/") == ROOT.as_uri() and meta.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
                return tuple(dist.requires or ())
        except (OSError, AttributeError, ValueError):
            continue
    out = subprocess.run(
        [sys.executable, "-c", "import sys, tempfile; from setuptools import build_meta as b; "
         "d = tempfile.mkdtemp(); print(d + '/' + b.prepare_metadata_for_build_wheel(d))"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]
    return tuple(md.PathDistribution(Path(out)).requires or ())


def declared(requires, extras: set[str]) -> set[str]:
    """Distribution names an install with `extras` brings: the base requirements (whatever their
    platform markers say: they are the daemon's, on the platforms that need them) and the extras'."""
    names = set()
    for line in requires:
        req = Requirement(line)
        marker = str(req.marker or "")
        if "extra" not in marker or any(req.marker.evaluate({"extra": e}) for e in extras):
            names.add(canonicalize_name(req.name))
    return names


@cache
def _installed_providers() -> dict[str, list[str]]:
    return md.packages_distributions()


def providers(module: str) -> set[str]:
    """Distributions that may provide top-level `module`: the installed ones that do, and the
    distribution of the same name (for packages not installed here, such as tensorrt_llm)."""
    return {canonicalize_name(d) for d in _installed_providers().get(module, [])} | {canonicalize_name(module)}


def undeclared(imports: dict[str, list[str]], names: set[str]) -> list[str]:
    return [f"{m} (imported at {', '.join(where[:3])})" for m, where in sorted(imports.items())
            if not providers(m) & names]


def test_make_run_installs_every_module_the_daemon_imports():
    extra = run_extra()
    requires = voiced_metadata_requires()
    imports = third_party_imports(daemon_sources(), OWN)
    assert {"torch", "tokenizers", "transformers", "grpc"} <= set(imports)  # the scan sees lazy imports
    missing = undeclared(imports, declared(requires, {extra}))
    assert not missing, (f"`make run` installs .[{extra}], which does not bring: " + "; ".join(missing)
                         + f". Declare each in pyproject.toml's dependencies or its `{extra}` extra.")


def test_the_dockerfile_installs_the_same_extra():
    extra = run_extra()
    # The install of voiced itself (other pip installs build the stubs or pin the image's versions).
    pip = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
           if "pip install" in line and "grpcio-tools" not in line]
    assert pip and all(f'".[{extra}]"' in line for line in pip), pip


def test_a_missing_optional_module_is_explained_by_its_extra():
    """Every third-party module the daemon imports beyond its base requirements is one `missing_extra`
    can explain, and the extra it names is the one that brings it."""
    requires = voiced_metadata_requires()
    base = declared(requires, set())
    for module, where in third_party_imports(daemon_sources(), OWN).items():
        if providers(module) & base:
            continue
        assert module in EXTRAS, f"{module} ({where[0]}) is not in voiced.extras.EXTRAS"
    for module, (dist, extra) in EXTRAS.items():
        assert canonicalize_name(dist) in declared(requires, {extra}) - base, f"{dist} is not in the {extra} extra"
        assert canonicalize_name(dist) in providers(module)
    err = missing_extra(ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers"), "voiced speak")
    assert isinstance(err, MissingExtra) and "pip install 'voiced[torch]'" in str(err) and "tokenizers" in str(err)
    assert missing_extra(ModuleNotFoundError("No module named 'nope'", name="nope")) is None


def test_the_client_imports_only_what_its_own_install_declares():
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    names = {canonicalize_name(Requirement(r).name) for r in reqs}
    imports = third_party_imports(sorted((ROOT / "client" / "voiced_client").rglob("*.py")), {"voiced_client"})
    assert {"grpc", "numpy"} <= set(imports)
    assert "torch" not in imports and "torch" not in names, imports.get("torch")
    missing = undeclared(imports, names)
    assert not missing, "voiced_client imports what client/pyproject.toml does not declare: " + "; ".join(missing)


# ------------------------------------------------------------------ the error a user sees at start-up


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.spark_fixtures import cached_spark_checkpoint
    from tests.whisper_fixtures import make_openai_checkpoint

    return (make_openai_checkpoint(tmp_path_factory.mktemp("deps") / "w", seed=1),
            cached_spark_checkpoint(tmp_path_factory))


def test_serve_without_the_spark_tokenizer_names_the_extra(checkpoints, monkeypatch, capsys):
    from voiced.cli import main

    whisper, spark = checkpoints
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails as if not installed
    rc = main(["serve", "--asr-model", str(whisper), "--tts-model", str(spark), "--device", "cpu",
               "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "voiced serve: error: this command needs the Python package 'tokenizers'" in err
    assert "pip install 'voiced[torch]'" in err


def test_registering_a_voice_without_transformers_names_the_extra(checkpoints, tmp_path, monkeypatch, capsys):
    import wave

    from tests.speech import phrase
    from voiced.cli import main

    ref = tmp_path / "ref.wav"
    with wave.open(str(ref), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((phrase("Hello there, this is my voice.") * 32767).astype("<i2").tobytes())
    monkeypatch.setitem(sys.modules, "transformers", None)
    rc = main(["voices", "add", "ann", "--audio", str(ref), "--text", "Hello there, this is my voice.",
               "--model", str(checkpoints[1]), "--device", "cpu", "--voices-dir", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "registering a voice needs the Python package 'transformers'" in err and "voiced[torch]" in err
