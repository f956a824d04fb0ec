"""Per-model run state that an adapter's hooks update and a block's match reads. Framework-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .backend import get_ops
from .config import ToMeConfig
from .levels import block_grid, downsample_factor
from .match import Match, bipartite_match, identity_match
from .partition import random_offsets

SUBLAYER_OPTION = {"attn": "merge_attn", "crossattn": "merge_crossattn", "mlp": "merge_mlp"}


@dataclass
class LevelStats:
    """What merging did at one level during the last model call."""

    blocks: int = 0
    tokens: int = 0
    kept: int = 0


@dataclass
class ToMeState:
    """What one patched model (a UNet or a ControlNet) knows while it runs.

    The adapter calls :meth:`begin_call` when the model is entered, :meth:`enter_grid` when a transformer
    sees its 2-D token grid, and :meth:`block_match` with each transformer block's input.
    ``finest_level`` is the downsample factor of the model's finest level with attention; it resolves
    ``max_downsample=None``.
    """

    config: ToMeConfig
    finest_level: int = 1
    latent_hw: Optional[Tuple[int, int]] = None
    grid_hw: Optional[Tuple[int, int]] = None
    step: Any = 0
    stats: Dict[int, LevelStats] = field(default_factory=dict)

    @property
    def max_downsample(self) -> int:
        return self.config.max_downsample if self.config.max_downsample is not None else self.finest_level

    def summary(self) -> str:
        """One line per level of the last call: blocks merged and tokens before and after."""
        lines = [
            f"  level 1/{factor}: {level.blocks} blocks, {level.tokens} -> {level.kept} tokens"
            f" ({1 - level.kept / level.tokens:.0%} merged)"
            for factor, level in sorted(self.stats.items())
        ]
        return "\n".join(lines) if lines else "  no block merged"

    def merges(self, sublayer: str) -> bool:
        """Whether ``sublayer`` ("attn", "crossattn" or "mlp") is wrapped in merge/unmerge."""
        return getattr(self.config, SUBLAYER_OPTION[sublayer])

    def begin_call(self, latent_hw: Optional[Tuple[int, int]], step: Any) -> None:
        """Start a model call on a latent of ``latent_hw`` (None: the first grid seen) at ``step``."""
        self.latent_hw = latent_hw
        self.grid_hw = None
        self.step = step
        self.stats = {}

    def enter_grid(self, grid_hw: Tuple[int, int]) -> None:
        self.grid_hw = grid_hw
        if self.latent_hw is None:
            self.latent_hw = grid_hw

    def block_match(self, metric: Any, stream: int) -> Match:
        """The match for one block's input ``metric`` ``[B, N, C]``; ``stream`` tells blocks apart."""
        ops = get_ops(metric)
        tokens = ops.shape(metric)[1]
        latent = self.latent_hw or self.grid_hw
        if latent is None:
            raise RuntimeError(
                "a transformer block ran before its model or transformer gave the latent size: ToMe needs the "
                "blocks inside a UNet, a ControlNet or a 2-D transformer (Transformer2DModel) to know their grid"
            )
        factor = downsample_factor(latent, tokens)
        if factor > self.max_downsample or self.config.ratio == 0:
            return identity_match(ops, ops.shape(metric)[0], tokens)
        config = self.config
        h, w = block_grid(latent, factor, self.grid_hw, tokens)
        offsets = (
            random_offsets(ops, metric, h, w, config.sx, config.sy, config.seed, self.step, stream)
            if config.use_rand and (h // config.sy) * (w // config.sx) > 0
            else None
        )
        match = bipartite_match(ops, metric, h, w, config.sx, config.sy, int(tokens * config.ratio), offsets)
        level = self.stats.setdefault(factor, LevelStats())
        level.blocks += 1
        level.tokens = tokens
        level.kept = match.kept
        return match
