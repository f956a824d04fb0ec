"""The import graph of the library and the tools beside it has no cycles, the library imports no tool
(issue #36), and the framework protocol stands near its bottom (#44): read from the source with ``ast``, every
import of a ``tome_core`` or ``tome_tools`` module (relative ones resolved), at the top of a file or inside a
function, is an edge."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "src" / "tome_core"
FOLDERS = {
    "tome_core": LIBRARY, **{f"tome_core.{sub}": LIBRARY / sub for sub in ("adapters", "algorithm", "backends", "hooks", "models")},
    "tome_tools": ROOT / "tome_tools",
}
PACKAGES = ("tome_core", "tome_tools")


def import_graph() -> Dict[str, Set[str]]:
    """``module -> the tome_core and tome_tools modules it imports``."""
    files = {}
    for package, folder in FOLDERS.items():
        for path in folder.glob("*.py"):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    graph = {}
    for module, path in files.items():
        names: Set[str] = set()
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # from .x import y, from . import x
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
                names |= {source} | {f"{source}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGES):
                names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names if alias.name.startswith(PACKAGES)}
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
    assert {"tome_core.driver", "tome_tools.bench", "tome_tools.bench_core", "tome_core.adapters.diffusers"} <= set(graph)
    assert cycles(graph) == []


def reach(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """``module -> every module it imports, directly or through others`` (the transitive closure)."""
    found = {module: set(targets) for module, targets in graph.items()}
    for _ in graph:
        found = {module: targets.union(*(found[t] for t in targets)) for module, targets in found.items()}
    return found


def test_relative_imports_are_edges():
    graph = import_graph()
    assert {"tome_core.framework", "tome_core.models.families"} <= graph["tome_core.models.model_tree"]
    assert "tome_core.algorithm.ops" in graph["tome_core.algorithm.backend"]


def test_the_library_imports_no_tool():
    graph = import_graph()
    assert {"tome_tools.bench", "tome_tools.diffusers_models"} <= set(graph)
    reach_of = reach(graph)
    assert {module: sorted(t for t in targets if t.startswith("tome_tools"))
            for module, targets in reach_of.items()
            if module.startswith("tome_core") and any(t.startswith("tome_tools") for t in targets)} == {}


def test_the_framework_protocol_imports_nothing_that_uses_it():
    """``framework.py`` (what the driver asks of a framework, and how a module's call is read) stands near the
    bottom of the library: everything it imports, all the way down, is the context parallelism description its
    protocol returns and the options that module reads; no family, match, model tree, hook or adapter."""
    assert reach(import_graph())["tome_core.framework"] <= {"tome_core.shards", "tome_core.config"}


def private_names_used(folder: pathlib.Path) -> List[str]:
    """``file: module.name`` for every underscored name of the library that a file imports or reads as a
    module attribute (``driver._x``), in the Python files under ``folder``."""
    library = {name for name in import_graph() if name.startswith("tome_core")}
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tome_core"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.name}: {node.module}.{alias.name}")
                    if f"{node.module}.{alias.name}" in library:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in library:
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    found.append(f"{path.name}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_the_tools_examples_and_studies_use_the_public_api():
    for folder in ("tome_tools", "examples", "docs"):
        assert private_names_used(ROOT / folder) == [], folder
