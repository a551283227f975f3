"""The import graph of ds_canzona/zero/ has no circles, lazy (in-function) imports included.

The factory that picks a runtime (``build``) sits above the runtimes; shared helpers
(``pricing``, ``comm``, ``owned``, ...) and version facts (``versions``) sit below them. A circle,
even one hidden in a function-level import, means a module cannot be read (or tested) without the
ones above it.
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
