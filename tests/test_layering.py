"""The import graph of ds_canzona/zero/ has no circles, lazy (in-function) imports included.

The factory that picks a runtime (``build``) sits above the runtimes; shared helpers
(``pricing``, ``comm``, ``owned``, ...) and version facts (``versions``) sit below them. A circle,
even one hidden in a function-level import, means a module cannot be read (or tested) without the
ones above it.

ds_canzona/bench/'s rooms go one way too: ``benchmarks/`` and ``gpu/`` may import ``standins/``,
which imports neither.
"""

from __future__ import annotations

import ast
import pathlib

import ds_canzona

PACKAGE = pathlib.Path(ds_canzona.__file__).parent / "zero"


def _zero_imports(path: pathlib.Path) -> set[str]:
    """The ds_canzona.zero modules ``path`` imports anywhere in its body (by module name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ds_canzona.zero."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.ImportFrom) and node.module == "ds_canzona.zero":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("ds_canzona.zero."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules.update({p.name: p / "__init__.py" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()})
    graph = {}
    for name, path in modules.items():
        files = [path] if path.name != "__init__.py" else sorted(path.parent.glob("*.py"))
        graph[name] = set().union(*(_zero_imports(f) for f in files)) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_zero_package_has_no_import_cycle():
    graph = _graph()
    assert {"build", "hook", "owner_placement", "support", "versions", "pricing"} <= set(graph)
    assert _cycle(graph) is None, f"import circle in ds_canzona/zero: {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_a_planted_cycle():
    # The checker itself: the circle this package had (build <-> owner_runtime via plan_cost_model,
    # owner_placement -> hook -> build -> stage3 -> owner_placement) is found.
    planted = {"hook": {"build"}, "build": {"stage3"}, "stage3": {"owner_placement"}, "owner_placement": {"hook"}}
    assert _cycle(planted) == ["build", "stage3", "owner_placement", "hook", "build"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


BENCH = PACKAGE.parent / "bench"
ROOMS = ("benchmarks", "gpu", "standins")


def _bench_rooms_imported(path: pathlib.Path) -> set[str]:
    """The rooms of ds_canzona/bench/ (benchmarks, gpu, standins) that ``path`` imports anywhere."""
    package = ["ds_canzona", *path.parent.relative_to(PACKAGE.parent).parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            names = [module + [alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        else:
            continue
        found.update(n[2] for n in names if n[:2] == ["ds_canzona", "bench"] and len(n) > 2 and n[2] in ROOMS)
    return found


def test_bench_standins_import_neither_benchmarks_nor_gpu():
    # benchmarks/ and gpu/ build on standins/ (fake worlds, meters, the rank spawner), which the
    # tests use alone: it must not pull a benchmark or the GPU session in, lazy imports included.
    files = {room: sorted((BENCH / room).glob("*.py")) for room in ROOMS}
    assert all(files.values()), files
    wrong = {str(f.relative_to(BENCH)): sorted(rooms) for f in files["standins"]
             if (rooms := _bench_rooms_imported(f) - {"standins"})}
    assert not wrong, f"standins/ imports another room: {wrong}"
    # the finder itself sees both forms the rooms use
    assert "standins" in _bench_rooms_imported(BENCH / "gpu" / "engine.py")  # from ..standins._ranks import ...
    assert "standins" in _bench_rooms_imported(BENCH / "benchmarks" / "step_offload.py")  # absolute
