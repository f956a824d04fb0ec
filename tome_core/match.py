"""Similarity and choice: bipartite soft matching of sources to destinations.

The result is a :class:`Match`, computed once per transformer block and used by every merge/unmerge in it:
``rows[b * N + i]`` is the row that original token ``i`` of batch item ``b`` goes to in the merged batch
flattened to ``[B * (N - r), C]`` (so merge and unmerge are one row scatter and one row gather), and
``sizes[b, k]`` how many original tokens slot ``k`` stands for. The merged sequence holds the unmerged sources (most
similar first, as tomesd orders them), then the destinations in grid order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .ops import Array, ArrayOps
from .partition import split


@dataclass(frozen=True)
class Match:
    """How the tokens of one block are merged. ``merged`` (r) is a Python int, so shapes stay static."""

    ops: ArrayOps
    rows: Optional[Array]  # [B * N] row of each token in the merged batch flattened to [B * (N - r), C]
    sizes: Optional[Array]  # [B, N - r, 1] tokens per slot, in the metric's dtype; None when nothing merges
    inverse_sizes: Optional[Array]  # 1 / sizes
    batch: int
    tokens: int  # N
    merged: int  # r

    @property
    def kept(self) -> int:
        """Length of the merged sequence, N - r."""
        return self.tokens - self.merged

    @property
    def slot(self) -> Optional[Array]:
        """``[B, N]``: each token's position in its own merged sequence."""
        if self.rows is None:
            return None
        ops = self.ops
        offsets = ops.reshape(ops.arange(self.batch, self.rows) * self.kept, (self.batch, 1))
        return ops.reshape(self.rows, (self.batch, self.tokens)) - offsets


def identity_match(ops: ArrayOps, batch: int, tokens: int) -> Match:
    """A match that merges nothing: merge and unmerge return their input unchanged."""
    return Match(ops=ops, rows=None, sizes=None, inverse_sizes=None, batch=batch, tokens=tokens, merged=0)


def cosine_scores(ops: ArrayOps, metric: Array, src: Array, dst: Array) -> Array:
    """Cosine similarity of every source token to every destination token: ``[B, S, D]``.

    A zero vector has similarity 0 to everything (tomesd would produce NaN there).
    """
    norm = ops.vector_norm(metric)
    unit = metric / ops.where(norm == 0, 1.0, norm)
    a = ops.take(unit, src, axis=1)
    b = ops.take(unit, dst, axis=1)
    return ops.matmul(a, ops.matrix_transpose(b))


def choose(ops: ArrayOps, scores: Array, merged: int) -> Tuple[Array, Array]:
    """Rank the sources by their best score and give each its slot.

    Returns ``order [B, S]`` (source indices, best matched first; a stable sort, so ties break by source
    order identically on every backend) and ``slot [B, S]`` of each ranked source: the first ``merged`` go
    to their best destination's slot, the rest keep slots of their own, in rank order.
    """
    _, num_src, _ = ops.shape(scores)
    kept_src = num_src - merged
    best, best_dst = ops.max_argmax(scores)
    order = ops.argsort_desc(best)
    rank = ops.reshape(ops.arange(num_src, order), (1, num_src))
    dst_of_ranked = ops.take_along_axis(best_dst, order, axis=1)
    return order, ops.where(rank >= merged, rank - merged, dst_of_ranked + kept_src)


def bipartite_match(
    ops: ArrayOps, metric: Array, h: int, w: int, sx: int, sy: int, merged: int, offsets: Optional[Array]
) -> Match:
    """Match the ``h*w`` tokens of ``metric`` ``[B, N, C]``, merging ``merged`` sources into destinations.

    ``offsets`` places the destination in each cell (see :func:`tome_core.partition.split`).
    ``merged`` must not exceed the number of sources; a grid with no full cell merges nothing.
    """
    batch, tokens, _ = ops.shape(metric)
    if h * w != tokens:
        raise ValueError(f"grid {h}x{w} has {h * w} tokens but the metric has {tokens}")
    if merged == 0 or (h // sy) * (w // sx) == 0:
        return identity_match(ops, batch, tokens)
    dst, src = split(ops, metric, h, w, sx, sy, offsets)
    num_dst, num_src = ops.shape(dst)[0], ops.shape(src)[0]
    if merged > num_src:
        raise ValueError(f"cannot merge {merged} of {num_src} source tokens")
    kept = tokens - merged

    order, ranked_slot = choose(ops, cosine_scores(ops, metric, src, dst), merged)
    ranked_token = ops.reshape(ops.take(src, ops.reshape(order, (batch * num_src,)), axis=0), (batch, num_src))
    dst_slot = ops.arange(num_dst, order) + (num_src - merged)
    token = ops.concat([ranked_token, ops.broadcast_to(ops.reshape(dst, (1, num_dst)), (batch, num_dst))], axis=1)
    row = ops.concat([ranked_slot, ops.broadcast_to(ops.reshape(dst_slot, (1, num_dst)), (batch, num_dst))], axis=1)
    row = row + ops.reshape(ops.arange(batch, order) * kept, (batch, 1))
    rows = ops.reshape(ops.scatter(ops.zeros((batch, tokens), order), token, row, axis=1), (batch * tokens,))
    sizes = ops.scatter_add(ops.zeros((batch * kept,), metric), rows, ops.ones((batch * tokens,), metric), axis=0)
    sizes = ops.reshape(sizes, (batch, kept, 1))
    return Match(
        ops=ops, rows=rows, sizes=sizes, inverse_sizes=1 / sizes, batch=batch, tokens=tokens, merged=merged
    )
