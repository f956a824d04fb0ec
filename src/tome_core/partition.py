"""Partition: which tokens of an h x w grid are destinations (one per sy x sx cell) and which are sources.

Built by index arithmetic, never by sorting, so every backend produces the same split. Cells tile the
grid row-major; tokens in the rows and columns left over when h or w is not a multiple of sy or sx are
always sources.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple, Union

from .ops import Array, ArrayOps

# A small prime keeps every product below 2**31, so the hash is identical in int32 (jax) and int64.
_PRIME = 32749
_MIX = (1103, 2713, 9007, 17393)  # key mixing; the last two also scramble each cell
_CACHE: "OrderedDict[Tuple, Any]" = OrderedDict()
_CACHE_SIZE = 64


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
    """Shape-only index arrays, kept per backend and device where the backend allows it, until
    :func:`forget_tables`."""
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
    """Drop the arrays :func:`cached` keeps. A patched model's call does so as it returns, so that its blocks
    share them within the call and nothing it built stays allocated between calls (a patched model's memory
    between calls is the unpatched model's); the next call builds them again, a few small kernels."""
    _CACHE.clear()


def split(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, offsets: Optional[Array]
) -> Tuple[Array, Array]:
    """Flat token indices ``(dst [D], src [N - D])`` for an ``h x w`` grid.

    ``offsets[i, j]`` is the destination's row-major position inside cell ``(i, j)``; ``None`` means the
    cell's first position. Destinations come out in cell order (row-major over cells); sources cell by
    cell, then the leftover columns and rows.
    """
    cells, leftover = cached(ops, like, ("cells", h, w, sx, sy), lambda: cell_table(ops, like, h, w, sx, sy))
    num_cells, per_cell = ops.shape(cells)
    if offsets is None:
        return cached(ops, like, ("fixed", h, w, sx, sy), lambda: _split(ops, cells, leftover, None))
    return _split(ops, cells, leftover, ops.reshape(offsets, (num_cells, 1)))


def _split(ops: ArrayOps, cells: Array, leftover: Optional[Array], offsets: Optional[Array]) -> Tuple[Array, Array]:
    num_cells, per_cell = ops.shape(cells)
    if offsets is None:
        offsets = ops.zeros((num_cells, 1), cells)
    dst = ops.reshape(ops.take_along_axis(cells, offsets, axis=1), (num_cells,))
    k = ops.reshape(ops.arange(per_cell - 1, cells), (1, per_cell - 1))
    src = ops.reshape(ops.take_along_axis(cells, k + ops.as_index(k >= offsets), axis=1), (num_cells * (per_cell - 1),))
    return dst, src if leftover is None else ops.concat([src, leftover], axis=0)


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


@lru_cache(maxsize=256)
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


class Draw(NamedTuple):
    """What places each cell's destination pseudo-randomly in one call (:func:`random_offsets`): the ``seed``, the
    call's ``step``, the block's ``stream`` among the model's ``streams``, and ``drawn``, the call's tables by grid
    and seed, drawn for every stream at once by the first block that needs them."""

    seed: int
    step: Union[int, Array]
    stream: int
    streams: int
    drawn: Dict[Tuple[int, ...], Array]

    def offsets(self, ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int) -> Array:
        """This stream's :func:`random_offsets` of an ``h x w`` grid of ``sx x sy`` cells under ``seed``."""
        key = (h, w, sx, sy, seed)
        table = self.drawn.get(key)
        if table is None or ops.shape(table)[0] <= self.stream:
            streams = ops.arange(max(self.streams, self.stream + 1), like)
            table = self.drawn[key] = random_offsets(ops, like, h, w, sx, sy, seed, self.step, streams)
        return table[self.stream]


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
    cells, leftover = cached(ops, like, ("cells", h, w, sx, sy), lambda: cell_table(ops, like, h, w, sx, sy))
    full = num_cells(h, w, sx, sy) > 0
    if draw is not None:
        offsets = draw.offsets(ops, like, h, w, sx, sy, draw.seed) if picks and full else None
        if frames > 1:  # the reference frame of every chunk: drawn like a destination in a 1 x K cell, from the next seed
            reference = ops.reshape(draw.offsets(ops, like, 1, frames, frames, 1, draw.seed + 1), (1,))
    if frames > 1 and reference is None:
        reference = frames // 2
    dst = src = neighbours = nearby = bands = None
    if similarity and full:
        dst, src = split(ops, like, h, w, sx, sy, offsets)
        neighbours = neighbour_table(ops, like, h, w, sx, sy, window) if window else None
        nearby = window_table(ops, like, h, w, window) if window and frames > 1 else None
        bands = None if window else frame_bands(h, w, sx, sy, frame_rows, frame_window)
    return Partition(h, w, sx, sy, cells, leftover, offsets, dst, src, window, neighbours, nearby, frames, reference, bands)
