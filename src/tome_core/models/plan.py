"""The model plan: what patching one model means, read from the model and the options once per ``patch``: the
driver checks and attaches from it, and nothing walks the model again. Framework-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, FrozenSet, NamedTuple, Optional, Tuple

from ..config import ToMeConfig
from ..framework import Framework
from .families import BlockFamily, Sublayer, child_at, model_layout
from .model_tree import block_levels, blocks_of, finest_level, is_unet_like
from .selection import ModelFacts, block_ratios, selected_blocks


class MergedSublayer(NamedTuple):
    """One sub-layer that merges: its block's index (stream), block, family, level and ``block_ratios`` entry (or
    None), the family's description of the sub-layer and the sub-layer module."""

    stream: int
    block: Any
    family: BlockFamily
    level: Optional[int]
    ratio: Optional[float]
    sublayer: Sublayer
    target: Any


@dataclass(frozen=True)
class ModelPlan:
    """One model as ``config`` patches it (built by :func:`plan_model`)."""

    model: Any
    config: ToMeConfig
    blocks: Tuple[Tuple[Any, BlockFamily], ...]  # the spatial blocks of a known family, in module order (streams)
    levels: Tuple[Optional[int], ...]  # each block's level (downsample factor), None where the model does not tell
    finest: int  # the downsample factor of the finest level with attention (1 in a transformer)
    merged: Tuple[MergedSublayer, ...]  # every sub-layer that merges under config, block by block
    choices: Tuple[Tuple[int, ToMeConfig], ...]  # what mode="auto" runs (ToMeConfig.auto_choices)
    lent: FrozenSet[int]  # ids of the modules inside the children the model lends (ModelLayout.lent)

    @property
    def where(self) -> str:
        return type(self.model).__qualname__

    @property
    def deepest(self) -> int:
        """The coarsest level that merges (:meth:`ModelFacts.deepest`)."""
        return self.facts.deepest(self.config)

    @property
    def hooked(self) -> Tuple[MergedSublayer, ...]:
        """The merged sub-layers that get hooks: those of blocks at a level that can merge."""
        return tuple(m for m in self.merged if m.level is None or m.level <= self.deepest)

    @property
    def streams(self) -> int:
        """How many block streams draw partitions (the last merged block's index + 1)."""
        return max((m.stream for m in self.merged), default=-1) + 1

    @property
    def size_aware(self) -> bool:
        """Whether some merged self-attention runs size-aware under one of the choices."""
        return any(
            choice.arrangement(m.sublayer.kind, m.sublayer.attention)[1] for m in self.merged for _, choice in self.choices
        )

    @property
    def rising(self) -> bool:
        """Whether the model's timestep rises while sampling (then a falling one starts a generation)."""
        return any(family.timesteps_rise for _, family in self.blocks)

    @property
    def facts(self) -> ModelFacts:
        """What :func:`~tome_core.models.selection.check_model` checks the options against."""
        timesteps = max((family.timesteps for _, family in self.blocks), default=None)
        return ModelFacts(self.where, self.finest, self.levels, timesteps)


def plan_model(fw: Framework, model: Any, config: ToMeConfig) -> ModelPlan:
    """The plan of ``model`` (one found by :func:`~tome_core.models.model_tree.find_models`) under ``config``; block
    indices of ``blocks`` and ``block_ratios`` outside the model raise here."""
    blocks = tuple(blocks_of(fw, model))
    levels = tuple(block_levels(fw, model, blocks))
    where = type(model).__qualname__
    chosen = set(selected_blocks(config, len(blocks), where))
    ratios = block_ratios(config, len(blocks), where)
    merged = tuple(
        MergedSublayer(stream, block, family, levels[stream], ratios.get(stream), sublayer, target)
        for stream, (block, family) in enumerate(blocks) if stream in chosen
        for sublayer in family.sublayers if config.sublayers[sublayer.kind]
        for target in (child_at(block, sublayer.child),) if target is not None and fw.is_module(target)
    )
    # keys and values in cells only where every merged self-attention takes them apart from its queries
    kv_input = all(m.sublayer.kv_input is not None or m.sublayer.projections for m in merged if m.sublayer.kind == "attn")
    lent = frozenset(
        id(m) for path in model_layout(type(model)).lent if fw.is_module(child_at(model, path))
        for m in fw.submodules(child_at(model, path))
    )
    return ModelPlan(
        model=model, config=config, blocks=blocks, levels=levels, finest=finest_level(fw, model, blocks),
        merged=merged, choices=config.auto_choices(kv_input, is_unet_like(model)), lent=lent,
    )
