"""The ToMe options, their defaults and their validation (shared by every framework's entry point)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

MAX_DOWNSAMPLE_CHOICES = (None, 1, 2, 4, 8)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


@dataclass(frozen=True)
class ToMeConfig:
    """Token Merging options. Defaults follow tomesd, except ``max_downsample=None``.

    ratio: fraction of a merged level's tokens removed, in ``[0, 1 - 1/(sx*sy)]``.
    max_downsample: merge blocks whose latent downsample factor is at most this (1, 2, 4 or 8);
        ``None`` (default) means the finest level that has attention (1 on SD 1.x/2.x, 2 on SDXL).
    sx, sy: cell width and height; each cell of the grid keeps one destination token.
    use_rand: place each cell's destination at a pseudo-random position (else the cell's first).
    merge_attn, merge_crossattn, merge_mlp: merge around self-attention, cross-attention, feed-forward.
    seed: seeds the destination placement; with the timestep it fully determines the partition.
    """

    ratio: float = 0.5
    max_downsample: Optional[int] = None
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("sx", self.sx, 1)
        _check_int("sy", self.sy, 1)
        for flag in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            _check_bool(flag, getattr(self, flag))
        _check_int("seed", self.seed, 0)
        if self.max_downsample not in MAX_DOWNSAMPLE_CHOICES or isinstance(self.max_downsample, bool):
            raise ValueError(f"max_downsample must be one of None, 1, 2, 4, 8, got {self.max_downsample!r}")
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio must be a float in [0, 1), got {ratio!r} ({type(ratio).__name__})")
        if not (math.isfinite(ratio) and 0 <= ratio < 1):
            raise ValueError(f"ratio must be in [0, 1), got {ratio!r}")
        reachable = self.max_ratio
        if ratio > reachable:
            raise ValueError(
                f"ratio={ratio!r} cannot be reached with sx={self.sx}, sy={self.sy}: one token per "
                f"{self.sx}x{self.sy} cell is kept, so ratio must be at most 1 - 1/(sx*sy) = {reachable:g}"
            )

    @property
    def max_ratio(self) -> float:
        """The largest ratio the cell size allows: every source merged, one destination per cell kept."""
        return 1 - 1 / (self.sx * self.sy)

    @property
    def merges_anything(self) -> bool:
        return self.ratio > 0 and (self.merge_attn or self.merge_crossattn or self.merge_mlp)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ToMeConfig":
        """Build from keyword options; unknown names raise TypeError listing the valid ones."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown ToMe option(s) {', '.join(unknown)}; valid options are {', '.join(names)}")
        return cls(**options)
