"""What a patched model's last call merged, level by level, and what the patch has told its user: the statistics
behind ``summary()`` and the warnings said once. Framework-free."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..algorithm.match import Match
from ..config import ToMeConfig
from ..models.selection import scale


@dataclass
class LevelStats:
    """What merging did at one level during the last model call."""

    blocks: int = 0
    tokens: int = 0
    kept: int = 0
    frames: int = 1  # > 1: tokens and kept count a chunk of this many frames (cross-frame merging)


# A block's level in a call's statistics: (downsample factor, why its options are the fallback's, or None).
Level = Tuple[int, Optional[str]]


@dataclass
class Ledger:
    """The last call's statistics, by level: blocks whose merged sub-layer ran on fewer tokens (``stats``; under
    the fallback arrangement, ``fallbacks``), and blocks that ran unmerged, and why (``unpaid``: merging would not
    pay; ``too_small``: the grid holds nothing to merge; ``held``: the call's own arguments; ``passes``: a matched
    self-attention ran on all its tokens). Blocks are counted as their sub-layers' calls return, not as they
    match. ``said`` holds the warnings given (each once per patch); ``inform`` is where a word that is not a
    warning goes (the framework's logger at info level, ``Framework.inform``)."""

    where: str = "the model"  # the patched model's class, for messages
    stats: Dict[int, LevelStats] = field(default_factory=dict)
    fallbacks: Dict[Level, LevelStats] = field(default_factory=dict)
    unpaid: Dict[int, Tuple[LevelStats, str]] = field(default_factory=dict)
    too_small: Dict[int, str] = field(default_factory=dict)
    held: Dict[str, int] = field(default_factory=dict)
    passes: Dict[Tuple[int, str, str], LevelStats] = field(default_factory=dict)
    said: set = field(default_factory=set)
    inform: Callable[[str], None] = field(default=logging.getLogger("tome_core").info, repr=False, compare=False)
    started: bool = False  # a call has begun since patch

    def start_call(self) -> None:
        self.started = True
        self.stats, self.fallbacks, self.unpaid, self.too_small, self.passes, self.held = ({} for _ in range(6))

    def count(self, level: Level, match: Match) -> None:
        """Count a block at ``level``: its sub-layer merged by ``match`` ran."""
        factor, fallback = level
        stats = self.stats.setdefault(factor, LevelStats()) if fallback is None else self.fallbacks.setdefault(level, LevelStats())
        stats.blocks += 1
        stats.tokens, stats.kept = match.grid_tokens
        stats.frames = match.frames

    def passed(self, level: Level, sublayer: str, why: str, tokens: int) -> None:
        """Count a block at ``level`` whose matched ``sublayer`` ran on all its ``tokens`` tokens, because of ``why``."""
        stats = self.passes.setdefault((level[0], sublayer, why), LevelStats())
        stats.blocks += 1
        stats.tokens = stats.kept = tokens

    def hold(self, why: str) -> None:
        """Count a block that this call's own arguments run unmerged, because of ``why``."""
        self.held[why] = self.held.get(why, 0) + 1

    def unpaid_block(self, factor: int, why: str, tokens: int) -> None:
        """Count a block of ``tokens`` tokens at level ``factor`` that runs unmerged: merging would not pay (``why``)."""
        if factor not in self.unpaid:
            self.unpaid[factor] = (LevelStats(), why)
        level = self.unpaid[factor][0]
        level.blocks += 1
        level.tokens = level.kept = tokens

    def say_once(self, message: str) -> None:
        """Warn ``message`` the first time this patch has it to say."""
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, UserWarning, stacklevel=3)

    def tell_unpaid(self, factor: int, why: str, min_tokens: Optional[int]) -> None:
        """Tell the user once per patch (:attr:`inform`) that blocks at level ``factor`` run unmerged (``why``), and how
        to merge anyway: otherwise a patch that merges nothing looks like one that merges."""
        if UNPAID in self.said:
            return
        self.said.add(UNPAID)
        how = (
            "To merge there, lower min_tokens (0 merges at every size)" if min_tokens is not None else
            "To merge at every size, pass min_tokens=0 or choose the arrangement yourself (mode='tokens' or "
            "mode='kv', or a ratio)"
        )
        self.inform(
            f"ToMe on {self.where}: its blocks at {scale(factor)} run unmerged: {why}. {how}; summary() tells what "
            "each call merged (said once)"
        )

    def summary(self, active: ToMeConfig, fallback: Optional[ToMeConfig], notes: List[str]) -> List[str]:
        """One line per level of the last call (named by its scale: ``1/2`` is the level at half the latent's
        width): the blocks whose merged sub-layer ran on fewer tokens, tokens before and after (what their attention
        saw), and the arrangement (``active``'s); ``notes`` on them; then the blocks that ran under the ``fallback``
        arrangement, those that ran unmerged, and those whose self-attention ran on all its tokens, and why."""
        lines = [_summary_line(active, factor, level) for factor, level in sorted(self.stats.items())]
        lines += notes if lines else []
        lines += [
            _summary_line(fallback, factor, level) + f"; {why}, so ToMe for SD's arrangement runs there"
            for (factor, why), level in sorted(self.fallbacks.items())
        ]
        lines += [f"  {scale(factor)}: {level.blocks} blocks unmerged: {why}" for factor, (level, why) in sorted(self.unpaid.items())]
        lines += [f"  {scale(factor)}: no block merged: {why}" for factor, why in sorted(self.too_small.items())]
        lines += [f"  {blocks} blocks unmerged: {why}" for why, blocks in sorted(self.held.items())]
        lines += [
            f"  1/{factor} scale: {level.blocks} blocks ran {sublayer} on all {level.tokens} tokens: {why}"
            for (factor, sublayer, why), level in sorted(self.passes.items())
        ]
        return lines


UNPAID = "unpaid"  # in Ledger.said: the user was told that merging would not pay at some level


def shown_sublayer(matches: Dict[str, Match]) -> str:
    """The sub-layer kind whose match a block's line of the summary shows: its self-attention's, else its first
    merged sub-layer's."""
    return "attn" if "attn" in matches else next(iter(matches))


def _summary_line(config: ToMeConfig, factor: int, level: LevelStats) -> str:
    kind = "keys/values" if config.mode == "kv" else "queries" if config.mode == "queries" else "tokens"
    how = "x".join(map(str, config.cell_at(factor))) + " cells" if config.matching == "cell" else "similarity"
    chunk = f" (chunks of {level.frames} frames)" if level.frames > 1 else ""
    return (
        f"  1/{factor} scale: {level.blocks} blocks, {level.tokens} -> {level.kept} {kind}{chunk}"
        f" ({1 - level.kept / level.tokens:.0%} merged; {config.mode}, {how})"
    )
