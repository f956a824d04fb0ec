"""The package's import graph has no cycles (issue #36): read from the source with ``ast``, every import of a
``tome_core`` module, at the top of a file or inside a function, is an edge."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
# where each installed package's files sit in the checkout (pyproject's package-dir)
FOLDERS = {"tome_core": ROOT / "tome_core", "tome_core.adapters": ROOT / "adapters", "tome_core.backends": ROOT / "backends"}


def import_graph() -> Dict[str, Set[str]]:
    """``module -> the tome_core modules it imports``."""
    files = {}
    for package, folder in FOLDERS.items():
        for path in folder.glob("*.py"):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    graph = {}
    for module, path in files.items():
        names: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tome_core"):
                names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names if alias.name.startswith("tome_core")}
        graph[module] = {name for name in names if name in files and name != module}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every cycle a depth-first walk meets (one per back edge)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    found: List[List[str]] = []

    def walk(module: str, path: List[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return found


def test_the_walk_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_no_cycle():
    graph = import_graph()
    assert {"tome_core.driver", "tome_core.bench", "tome_core.bench_core", "tome_core.adapters.diffusers"} <= set(graph)
    assert cycles(graph) == []
