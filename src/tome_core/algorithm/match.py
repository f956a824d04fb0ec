"""Similarity and choice: ToMe for SD's bipartite soft matching (arXiv 2303.17604) of sources to destinations, one
:class:`Match` per block for all its merges and unmerges. A run finds its matches through a :class:`Matcher`, ToMe's
own (:data:`TOME`) unless its caller plugs in another."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from ..config import ToMeConfig
from .ops import Array, ArrayOps
from .partition import Band, Draw, Partition, cached, cell_table, constant, partition_grid


@dataclass(frozen=True)
class Match:
    """How the tokens of one block are merged: ``rows`` maps each token to its slot's row in the merged batch, so
    merge and unmerge are one row scatter and one row gather. ``merged`` (r) is a Python int: shapes stay static."""

    ops: ArrayOps
    rows: Optional[Array]  # [B * N] row of each token in the merged batch flattened to [B * (N - r), C]
    sizes: Optional[Array]  # [B, N - r, 1] tokens per slot, in the metric's dtype; None when nothing merges
    batch: int
    tokens: int  # N
    merged: int  # r
    representatives: Optional[Array] = None  # [B, N - r] the token each slot stands at (its destination)
    pool: Optional[Tuple[int, int, int, int]] = None  # (h, w, sx, sy) when the match is exact sx*sy pooling
    frames: int = 1  # K > 1: a cross-frame match; its input [B * K, N / K, C] is read as [B, N, C] chunks
    picked: Optional[Array] = None  # [B * (N - r)] when each slot takes one token's value: the row of that token
    # (before, after): tokens around the grid's, each its own slot, that N counts: a match over the whole sequence
    # [before; grid; after] a sub-layer runs on merges and unmerges it with no concatenation
    joined: Tuple[int, int] = (0, 0)

    @property
    def kept(self) -> int:
        """Length of the merged sequence, N - r."""
        return self.tokens - self.merged

    @property
    def grid_tokens(self) -> Tuple[int, int]:
        """``(tokens, kept)`` of the grid's alone: without the :attr:`joined` tokens around it."""
        around = sum(self.joined)
        return self.tokens - around, self.kept - around

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
    return Match(ops=ops, rows=None, sizes=None, batch=batch, tokens=tokens, merged=0)


SIMILARITY_BLOCK = 2**24
"""Most entries of one source-by-destination similarity block per batch item (64 MiB in float32); above it
:func:`best_destinations` takes the sources in chunks. How this size was chosen: ``docs/how-it-works.md``."""


def best_destinations(
    ops: ArrayOps, metric: Array, src: Array, dst: Array, neighbours: Optional[Array] = None,
    block: Optional[int] = None, bands: Optional[Sequence[Band]] = None, order: Optional[Array] = None,
) -> Tuple[Array, Array]:
    """Each source's highest cosine similarity to a destination and that destination, ``[B, S]`` twice (a zero vector:
    0 to everything, where tomesd gives NaN). ``neighbours [S, W]`` limits each source to those destinations (local
    matching), ``bands`` (:func:`~tome_core.algorithm.partition.frame_bands`) each run of sources to a run of
    destinations; ``order``: ``src`` and ``dst`` end to end (:attr:`Partition.order`), gathered at once.

    Sources go in equal chunks (a Python count, unrolled under compilers) of at most ``block`` similarities per batch
    item (``None``: :data:`SIMILARITY_BLOCK`), so memory stays linear in tokens. A BLAS may round a chunk's rows unlike
    the full product's: destinations within rounding may swap, as between backends; exact ties go to the first.
    """
    unit = ops.unit_vectors(metric)
    num_src, num_dst = ops.shape(src)[0], ops.shape(dst)[0]
    if neighbours is not None:  # one candidate per source at a time: no [S, W, C] gather
        a, b = ops.take(unit, src, axis=1), ops.take(unit, dst, axis=1)
        best = which = None
        for k in range(ops.shape(neighbours)[1]):
            candidate = neighbours[:, k]
            score = ops.mean(a * ops.take(b, candidate, axis=1), (2,))
            if best is None:
                best, which = score, ops.broadcast_to(ops.reshape(candidate, (1, -1)), ops.shape(score))
            else:
                better = score > best  # strictly: the first of equal candidates wins, as an argmax
                best, which = ops.where(better, score, best), ops.where(better, ops.reshape(candidate, (1, -1)), which)
        return best, which
    limit = SIMILARITY_BLOCK if block is None else block
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"block must be an int >= 1 (similarity entries per batch item), got {limit!r}")
    if order is not None:
        both = ops.take(unit, order, axis=1)
        a, b = both[:, :num_src], both[:, num_src:]
    else:
        a, b = None, ops.take(unit, dst, axis=1)
    b_t = ops.aligned_columns(ops.matrix_transpose(b))
    parts = []
    for first, end, low, high in bands or ((0, num_src, 0, num_dst),):
        chunks = -(-(end - first) // max(1, limit // max(1, high - low)))  # ceil(sources / rows that fit)
        rows = -(-(end - first) // chunks)  # equal chunks, the last one shorter
        for start in range(first, end, rows):
            whole, cut = rows >= num_src, slice(start, min(start + rows, end))  # whole: one product over every source
            sources = ops.take(unit, src if whole else src[cut], axis=1) if a is None else a if whole else a[:, cut]
            if (low, high) == (0, num_dst):  # every destination: the aligned product, cut back
                best, which = ops.max_argmax(ops.matmul(sources, b_t)[..., :num_dst])
            else:
                best, which = ops.max_argmax(ops.matmul(sources, b_t[..., low:high]))
                which = which + low if low else which
            parts.append((best, which))
    if len(parts) == 1:
        return parts[0]
    return ops.concat([best for best, _ in parts], axis=1), ops.concat([which for _, which in parts], axis=1)


def batch_as_channels(ops: ArrayOps, metric: Array) -> Array:
    """``[B, N, C] -> [1, N, B*C]``: each token's per-item unit vectors side by side, so that the cosine similarity
    of two tokens is the mean of their per-item ones. One item is returned as it is."""
    batch, tokens, channels = ops.shape(metric)
    if batch == 1:
        return metric
    unit = ops.unit_vectors(metric)
    per_token = ops.reshape(ops.matrix_transpose(ops.reshape(unit, (batch, tokens * channels))), (tokens, channels * batch))
    return ops.reshape(per_token, (1, tokens, channels * batch))


def rank_sources(ops: ArrayOps, best: Array) -> Array:
    """Source indices ``[B, S]``, best matched first: a stable sort, so ties break by source order on every backend."""
    return ops.argsort_desc(best)


def assign(
    ops: ArrayOps, order: Array, best_dst: Array, src: Array, dst: Array, merged: int, like: Array,
    dst_slot: Optional[Array] = None, dst_kept: int = 0, frames: int = 1,
) -> Match:
    """The match that merges the first ``merged`` ranked sources into their best destinations. Slots: kept sources
    in rank order, then the destinations in cell order, or with ``dst_slot [B, D]`` destination ``j`` in slot
    ``dst_slot[b, j]`` of ``dst_kept`` (the match then records no :attr:`Match.representatives`)."""
    batch, num_src = ops.shape(order)
    num_dst = ops.shape(dst)[0]
    tokens = num_src + num_dst
    kept = num_src - merged + (num_dst if dst_slot is None else dst_kept)
    rank = ops.reshape(ops.arange(num_src, order), (1, num_src))
    dst_of_ranked = ops.take_along_axis(best_dst, order, axis=1)
    dst_tokens = ops.broadcast_to(ops.reshape(dst, (1, num_dst)), (batch, num_dst))
    if dst_slot is None:
        own = ops.arange(num_dst, order) + (num_src - merged)
        dst_row = ops.broadcast_to(ops.reshape(own, (1, num_dst)), (batch, num_dst))
    else:
        dst_of_ranked = ops.take_along_axis(dst_slot, dst_of_ranked, axis=1)
        dst_row = dst_slot + (num_src - merged)
    ranked_slot = ops.where(rank >= merged, rank - merged, dst_of_ranked + (num_src - merged))
    ranked_token = ops.reshape(ops.take(src, ops.reshape(order, (batch * num_src,)), axis=0), (batch, num_src))
    token = ops.concat([ranked_token, dst_tokens], axis=1)
    row = ops.concat([ranked_slot, dst_row], axis=1)
    row = row + ops.reshape(ops.arange(batch, order) * kept, (batch, 1))
    rows = ops.reshape(ops.scatter(ops.zeros((batch, tokens), order), token, row, axis=1), (batch * tokens,))
    sizes = ops.scatter_add(ops.zeros((batch * kept,), like), rows, ops.ones((batch * tokens,), like), axis=0)
    sizes = ops.reshape(sizes, (batch, kept, 1))
    representatives = None
    if dst_slot is None:
        kept_sources = ops.take(ranked_token, ops.arange(num_src - merged, order) + merged, axis=1)
        representatives = ops.concat([kept_sources, dst_tokens], axis=1)
    return Match(
        ops=ops, rows=rows, sizes=sizes, batch=batch, tokens=tokens, merged=tokens - kept,
        representatives=representatives, frames=frames,
    )


def bipartite_matches(
    ops: ArrayOps, metric: Array, h: int, w: int, sx: int, sy: int, merged: Sequence[int], offsets: Optional[Array],
    window: int = 0, shared: bool = False,
) -> List[Match]:
    """One :class:`Match` of the ``h*w`` tokens of ``metric`` ``[B, N, C]`` per count of ``merged`` sources, from
    one similarity and ranking. ``offsets``: each cell's destination (:func:`~tome_core.algorithm.partition.split`);
    ``window > 0``: sources meet only destinations within ``window`` cells; ``shared``: one match for the whole
    batch, by the similarity summed over it (one position per merged token, as rotary embeddings need)."""
    part = partition_grid(ops, metric, h, w, sx, sy, offsets=offsets, window=window)
    return partition_bipartite(ops, metric, part, merged, shared)


def partition_bipartite(
    ops: ArrayOps, metric: Array, part: Partition, merged: Sequence[int], shared: bool = False, represent: bool = True,
) -> List[Match]:
    """:func:`bipartite_matches` on a drawn :class:`~tome_core.algorithm.partition.Partition`. ``represent=False``
    lets a partition from the tables skip :attr:`Match.representatives` (what rotary positions and masks follow)."""
    batch, tokens, _ = ops.shape(metric)
    if part.h * part.w != tokens:
        raise ValueError(f"grid {part.h}x{part.w} has {part.h * part.w} tokens but the metric has {tokens}")
    if not any(merged) or not part.full_cells:
        return [identity_match(ops, batch, tokens) for _ in merged]
    dst, src, num_src = part.dst, part.src, ops.shape(part.src)[0]
    if max(merged) > num_src:
        raise ValueError(f"cannot merge {max(merged)} of {num_src} source tokens")
    best, best_dst = best_destinations(
        ops, batch_as_channels(ops, metric) if shared else metric, src, dst, part.neighbours, bands=part.bands,
        order=part.order,
    )
    order = rank_sources(ops, best)
    if shared and batch > 1:
        order, best_dst = (ops.broadcast_to(a, (batch, num_src)) for a in (order, best_dst))
    matches: Dict[int, Match] = {0: identity_match(ops, batch, tokens)}  # one per count
    for count in merged:
        if count not in matches and part.dst_slot is not None:
            matches[count] = _assign_drawn(ops, order, best_dst, part, count, metric, represent)
        elif count not in matches:
            matches[count] = assign(ops, order, best_dst, src, dst, count, metric)
    return [matches[count] for count in merged]


def _assign_drawn(
    ops: ArrayOps, order: Array, best_dst: Array, part: Partition, merged: int, like: Array, represent: bool
) -> Match:
    """:func:`assign` on a partition from the tables in the fewest launches: one scatter of the ranked sources'
    slots into its ``dst_slot``, every shape-only array kept (:func:`~tome_core.algorithm.partition.cached`)."""
    batch, num_src = ops.shape(order)
    before, after = part.around
    tokens = before + part.h * part.w + after
    kept = tokens - merged
    stays = num_src - merged
    # slots counted from the first destination's (so that the merged sources' are their destinations' places),
    # then moved by it and by each batch item's first row
    into = ops.take_along_axis(best_dst, order[:, :merged], axis=1)
    if stays:
        kept_slots = cached(ops, order, ("kept slots", batch, num_src, merged), lambda: ops.broadcast_to(
            ops.reshape(ops.arange(stays, order) - stays, (1, stays)), (batch, stays)
        ))
        into = ops.concat([into, kept_slots], axis=1)
    placed = part.order if part.placed is None else part.placed  # sources, then destinations
    token = ops.reshape(ops.take(placed[:num_src], ops.reshape(order, (batch * num_src,)), axis=0), (batch, num_src))

    def first_rows():  # the tokens before the grid's stay in front, in their own slots
        item = ops.reshape(ops.arange(batch, order) * kept, (batch, 1))
        position = ops.reshape(ops.arange(tokens, order), (1, tokens))
        return item + (ops.where(position < before, position, before + stays) if before else stays)
    first_rows = cached(ops, order, ("first rows", batch, kept, stays, before), first_rows)
    slots = ops.broadcast_to(ops.reshape(part.dst_slot, (1, tokens)), (batch, tokens))
    rows = ops.reshape(ops.scatter(slots, token, into, axis=1) + first_rows, (batch * tokens,))
    ones = constant(ops, like, 1, (batch * tokens,))
    sizes = ops.reshape(ops.scatter_add(constant(ops, like, 0, (batch * kept,)), rows, ones, axis=0), (batch, kept, 1))
    representatives = None
    if represent:
        num_dst = part.h * part.w - num_src
        ids = lambda start, count: [ops.broadcast_to(  # noqa: E731
            ops.reshape(ops.arange(count, order) + start, (1, count)), (batch, count)
        )] if count else []
        front, back = cached(ops, order, ("around", batch, before, tokens, after), lambda: (ids(0, before), ids(tokens - after, after)))
        dst = ops.broadcast_to(ops.reshape(placed[num_src:], (1, num_dst)), (batch, num_dst))
        representatives = ops.concat(front + [token[:, merged:], dst] + back, axis=1)
    return Match(
        ops=ops, rows=rows, sizes=sizes, batch=batch, tokens=tokens, merged=merged, representatives=representatives,
        joined=part.around,
    )


def chunk_matches(
    ops: ArrayOps, metric: Array, frames: int, reference: Array, h: int, w: int, sx: int, sy: int,
    within: Sequence[int], across: int, offsets: Optional[Array], window: int = 0,
) -> List[Match]:
    """Cross-frame matches (VidToMe's arrangement) of ``metric`` ``[B * K, N, C]`` in chunks of ``K = frames`` frames,
    one per count of ``within``: the ``across`` other-frame tokens most similar to a token of frame ``reference`` (an
    int or a 1-element index array) join its slot, and the reference frame is matched as one frame
    (:func:`bipartite_matches`). Slots: the other frames' kept tokens, most similar first, then the reference's."""
    part = partition_grid(ops, metric, h, w, sx, sy, offsets=offsets, window=window, frames=frames, reference=reference)
    return partition_chunks(ops, metric, part, within, across)


def partition_chunks(ops: ArrayOps, metric: Array, part: Partition, within: Sequence[int], across: int) -> List[Match]:
    """:func:`chunk_matches` on a drawn :class:`~tome_core.algorithm.partition.Partition`."""
    frames, reference = part.frames, part.reference
    batch_frames, tokens, channels = ops.shape(metric)
    if batch_frames % frames:
        raise ValueError(f"a batch of {batch_frames} frames does not split into chunks of {frames}")
    if across > (frames - 1) * tokens:
        raise ValueError(f"cannot merge {across} of the {(frames - 1) * tokens} tokens of the other frames")
    batch, num_src = batch_frames // frames, (frames - 1) * tokens
    chunk = ops.reshape(metric, (batch, frames * tokens, channels))
    position = ops.arange(tokens, metric)
    ref = position + reference * tokens
    other_frame = ops.arange(frames - 1, metric)
    other_frame = other_frame + ops.as_index(other_frame >= reference)
    src = ops.reshape(ops.reshape(other_frame * tokens, (frames - 1, 1)) + ops.reshape(position, (1, tokens)), (num_src,))
    reference_matches = partition_bipartite(ops, ops.take(chunk, ref, axis=1), part, within)
    if across:
        near = None
        if part.window:  # each reference token's nearby tokens, for every other frame
            width = ops.shape(part.nearby)[1]
            near = ops.broadcast_to(ops.reshape(part.nearby, (1, tokens, width)), (frames - 1, tokens, width))
            near = ops.reshape(near, (num_src, width))
        best, best_dst = best_destinations(ops, chunk, src, ref, near)
        order = rank_sources(ops, best)
    else:  # nothing crosses frames: every other-frame token keeps its own slot
        order = ops.broadcast_to(ops.reshape(ops.arange(num_src, metric), (1, num_src)), (batch, num_src))
        best_dst = order * 0
    return [
        assign(ops, order, best_dst, src, ref, across, metric, match.slot, match.kept, frames)
        if across or match.merged else identity_match(ops, batch_frames, tokens)
        for match in reference_matches
    ]


def cell_match(ops: ArrayOps, like: Array, batch: int, h: int, w: int, sx: int, sy: int) -> Match:
    """Every token of an ``h x w`` grid joins its own ``sx x sy`` cell (average pooling); leftover tokens stay.
    Slots: the cells in row-major order, then the leftover tokens."""
    return partition_pooled(ops, like, batch, partition_grid(ops, like, h, w, sx, sy, similarity=False, picks=False))


def partition_pooled(ops: ArrayOps, like: Array, batch: int, part: Partition) -> Match:
    """:func:`cell_match` on a drawn :class:`~tome_core.algorithm.partition.Partition` (its cells)."""
    if not part.full_cells or part.sx * part.sy == 1:
        return identity_match(ops, batch, part.h * part.w)
    key = ("match", "cell match", batch, part.h, part.w, part.sx, part.sy)  # shapes only: built once per device
    return cached(ops, like, key, lambda: _pooled(ops, like, batch, part))


def build_cell_match(ops: ArrayOps, like: Array, batch: int, h: int, w: int, sx: int, sy: int) -> Match:
    """:func:`cell_match` without its cache: the match built anew, as on a call's first meeting of its shape."""
    return _pooled(ops, like, batch, Partition(h, w, sx, sy, *cell_table(ops, like, h, w, sx, sy)))


def _pooled(ops: ArrayOps, like: Array, batch: int, part: Partition) -> Match:
    cells, leftover = part.cells, part.leftover
    num_cells, per_cell = ops.shape(cells)
    num_left = 0 if leftover is None else ops.shape(leftover)[0]
    kept, tokens = num_cells + num_left, part.h * part.w
    token, slot = ops.reshape(cells, (tokens - num_left,)), ops.arange(tokens - num_left, cells) // per_cell
    representatives = ops.reshape(ops.take(cells, ops.zeros((1,), cells), axis=1), (num_cells,))
    sizes = ops.ones((num_cells,), like) * per_cell
    if leftover is not None:
        token = ops.concat([token, leftover], axis=0)
        slot = ops.concat([slot, ops.arange(num_left, cells) + num_cells], axis=0)
        representatives = ops.concat([representatives, leftover], axis=0)
        sizes = ops.concat([sizes, ops.ones((num_left,), like)], axis=0)
    slot_of_token = ops.scatter(ops.zeros((tokens,), cells), token, slot, axis=0)
    offsets = ops.reshape(ops.arange(batch, cells) * kept, (batch, 1))
    rows = ops.reshape(ops.reshape(slot_of_token, (1, tokens)) + offsets, (batch * tokens,))
    sizes = ops.broadcast_to(ops.reshape(sizes, (1, kept, 1)), (batch, kept, 1))
    return Match(
        ops=ops, rows=rows, sizes=sizes, batch=batch, tokens=tokens, merged=tokens - kept,
        representatives=ops.broadcast_to(ops.reshape(representatives, (1, kept)), (batch, kept)),
        pool=(part.h, part.w, part.sx, part.sy) if leftover is None else None,
    )


def sampled_cell_match(
    ops: ArrayOps, like: Array, batch: int, h: int, w: int, sx: int, sy: int, offsets: Optional[Array]
) -> Match:
    """:func:`cell_match` with each cell standing as one of its tokens (``offsets [h//sy, w//sx]``, its position in
    the cell; ``None``: the first) instead of their mean: drawn per call, an unbiased sample where a mean is biased."""
    return partition_sampled(ops, like, batch, partition_grid(ops, like, h, w, sx, sy, similarity=False, offsets=offsets))


def partition_sampled(ops: ArrayOps, like: Array, batch: int, part: Partition) -> Match:
    """:func:`sampled_cell_match` on a drawn :class:`~tome_core.algorithm.partition.Partition`."""
    pooled = partition_pooled(ops, like, batch, part)
    if pooled.merged == 0:
        return pooled
    if part.picked is not None:  # from the tables
        tokens = part.picked
    else:
        cells, leftover = part.cells, part.leftover
        num_cells = ops.shape(cells)[0]
        offsets = ops.zeros((num_cells, 1), cells) if part.offsets is None else ops.reshape(part.offsets, (num_cells, 1))
        tokens = ops.reshape(ops.take_along_axis(cells, offsets, axis=1), (num_cells,))
        if leftover is not None:
            tokens = ops.concat([tokens, leftover], axis=0)
    first_rows = cached(ops, tokens, ("first rows", batch, pooled.tokens, 0), lambda: ops.reshape(
        ops.arange(batch, tokens) * pooled.tokens, (batch, 1)
    ))
    tokens = ops.reshape(tokens, (1, pooled.kept))
    rows = ops.reshape(tokens + first_rows, (batch * pooled.kept,))
    return replace(pooled, representatives=ops.broadcast_to(tokens, (batch, pooled.kept)), pool=None, picked=rows)


def bipartite_match(
    ops: ArrayOps, metric: Array, h: int, w: int, sx: int, sy: int, merged: int, offsets: Optional[Array], window: int = 0,
) -> Match:
    """:func:`bipartite_matches` for a single count ``merged``."""
    return bipartite_matches(ops, metric, h, w, sx, sy, [merged], offsets, window)[0]


def match_block(
    ops: ArrayOps, metric: Array, part: Optional[Partition], merged: Dict[str, int], *, matching: str = "similarity",
    cell_pool: str = "mean", across: int = 0, shared: bool = False,
) -> Dict[str, Match]:
    """One match per sub-layer of ``merged`` (how many tokens of ``metric`` each merges) on the block's partition
    ``part`` (None: nothing merges): pooled (``matching="cell"``, :func:`cell_match` or with ``cell_pool="sample"``
    :func:`sampled_cell_match`) or by similarity (:func:`bipartite_matches`, :func:`chunk_matches` where
    ``part.frames > 1``)."""
    batch, tokens = ops.shape(metric)[:2]
    if part is None:
        return dict.fromkeys(merged, identity_match(ops, batch, tokens))
    if matching == "cell":
        found = (partition_sampled if cell_pool == "sample" else partition_pooled)(ops, metric, batch, part)
        return {sublayer: found if count else identity_match(ops, batch, tokens) for sublayer, count in merged.items()}
    if part.frames > 1:
        return dict(zip(merged, partition_chunks(ops, metric, part, list(merged.values()), across)))
    return dict(zip(merged, partition_bipartite(ops, metric, part, list(merged.values()), shared, represent=shared)))


class Matcher(Protocol):
    """How a run finds each block's matches: the seam where another way of choosing tokens plugs in
    (:attr:`Matching.matcher <tome_core.hooks.matching.Matching.matcher>`). The run decides the rest (blocks, levels,
    counts, arrangement) and calls it once per merging block; :data:`TOME` is ToMe's own."""

    sized: bool  # a slot may stand for several tokens: size-aware attention weighs them (False: never armed)

    def __call__(
        self, ops: ArrayOps, metric: Array, grid: Optional[Tuple[int, int]], cell: Tuple[int, int],
        merged: Dict[str, int], config: ToMeConfig, draw: Optional[Draw], across: int, shared: bool, frames: int,
        video: Tuple[int, int], around: Tuple[int, int] = (0, 0),
    ) -> Dict[str, Match]:
        """One match per sub-layer of ``merged``, each merging that many tokens of ``metric`` on a ``grid`` ``(h, w)``
        (None: nothing merges) of ``cell`` ``(sx, sy)`` cells; ``draw``: the call's partitions (None: fixed);
        ``frames``, ``across``: cross-frame chunks; ``video``: ``(frame_rows, frame_offset)`` of stacked frames;
        ``around``: ``(before, after)`` tokens around the grid's in what the sub-layers run on, passed where not
        ``(0, 0)``: a match may carry them (:attr:`Match.joined`) or cover the grid alone."""


class ToMeMatcher:
    """ToMe's :class:`Matcher`: :func:`~tome_core.algorithm.partition.partition_grid`, then :func:`match_block`."""

    sized = True

    def __call__(
        self, ops: ArrayOps, metric: Array, grid: Optional[Tuple[int, int]], cell: Tuple[int, int],
        merged: Dict[str, int], config: ToMeConfig, draw: Optional[Draw], across: int, shared: bool, frames: int,
        video: Tuple[int, int], around: Tuple[int, int] = (0, 0),
    ) -> Dict[str, Match]:
        similarity = config.matching == "similarity"
        part = None if grid is None else partition_grid(
            ops, metric, *grid, *cell, draw, similarity=similarity, picks=similarity or config.cell_pool == "sample",
            window=config.local_window, frames=frames if similarity else 1, frame_rows=video[0],
            frame_offset=video[1], frame_window=config.frame_window, around=around,
        )
        return match_block(
            ops, metric, part, merged, matching=config.matching, cell_pool=config.cell_pool, across=across,
            shared=shared,
        )


TOME = ToMeMatcher()
"""ToMe's own :class:`Matcher`, every run state's unless its caller sets another."""
