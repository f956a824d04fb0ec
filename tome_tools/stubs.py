"""The type stubs of the framework entry modules (``src/tome_core/{torch,paddle,jax}.pyi``), written from the
library's own definitions.

At runtime ``patch`` and ``apply_tome`` take ``**options`` and carry an explicit ``__signature__``
(:func:`tome_core.dropin.ratio_positional`), which ``inspect.signature`` and ``help()`` read but editors and
type checkers (pyright/Pylance, mypy, jedi) do not: they read the stubs, which list every option of
:class:`tome_core.ToMeConfig` by keyword with its type and default. Run from the checkout's root after
changing an option or an entry module (tests/core/test_stubs.py fails until the stubs match)::

    python -m tome_tools.stubs          # rewrite the stubs
    python -m tome_tools.stubs --check  # exit 1 naming the stale ones

Framework-free: each entry module is read with ``ast``, its public names (``__all__``) declared by how the
module binds them: an entry point of ``ratio_positional`` with its signature, the drop-ins of
``tomesd_functions`` with theirs, a name imported from the library re-exported from there, an alias as an
alias, anything else as ``Any``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import pathlib
import sys
import textwrap
import typing
from typing import Any, Dict, List, Sequence

from tome_core.dropin import ratio_positional, tomesd_functions

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "src" / "tome_core"
MODULES = ("torch", "paddle", "jax")
COMMAND = "python -m tome_tools.stubs"
WIDTH = 110  # the project's line length


def _annotation(annotation: Any) -> str:
    """An annotation as source text (``Any`` where there is none)."""
    if annotation is inspect.Parameter.empty:
        return "Any"
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _default(value: Any) -> str:
    text = repr(value)
    if ast.literal_eval(text) != value:  # a stub's default must be a literal
        raise ValueError(f"default {value!r} is not a literal")
    return text


def _function(name: str, signature: inspect.Signature, doc: str) -> List[str]:
    """A stub ``def``, one parameter a line unless it fits on one. A ``**`` parameter is left out: the
    drop-ins' ``**unknown`` only words the TypeError for an option they lack, which a checker reports
    instead."""
    parameters = []
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            continue
        if p.kind is p.KEYWORD_ONLY and "*" not in parameters:
            parameters.append("*")
        default = "" if p.default is p.empty else f" = {_default(p.default)}"
        parameters.append(f"{p.name}: {_annotation(p.annotation)}{default}")
    returns = f") -> {_annotation(signature.return_annotation)}:"
    head = [f"def {name}({', '.join(parameters)}{returns}"]
    if len(head[0]) > WIDTH:
        head = [f"def {name}(", *(f"    {p}," for p in parameters), returns]
    quoted = textwrap.wrap(f'"""{doc}"""', WIDTH - 4)
    return head + [f"    {line}" for line in quoted]


def _import(source: str, names: List[str]) -> str:
    line = f"from {source} import {', '.join(names)}"
    if len(line) <= WIDTH:
        return line
    return f"from {source} import (\n" + "".join(f"    {name},\n" for name in names) + ")"


def _names(target: ast.expr) -> List[str]:
    """The names an assignment binds (none for an attribute or an item)."""
    elements = target.elts if isinstance(target, ast.Tuple) else [target]
    return [e.id for e in elements if isinstance(e, ast.Name)]


def _called(value: ast.expr) -> str:
    return value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else ""


def _entry_doc(module: str, name: str) -> str:
    return (f"Every option of tome_core.ToMeConfig, the ratio also positional; "
            f"help(tome_core.{module}.{name}) describes each.")


def stub(module: str) -> str:
    """The text of ``tome_core/<module>.pyi``."""
    path = LIBRARY / f"{module}.py"
    tree = ast.parse(path.read_text())
    assigns = [node for node in tree.body if isinstance(node, ast.Assign) and len(node.targets) == 1]
    public = next(ast.literal_eval(a.value) for a in assigns if _names(a.targets[0]) == ["__all__"])
    imports: Dict[str, List[str]] = {}  # library module -> its "name as name" re-exports
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tome_core."):
            bound = [(alias.name, alias.asname or alias.name) for alias in node.names]
            imports.setdefault(node.module, []).extend(f"{n} as {b}" for n, b in bound if b in public)
    declared = {entry.split(" as ")[1] for names in imports.values() for entry in names}
    body: List[List[str]] = []  # the declarations, in the module's order
    for node in assigns:
        bound = _names(node.targets[0])
        names = [name for name in bound if name in public]
        if _called(node.value) == "ratio_positional":
            entries = [ratio_positional(lambda model, **options: model, n, module) for n in names]
            body += [_function(n, inspect.signature(e), _entry_doc(module, n))
                     for n, e in zip(names, entries)]
        elif _called(node.value) == "tomesd_functions":
            for name, function in zip(bound, tomesd_functions(lambda model, **options: model, lambda model: model)):
                doc = " ".join((function.__doc__ or "").split())
                body += [_function(name, inspect.signature(function), doc)] if name in public else []
        elif isinstance(node.value, ast.Name) and node.value.id in declared:
            body += [[f"{name} = {node.value.id}"] for name in names]
        elif names:
            body.append([f"{name}: Any" for name in names])
        declared.update(names)
    missing = [name for name in public if name not in declared]
    if missing:
        raise ValueError(f"{path.name}: cannot tell how to declare {', '.join(missing)}")

    text = "\n\n".join("\n".join(lines) for lines in body)
    used = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
    listed = ", ".join(f'"{name}"' for name in public)
    head = [
        f"# Written by `{COMMAND}` from tome_core/{module}.py and ToMeConfig: edit those, then rerun it.",
        "# Editors and type checkers read this stub; at runtime inspect.signature shows the same parameters.",
        "",
        f"from typing import {', '.join(sorted(used & set(typing.__all__)))}",
        "",
        *(_import(source, names) for source, names in imports.items() if names),
        "",
        *textwrap.wrap(f"__all__ = [{listed}]", WIDTH, subsequent_indent="    "),
    ]
    return "\n".join(head) + "\n\n" + text + "\n"


def stale() -> List[pathlib.Path]:
    """The stubs that differ from what :func:`stub` writes."""
    paths = [LIBRARY / f"{module}.pyi" for module in MODULES]
    return [p for p, m in zip(paths, MODULES) if not p.exists() or p.read_text() != stub(m)]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    paths = stale()
    if args.check:
        for path in paths:
            print(f"stale: {path} (run `{COMMAND}`)")
        return 1 if paths else 0
    for path in paths:
        path.write_text(stub(path.stem))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
