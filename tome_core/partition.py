"""Partition: which tokens of an h x w grid are destinations (one per sy x sx cell) and which are sources.

Built by index arithmetic, never by sorting, so every backend produces the same split. Cells tile the
grid row-major; tokens in the rows and columns left over when h or w is not a multiple of sy or sx are
always sources.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from .ops import Array, ArrayOps

# A small prime keeps every product below 2**31, so the hash is identical in int32 (jax) and int64.
_PRIME = 32749
_MIX = (1103, 2713, 9007, 17393)


def num_cells(h: int, w: int, sx: int, sy: int) -> int:
    """Number of destinations: one per full sy x sx cell."""
    return (h // sy) * (w // sx)


def random_offsets(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, seed: int, step: Union[int, Array], stream: int
) -> Array:
    """Destination position inside each cell, in ``[0, sx*sy)``, shape ``[h//sy, w//sx]``.

    A counter-based hash of (seed, step, stream, cell): no random-number generator state is read or
    advanced, the same arguments give the same partition on every backend and on every run, and
    ``step`` may be a traced or on-device integer (the denoising timestep) without a host sync.
    """
    hsy, wsx = h // sy, w // sx
    cell = ops.arange(hsy * wsx, like)
    key = (seed % _PRIME) * _MIX[0] % _PRIME
    key = (key + stream % _PRIME) * _MIX[1] % _PRIME
    step = step % _PRIME if isinstance(step, int) else ops.as_index(step) % _PRIME
    x = (step + key) * _MIX[2] % _PRIME
    x = (x + cell) % _PRIME
    for mix in _MIX:
        x = (x * x % _PRIME + mix) * mix % _PRIME
    return ops.reshape(x % (sx * sy), (hsy, wsx))


def split(
    ops: ArrayOps, like: Array, h: int, w: int, sx: int, sy: int, offsets: Optional[Array]
) -> Tuple[Array, Array]:
    """Flat token indices ``(dst [D], src [N - D])`` for an ``h x w`` grid.

    ``offsets[i, j]`` is the destination's row-major position inside cell ``(i, j)``; ``None`` means the
    cell's first position. Destinations come out in cell order (row-major over cells); sources cell by
    cell, then the leftover columns and rows.
    """
    hsy, wsx = h // sy, w // sx
    cells = sx * sy
    rows = ops.reshape(ops.arange(hsy, like) * (sy * w), (hsy, 1))
    cols = ops.reshape(ops.arange(wsx, like) * sx, (1, wsx))
    corner = ops.reshape(rows + cols, (hsy, wsx, 1))
    if offsets is None:
        offsets = ops.zeros((hsy, wsx), corner)
    offsets = ops.reshape(offsets, (hsy, wsx, 1))
    dst = corner + (offsets // sx) * w + offsets % sx

    k = ops.reshape(ops.arange(cells - 1, like), (1, 1, cells - 1))
    local = k + ops.as_index(k >= offsets)
    src_cells = corner + (local // sx) * w + local % sx

    pieces = [ops.reshape(src_cells, (hsy * wsx * (cells - 1),))]
    if wsx * sx < w:
        right = ops.reshape(ops.arange(hsy * sy, like) * w, (hsy * sy, 1)) + ops.reshape(
            ops.arange(w - wsx * sx, like) + wsx * sx, (1, w - wsx * sx)
        )
        pieces.append(ops.reshape(right, ((hsy * sy) * (w - wsx * sx),)))
    if hsy * sy < h:
        pieces.append(ops.arange((h - hsy * sy) * w, like) + hsy * sy * w)
    src = pieces[0] if len(pieces) == 1 else ops.concat(pieces, axis=0)
    return ops.reshape(dst, (hsy * wsx,)), src
