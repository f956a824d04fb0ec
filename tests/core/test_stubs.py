"""The type stubs of the entry modules (``tome_core/{torch,paddle,jax}.pyi``, issue #45) list every option,
once, in the signatures they share (``tome_core/_signatures.pyi``): editors and type checkers read them, not the
``__signature__`` that ``inspect.signature`` shows. They are written by ``python -m tome_tools.stubs``; these
checks read them with ``ast`` (no framework needed) and compare them with the options of
:class:`~tome_core.ToMeConfig`, and with the runtime signatures in the sessions whose framework is installed
(TOME_TEST_BACKENDS)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from typing import Dict, List

import pytest

from tome_core.config import option_parameters
from tome_tools.stubs import COMMAND, LIBRARY, MODULES, SHARED, stubs

ENTRY_POINTS = ("patch", "apply_tome")


def _stub(module: str) -> ast.Module:
    return ast.parse((LIBRARY / f"{module}.pyi").read_text())


def _protocols() -> Dict[str, ast.arguments]:
    """The parameters of each protocol's ``__call__`` in the shared stub, ``self`` left out."""
    protocols = {}
    for node in _stub(SHARED).body:
        if isinstance(node, ast.ClassDef):
            assert [ast.unparse(base) for base in node.bases] == ["Protocol"], node.name
            (call,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__call__"]
            assert call.args.args[0].arg == "self"
            protocols[node.name] = ast.arguments(**{**vars(call.args), "args": call.args.args[1:]})
    return protocols


def _functions(tree: ast.Module) -> Dict[str, ast.arguments]:
    """The parameters of each function a stub declares: by a ``def``, or as an instance of a shared protocol
    (``patch: PatchFunction``)."""
    functions = {node.name: node.args for node in tree.body if isinstance(node, ast.FunctionDef)}
    shared = {alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
              and node.module == f"tome_core.{SHARED}" for alias in node.names}
    protocols = _protocols()
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) in shared:
            functions[node.target.id] = protocols[ast.unparse(node.annotation)]
    return functions


def _reexports(tree: ast.Module) -> List[ast.ImportFrom]:
    return [node for node in tree.body if isinstance(node, ast.ImportFrom)
            and node.module not in ("typing", f"tome_core.{SHARED}")]


def _text(annotation: object) -> str:
    """An annotation as normalised source text."""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return ast.unparse(ast.parse(text, mode="eval"))


@pytest.mark.parametrize("module", (SHARED, *MODULES))
def test_each_stub_is_what_the_tool_writes(module):
    path = LIBRARY / f"{module}.pyi"
    assert path.read_text() == stubs()[path], f"{path.name} is stale: run `{COMMAND}` from the checkout's root"


def test_the_options_are_listed_once_in_the_shared_stub_which_imports_nothing_at_runtime():
    """Each entry stub names the shared protocols (not re-exported: imported without ``as``); the shared stub
    has no module beside it, so nothing imports it at runtime, and lists the options of one protocol only."""
    assert not (LIBRARY / f"{SHARED}.py").exists()
    for module in MODULES:
        tree = _stub(module)
        assert not any(isinstance(node, ast.FunctionDef) and node.args.kwonlyargs for node in tree.body)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == f"tome_core.{SHARED}":
                assert all(alias.asname is None for alias in node.names)
    listing = [name for name, args in _protocols().items() if args.kwonlyargs]
    assert listing == ["PatchFunction"]


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_entry_point_lists_every_option_in_order_with_its_type_and_default(module, name):
    """The model, the ratio (also positional), then every other option by keyword, as ToMeConfig defines them."""
    args = _functions(_stub(module))[name]
    assert [a.arg for a in args.args] == ["model", "ratio"] and not args.posonlyargs
    assert args.vararg is None and args.kwarg is None  # an unknown option is a type error, as it is at runtime
    options = option_parameters()
    stubbed = [args.args[1], *args.kwonlyargs]
    defaults = [args.defaults[-1], *args.kw_defaults]
    assert [a.arg for a in stubbed] == ["ratio"] + [p.name for p in options if p.name != "ratio"]
    expected = {p.name: p for p in options}
    for arg, default in zip(stubbed, defaults):
        option = expected[arg.arg]
        assert ast.literal_eval(default) == option.default and type(ast.literal_eval(default)) is type(option.default)
        assert ast.unparse(arg.annotation) == _text(option.annotation), arg.arg


@pytest.mark.parametrize("module", MODULES)
def test_each_stub_declares_the_public_names_of_its_module(module):
    source = ast.parse((LIBRARY / f"{module}.py").read_text())
    public = next(ast.literal_eval(n.value) for n in source.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", None) == "__all__")
    tree = _stub(module)
    declared = set(_functions(tree))
    for node in _reexports(tree):
        assert all(alias.asname == alias.name for alias in node.names)  # "x as x": re-exported
        declared |= {alias.asname for alias in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            declared |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign):
            declared.add(node.target.id)
    assert declared - {"__all__"} == set(public)
    assert next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and n.targets[0].id == "__all__") == public


@pytest.mark.parametrize("module", MODULES)
def test_each_stubbed_function_takes_the_runtime_parameters(module):
    """Names, kinds and defaults as ``inspect.signature`` gives them; re-exports are the runtime's objects."""
    if module not in os.environ.get("TOME_TEST_BACKENDS", "numpy").split(","):
        pytest.skip(f"{module} is not tested in this session")
    runtime = importlib.import_module(f"tome_core.{module}")
    tree = _stub(module)
    for name, args in _functions(tree).items():
        stubbed = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args.args]
        stubbed += [(a.arg, inspect.Parameter.KEYWORD_ONLY) for a in args.kwonlyargs]
        defaults = [ast.literal_eval(d) for d in args.defaults]
        defaults += [ast.literal_eval(d) for d in args.kw_defaults if d is not None]
        parameters = list(inspect.signature(getattr(runtime, name)).parameters.values())
        assert stubbed == [(p.name, p.kind) for p in parameters], name
        assert defaults == [p.default for p in parameters if p.default is not p.empty], name
    for node in _reexports(tree):
        source = importlib.import_module(node.module)
        assert all(getattr(runtime, a.name) is getattr(source, a.name) for a in node.names)
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):  # an alias
            assert getattr(runtime, node.targets[0].id) is getattr(runtime, node.value.id)

