"""Which blocks of a model merge, at which level and ratio: the options checked against one model at ``patch``
(:func:`check_model`), so that every option either acts on the model or is refused (or warned of) before anything
is attached. Framework-free: the driver gives each block's level and the kinds of sub-layer each block has."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Optional, Sequence

from ..config import LEVELS, SUBLAYERS, ToMeConfig


# What each kind of sub-layer is, for messages.
KIND_NAMES = {"attn": "self-attention", "crossattn": "cross-attention", "mlp": "a feed-forward (MLP)"}


def scale(level: int) -> str:
    """A level as users see it: ``1/2 scale`` for the level downsampled 2x."""
    return f"1/{level} scale"


def _resolve(name: str, indices: Sequence[int], count: int, where: str) -> List[int]:
    """Block indices (negative from the end) resolved against ``count``; one block named twice is refused."""
    resolved: Dict[int, int] = {}
    for index in indices:
        if not -count <= index < count:
            raise ValueError(f"{name}: index {index} is out of range for {where}, which has {count} transformer blocks")
        block = index % count
        if block in resolved:
            raise ValueError(
                f"{name} names block {block} of {where} twice ({resolved[block]} and {index}; it has {count} "
                "blocks, negative indices count from the end): name each block once"
            )
        resolved[block] = index
    return list(resolved)


def selected_blocks(config: ToMeConfig, count: int, where: str) -> List[int]:
    """Indices of the blocks that merge (``config.blocks``, negative from the end), checked against ``count``."""
    if config.blocks is None:
        return list(range(count))
    return sorted(_resolve("blocks", config.blocks, count, where))


def block_ratios(config: ToMeConfig, count: int, where: str) -> Dict[int, float]:
    """``config.block_ratios`` with indices resolved against ``count`` blocks; each must be a merged block."""
    given = config.block_ratios or {}
    resolved = dict(zip(_resolve("block_ratios", list(given), count, where), given.values()))
    if config.blocks is not None:
        chosen = set(selected_blocks(config, count, where))
        outside = sorted(set(resolved) - chosen)
        if outside:
            raise ValueError(
                f"block_ratios gives block {outside[0]} of {where} a ratio, but blocks={list(config.blocks)} leaves it "
                "unmerged: add it to blocks or drop its ratio"
            )
    return resolved


@dataclass(frozen=True)
class ModelFacts:
    """What the driver tells about one model: its name, the finest level with attention, the level of each
    transformer block in module order (``None``: not known), and the largest timestep it receives (``None``:
    not known)."""

    where: str
    finest: int
    levels: Sequence[Optional[int]]
    timesteps: Optional[float] = None

    def deepest(self, config: ToMeConfig) -> int:
        """The coarsest level that merges: ``max_downsample``, or the finest level with attention."""
        return self.finest if config.max_downsample is None else config.max_downsample


def check_model(config: ToMeConfig, facts: ModelFacts, kinds: Optional[Sequence[AbstractSet[str]]] = None) -> None:
    """Refuse options that cannot act on this model (blocks out of range, named twice or never merging, ratios or
    cells of levels where no block merges, unreachable ratios, a timestep range outside the model's); warn when
    valid options merge no token, or act on a kind of sub-layer no merged block has. ``kinds``: the kinds of
    sub-layer each block has, in the order of ``facts.levels`` (None: every kind)."""
    count = len(facts.levels)
    chosen = selected_blocks(config, count, facts.where)
    ratios = block_ratios(config, count, facts.where)
    deepest = facts.deepest(config)
    if config.timestep_range is not None and facts.timesteps is not None:
        low, high = config.timestep_range
        if low > facts.timesteps or high < 0:
            raise ValueError(
                f"timestep_range={config.timestep_range} never merges on {facts.where}, whose timesteps run from 0 "
                f"to {facts.timesteps:g} (the units the model receives from its pipeline); give a range within them"
            )
    if config.max_downsample is not None and config.max_downsample < facts.finest:
        _nothing(facts, f"max_downsample={config.max_downsample} but the finest level with attention is downsampled "
                 f"{facts.finest}x; use max_downsample=None or >= {facts.finest}")
        return
    mergeable = [i for i, level in enumerate(facts.levels) if level is not None and level <= deepest]
    if all(level is not None for level in facts.levels):
        merged_levels = sorted({facts.levels[i] for i in chosen if facts.levels[i] <= deepest})
        reachable = sorted({facts.levels[i] for i in mergeable})
    else:  # levels not known: judged by the range from the finest level with attention
        merged_levels = reachable = [level for level in LEVELS if facts.finest <= level <= deepest]
    never = (
        f"with max_downsample={config.max_downsample!r} the blocks of {facts.where} merge at "
        + ", ".join(scale(level) for level in reachable)
    )
    for name, indices in (("blocks", config.blocks or ()), ("block_ratios", config.block_ratios or {})):
        for index in indices:
            level = facts.levels[index % count]
            if level is not None and level > deepest:
                raise ValueError(
                    f"{name} names block {index} of {facts.where}, which runs at {scale(level)} and never merges: "
                    f"{never} (blocks {', '.join(map(str, mergeable))}); name those, or raise max_downsample to {level}"
                )
    for name in ("level_ratios", "level_cells"):
        for level in getattr(config, name) or {}:
            if level not in merged_levels:
                raise ValueError(
                    f"{name} names level {level} ({scale(level)}), where no block of {facts.where} merges: {never}"
                    + ("" if level > deepest else " (among the blocks selected)")
                )
    zeroed = set()
    merges = config.frames > 1 and config.across_frames > 0
    for block in chosen:
        level = facts.levels[block]
        for at in [level] if level is not None else merged_levels:
            if at > deepest:
                continue
            for sublayer in SUBLAYERS:
                if not config.sublayers[sublayer] or (kinds is not None and sublayer not in kinds[block]):
                    continue
                ratio, option = _ratio_and_option(config, sublayer, at, ratios.get(block), block)
                if ratio > config.max_ratio_at(at) + 1e-12:
                    sx, sy = config.cell_at(at)
                    raise ValueError(
                        f"{option}={ratio:g} cannot be reached at {scale(at)} of {facts.where}, whose cells are "
                        f"{sx}x{sy} (sx, sy or level_cells[{at}]): one token per cell is kept, so at most "
                        f"{config.max_ratio_at(at):g}"
                    )
                if ratio > 0:
                    merges = True
                else:
                    zeroed.add(f"{option}={ratio!r}")
    merged_blocks = [block for block in chosen if facts.levels[block] is None or facts.levels[block] <= deepest]
    have = set().union(*(kinds[block] for block in merged_blocks)) if kinds is not None else set(SUBLAYERS)
    if merges:
        _absent(config, facts, have)
        return
    on = [sublayer for sublayer in SUBLAYERS if config.sublayers[sublayer]]
    if not on:
        reason = "merge_attn, merge_crossattn and merge_mlp are all False"
    elif merged_blocks and not have.intersection(on):
        off = [f"merge_{sublayer}=False" for sublayer in SUBLAYERS if sublayer not in on]
        reason = (
            (" and ".join(off) + ", and " if off else "") + " and ".join(f"merge_{sublayer}=True" for sublayer in on)
            + f" act{'s' if len(on) == 1 else ''} on {' and '.join(KIND_NAMES[sublayer] for sublayer in on)}, which no "
            f"merged block of {facts.where} has"
        )
    elif config.matching == "cell":
        reason = "matching='cell' with 1x1 cells pools nothing"
    elif not chosen:
        reason = "blocks=[] selects no block"
    else:
        reason = f"{', '.join(sorted(zeroed))} (no merged block has a ratio above 0)"
    _nothing(facts, reason)


def _absent(config: ToMeConfig, facts: ModelFacts, have: AbstractSet[str]) -> None:
    """Warn for each option that acts on a kind of sub-layer no merged block has (``have``: the kinds they have).
    ``merge_attn`` is on by default, so only its ratio counts."""
    for kind in SUBLAYERS:
        ratio = getattr(config, f"{kind}_ratio")
        given = ([f"merge_{kind}=True"] if kind != "attn" and config.sublayers[kind] else []) + (
            [f"{kind}_ratio={ratio!r}"] if ratio is not None else []
        )
        if kind not in have and given:
            warnings.warn(
                f"ToMe patch on {facts.where}: {' and '.join(given)} act{'s' if len(given) == 1 else ''} on "
                f"{KIND_NAMES[kind]}, which no merged block of {facts.where} has, so it changes nothing there; "
                "leave it out",
                UserWarning, stacklevel=5,
            )


def _ratio_and_option(config: ToMeConfig, sublayer: str, level: int, block_ratio: Optional[float], block: int):
    """A sub-layer's ratio at ``level`` in a block, and the option that sets it (for messages)."""
    if config.matching == "cell":
        return config.max_ratio_at(level), f"level_cells[{level}]" if level in (config.level_cells or {}) else "ratio"
    if getattr(config, f"{sublayer}_ratio") is not None:
        return getattr(config, f"{sublayer}_ratio"), f"{sublayer}_ratio"
    if block_ratio is not None:
        return block_ratio, f"block_ratios[{block}]"
    if config.level_ratios is not None and level in config.level_ratios:
        return config.level_ratios[level], f"level_ratios[{level}]"
    return config.ratio, "ratio"


def _nothing(facts: ModelFacts, reason: str) -> None:
    warnings.warn(f"ToMe patch on {facts.where} merges no tokens: {reason}", UserWarning, stacklevel=5)
