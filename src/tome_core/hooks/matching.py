"""How a patched model's blocks get their matches: a block's image tokens, its place and its options in, its
matches out, found by the matcher (ToMe's own by default) and kept for reuse where the options ask. Framework-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..algorithm.match import TOME, Match, Matcher
from ..algorithm.ops import ArrayOps
from ..algorithm.partition import Draw
from ..config import ToMeConfig
from ..models.levels import Place


@dataclass
class Matching:
    """The matcher of one patched model, the partitions its current call has drawn (by grid and seed, for its
    ``streams`` block streams together: :class:`~tome_core.algorithm.partition.Draw`), and the matches kept for
    reuse (``reuse_level``, ``reuse_blocks``, ``reuse_steps``) with what decides when they go: the count of calls
    and, with ``reuse_steps > 1``, the generation (the ``pipeline`` patched with the model, or the timesteps)."""

    matcher: Matcher = field(default=TOME, repr=False, compare=False)
    streams: int = 0
    cache: Dict[Any, Dict[str, Match]] = field(default_factory=dict)
    drawn: Dict[Tuple[int, ...], Any] = field(default_factory=dict)
    calls: int = 0
    last_timestep: Optional[float] = None  # with reuse_steps > 1: the previous call's (largest) timestep
    pipeline: Any = None  # with reuse_steps > 1: the pipeline patched with the model (call_hooks.PipelineWatch)
    generation: Any = None  # with reuse_steps > 1: the pipeline's generation of the previous call

    def start_call(self, reuse_steps: int) -> None:
        """A call begins: matches kept from earlier calls go unless ``reuse_steps`` keeps them for this one."""
        if reuse_steps == 1:
            self.cache = {}  # also where reuse_blocks keeps its matches within the call
        else:  # the call counter is read only here, so compiled models do not specialise on it otherwise
            if self.calls % reuse_steps == 0:
                self.cache = {}
            self.calls += 1
        self.drawn = {}

    def follow_generation(self, timestep: float, generation: Any = None) -> None:
        """With ``reuse_steps > 1``, before each call: its (largest) timestep and its pipeline's ``generation``, if any.
        A new generation drops the matches and counts calls from 0, so a seed gives the same image in every one.
        Without the pipeline, a timestep above the previous call's starts one (sampling runs from high noise to
        low); calls at one timestep (conditional and unconditional halves) stay in one."""
        if generation is not None:
            if generation != self.generation:
                self.calls = 0
                self.cache = {}
            self.generation = generation
        elif self.last_timestep is not None and timestep > self.last_timestep:
            self.calls = 0
            self.cache = {}
        self.last_timestep = timestep

    def find(
        self, ops: ArrayOps, metric: Any, place: Place, config: ToMeConfig, merged: Dict[str, int], cell: Tuple[int, int],
        frames: int, video: Tuple[int, int], step: Any, stream: int, shared: bool, block_ratio: Optional[float],
        reuse: bool, around: Tuple[int, int] = (0, 0),
    ) -> Dict[str, Match]:
        """The matches of a block ``stream`` whose image tokens ``metric`` ``[B, N, C]`` lie at ``place``, merging
        ``merged`` tokens per sub-layer in ``cell`` cells, under ``config`` at ``step``; ``frames``: frames per
        cross-frame chunk; ``video``: ``(frame_rows, offset)`` of the frames its grid stacks; ``shared``: one match
        for the whole batch; ``reuse``: the options keep matches, looked up here first. A match is reused only where
        its partition would be drawn alike: the same grid (not just as many tokens), cells and frames; so a kept
        one covers the grid alone, where a fresh one may carry the ``around`` tokens (``(before, after)``) too."""
        batch, tokens = ops.shape(metric)[:2]
        first = stream - stream % config.reuse_blocks  # the block whose match a run of reuse_blocks shares
        key = (place.factor if config.reuse_level else ("block", first), batch, tokens, place.grid, cell, video, shared, block_ratio, frames)
        matches = self.cache.get(key) if reuse else None
        if matches is None:
            across = int((frames - 1) * place.tokens * config.across_frames)
            grid = grid_of(place) if any(merged.values()) or across else None  # None: no partition, nothing merges
            draw = Draw(config.seed, step, first, self.streams, self.drawn) if config.use_rand and grid is not None else None
            joined = {"around": around} if any(around) and not reuse else {}
            matches = self.matcher(ops, metric, grid, cell, merged, config, draw, across, shared, frames, video, **joined)
            if reuse:
                self.cache[key] = matches
        return matches


def grid_of(place: Place) -> Tuple[int, int]:
    """The block's grid, refused where its tokens lie on none (:class:`~tome_core.models.levels.Place`)."""
    if place.grid is None:
        raise ValueError(place.problem)
    return place.grid
