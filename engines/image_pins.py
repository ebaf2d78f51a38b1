"""Print pip constraints that hold what an image already has of voiced's dependencies.

    python3 engines/image_pins.py pyproject.toml [more names ...] > pins.txt
    pip install -c pins.txt . [more names ...]

One ``name==version`` line for each dependency of voiced (pyproject's ``[project] dependencies`` and
the names given) that is installed. gRPC (grpcio, grpcio-*) is left free: it is voiced's own
transport and nothing in TensorRT-LLM's release image bounds it. Everything else stays exactly what
TensorRT-LLM was resolved against (protobuf above all, 6.x in the 1.0.0 image); a floor of ours above
what the image has then fails the build when pip resolves, instead of upgrading the image's package.
Used by the Dockerfile; stdlib only, since it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the release images run 3.12
    import tomli as tomllib

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(pyproject: Path, extra: list[str]) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = [_NAME.match(d).group(1) for d in deps] + extra
    out = []
    for name in dict.fromkeys(canonical(n) for n in names):
        if name == "grpcio" or name.startswith("grpcio-"):
            continue
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue  # not in the image: pip installs what our bounds allow
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print("\n".join(pins(Path(args[0] if args else "pyproject.toml"), args[1:])))
