"""The type stubs of the framework entry modules (``src/tome_core/{torch,paddle,jax}.pyi``) and the signatures
they share (``src/tome_core/_signatures.pyi``), written from the library's own definitions.

At runtime ``patch`` and ``apply_tome`` take ``**options`` and carry an explicit ``__signature__``
(:func:`tome_core.dropin.ratio_positional`), as tomesd's ``apply_patch`` drop-in does
(:func:`tome_core.dropin.tomesd_functions`); ``inspect.signature`` and ``help()`` read it but editors and type
checkers (pyright/Pylance, mypy, jedi) do not: they read the stubs. ``_signatures.pyi``, a stub-only module,
lists every option of :class:`tome_core.ToMeConfig` once, by keyword with its type and default, as the
``__call__`` of the protocol ``PatchFunction`` (tomesd's parameters: ``TomesdApplyPatch``); each entry stub
declares ``patch: PatchFunction`` and the like. Run from the checkout's root after changing an option or an
entry module (tests/core/test_stubs.py fails until the stubs match)::

    python -m tome_tools.stubs          # rewrite the stubs
    python -m tome_tools.stubs --check  # exit 1 naming the stale ones

Framework-free: each entry module is read with ``ast``, its public names (``__all__``) declared by how the
module binds them: an entry point of ``ratio_positional`` or tomesd's ``apply_patch`` as an instance of its
protocol, ``remove_patch`` with its signature, a name imported from the library re-exported from there, an
alias as an alias, anything else as ``Any``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import pathlib
import sys
import textwrap
import typing
from typing import Any, Callable, Dict, List, Sequence, Tuple

from tome_core.dropin import ratio_positional, tomesd_functions

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "src" / "tome_core"
MODULES = ("torch", "paddle", "jax")
SHARED = "_signatures"  # the stub-only module of the signatures the entry stubs share
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


def _function(name: str, signature: inspect.Signature, doc: str, indent: str = "") -> List[str]:
    """A stub ``def``, one parameter a line unless it fits on one; ``indent``: a protocol's method (``self``
    first). Positional-or-keyword and keyword-only parameters: the entry points' signatures have no other kind
    (an unknown option is a type error, as it is at runtime)."""
    parameters = ["self"] if indent else []
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ValueError(f"parameter {p} of {name}{signature}: not one a stub's signature takes")
        if p.kind is p.KEYWORD_ONLY and "*" not in parameters:
            parameters.append("*")
        default = "" if p.default is p.empty else f" = {_default(p.default)}"
        parameters.append(f"{p.name}: {_annotation(p.annotation)}{default}")
    returns = f") -> {_annotation(signature.return_annotation)}:"
    head = [f"{indent}def {name}({', '.join(parameters)}{returns}"]
    if len(head[0]) > WIDTH:
        head = [f"{indent}def {name}(", *(f"{indent}    {p}," for p in parameters), f"{indent}{returns}"]
    return head + _docstring(doc, indent + "    ")


def _docstring(doc: str, indent: str) -> List[str]:
    return [f"{indent}{line}" for line in textwrap.wrap(f'"""{doc}"""', WIDTH - len(indent))]


def _protocol(name: str, doc: str, signature: inspect.Signature, call_doc: str) -> List[str]:
    """A callable protocol: what a name bound to a function of that signature is to a type checker."""
    call = _function("__call__", signature, call_doc, "    ")
    return [f"class {name}(Protocol):", *_docstring(doc, "    "), "", *call]


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


def _dropins() -> Tuple[Callable[..., Any], Callable[[Any], Any]]:
    """tomesd's ``(apply_patch, remove_patch)`` as the entry modules build them (on stand-in functions)."""
    return tomesd_functions(lambda model, **options: model, lambda model: model)


def _doc(function: Callable[..., Any]) -> str:
    return " ".join((function.__doc__ or "").split())


def _entry_points() -> Dict[str, inspect.Signature]:
    """The signatures the entry stubs share, by the name of their protocol in ``_signatures.pyi``."""
    apply_patch, _ = _dropins()
    return {
        "PatchFunction": inspect.signature(ratio_positional(lambda model, **options: model, "patch", "")),
        "TomesdApplyPatch": inspect.signature(apply_patch),
    }


def shared_stub() -> str:
    """The text of ``tome_core/_signatures.pyi``."""
    signatures = _entry_points()
    patch_doc = "``patch`` and ``apply_tome`` of every entry module (tome_core.torch, .paddle, .jax)."
    tomesd_doc = "``apply_patch`` of the entry modules with tomesd's drop-ins (tome_core.torch, .paddle)."
    call_doc = "Every option of tome_core.ToMeConfig, the ratio also positional; help() of either lists each."
    body = [
        _protocol("PatchFunction", patch_doc, signatures["PatchFunction"], call_doc),
        _protocol("TomesdApplyPatch", tomesd_doc, signatures["TomesdApplyPatch"], _doc(_dropins()[0])),
    ]
    text = "\n\n".join("\n".join(lines) for lines in body)
    head = [
        f"# Written by `{COMMAND}` from ToMeConfig and tome_core/dropin.py: edit those, then rerun it.",
        "# Stub-only: the entry points' signatures, by which the entry modules' stubs (torch.pyi,",
        "# paddle.pyi, jax.pyi) declare their functions, so that each option is listed once.",
        "",
        *_typing(text),
    ]
    return "\n".join(head) + "\n" + text + "\n"


def _typing(text: str) -> List[str]:
    """The import of the names of ``typing`` that ``text`` uses, and a blank line (none if it uses none)."""
    used = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)} & set(typing.__all__)
    return [f"from typing import {', '.join(sorted(used))}", ""] if used else []


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
    protocols: List[str] = []  # those of _signatures.pyi that the declarations name
    for node in assigns:
        bound = _names(node.targets[0])
        names = [name for name in bound if name in public]
        if _called(node.value) == "ratio_positional":
            protocols += ["PatchFunction"] if names else []
            body += [[f"{n}: PatchFunction", *_docstring(_entry_doc(module, n), "")] for n in names]
        elif _called(node.value) == "tomesd_functions":
            apply_patch, remove_patch = bound  # as tomesd_functions returns them
            if apply_patch in public:
                protocols.append("TomesdApplyPatch")
                body.append([f"{apply_patch}: TomesdApplyPatch", *_docstring(_doc(_dropins()[0]), "")])
            if remove_patch in public:
                function = _dropins()[1]
                body.append(_function(remove_patch, inspect.signature(function), _doc(function)))
        elif isinstance(node.value, ast.Name) and node.value.id in declared:
            body += [[f"{name} = {node.value.id}"] for name in names]
        elif names:
            body.append([f"{name}: Any" for name in names])
        declared.update(names)
    missing = [name for name in public if name not in declared]
    if missing:
        raise ValueError(f"{path.name}: cannot tell how to declare {', '.join(missing)}")

    text = "\n\n".join("\n".join(lines) for lines in body)
    listed = ", ".join(f'"{name}"' for name in public)
    head = [
        f"# Written by `{COMMAND}` from tome_core/{module}.py: edit it, then rerun it.",
        f"# Editors and type checkers read this stub (the entry points' parameters: {SHARED}.pyi); at",
        "# runtime inspect.signature shows the same parameters.",
        "",
        *_typing(text),
        *([_import(f"tome_core.{SHARED}", list(dict.fromkeys(protocols)))] if protocols else []),
        *(_import(source, names) for source, names in imports.items() if names),
        "",
        *textwrap.wrap(f"__all__ = [{listed}]", WIDTH, subsequent_indent="    "),
    ]
    return "\n".join(head) + "\n\n" + text + "\n"


def stubs() -> Dict[pathlib.Path, str]:
    """Every stub the tool writes, by its path."""
    return {LIBRARY / f"{SHARED}.pyi": shared_stub(), **{LIBRARY / f"{m}.pyi": stub(m) for m in MODULES}}


def stale() -> List[pathlib.Path]:
    """The stubs that differ from what :func:`stubs` writes."""
    return [path for path, text in stubs().items() if not path.exists() or path.read_text() != text]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    args = parser.parse_args(argv)
    paths = stale()
    if args.check:
        for path in paths:
            print(f"stale: {path} (run `{COMMAND}`)")
        return 1 if paths else 0
    texts = stubs()
    for path in paths:
        path.write_text(texts[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
