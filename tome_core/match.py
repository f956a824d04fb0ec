"""Similarity and choice: bipartite soft matching of sources to destinations.

The result is a :class:`Match`, computed once per transformer block and used by every merge/unmerge in it:
``slot[b, i]`` is the position in the merged sequence that original token ``i`` goes to, and ``sizes[b, k]``
how many original tokens slot ``k`` stands for. ``rows`` is the same map over the batch flattened into rows
(``b * (N - r) + slot[b, i]``), so merge and unmerge are single row scatters and gathers. The merged sequence holds the unmerged sources (most
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
    slot: Optional[Array]  # [B, N] index into the merged sequence; None when nothing merges
    rows: Optional[Array]  # [B * N] row of each token in the merged batch flattened to [B * (N - r), C]
    sizes: Optional[Array]  # [B, N - r, 1] tokens per slot, in the metric's dtype
    inverse_sizes: Optional[Array]  # 1 / sizes
    tokens: int  # N
    merged: int  # r

    @property
    def kept(self) -> int:
        """Length of the merged sequence, N - r."""
        return self.tokens - self.merged


def identity_match(ops: ArrayOps, tokens: int) -> Match:
    """A match that merges nothing: merge and unmerge return their input unchanged."""
    return Match(ops=ops, slot=None, rows=None, sizes=None, inverse_sizes=None, tokens=tokens, merged=0)


def cosine_scores(ops: ArrayOps, metric: Array, src: Array, dst: Array) -> Array:
    """Cosine similarity of every source token to every destination token: ``[B, S, D]``.

    A zero vector has similarity 0 to everything (tomesd would produce NaN there).
    """
    norm = ops.vector_norm(metric)
    unit = metric / ops.where(norm == 0, ops.ones((1,), norm), norm)
    a = ops.take(unit, src, axis=1)
    b = ops.take(unit, dst, axis=1)
    return ops.matmul(a, ops.matrix_transpose(b))


def choose(ops: ArrayOps, scores: Array, merged: int) -> Tuple[Array, Array]:
    """Slot of every source ``[B, S]``: the ``merged`` best-matched sources go to their best destination.

    Sources are ranked by their best score with a stable descending sort, so ties break by source order
    identically on every backend.
    """
    batch, num_src, _ = ops.shape(scores)
    kept_src = num_src - merged
    best, best_dst = ops.max_argmax(scores)
    order = ops.argsort_desc(best)
    rank = ops.reshape(ops.arange(num_src, scores), (1, num_src))
    dst_of_ranked = ops.take_along_axis(best_dst, order, axis=1)
    slot_of_ranked = ops.where(rank >= merged, rank - merged, dst_of_ranked + kept_src)
    src_slot = ops.scatter(ops.zeros((batch, num_src), order), order, slot_of_ranked, axis=1)
    return src_slot, kept_src


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
        return identity_match(ops, tokens)
    dst, src = split(ops, metric, h, w, sx, sy, offsets)
    num_dst = ops.shape(dst)[0]
    if merged > tokens - num_dst:
        raise ValueError(f"cannot merge {merged} of {tokens - num_dst} source tokens")

    src_slot, kept_src = choose(ops, cosine_scores(ops, metric, src, dst), merged)
    dst_slot = ops.broadcast_to(ops.reshape(ops.arange(num_dst, metric) + kept_src, (1, num_dst)), (batch, num_dst))
    position = ops.broadcast_to(ops.reshape(ops.concat([src, dst], axis=0), (1, tokens)), (batch, tokens))
    slot = ops.scatter(ops.zeros((batch, tokens), src_slot), position, ops.concat([src_slot, dst_slot], axis=1), axis=1)
    kept = tokens - merged
    sizes = ops.scatter_add(ops.zeros((batch, kept), metric), slot, ops.ones((batch, tokens), metric), axis=1)
    sizes = ops.reshape(sizes, (batch, kept, 1))
    rows = ops.reshape(slot + ops.reshape(ops.arange(batch, metric) * kept, (batch, 1)), (batch * tokens,))
    return Match(
        ops=ops, slot=slot, rows=rows, sizes=sizes, inverse_sizes=1 / sizes, tokens=tokens, merged=merged
    )
