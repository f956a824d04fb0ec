"""Merge and unmerge: move a ``[B, N, C]`` sequence to the ``N - r`` slots of a :class:`Match` and back.

Merge is one segment sum over slots divided by the slot sizes (each destination becomes the mean of
itself and the sources merged into it); unmerge is one gather (every token takes its slot's value).
"""

from __future__ import annotations

from .match import Match
from .ops import Array


def merge(x: Array, match: Match) -> Array:
    """``[B, N, C] -> [B, N - r, C]``; the identity when nothing merges."""
    if match.merged == 0:
        return x
    ops = match.ops
    batch, tokens, channels = ops.shape(x)
    index = ops.broadcast_to(ops.reshape(match.slot, (batch, tokens, 1)), (batch, tokens, channels))
    summed = ops.scatter_add(ops.zeros((batch, match.kept, channels), x), index, x, axis=1)
    return summed / ops.astype_like(match.sizes, x)


def unmerge(x: Array, match: Match) -> Array:
    """``[B, N - r, C] -> [B, N, C]``; the identity when nothing merges."""
    if match.merged == 0:
        return x
    ops = match.ops
    batch, _, channels = ops.shape(x)
    index = ops.broadcast_to(ops.reshape(match.slot, (batch, match.tokens, 1)), (batch, match.tokens, channels))
    return ops.take_along_axis(x, index, axis=1)
