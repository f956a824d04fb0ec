"""Where the ``kv`` and ``queries`` arrangements can run: they hand a self-attention keys and values apart from its
queries, which only some attentions take (``kv`` also runs inside the attention kernel of others, where the
framework reaches it). Read at ``patch`` and as each block starts. Framework-free."""

from __future__ import annotations

from typing import Any, Optional

from ..framework import Framework
from .families import Sublayer, TEXT_NONE, attends_text_only


def arrangement_problem(fw: Framework, block: Any, sublayer: Sublayer, module: Any, mode: str = "kv", kernel: bool = True) -> Optional[str]:
    """Why a self-attention cannot run the ``kv`` or ``queries`` arrangement (``mode``) now, or None: where it takes
    no keys and values through its ``kv_input``, ``kv`` can still merge them inside its attention kernel
    (:func:`kv_in_kernel`) when ``kernel`` allows it and the framework can."""
    problem = _separate_kv_problem(fw, block, sublayer, module)
    if problem is None or not kernel or mode != "kv" or sublayer.projections or attends_text_only(block, sublayer):
        return problem
    inside = fw.kernel_keys_problem(module)
    return None if inside is None else f"{problem}, and {inside}"


def kv_in_kernel(fw: Framework, sublayer: Sublayer, module: Any) -> bool:
    """Whether the ``kv`` arrangement of this self-attention, which :func:`arrangement_problem` let run, merges its
    keys and values inside its attention kernel: it has no ``kv_input``, or its processor takes no keys from it."""
    return sublayer.kv_input is None or not fw.separate_kv(module)


def _separate_kv_problem(fw: Framework, block: Any, sublayer: Sublayer, module: Any) -> Optional[str]:
    where = lambda: f"{type(block).__name__}.{sublayer.child}"  # noqa: E731 (formatted only for a problem)
    if sublayer.projections:
        if fw.separate_kv(module):
            return None
        return (
            f"{where()}'s processor {type(getattr(module, 'processor', None)).__name__} does not run its query, key "
            f"and value projections ({', '.join(sublayer.projections[:3])}) apart, where ToMe merges"
        )
    if sublayer.kv_input is None:
        if sublayer.text != TEXT_NONE:
            return f"{where()} runs joint attention over text and image tokens"
        return f"{where()} takes no keys and values apart from its queries"
    if attends_text_only(block, sublayer):
        return f"{where()} attends to the text ({sublayer.text_if or sublayer.text_unless}={bool(sublayer.text_if)}), not to its own tokens"
    if not fw.separate_kv(module):
        processor = type(getattr(module, "processor", None)).__name__
        return (
            f"{where()}'s processor {processor} does not compute keys and values from {sublayer.kv_input} "
            "(fused projections, perturbed-attention guidance, or a processor of its own)"
        )
    return None


def arrangement_error(mode: str, where: str, problem: str) -> ValueError:
    """The error for an explicit ``kv`` or ``queries`` ``mode`` that a self-attention in ``where`` cannot run."""
    return ValueError(
        f"mode={mode!r} needs self-attention that takes keys and values apart from its queries"
        f"{' (or whose attention kernel ToMe reaches)' if mode == 'kv' else ''}, and in {where} "
        f"{problem}; pass mode='tokens' there, or leave mode out (the default runs ToMe for SD's arrangement where "
        "kv cannot run)"
    )
