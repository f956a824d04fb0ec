"""Partition: which tokens of an h x w grid are destinations (one per sy x sx cell) and which are sources.

Built by index arithmetic, never by sorting, so every backend produces the same split. Cells tile the
grid row-major; tokens in the rows and columns left over when h or w is not a multiple of sy or sx are
always sources.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

from .ops import Array, ArrayOps

# A small prime keeps every product below 2**31, so the hash is identical in int32 (jax) and int64.
_PRIME = 32749
_MIX = (1103, 2713, 9007, 17393)  # key mixing; the last two also scramble each cell
_CACHE: "OrderedDict[Tuple, Any]" = OrderedDict()
_CACHE_SIZE = 128


def num_cells(h: int, w: int, sx: int, sy: int) -> int:
    """Number of destinations: one per full sy x sx cell."""
    return (h // sy) * (w // sx)


def random_offsets(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int, step: Union[int, Array],
    stream: Union[int, Array],
) -> Array:
    """Destination position inside each cell, in ``[0, sx*sy)``, shape ``[h//sy, w//sx]``; for an array of
    ``S`` streams ``[S, h//sy, w//sx]``, row ``i`` the partition of stream ``stream[i]`` (one set of array
    operations for every block of a call: an eager GPU call is bound by their launches).

    A counter-based hash of (seed, step, stream, cell): no random-number generator state is read or
    advanced, the same arguments give the same partition on every backend and on every run, and
    ``step`` may be a traced or on-device number (the denoising timestep, integer or fractional) without a
    host sync; steps that differ by at least 1/1000 give different partitions.
    """
    hsy, wsx = h // sy, w // sx
    cell = ops.arange(hsy * wsx, like)
    key = (seed % _PRIME) * _MIX[0] % _PRIME
    several = not isinstance(stream, int)
    key = (stream % _PRIME + key) * _MIX[1] % _PRIME
    if several:  # an array of streams: one row of cells each
        key = ops.reshape(key, (-1, 1))
    # Flow-matching transformers (Flux) pass fractional timesteps in [0, 1]: the hash takes floor(1000 * t).
    # Computed as (floor(t) mod p) * 1000 + the fraction's thousandths, so that int32 never overflows.
    if isinstance(step, (int, float)):
        whole = math.floor(step)
        step = ((whole % _PRIME) * 1000 + math.floor((step - whole) * 1000)) % _PRIME
    else:
        whole = ops.as_index(step)
        step = ((whole % _PRIME) * 1000 + ops.as_index((step - whole) * 1000)) % _PRIME
    x = (step + key) * _MIX[2] % _PRIME
    x = _scramble((x + cell) % _PRIME)
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


def cell_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int) -> Tuple[Array, Optional[Array]]:
    """Token index of every position of every cell ``[cells, sx*sy]`` (row-major inside the cell), and the
    leftover tokens outside the full cells (``None`` when the grid is tiled exactly). Depends on shapes only."""
    hsy, wsx = h // sy, w // sx
    per_cell = sx * sy
    rows = ops.reshape(ops.arange(hsy, like) * (sy * w), (hsy, 1, 1))
    cols = ops.reshape(ops.arange(wsx, like) * sx, (1, wsx, 1))
    position = ops.arange(per_cell, like)
    inside = ops.reshape((position // sx) * w + position % sx, (1, 1, per_cell))
    cells = ops.reshape(rows + cols + inside, (hsy * wsx, per_cell))
    pieces = []
    if wsx * sx < w:
        right = ops.reshape(ops.arange(hsy * sy, like) * w, (hsy * sy, 1)) + ops.reshape(
            ops.arange(w - wsx * sx, like) + wsx * sx, (1, w - wsx * sx)
        )
        pieces.append(ops.reshape(right, ((hsy * sy) * (w - wsx * sx),)))
    if hsy * sy < h:
        pieces.append(ops.arange((h - hsy * sy) * w, like) + hsy * sy * w)
    leftover = None if not pieces else pieces[0] if len(pieces) == 1 else ops.concat(pieces, axis=0)
    return cells, leftover


def cached(ops: ArrayOps, like: Array, key: Tuple, build: Callable[[], Any]) -> Any:
    """Index arrays that depend on shapes (and the seed) alone, kept per backend and device where the backend
    allows it: built once, then read by every block and call, so that a call launches only the kernels of its own
    arithmetic. At most :data:`_CACHE_SIZE` entries, the least recently built dropped first; ``remove`` clears them
    (:func:`forget_tables`). What they hold: ``docs/results/launches.md``."""
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


def forget_tables() -> None:
    """Drop the arrays :func:`cached` keeps (``remove`` does, so that an unpatched model holds nothing of ToMe)."""
    _CACHE.clear()


def split(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, offsets: Optional[Array]
) -> Tuple[Array, Array]:
    """Flat token indices ``(dst [D], src [N - D])`` for an ``h x w`` grid.

    ``offsets[i, j]`` is the destination's row-major position inside cell ``(i, j)``; ``None`` means the
    cell's first position. Destinations come out in cell order (row-major over cells); sources cell by
    cell, then the leftover columns and rows.
    """
    if offsets is None:  # the fixed partition: the one row of its table
        order = split_table(ops, like, h, w, sx, sy, None)[0][0]
        sources = h * w - num_cells(h, w, sx, sy)
        return order[sources:], order[:sources]
    cells, leftover = _cells(ops, like, h, w, sx, sy)
    dst, src = _split_rows(ops, cells, leftover, ops.reshape(offsets, (1, ops.shape(cells)[0], 1)))
    return dst[0], src[0]


def _cells(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int) -> Tuple[Array, Optional[Array]]:
    """:func:`cell_table`, kept (:func:`cached`)."""
    return cached(ops, like, ("cells", h, w, sx, sy), lambda: cell_table(ops, like, h, w, sx, sy))


def _destinations(ops: ArrayOps, cells: Array, offsets: Array) -> Array:
    """``[R, cells]``: the token at ``offsets [R, cells, 1]`` inside each cell of :func:`cell_table`'s ``cells``."""
    rows = ops.shape(offsets)[0]
    count, per_cell = ops.shape(cells)
    table = ops.broadcast_to(ops.reshape(cells, (1, count, per_cell)), (rows, count, per_cell))
    return ops.reshape(ops.take_along_axis(table, offsets, axis=2), (rows, count))


def _with_leftover(ops: ArrayOps, tokens: Array, leftover: Optional[Array]) -> Array:
    """``tokens [R, K]`` followed in each row by the ``leftover`` tokens (None: none)."""
    if leftover is None:
        return tokens
    rows, count = ops.shape(tokens)[0], ops.shape(leftover)[0]
    return ops.concat([tokens, ops.broadcast_to(ops.reshape(leftover, (1, count)), (rows, count))], axis=1)


def _split_rows(ops: ArrayOps, cells: Array, leftover: Optional[Array], offsets: Array) -> Tuple[Array, Array]:
    """:func:`split` for ``R`` rows of ``offsets [R, cells, 1]`` at once: ``(dst [R, D], src [R, N - D])``."""
    rows = ops.shape(offsets)[0]
    count, per_cell = ops.shape(cells)
    table = ops.broadcast_to(ops.reshape(cells, (1, count, per_cell)), (rows, count, per_cell))
    k = ops.reshape(ops.arange(per_cell - 1, cells), (1, 1, per_cell - 1))
    src = ops.reshape(ops.take_along_axis(table, k + ops.as_index(k >= offsets), axis=2), (rows, count * (per_cell - 1)))
    return _destinations(ops, cells, offsets), _with_leftover(ops, src, leftover)


def neighbour_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, window: int) -> Array:
    """For local matching: ``[S, (2*window+1)**2]`` indices of the destinations whose cells lie within
    ``window`` cells of each source's cell (clamped at the borders, so some repeat), in :func:`split`'s
    source order. A leftover token counts as being in its nearest cell. Depends on shapes only."""
    return cached(ops, like, ("neighbours", h, w, sx, sy, window), lambda: _neighbours(ops, like, h, w, sx, sy, window))


def _neighbours(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, window: int) -> Array:
    hsy, wsx = h // sy, w // sx
    per_cell = sx * sy - 1
    cell = ops.arange(hsy * wsx * per_cell, like) // per_cell
    rows, cols = [cell // wsx], [cell % wsx]
    _, leftover = cell_table(ops, like, h, w, sx, sy)
    if leftover is not None:
        rows.append(_clamp(ops, leftover // w // sy, hsy - 1))
        cols.append(_clamp(ops, leftover % w // sx, wsx - 1))
    row = ops.concat(rows, axis=0) if len(rows) > 1 else rows[0]
    col = ops.concat(cols, axis=0) if len(cols) > 1 else cols[0]
    return _within(ops, like, row, col, hsy, wsx, window)


Band = Tuple[int, int, int, int]  # (first source, end of sources, first destination, end of destinations)


def stacked_frames(h: int, frame_rows: int) -> int:
    """The frames of ``frame_rows`` rows each that an ``h``-row grid stacks (1: none, ``frame_rows`` 0 or ``h``)."""
    return -(-h // frame_rows) if frame_rows and frame_rows < h else 1


def window_limits(frames: int, window: Optional[int]) -> bool:
    """Whether a ``window`` of frames on each side (None: every frame) leaves out some of ``frames`` frames."""
    return window is not None and frames > window + 1


def frame_bands(h: int, w: int, sx: int, sy: int, frame_rows: int, window: Optional[int]) -> Optional[Tuple[Band, ...]]:
    """For a video whose frames of ``frame_rows`` token rows are stacked in the ``h x w`` grid's rows: which
    destinations (in :func:`split`'s order) each run of sources may be compared with, so that a source meets
    only the destinations of the frames within ``window`` frames of its own, and the similarity costs
    linear instead of quadratic in frames. One band per frame: the sources of the cells whose first row lies
    in it, against the destinations of the cells that reach the rows of the frames from ``window`` before to
    ``window`` after those cells' frames (a cell that straddles two frames, where ``frame_rows`` is not a
    multiple of ``sy``, counts as in both); the leftover sources, after the cells', against every destination.
    None where every source meets every destination: no frames (``frame_rows`` 0 or the whole grid),
    ``window`` None, or a window that spans the video. Depends on shapes only (Python ints)."""
    key = (h, w, sx, sy, frame_rows, window)
    if key not in _BANDS:
        if len(_BANDS) >= 256:
            _BANDS.clear()
        _BANDS[key] = _frame_bands(h, w, sx, sy, frame_rows, window)
    return _BANDS[key]


# frame_bands' answers: a plain dict, not functools.lru_cache, which torch.compile warns may be silently wrong
_BANDS: Dict[Tuple[Any, ...], Optional[Tuple[Band, ...]]] = {}


def _frame_bands(h: int, w: int, sx: int, sy: int, frame_rows: int, window: Optional[int]) -> Optional[Tuple[Band, ...]]:
    frames = stacked_frames(h, frame_rows)
    if not window_limits(frames, window):
        return None
    hsy, wsx = h // sy, w // sx
    per_cell = sx * sy - 1
    bands = []
    row = 0  # the first cell row of the next band
    while row < hsy:
        frame = row * sy // frame_rows
        end = min(hsy, -(-(frame + 1) * frame_rows // sy))  # the cells whose first row lies in this frame
        last = (end * sy - 1) // frame_rows  # the frame of their last row
        first_row = max(0, frame - window) * frame_rows
        end_row = min(h, (min(frames - 1, last + window) + 1) * frame_rows)
        destinations = (first_row // sy * wsx, min(hsy, -(-end_row // sy)) * wsx)
        bands.append((row * wsx * per_cell, end * wsx * per_cell, *destinations))
        row = end
    sources = h * w - hsy * wsx
    if sources > hsy * wsx * per_cell:  # the leftover rows and columns: every destination
        bands.append((hsy * wsx * per_cell, sources, 0, hsy * wsx))
    return tuple(bands)


def window_table(ops: ArrayOps, like: Array, h: int, w: int, window: int) -> Array:
    """``[h*w, (2*window+1)**2]``: for each token of an ``h x w`` grid, the tokens within ``window`` rows and
    columns of it (clamped at the borders, so some repeat). Depends on shapes only."""
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
"""Partitions drawn per grid and seed (a prime): a call's step picks one of them for each block stream
(:class:`Draw`). 31 distinct partitions cycle through a 50-step generation (its timesteps 20 apart land on
distinct draws), each a fresh pseudo-random placement, for a fixed memory of ``2 * DRAWS`` index rows per grid."""


def draw_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Array:
    """``[DRAWS, h//sy, w//sx]``: the destination's position inside each cell in each of the grid's drawn
    partitions under ``seed`` (row ``i``: :func:`random_offsets` of stream ``i`` at step 0). Depends on shapes and
    the seed only: built once and kept (:func:`cached`)."""
    return cached(ops, like, ("draws", h, w, sx, sy, seed), lambda: random_offsets(
        ops, like, h, w, sx, sy, seed, 0, ops.arange(DRAWS, like)
    ))


def _drawn_offsets(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int]) -> Array:
    """``[R, cells, 1]``: each cell's destination position in each drawn partition (``seed`` None: ``R = 1``, each
    cell's first token)."""
    count = num_cells(h, w, sx, sy)
    if seed is None:
        return ops.zeros((1, count, 1), ops.arange(1, like))
    return ops.reshape(draw_table(ops, like, h, w, sx, sy, seed), (DRAWS, count, 1))


def split_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int]) -> Tuple[Array, Array]:
    """``(order [R, N], dst_slot [R, N])`` for the grid's drawn partitions (``R = DRAWS``; ``seed`` None: the one
    fixed partition, each cell's first token, ``R = 1``): ``order`` lists each partition's sources, then its
    destinations (:func:`split`'s two arrays end to end), and ``dst_slot`` holds at each destination token its
    place among the destinations (0 at sources). Built once per shape and seed and kept (:func:`cached`)."""
    def build():
        cells, leftover = _cells(ops, like, h, w, sx, sy)
        dst, src = _split_rows(ops, cells, leftover, _drawn_offsets(ops, like, h, w, sx, sy, seed))
        rows, count = ops.shape(dst)
        slots = ops.broadcast_to(ops.reshape(ops.arange(count, cells), (1, count)), (rows, count))
        return ops.concat([src, dst], axis=1), ops.scatter(ops.zeros((rows, h * w), cells), dst, slots, axis=1)
    return cached(ops, like, ("split table", h, w, sx, sy, seed), build)


def pick_table(ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: Optional[int]) -> Array:
    """``[R, cells + leftover]``: the token standing for each cell in each drawn partition (as :func:`split_table`),
    then the leftover tokens. Built once per shape and seed and kept (:func:`cached`)."""
    def build():
        cells, leftover = _cells(ops, like, h, w, sx, sy)
        return _with_leftover(ops, _destinations(ops, cells, _drawn_offsets(ops, like, h, w, sx, sy, seed)), leftover)
    return cached(ops, like, ("pick table", h, w, sx, sy, seed), build)


class Draw(NamedTuple):
    """Which drawn partition each block stream uses in one call: the step's key (its thousandths: flow-matching
    transformers pass timesteps in [0, 1]) plus the stream's own offset, modulo :data:`DRAWS`; one small set of array operations per call, then one gather per grid for
    every stream at once (an eager GPU call is bound by kernel launches), and nothing read on the host. ``seed``,
    ``step``, the block's ``stream`` among the model's ``streams``, and ``drawn``: the call's arrays by grid and
    seed."""

    seed: int
    step: Union[int, Array]
    stream: int
    streams: int
    drawn: Dict[Tuple, Any]

    def rows(self, ops: ArrayOps, like: Array) -> Array:
        """``[streams]``: the drawn partition of every stream in this call (computed once per call)."""
        streams = max(self.streams, self.stream + 1)
        key = ("rows", self.seed, streams)
        rows = self.drawn.get(key)
        if rows is None or ops.shape(rows)[0] <= self.stream:
            offsets = cached(ops, like, ("stream offsets", self.seed, streams), lambda: (
                ops.arange(streams, like) * _STREAM_SPREAD + (self.seed % _PRIME) * _MIX[0]
            ) % DRAWS)
            step = self.step  # keyed by its thousandths, the same for an int, a float and an array of either
            if isinstance(step, (int, float)):
                rows = (offsets + math.floor(step * 1000)) % DRAWS
            else:
                rows = (offsets + ops.as_index(step * 1000)) % DRAWS
            self.drawn[key] = rows
        return rows

    def _per_call(self, ops: ArrayOps, like: Array, key: Tuple, table: Array) -> Array:
        """``table``'s rows for every stream in this call, once per call and grid."""
        chosen = self.drawn.get(key)
        if chosen is None:
            chosen = self.drawn[key] = ops.take(table, self.rows(ops, like), axis=0)
        return chosen

    def split(self, ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Tuple[Array, Array]:
        """This stream's row of :func:`split_table` in this call."""
        order, slots = split_table(ops, like, h, w, sx, sy, seed)
        key = (h, w, sx, sy, seed)
        return (
            self._per_call(ops, like, ("order",) + key, order)[self.stream],
            self._per_call(ops, like, ("slots",) + key, slots)[self.stream],
        )

    def picks(self, ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Array:
        """This stream's row of :func:`pick_table` in this call."""
        table = pick_table(ops, like, h, w, sx, sy, seed)
        return self._per_call(ops, like, ("picks", h, w, sx, sy, seed), table)[self.stream]

    def offsets(self, ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Array:
        """This stream's destination position in each cell (``[h//sy, w//sx]``) in this call."""
        table = draw_table(ops, like, h, w, sx, sy, seed)
        return self._per_call(ops, like, ("offsets", h, w, sx, sy, seed), table)[self.stream]


_STREAM_SPREAD = 7  # consecutive blocks land 7 draws apart (coprime with DRAWS: all distinct up to DRAWS streams)


@dataclass(frozen=True)
class Partition:
    """One block's ``h x w`` grid split for one call: everything its match reads of the grid, built at once by
    :func:`partition_grid`. ``cells`` and ``leftover``: :func:`cell_table`; ``offsets``: each cell's destination
    position (None: its first token); ``dst`` and ``src``: :func:`split` (similarity matching); ``neighbours``:
    each source's candidate destinations (:func:`neighbour_table`, local matching) and ``nearby`` each token's
    neighbours (:func:`window_table`, local matching across frames); ``reference``: the reference frame of a
    cross-frame chunk of ``frames`` frames (a Python int or a 1-element index array); ``bands``: the runs of
    sources and the destinations each meets in a video whose frames are stacked in rows (:func:`frame_bands`;
    None: every source meets every destination)."""

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

    @property
    def full_cells(self) -> int:
        """Destinations: one per full cell."""
        return num_cells(self.h, self.w, self.sx, self.sy)


def partition_grid(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, draw: Optional[Draw] = None, *,
    similarity: bool = True, picks: bool = True, window: int = 0, frames: int = 1, offsets: Optional[Array] = None,
    reference: Any = None, frame_rows: int = 0, frame_window: Optional[int] = None,
) -> Partition:
    """The :class:`Partition` of an ``h x w`` grid of ``sx x sy`` cells. ``draw`` places the destinations (and a
    chunk's reference frame) pseudo-randomly where the match ``picks`` a token per cell, else ``offsets`` places
    them (None: each cell's first token) and ``reference`` is the chunk's (None: its middle frame). ``similarity``:
    the match compares sources with destinations (``dst``, ``src``; within ``window`` cells when > 0); ``frames``:
    it runs on chunks of that many frames; ``frame_rows``: the grid stacks a video's frames of that many rows, and a
    source meets only the destinations within ``frame_window`` frames of its own (:func:`frame_bands`; not with
    ``window``, already local)."""
    cells, leftover = _cells(ops, like, h, w, sx, sy)
    count = num_cells(h, w, sx, sy)
    full = count > 0
    tabled = offsets is None  # drawn (draw) or fixed: from the tables; explicit offsets: split here
    seed = draw.seed if draw is not None else None
    if draw is not None and frames > 1:  # the reference frame of every chunk: drawn like a destination in a 1 x K cell, from the next seed
        reference = ops.reshape(draw.offsets(ops, like, 1, frames, frames, 1, draw.seed + 1), (1,))
    if frames > 1 and reference is None:
        reference = frames // 2
    dst = src = neighbours = nearby = bands = order = dst_slot = picked = None
    if full and picks and tabled:
        if similarity:
            order, dst_slot = draw.split(ops, like, h, w, sx, sy, seed) if draw is not None else (
                tuple(table[0] for table in split_table(ops, like, h, w, sx, sy, None))
            )
        else:
            picked = draw.picks(ops, like, h, w, sx, sy, seed) if draw is not None else pick_table(ops, like, h, w, sx, sy, None)[0]
    if similarity and full:
        if order is not None:
            src, dst = order[: h * w - count], order[h * w - count :]
        else:
            dst, src = split(ops, like, h, w, sx, sy, offsets)
        neighbours = neighbour_table(ops, like, h, w, sx, sy, window) if window else None
        nearby = window_table(ops, like, h, w, window) if window and frames > 1 else None
        bands = None if window else frame_bands(h, w, sx, sy, frame_rows, frame_window)
    return Partition(
        h, w, sx, sy, cells, leftover, offsets, dst, src, window, neighbours, nearby, frames, reference, bands, order,
        dst_slot, picked,
    )
