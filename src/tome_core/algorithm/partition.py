"""Partition: which tokens of an h x w grid are destinations (one per full sy x sx cell, row-major) and which are
sources (the rest, leftover rows and columns included). Index arithmetic only, never a sort: every backend produces
the same split. A video searched within a frame window is tiled frame by frame (a :data:`Tiling`)."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from .ops import Array, ArrayOps

# A small prime keeps every product below 2**31, so the hash is identical in int32 (jax) and int64.
_PRIME = 32749
_MIX = (1103, 2713, 9007, 17393)  # key mixing; the last two also scramble each cell
_CACHE: "OrderedDict[Tuple, Any]" = OrderedDict()
_CACHE_SIZE = 128


Tiling = Tuple[int, ...]
"""The rows of each band a grid is tiled in on its own, top to bottom (:func:`frame_search`); None: one band."""


def num_cells(h: int, w: int, sx: int, sy: int, tiling: Optional[Tiling] = None) -> int:
    """Number of destinations: one per full sy x sx cell (of each band of rows of ``tiling``)."""
    return sum(rows // sy for rows in tiling or (h,)) * (w // sx)


def random_offsets(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int, step: Union[int, Array],
    stream: Union[int, Array],
) -> Array:
    """Destination position inside each cell, in ``[0, sx*sy)``, shape ``[h//sy, w//sx]`` (``[S, h//sy, w//sx]``
    for an array of ``S`` streams): a counter-based hash of (seed, step, stream, cell), the same on every backend;
    ``step`` may be a traced or on-device number (read without a host sync), steps 1/1000 apart differ."""
    hsy, wsx = h // sy, w // sx
    several = not isinstance(stream, int)
    key = (stream % _PRIME + (seed % _PRIME) * _MIX[0] % _PRIME) * _MIX[1] % _PRIME
    if several:  # an array of streams: one row of cells each
        key = ops.reshape(key, (-1, 1))
    # Flow-matching transformers (Flux) pass fractional timesteps in [0, 1]: the hash takes floor(1000 * t).
    # Computed as (floor(t) mod p) * 1000 + the fraction's thousandths, so that int32 never overflows.
    floor = math.floor if isinstance(step, (int, float)) else ops.as_index
    whole = floor(step)
    step = ((whole % _PRIME) * 1000 + floor((step - whole) * 1000)) % _PRIME
    x = (step + key) * _MIX[2] % _PRIME
    x = _scramble((x + ops.arange(hsy * wsx, like)) % _PRIME)  # one hash per cell
    # The seed's higher digits in base p, each mixed in by a further round (none for seeds below p), so that
    # distinct seeds give distinct partitions far beyond p (every seed below p**3 > 2**45 has its own digits).
    high = seed // _PRIME
    while high:
        x = _scramble((x + (high % _PRIME) * _MIX[0] % _PRIME) % _PRIME)
        high //= _PRIME
    return ops.reshape(x % (sx * sy), (-1, hsy, wsx) if several else (hsy, wsx))


def _scramble(x: Array) -> Array:
    """Two rounds of a quadratic mix modulo p (every intermediate below 2**31)."""
    for mix in _MIX[2:]:
        x = (x * x % _PRIME + mix) * mix % _PRIME
    return x


def cell_table(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, tiling: Optional[Tiling] = None
) -> Tuple[Array, Optional[Array]]:
    """Token index of every position of every cell ``[cells, sx*sy]`` (row-major inside the cell), and the tokens
    outside the full cells (leftover columns, then rows; ``None``: none), band by band for a ``tiling``."""
    tiles, first = [], 0
    for rows in tiling or (h,):
        tiles.append(_tile(ops, like, rows, w, sx, sy, first * w))
        first += rows
    if len(tiles) == 1:
        return tiles[0]
    leftovers = [leftover for _, leftover in tiles if leftover is not None]
    cells = ops.concat([cells for cells, _ in tiles], axis=0)
    return cells, ops.concat(leftovers, axis=0) if leftovers else None


def _tile(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, start: int) -> Tuple[Array, Optional[Array]]:
    """:func:`cell_table` of ``h`` rows of a ``w``-wide grid whose first token is ``start``."""
    hsy, wsx = h // sy, w // sx
    per_cell = sx * sy
    rows = ops.reshape(ops.arange(hsy, like) * (sy * w) + start, (hsy, 1, 1))
    cols = ops.reshape(ops.arange(wsx, like) * sx, (1, wsx, 1))
    position = ops.arange(per_cell, like)
    inside = ops.reshape((position // sx) * w + position % sx, (1, 1, per_cell))
    cells = ops.reshape(rows + cols + inside, (hsy * wsx, per_cell))
    pieces = []
    if wsx * sx < w:
        right = ops.reshape(ops.arange(hsy * sy, like) * w + start, (hsy * sy, 1)) + ops.reshape(
            ops.arange(w - wsx * sx, like) + wsx * sx, (1, w - wsx * sx)
        )
        pieces.append(ops.reshape(right, ((hsy * sy) * (w - wsx * sx),)))
    if hsy * sy < h:
        pieces.append(ops.arange((h - hsy * sy) * w, like) + (hsy * sy * w + start))
    return cells, None if not pieces else pieces[0] if len(pieces) == 1 else ops.concat(pieces, axis=0)


def cached(ops: ArrayOps, like: Array, key: Tuple, build: Callable[[], Any]) -> Any:
    """``build()``, kept per backend and device where the backend allows it (the :data:`_CACHE_SIZE` newest): index
    arrays of shapes and seed alone, so that a call launches only its own arithmetic (``docs/results/launches.md``)."""
    device = ops.cache_key(like)
    if device is None:
        return build()
    key = (ops.name, device) + key
    value = _CACHE.get(key)
    if value is None:
        value = _CACHE[key] = build()
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return value


def constant(ops: ArrayOps, like: Array, value: int, shape: Sequence[int]) -> Array:
    """``value`` in ``like``'s dtype as an array of ``shape``: one kept element broadcast (a view), so that nothing is
    filled in a call (an out-of-place scatter copies its target once anyway)."""
    key = ("constant", value, str(getattr(like, "dtype", "")))
    return ops.broadcast_to(cached(ops, like, key, lambda: ops.zeros((1,), like) + value), tuple(shape))


def forget_tables() -> None:
    """Drop the arrays :func:`cached` keeps (``remove`` does, so that an unpatched model holds nothing of ToMe)."""
    _CACHE.clear()


def split(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, offsets: Optional[Array],
    tiling: Optional[Tiling] = None,
) -> Tuple[Array, Array]:
    """Flat token indices ``(dst [D], src [N - D])``: ``offsets[i, j]`` is the destination's row-major position in
    cell ``(i, j)`` (``None``: its first). Destinations in cell order, sources cell by cell, then the leftovers."""
    if offsets is None:  # the fixed partition: the one row of its table
        order = split_table(ops, like, h, w, sx, sy, None, tiling)[0][0]
        sources = h * w - num_cells(h, w, sx, sy, tiling)
        return order[sources:], order[:sources]
    cells, leftover = _cells(ops, like, h, w, sx, sy, tiling)
    dst, src = _split_rows(ops, cells, leftover, ops.reshape(offsets, (1, ops.shape(cells)[0], 1)))
    return dst[0], src[0]


def _cells(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, tiling: Optional[Tiling] = None
) -> Tuple[Array, Optional[Array]]:
    """:func:`cell_table`, kept (:func:`cached`)."""
    return cached(ops, like, ("cells", h, w, sx, sy, tiling), lambda: cell_table(ops, like, h, w, sx, sy, tiling))


def _destinations(ops: ArrayOps, cells: Array, offsets: Array, skip: bool = False) -> Array:
    """``[R, cells]``: the token at ``offsets [R, cells, 1]`` inside each cell of :func:`cell_table`'s ``cells``;
    ``skip``: ``[R, cells * (sx*sy - 1)]``, every other token of each cell instead."""
    rows = ops.shape(offsets)[0]
    count, per_cell = ops.shape(cells)
    table = ops.broadcast_to(ops.reshape(cells, (1, count, per_cell)), (rows, count, per_cell))
    if skip:
        k = ops.reshape(ops.arange(per_cell - 1, cells), (1, 1, per_cell - 1))
        offsets = k + ops.as_index(k >= offsets)
    return ops.reshape(ops.take_along_axis(table, offsets, axis=2), (rows, count * ops.shape(offsets)[2]))


def _with_leftover(ops: ArrayOps, tokens: Array, leftover: Optional[Array]) -> Array:
    """``tokens [R, K]`` followed in each row by the ``leftover`` tokens (None: none)."""
    if leftover is None:
        return tokens
    rows, count = ops.shape(tokens)[0], ops.shape(leftover)[0]
    return ops.concat([tokens, ops.broadcast_to(ops.reshape(leftover, (1, count)), (rows, count))], axis=1)


def _split_rows(ops: ArrayOps, cells: Array, leftover: Optional[Array], offsets: Array) -> Tuple[Array, Array]:
    """:func:`split` for ``R`` rows of ``offsets [R, cells, 1]`` at once: ``(dst [R, D], src [R, N - D])``."""
    return _destinations(ops, cells, offsets), _with_leftover(ops, _destinations(ops, cells, offsets, True), leftover)


def neighbour_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, window: int) -> Array:
    """For local matching: ``[S, (2*window+1)**2]`` the destinations within ``window`` cells of each source's cell
    (its nearest for a leftover token; clamped at the borders, so some repeat), in :func:`split`'s source order."""
    def build() -> Array:
        hsy, wsx = h // sy, w // sx
        cell = ops.arange(hsy * wsx * (sx * sy - 1), like) // (sx * sy - 1)
        row, col = cell // wsx, cell % wsx
        _, leftover = cell_table(ops, like, h, w, sx, sy)
        if leftover is not None:
            row = ops.concat([row, _clamp(ops, leftover // w // sy, hsy - 1)], axis=0)
            col = ops.concat([col, _clamp(ops, leftover % w // sx, wsx - 1)], axis=0)
        return _within(ops, like, row, col, hsy, wsx, window)
    return cached(ops, like, ("neighbours", h, w, sx, sy, window), build)


Band = Tuple[int, int, int, int]  # (first source, end of sources, first destination, end of destinations)


def frame_pieces(h: int, frame_rows: int, offset: int = 0) -> Tiling:
    """The rows of each frame in an ``h``-row grid of frames of ``frame_rows`` rows (0: one frame), starting at row
    ``offset`` of its first (a context-parallel piece may start mid-frame): the first and last may be pieces."""
    if not frame_rows:
        return (h,)
    if not 0 <= offset < frame_rows:
        raise ValueError(f"offset must be a row of a {frame_rows}-row frame (0 to {frame_rows - 1}), got {offset}")
    first = min(h, frame_rows - offset)
    whole, rest = divmod(h - first, frame_rows)
    return (first,) + (frame_rows,) * whole + ((rest,) if rest else ())


def stacked_frames(h: int, frame_rows: int, offset: int = 0) -> int:
    """How many frames (or pieces of one) :func:`frame_pieces` finds."""
    return len(frame_pieces(h, frame_rows, offset))


def window_limits(frames: int, window: Optional[int]) -> bool:
    """Whether a ``window`` of frames on each side (None: every frame) leaves out some of ``frames`` frames."""
    return window is not None and frames > window + 1


class FrameSearch(NamedTuple):
    """:func:`frame_search`'s answer: each group of frames' rows and first and last frame, and the runs of sources."""

    tiling: Tiling
    frames: Tuple[Tuple[int, int], ...]
    bands: Tuple[Band, ...]


def frame_search(
    h: int, w: int, sx: int, sy: int, frame_rows: int, window: Optional[int], offset: int = 0
) -> Optional[FrameSearch]:
    """For frames of ``frame_rows`` rows stacked in an ``h x w`` grid (its first row: row ``offset`` of a frame): the
    grid tiled frame by frame, frames thinner than a cell grouped until a group holds ``sy`` rows, and each run of
    sources meeting the destinations of the frames within ``window`` of its own (``docs/how-it-works.md``). None
    where every source meets every destination. Python ints only."""
    key = (h, w, sx, sy, frame_rows, window, offset)
    if key not in _BANDS:
        if len(_BANDS) >= 256:
            _BANDS.clear()
        _BANDS[key] = _frame_search(h, w, sx, sy, frame_rows, window, offset)
    return _BANDS[key]


def frame_bands(
    h: int, w: int, sx: int, sy: int, frame_rows: int, window: Optional[int], offset: int = 0
) -> Optional[Tuple[Band, ...]]:
    """:func:`frame_search`'s bands (None: every source meets every destination)."""
    search = frame_search(h, w, sx, sy, frame_rows, window, offset)
    return None if search is None else search.bands


# frame_search's answers: a plain dict, not functools.lru_cache, which torch.compile warns may be silently wrong
_BANDS: Dict[Tuple[Any, ...], Optional[FrameSearch]] = {}


def _frame_search(
    h: int, w: int, sx: int, sy: int, frame_rows: int, window: Optional[int], offset: int
) -> Optional[FrameSearch]:
    pieces = frame_pieces(h, frame_rows, offset)
    if not window_limits(len(pieces), window) or h < sy or w < sx:
        return None
    groups: List[Tuple[int, int, int]] = []  # (rows, first frame, last frame)
    for frame, rows in enumerate(pieces):
        if groups and groups[-1][0] < sy:  # thinner than a cell: takes the next frame
            groups[-1] = (groups[-1][0] + rows, groups[-1][1], frame)
        else:
            groups.append((rows, frame, frame))
    if len(groups) > 1 and groups[-1][0] < sy:  # a short last group joins the one before
        rows, _, last = groups.pop()
        groups[-1] = (groups[-1][0] + rows, groups[-1][1], last)
    if len(groups) == 1:
        return None
    wsx, per_cell = w // sx, sx * sy - 1
    first_cell = [0, *itertools.accumulate(rows // sy * wsx for rows, _, _ in groups)]  # each group's, then the end
    reaches = []
    for _, first, last in groups:  # the groups whose frames all lie within the window of this group's
        low = next(j for j, group in enumerate(groups) if group[1] >= first - window)
        high = max(j for j, group in enumerate(groups) if group[2] <= last + window)
        reaches.append((first_cell[low], first_cell[high + 1]))
    bands = [(first_cell[g] * per_cell, first_cell[g + 1] * per_cell, *reach) for g, reach in enumerate(reaches)]
    start = first_cell[-1] * per_cell
    for (rows, _, _), reach in zip(groups, reaches):
        covered = rows // sy * sy
        left = covered * (w - wsx * sx) + (rows - covered) * w
        if left:
            bands.append((start, start + left, *reach))
            start += left
    return FrameSearch(tuple(rows for rows, _, _ in groups), tuple((a, b) for _, a, b in groups), tuple(bands))


def window_table(ops: ArrayOps, like: Array, h: int, w: int, window: int) -> Array:
    """Kept ``[h*w, (2*window+1)**2]``: the tokens within ``window`` rows and columns of each (clamped: some repeat)."""
    return cached(ops, like, ("window", h, w, window), lambda: _within(
        ops, like, ops.arange(h * w, like) // w, ops.arange(h * w, like) % w, h, w, window
    ))


def _within(ops: ArrayOps, like: Array, row: Array, col: Array, rows: int, cols: int, window: int) -> Array:
    """``[S, (2*window+1)**2]`` positions of a ``rows x cols`` grid within ``window`` of each ``(row, col)``."""
    count = ops.shape(row)[0]
    side = 2 * window + 1
    step = ops.arange(side, like) - window
    near_row = _clamp(ops, ops.reshape(row, (count, 1, 1)) + ops.reshape(step, (1, side, 1)), rows - 1)
    near_col = _clamp(ops, ops.reshape(col, (count, 1, 1)) + ops.reshape(step, (1, 1, side)), cols - 1)
    return ops.reshape(near_row * cols + near_col, (count, side * side))


def _clamp(ops: ArrayOps, x: Array, high: int) -> Array:
    return ops.where(x < 0, 0, ops.where(x > high, high, x))


DRAWS = 31
"""Partitions drawn per grid and seed (a prime, so a 50-step generation's timesteps 20 apart land on distinct
draws): a call's step picks one for each block stream (:class:`Draw`), for ``2 * DRAWS`` index rows per grid."""


def draw_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Array:
    """Kept ``[DRAWS, h//sy, w//sx]``: row ``i`` is :func:`random_offsets` of stream ``i`` at step 0 under ``seed``."""
    return cached(ops, like, ("draws", h, w, sx, sy, seed), lambda: random_offsets(
        ops, like, h, w, sx, sy, seed, 0, ops.arange(DRAWS, like)
    ))


def _drawn_offsets(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int], tiling: Optional[Tiling]
) -> Array:
    """``[R, cells, 1]``: each cell's destination position in each drawn partition (``seed`` None: ``R = 1``, each
    cell's first token); a grid tiled band by band draws as the grid of its cells' rows would."""
    count = num_cells(h, w, sx, sy, tiling)
    if seed is None:
        return ops.zeros((1, count, 1), ops.arange(1, like))
    cell_rows = h if tiling is None else count // (w // sx) * sy
    return ops.reshape(draw_table(ops, like, cell_rows, w, sx, sy, seed), (DRAWS, count, 1))


def split_table(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int], tiling: Optional[Tiling] = None
) -> Tuple[Array, Array]:
    """Kept ``(order [R, N], dst_slot [R, N])`` of the ``R = DRAWS`` drawn partitions (``seed`` None: the fixed one):
    :func:`split`'s sources then destinations, and each destination token's place among them (0 at sources)."""
    def build():
        cells, leftover = _cells(ops, like, h, w, sx, sy, tiling)
        dst, src = _split_rows(ops, cells, leftover, _drawn_offsets(ops, like, h, w, sx, sy, seed, tiling))
        rows, count = ops.shape(dst)
        slots = ops.broadcast_to(ops.reshape(ops.arange(count, cells), (1, count)), (rows, count))
        return ops.concat([src, dst], axis=1), ops.scatter(ops.zeros((rows, h * w), cells), dst, slots, axis=1)
    return cached(ops, like, ("split table", h, w, sx, sy, seed, tiling), build)


def joined_table(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int], tiling: Optional[Tiling],
    around: Tuple[int, int],
) -> Tuple[Array, Array]:
    """:func:`split_table` for the sequence ``[before; grid; after]`` (``around``) whose other tokens keep their own
    slots: kept ``(placed [R, N], slots [R, before + N + after])``, the order's tokens at their places in that
    sequence, and each token's slot as :func:`split_table`'s (the ``i``-th token after the grid: destinations + ``i``;
    those before get theirs from the match's first rows)."""
    before, after = around

    def build():
        order, dst_slot = split_table(ops, like, h, w, sx, sy, seed, tiling)
        rows, count = ops.shape(order)[0], num_cells(h, w, sx, sy, tiling)
        pieces = [ops.zeros((rows, before), order)] if before else []
        pieces.append(dst_slot)
        if after:
            pieces.append(ops.broadcast_to(ops.reshape(ops.arange(after, order) + count, (1, after)), (rows, after)))
        return order + before, ops.concat(pieces, axis=1)
    return cached(ops, like, ("joined table", h, w, sx, sy, seed, tiling, before, after), build)


def pick_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int]) -> Array:
    """Kept ``[R, cells + leftover]``: the token standing for each cell in each drawn partition (as
    :func:`split_table`), then the leftover tokens."""
    def build():
        cells, leftover = _cells(ops, like, h, w, sx, sy)
        return _with_leftover(ops, _destinations(ops, cells, _drawn_offsets(ops, like, h, w, sx, sy, seed, None)), leftover)
    return cached(ops, like, ("pick table", h, w, sx, sy, seed), build)


class Draw(NamedTuple):
    """Which drawn partition the block ``stream`` of ``streams`` uses in one call (the step's thousandths plus its
    own offset, modulo :data:`DRAWS`), nothing read on the host; ``drawn``: the call's arrays by grid and seed."""

    seed: int
    step: Union[int, Array]
    stream: int
    streams: int
    drawn: Dict[Tuple, Any]

    def row(self, ops: ArrayOps, like: Array, key: Tuple, table: Array) -> Array:
        """This stream's row of ``table`` (kept drawn partitions named by ``key``), taken for every stream at once."""
        if key not in self.drawn:
            streams = max(self.streams, self.stream + 1)
            every = ("rows", self.seed, streams)  # every stream's draw in this call, for all its tables
            if every not in self.drawn:
                offsets = cached(ops, like, ("stream offsets", self.seed, streams), lambda: (
                    ops.arange(streams, like) * _STREAM_SPREAD + (self.seed % _PRIME) * _MIX[0]
                ) % DRAWS)
                floor = math.floor if isinstance(self.step, (int, float)) else ops.as_index
                self.drawn[every] = (offsets + floor(self.step * 1000)) % DRAWS
            self.drawn[key] = ops.take(table, self.drawn[every], axis=0)
        return self.drawn[key][self.stream]


_STREAM_SPREAD = 7  # consecutive blocks land 7 draws apart (coprime with DRAWS: all distinct up to DRAWS streams)


@dataclass(frozen=True)
class Partition:
    """One block's ``h x w`` grid split for one call (:func:`partition_grid`), all its match reads: ``cells``,
    ``leftover`` (:func:`cell_table`), ``dst``, ``src`` (:func:`split`), ``neighbours`` (:func:`neighbour_table`),
    ``nearby`` (:func:`window_table`), ``bands``, ``tiling`` (:func:`frame_search`), a chunk's ``reference`` frame."""

    h: int
    w: int
    sx: int
    sy: int
    cells: Array
    leftover: Optional[Array]
    offsets: Optional[Array] = None
    dst: Optional[Array] = None
    src: Optional[Array] = None
    window: int = 0
    neighbours: Optional[Array] = None
    nearby: Optional[Array] = None
    frames: int = 1
    reference: Any = None
    bands: Optional[Tuple[Band, ...]] = None
    order: Optional[Array] = None  # [N]: ``src`` then ``dst`` end to end, where the partition was drawn from a table
    dst_slot: Optional[Array] = None  # [N]: each destination token's place among the destinations (split_table)
    picked: Optional[Array] = None  # [cells + leftover]: the token standing for each cell, then the leftovers
    tiling: Optional[Tiling] = None
    around: Tuple[int, int] = (0, 0)  # tokens before and after the grid's that its matches carry (joined_table)
    placed: Optional[Array] = None  # [N]: ``order`` at its places among them; ``dst_slot`` then runs over all

    @property
    def full_cells(self) -> int:
        """Destinations: one per full cell."""
        return num_cells(self.h, self.w, self.sx, self.sy, self.tiling)


def partition_grid(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, draw: Optional[Draw] = None, *,
    similarity: bool = True, picks: bool = True, window: int = 0, frames: int = 1, offsets: Optional[Array] = None,
    reference: Any = None, frame_rows: int = 0, frame_window: Optional[int] = None, frame_offset: int = 0,
    around: Tuple[int, int] = (0, 0),
) -> Partition:
    """The :class:`Partition` of an ``h x w`` grid of ``sx x sy`` cells. ``draw`` places the destinations (and a
    chunk's reference frame) pseudo-randomly where the match ``picks`` a token per cell, else ``offsets`` (None:
    each cell's first token) and ``reference`` (None: the middle frame). ``similarity``: sources are compared with
    destinations (within ``window`` cells when > 0); ``frames``: in chunks of that many frames; ``frame_rows``,
    ``frame_window``, ``frame_offset``: :func:`frame_search` (not with ``window``, already local); ``around``:
    ``(before, after)`` tokens around the grid's that a similarity match of one frame from the tables carries
    (:func:`joined_table`), so that it merges the whole sequence a sub-layer runs on."""
    search = frame_search(h, w, sx, sy, frame_rows, frame_window, frame_offset) if similarity and not window else None
    tiling = None if search is None else search.tiling
    cells, leftover = _cells(ops, like, h, w, sx, sy, tiling)
    count = num_cells(h, w, sx, sy, tiling)
    seed = draw.seed if draw is not None else None
    if draw is not None and frames > 1:  # each chunk's reference: a destination in a 1 x K cell, the next seed
        table = draw_table(ops, like, 1, frames, frames, 1, seed + 1)
        reference = ops.reshape(draw.row(ops, like, ("offsets", 1, frames, frames, 1, seed + 1), table), (1,))
    if frames > 1 and reference is None:
        reference = frames // 2
    dst = src = neighbours = nearby = bands = order = dst_slot = picked = placed = None
    around = around if similarity and frames == 1 and count and picks and offsets is None else (0, 0)
    if count and picks and offsets is None:  # drawn or fixed: from the tables; explicit offsets: split here

        def row(name: Any, table: Array) -> Array:  # fixed: the table's one row; drawn: this stream's in this call
            return table[0] if draw is None else draw.row(ops, like, (name, h, w, sx, sy, seed, tiling), table)
        if similarity:
            order, dst_slot = split_table(ops, like, h, w, sx, sy, seed, tiling)
            if any(around):
                placed, dst_slot = joined_table(ops, like, h, w, sx, sy, seed, tiling, around)
                placed = row(("placed", *around), placed)
            order, dst_slot = row("order", order), row(("slots", *around), dst_slot)
        else:
            picked = row("picks", pick_table(ops, like, h, w, sx, sy, seed))
    if similarity and count:
        if order is not None:
            src, dst = order[: h * w - count], order[h * w - count :]
        else:
            dst, src = split(ops, like, h, w, sx, sy, offsets, tiling)
        neighbours = neighbour_table(ops, like, h, w, sx, sy, window) if window else None
        nearby = window_table(ops, like, h, w, window) if window and frames > 1 else None
        bands = None if search is None else search.bands
    return Partition(
        h, w, sx, sy, cells, leftover, offsets, dst, src, window, neighbours, nearby, frames, reference, bands, order,
        dst_slot, picked, tiling, around, placed,
    )
