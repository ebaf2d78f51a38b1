"""Generate the Python stubs from proto/voiced/v1/voiced.proto (run by `make proto`).

    python proto/generate.py [OUT_DIR]     # default: client/voiced_client/proto

The stubs ship in the client package so that clients install without the daemon; the daemon
imports them from there. protoc writes `import voiced_pb2`, which only works from the current
directory, so the import is rewritten to a relative one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "voiced" / "v1"
DEFAULT_OUT = ROOT / "client" / "voiced_client" / "proto"
FILES = ("voiced_pb2.py", "voiced_pb2.pyi", "voiced_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_DIR / "voiced.proto"),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            text = (Path(tmp) / name).read_text()
            text = text.replace("import voiced_pb2 as voiced__pb2", "from . import voiced_pb2 as voiced__pb2")
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
