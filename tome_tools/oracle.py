"""The benchmark's oracle: free token removal, the limit of what token reduction saves.

ToMe's own hooks at the blocks, levels and sizes where a configuration merges, in its arrangement, with each match
keeping the first of its tokens instead (:class:`FirstTokens`, plugged into the library's
:class:`~tome_core.algorithm.match.Matcher` seam): a merged sub-layer runs on as many tokens as ToMe's with no similarity,
mean or size bias to compute. So every family, rotary table, mask and layout the patch knows, the oracle knows too.
Framework-free (the library's array ops); Flax's bench keeps a table of counts instead
(:class:`tome_tools.flax_bench.OraclePlan`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from tome_core import driver
from tome_core.config import ToMeConfig
from tome_core.framework import Framework
from tome_core.algorithm.match import TOME, Match, identity_match
from tome_core.algorithm.ops import Array, ArrayOps
from tome_core.algorithm.partition import Draw, cached, num_cells
from tome_core.models.plan import plan_model
from tome_core.hooks.retyping import Patch


def first_tokens_match(ops: ArrayOps, like: Array, batch: int, tokens: int, kept: int) -> Match:
    """A match that keeps the first ``kept`` of each batch item's ``tokens`` tokens: merge takes their rows (a
    gather, the rest dropped), unmerge gives token ``i`` the value of slot ``i % kept``, every slot stands for one
    token at its own position. A function of the shape only, built once per shape and device in a call;
    ``kept >= tokens`` merges nothing."""
    if kept >= tokens:
        return identity_match(ops, batch, tokens)
    if kept < 1:
        raise ValueError(f"a match keeps at least one of its {tokens} tokens, not {kept}")

    def build() -> Match:
        item = ops.reshape(ops.arange(batch, like), (batch, 1))
        slot = ops.reshape(ops.arange(tokens, like) % kept, (1, tokens))
        first = ops.reshape(ops.arange(kept, like), (1, kept))
        return Match(
            ops=ops, rows=ops.reshape(slot + item * kept, (batch * tokens,)), sizes=ops.ones((batch, kept, 1), like),
            batch=batch, tokens=tokens, merged=tokens - kept, representatives=ops.broadcast_to(first, (batch, kept)),
            picked=ops.reshape(first + item * tokens, (batch * kept,)),
        )

    return cached(ops, like, ("match", "first tokens", batch, tokens, kept), build)


class CountedMatcher:
    """ToMe's own matcher (:data:`~tome_core.algorithm.match.TOME`), recording the grid of each call in ``grids``:
    how many matches a run computes, through the library's matcher seam."""

    sized = True

    def __init__(self) -> None:
        self.grids: list = []

    def __call__(self, ops: ArrayOps, metric: Array, grid: Optional[Tuple[int, int]], *rest: Any, **options: Any) -> Dict[str, Match]:
        self.grids.append(grid)
        return TOME(ops, metric, grid, *rest, **options)


class FirstTokens:
    """A :class:`~tome_core.algorithm.match.Matcher` whose every match keeps the first tokens, as many as ToMe's keeps there
    (similarity: the counts; cells: one token per full cell and the leftovers; no full cell: every token). Its
    kept tokens each stand for themselves, so no size-aware attention is armed (``sized``). Its matches cover the
    grid alone (``around`` is not carried: the block keeps the tokens around the grid apart)."""

    sized = False

    def __call__(
        self, ops: ArrayOps, metric: Array, grid: Optional[Tuple[int, int]], cell: Tuple[int, int],
        merged: Dict[str, int], config: ToMeConfig, draw: Optional[Draw], across: int, shared: bool, frames: int,
        video: Tuple[int, int], around: Tuple[int, int] = (0, 0),
    ) -> Dict[str, Match]:
        if frames > 1:
            raise ValueError(_CHUNKS.format(frames=frames))
        batch, tokens = ops.shape(metric)[:2]
        sx, sy = cell
        cells = 0 if grid is None else num_cells(*grid, sx, sy)
        pooled = tokens - cells * (sx * sy - 1)
        return {
            sublayer: first_tokens_match(
                ops, metric, batch, tokens,
                tokens if not count or not cells else pooled if config.matching == "cell" else tokens - count,
            )
            for sublayer, count in merged.items()
        }


_CHUNKS = "the oracle removes tokens per frame and cannot follow frames_per_chunk={frames} (cross-frame merging)"


def attach_oracle(fw: Framework, model: Any, config: ToMeConfig) -> Patch:
    """Hook ``model`` (one found by :func:`tome_core.models.model_tree.find_models`) with the oracle of ``config``: the
    patch's own hooks, checked as :func:`tome_core.driver.patch` checks them, with :class:`FirstTokens` finding
    every match. Returns the patch; its ``remove()`` takes the hooks off, its ``state`` is the oracle's run state.
    Cross-frame merging (``frames_per_chunk > 1``) is refused: the oracle removes tokens frame by frame."""
    if config.frames > 1:
        raise ValueError(_CHUNKS.format(frames=config.frames))
    plan = plan_model(fw, model, config)
    driver.check(fw, plan)
    patch = driver.attach_hooks(fw, plan, driver.model_state(plan, FirstTokens()))
    for target in patch.targets:  # each merged sub-layer gets the patch's class, as a patch's do
        patch.retype(target)
    return patch
