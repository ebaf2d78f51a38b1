"""The daemon's layers, read from its imports: the session core knows no transport, no module
imports one above its own layer, no folder holds a circle of imports, and a door imports no other
door: what doors share is in voiced/doors/shared.py (protocol helpers), voiced/doors/guard.py (the
bounds before a caller is let in) or in voiced/core."""

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
    ("daemon", ("voiced.daemon", "voiced.engine_process", "voiced.assembly")),
    ("bench", ("voiced.bench",)),  # the benchmarks run the daemon; the CLI runs them
    ("top", ("voiced.cli", "voiced.__main__")),
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


SHARED_DOOR_MODULE = "voiced.doors.shared"
# What every door does before it lets a caller in (connection places, deadlines, bounded reads).
GUARD_DOOR_MODULE = "voiced.doors.guard"


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """module -> the modules of voiced it imports (the longest known module an import names: a
    `from m import f` names m.f)."""
    modules = {module_name(p): p for p in sources()}
    graph = {}
    for name, path in modules.items():
        found = imports(path, top_level_only=top_level_only)
        deps = set()
        for imported, line in found:
            children = [m for m, at in found if at == line and m.startswith(imported + ".")]
            if children and all(m in modules for m in children):
                continue  # `from voiced.doors import web` takes the module voiced.doors.web, not the package
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported != "voiced":
                deps.add(imported)
        graph[name] = deps
    return graph


def folder_of(module: str) -> str:
    path = PKG.parent / Path(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def test_no_import_cycles_between_modules():
    cycles = find_cycles(import_graph(top_level_only=True))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_no_import_circle_inside_a_folder():
    """Counting every import, lazy ones and those under TYPE_CHECKING too: a circle a lazy import
    closes is still two modules that each need the other (how core/events.py and core/spec.py, and
    doors/http.py, openai_http.py and realtime.py, were tied)."""
    graph = import_graph(top_level_only=False)
    inside = {m: {d for d in deps if folder_of(d) == folder_of(m)} for m, deps in graph.items()}
    cycles = find_cycles(inside)
    assert cycles == [], "import circles inside a folder:\n" + "\n".join(cycles)


def door_imports_of_other_doors(graph: dict[str, set[str]], doors: set[str]) -> list[str]:
    """What breaks "a door imports no other door": within voiced/doors, a module other than the shared
    helper module may be imported by one module only (it is a part of that door), a door the registry
    names by none, and the registry (the package) by none."""
    inside = {m: {d for d in deps if d.startswith("voiced.doors")} for m, deps in graph.items()
              if m.startswith("voiced.doors.")}
    importers: dict[str, set[str]] = {}
    for m, deps in inside.items():
        for d in deps:
            importers.setdefault(d, set()).add(m)
    bad = []
    for d, by in sorted(importers.items()):
        if d in (SHARED_DOOR_MODULE, GUARD_DOOR_MODULE):
            continue
        if d == "voiced.doors" or d in doors:
            bad += [f"{m} imports {d}, a door (or the registry)" for m in sorted(by)]
        elif len(by) > 1:
            bad.append(f"{d} is imported by {', '.join(sorted(by))}: what doors share belongs in "
                       f"{SHARED_DOOR_MODULE} or voiced.core")
    return bad


def test_a_door_imports_no_other_door_but_the_shared_helpers():
    from voiced.doors import DOORS

    doors = {target.partition(":")[0] for target in DOORS.values()}
    bad = door_imports_of_other_doors(import_graph(top_level_only=False), doors)
    assert bad == [], "doors importing doors:\n" + "\n".join(bad)


def test_the_door_rule_sees_a_door_importing_a_door():
    graph = {"voiced.doors.a": {"voiced.doors.shared", "voiced.doors.a_wire"}, "voiced.doors.a_wire": set(),
             "voiced.doors.b": {"voiced.doors.shared", "voiced.doors.a_wire"},
             "voiced.doors.c": {"voiced.doors.a"}, "voiced.doors.shared": set()}
    assert door_imports_of_other_doors(graph, {"voiced.doors.a", "voiced.doors.b", "voiced.doors.c"}) == [
        "voiced.doors.c imports voiced.doors.a, a door (or the registry)",
        "voiced.doors.a_wire is imported by voiced.doors.a, voiced.doors.b: what doors share belongs in "
        "voiced.doors.shared or voiced.core"]
    assert find_cycles({"x.a": {"x.b"}, "x.b": {"x.a"}, "x.c": set()}) == ["x.a -> x.b -> x.a"]


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
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
    return cycles


def test_the_checks_see_a_forbidden_import(tmp_path):
    """The scan itself works: a core module importing a socket or grpc, even lazily, is named."""
    sample = tmp_path / "probe.py"
    sample.write_text("import numpy\ndef f():\n    import socket\n    from grpc import aio\n"
                      "from ..doors import grpc_wire\n")
    assert transport_imports(sample, "voiced.core.probe") == [
        "voiced.core.probe:3 imports socket", "voiced.core.probe:4 imports grpc", "voiced.core.probe:4 imports grpc.aio"]
    assert ("voiced.doors.grpc_wire", 5) in imports(sample, module="voiced.core.probe")
    assert layer_of("voiced.doors.grpc_wire") > layer_of("voiced.core.session") > layer_of("voiced.audio.ingest")


def test_the_package_imports_neither_the_tests_nor_the_developer_benchmarks():
    """An installed wheel has neither tests/ nor benchmarks/: `voiced bench e2e` must run without them."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in sources()
           for name, line in imports(path) if name.split(".")[0] in ("tests", "benchmarks")]
    assert bad == [], "the package reaching outside itself:\n" + "\n".join(bad)


def test_the_tests_import_no_developer_benchmark():
    """tests/ checks the product; the engines' developer benchmarks carry their own tests in benchmarks/."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in sorted((ROOT / "tests").glob("*.py"))
           for name, line in imports(path, module=f"tests.{path.stem}") if name.split(".")[0] == "benchmarks"]
    assert bad == [], "tests importing benchmarks/:\n" + "\n".join(bad)
