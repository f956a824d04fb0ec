"""Levels: which blocks of a UNet merge, judged by how far their token grid is downsampled from the latent, and the
grids they are judged by (:func:`spatial_size` of a feature map, token grids read from packed ids and coordinates)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from ..algorithm.backend import get_ops


def downsample_factor(latent_hw: Tuple[int, int], tokens: int, seen_hw: Optional[Tuple[int, int]] = None) -> int:
    """A block's level: how many times its grid was halved from the latent ``H x W``. With the grid ``h x w`` its
    transformer saw, the smallest power of two ``>= max(ceil(H/h), ceil(W/w))`` (exact for every shape); otherwise
    tomesd's estimate ``ceil(sqrt((H*W) // N))`` for ``N`` tokens, which agrees wherever it is exact."""
    height, width = latent_hw
    if seen_hw is not None and seen_hw[0] * seen_hw[1] == tokens:
        stride = max(math.ceil(height / seen_hw[0]), math.ceil(width / seen_hw[1]))
        return 1 << max(stride - 1, 0).bit_length()
    return max(1, math.ceil(math.sqrt((height * width) // tokens)))


def level_grid(latent_hw: Tuple[int, int], factor: int) -> Tuple[int, int]:
    """The token grid ``(ceil(H/d), ceil(W/d))`` of a level ``d`` below the latent ``H x W``."""
    height, width = latent_hw
    return math.ceil(height / factor), math.ceil(width / factor)


def block_grid(
    latent_hw: Tuple[int, int], factor: int, seen_hw: Optional[Tuple[int, int]], tokens: int
) -> Tuple[int, int]:
    """The block's real grid: the one its transformer saw when known (exact for every shape), else derived."""
    if seen_hw is not None and seen_hw[0] * seen_hw[1] == tokens:
        return seen_hw
    grid = level_grid(latent_hw, factor)
    if grid[0] * grid[1] != tokens:
        raise ValueError(
            f"cannot place {tokens} tokens on a grid: latent {latent_hw[0]}x{latent_hw[1]} at downsample "
            f"{factor} gives {grid[0]}x{grid[1]}"
        )
    return grid


class Place(NamedTuple):
    """Where a block of ``tokens`` image tokens sits: its level and its grid, or why it has none (``grid`` None)."""

    tokens: int
    factor: int
    grid: Optional[Tuple[int, int]]
    problem: Optional[str] = None


def block_place(latent_hw: Tuple[int, int], tokens: int, seen_hw: Optional[Tuple[int, int]]) -> Place:
    """A block's :func:`downsample_factor` and :func:`block_grid` at once; the grid's error is kept for where the
    grid is needed (a block at a level that merges nothing never needs it)."""
    factor = downsample_factor(latent_hw, tokens, seen_hw)
    try:
        return Place(tokens, factor, block_grid(latent_hw, factor, seen_hw, tokens))
    except ValueError as error:
        return Place(tokens, factor, None, str(error))


def leading_raster(ids: Sequence[Sequence[float]]) -> Optional[Tuple[int, int, int]]:
    """``(h, w, tail)`` when packed token ids ``[N, k]`` hold one image's ``h x w`` tokens in raster order, then
    ``tail`` tokens of other images, each in raster order under a higher index; else None (random ids). Columns:
    ``(row, col)``, ``(index, row, col)`` (FLUX.1 Kontext) or ``(index, row, col, layer)`` (Flux.2); rows and columns
    step evenly, by 1 or by a model's scale (FLUX.3's ``image_rope_scale``)."""
    if not ids:
        return None
    at = 0 if len(ids[0]) == 2 else 1  # the row's column
    segments = []
    start = 0
    while start < len(ids):
        rows = ids[start:]
        index = rows[0][0] if at else None
        if segments and (index is None or index <= segments[-1][0]):
            return None
        count = len(rows) if index is None else next((i for i, row in enumerate(rows) if row[0] != index), len(rows))
        top, left = rows[0][at], rows[0][at + 1]
        width = next((i for i in range(1, count) if rows[i][at] != top), count)
        col_step = rows[1][at + 1] - left if width > 1 else 1.0
        row_step = rows[width][at] - top if count > width else 1.0
        if count % width or col_step <= 0 or row_step <= 0 or any(
            not _near(rows[i][at], top + (i // width) * row_step) or not _near(rows[i][at + 1], left + (i % width) * col_step)
            for i in range(count)
        ):
            return None
        segments.append((index, count // width, width))
        start += count
    _, height, width = segments[0]
    return height, width, len(ids) - height * width


def trailing_raster(ids: Sequence[Sequence[float]]) -> Optional[Tuple[int, int, int]]:
    """``(h, w, head)`` when packed token ids ``[N, k]`` (``k > 2``: an index column first) end with one image's
    ``h x w`` tokens in raster order under their own index, after ``head`` tokens of other images (Flux.2 Klein
    KV's first step puts its reference images first); None otherwise."""
    if not ids or len(ids[0]) < 3:
        return None
    index = ids[-1][0]
    start = len(ids)
    while start and ids[start - 1][0] == index:
        start -= 1
    found = leading_raster(ids[start:])
    if found is None or found[2] or (start and leading_raster(ids[:start]) is None):  # the head: images too
        return None
    return found[0], found[1], start


def trailing_frames(coords: Sequence[Sequence[float]]) -> Optional[Tuple[int, int, int, int]]:
    """``(frames, h, w, head)`` when per-token coordinates ``(t, h, w)`` end with a video's frames, each ``h x w``
    tokens in raster order later than the one before, after ``head`` tokens that are such frames too (LTX-Video's
    conditioning frames); None otherwise (frames of one token are no grid)."""
    if not coords:
        return None
    last = coords[-1][0]
    width_start = len(coords)
    while width_start and coords[width_start - 1][0] == last:
        width_start -= 1
    pattern = [row[1:] for row in coords[width_start:]]
    frame = leading_raster(pattern)
    size = len(pattern)
    if frame is None or frame[2] or size < 2:
        return None
    frames, start = 1, width_start
    while start >= size:
        previous = coords[start - size : start]
        if any(row[0] != previous[0][0] for row in previous) or previous[0][0] >= coords[start][0]:
            break
        if any(not _near(a[1], b[0]) or not _near(a[2], b[1]) for a, b in zip(previous, pattern)):
            break
        frames, start = frames + 1, start - size
    if start and trailing_frames(coords[:start]) is None:
        return None
    return frames, frame[0], frame[1], start


def indicated_run(
    roles: Sequence[Sequence[float]], image: float, ids: Sequence[Sequence[Sequence[float]]],
    segments: Optional[Sequence[Sequence[float]]] = None,
) -> Optional[Tuple[int, int, int, int]]:
    """``(rows, cols, head, tail)`` of the image's last run in packed rows: per-token ``roles`` ``[B][L]`` whose last
    run of role ``image`` sits at the same place in every row (``head`` tokens before it, ``tail`` after), in one
    segment and under the same ids ``[B][L][k]`` ``(t, row, col)`` of a video's frames (:func:`trailing_frames`),
    read as ``frames * h`` rows of ``w`` columns. None otherwise."""
    if not roles or not roles[0] or image not in roles[0]:
        return None
    end = max(i for i, role in enumerate(roles[0]) if role == image) + 1
    start = end - 1
    while start and roles[0][start - 1] == image:
        start -= 1
    run = [list(token) for token in ids[0][start:end]]
    placed = [role == image for role in roles[0][max(start - 1, 0) :]]  # the token before the run, the run, after it
    for b, row in enumerate(roles):  # a single row of ids or segments: one layout for every row
        if [role == image for role in row[max(start - 1, 0) :]] != placed:
            return None
        if segments is not None and len(set(segments[min(b, len(segments) - 1)][start:end])) != 1:
            return None
        if [list(token) for token in ids[min(b, len(ids) - 1)][start:end]] != run:
            return None
    grid = trailing_frames(run) if len(run[0]) == 3 else None
    if grid is None or grid[3]:
        return None
    return grid[0] * grid[1], grid[2], start, len(roles[0]) - end


def _near(value: float, expected: float) -> bool:
    """Equal up to float32 rounding of position ids."""
    return abs(value - expected) <= 1e-5 * max(1.0, abs(expected))


def finest_attention_level(down_blocks_with_attention: Sequence[bool]) -> int:
    """Downsample factor of the first UNet down block that has transformer blocks (2**index); a model without
    attention in its down path counts as its deepest level."""
    for index, has_attention in enumerate(down_blocks_with_attention):
        if has_attention:
            return 2**index
    return 2 ** max(len(down_blocks_with_attention) - 1, 0)


def spatial_size(x: Any, data_format: str) -> Tuple[int, int]:
    """The ``(h, w)`` of a feature map ``x`` laid out as ``data_format`` (``"NCHW"``, or Flax's ``"NHWC"``)."""
    shape = get_ops(x).shape(x)
    return (shape[1], shape[2]) if data_format == "NHWC" else (shape[-2], shape[-1])
