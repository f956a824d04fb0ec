"""Levels: which blocks of a UNet merge, judged by how far their token grid is downsampled from the latent."""

from __future__ import annotations

import math
from typing import Optional, Tuple


def downsample_factor(latent_hw: Tuple[int, int], tokens: int) -> int:
    """tomesd's level measure: ``ceil(sqrt((H*W) // N))`` for a block of ``N`` tokens."""
    height, width = latent_hw
    return max(1, math.ceil(math.sqrt((height * width) // tokens)))


def level_grid(latent_hw: Tuple[int, int], factor: int) -> Tuple[int, int]:
    """The token grid ``(ceil(H/d), ceil(W/d))`` of a level ``d`` below the latent ``H x W``."""
    height, width = latent_hw
    return math.ceil(height / factor), math.ceil(width / factor)


def block_grid(latent_hw: Tuple[int, int], factor: int, seen_hw: Optional[Tuple[int, int]], tokens: int) -> Tuple[int, int]:
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


def levels_below(finest: int, max_downsample: int) -> Tuple[int, ...]:
    """The power-of-two levels from ``finest`` up to ``max_downsample`` (empty when none qualify)."""
    levels = []
    factor = finest
    while factor <= max_downsample:
        levels.append(factor)
        factor *= 2
    return tuple(levels)
