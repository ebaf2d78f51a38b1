"""The daemon's layers, read from its imports: the session core knows no transport, and no module
imports one above its own layer (so there is no circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "voiced"

# What a transport is made of: none of it may appear under voiced/core.
TRANSPORT = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "voiced_client.proto", "aiohttp",
             "websockets", "wyoming", "socket", "socketserver", "http.server", "asyncio.streams")

# Bottom to top; a module imports only from its own layer or those below it.
LAYERS = [
    ("leaves", ("voiced.config", "voiced.audio", "voiced.memory_plan", "voiced.hub", "voiced.text",
                "voiced.metrics", "voiced.engines", "voiced")),
    ("core", ("voiced.core",)),
    ("doors", ("voiced.doors",)),
    ("daemon", ("voiced.daemon",)),
    ("top", ("voiced.cli", "voiced.bench", "voiced.__main__")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, top_level_only: bool = False, module: str | None = None) -> list[tuple[str, int]]:
    """(module, line) for every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = (module or module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            # `from voiced.core import speech` imports a module too
            out += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return out


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


def sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def transport_imports(path: Path, module: str | None = None) -> list[str]:
    return [f"{module or module_name(path)}:{line} imports {name}" for name, line in imports(path, module=module)
            if any(name == t or name.startswith(t + ".") for t in TRANSPORT)]


def test_the_core_imports_no_transport():
    bad = [b for path in sorted((PKG / "core").rglob("*.py")) for b in transport_imports(path)]
    assert bad == [], "voiced/core must not touch a transport:\n" + "\n".join(bad)


def test_no_module_imports_from_a_layer_above_its_own():
    bad = []
    for path in sources():
        mine = layer_of(module_name(path))
        for name, line in imports(path):
            theirs = layer_of(name)
            if theirs is not None and mine is not None and theirs > mine:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
    assert bad == [], "imports that run up the layers:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    modules = {module_name(p): p for p in sources()}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported, _ in imports(path, top_level_only=True):
            # the longest known module the import names (a `from m import f` names m.f)
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported != "voiced":
                deps.add(imported)
        graph[name] = deps
    cycles = []
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_forbidden_import(tmp_path):
    """The scan itself works: a core module importing a socket or grpc, even lazily, is named."""
    sample = tmp_path / "probe.py"
    sample.write_text("import numpy\ndef f():\n    import socket\n    from grpc import aio\n"
                      "from ..doors import grpc_wire\n")
    assert transport_imports(sample, "voiced.core.probe") == [
        "voiced.core.probe:3 imports socket", "voiced.core.probe:4 imports grpc", "voiced.core.probe:4 imports grpc.aio"]
    assert ("voiced.doors.grpc_wire", 5) in imports(sample, module="voiced.core.probe")
    assert layer_of("voiced.doors.grpc_wire") > layer_of("voiced.core.session") > layer_of("voiced.audio.ingest")
