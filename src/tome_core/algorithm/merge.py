"""Merge and unmerge: move a ``[B, N, C]`` sequence to the ``N - r`` slots of a :class:`Match` and back: a scatter-add
divided by the slot sizes (each slot the mean of its tokens) and a gather, both on the batch flattened into rows
(several times faster than along axis 1). Trailing feature axes (``[B, N, heads, d]``) are carried as one ``C``."""

from __future__ import annotations

import math
from typing import Callable

from .match import Match
from .ops import Array
from .partition import constant


def _features(x: Array, match: Match, moved: Callable[[Array, Match], Array]) -> Array:
    """``moved(x, match)`` on ``x`` ``[B, N, *features]`` seen as ``[B, N, C]``, its result given the features back."""
    ops = match.ops
    shape = ops.shape(x)
    if len(shape) == 3:
        return moved(x, match)
    out = moved(ops.reshape(x, (shape[0], shape[1], math.prod(shape[2:]))), match)
    rows, tokens = ops.shape(out)[:2]
    return ops.reshape(out, (rows, tokens, *shape[2:]))


def merge(x: Array, match: Match) -> Array:
    """``[B, N, C] -> [B, N - r, C]``; the identity when nothing merges. A cross-frame match (``frames = K``)
    takes ``[B * K, N / K, C]``: each chunk of ``K`` consecutive items is one sequence."""
    return x if match.merged == 0 else _features(x, match, _merge)


def _merge(x: Array, match: Match) -> Array:
    ops = match.ops
    batch, tokens, channels = ops.shape(x)
    if match.picked is not None:  # each slot is one token: a row gather
        picked = ops.take(ops.reshape(x, (batch * tokens, channels)), match.picked, axis=0)
        return ops.reshape(picked, (match.batch, match.kept, channels))
    if match.pool is not None:  # every token in a full cell: two strided means (rows, then columns), no scatter
        h, w, sx, sy = match.pool  # (one mean over both axes is ~15x slower on torch's CPU kernels)
        rows = ops.mean(ops.reshape(x, (batch, h // sy, sy, w * channels)), (2,))
        return ops.mean(ops.reshape(rows, (batch, match.kept, sx, channels)), (2,))
    index = ops.broadcast_to(ops.reshape(match.rows, (batch * tokens, 1)), (batch * tokens, channels))
    rows = ops.reshape(x, (batch * tokens, channels))
    summed = ops.scatter_add(constant(ops, x, 0, (match.batch * match.kept, channels)), index, rows, axis=0)
    return ops.reshape(summed, (match.batch, match.kept, channels)) / ops.astype_like(match.sizes, x)


def unmerge(x: Array, match: Match) -> Array:
    """``[B, N - r, C] -> [B, N, C]`` (``[B * K, N / K, C]`` for a cross-frame match); identity when nothing merges."""
    return x if match.merged == 0 else _features(x, match, _unmerge)


def _unmerge(x: Array, match: Match) -> Array:
    ops = match.ops
    batch, kept, channels = ops.shape(x)
    rows = ops.take(ops.reshape(x, (batch * kept, channels)), match.rows, axis=0)
    return ops.reshape(rows, (batch * match.frames, match.tokens // match.frames, channels))


def size_bias(match: Match, like: Array) -> Array:
    """``[B, 1, N - r]``: log of how many tokens each merged key stands for, in ``like``'s dtype: added to attention
    logits, attention over the merged keys equals attention over all N keys (proportional attention, ToMe eq. 1)."""
    ops = match.ops
    return ops.reshape(ops.log(ops.astype_like(match.sizes, like)), (match.batch, 1, match.kept))
