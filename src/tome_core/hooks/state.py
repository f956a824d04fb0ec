"""Per-model run state that an adapter's hooks update and a block's match reads: the patch's options and its
plan, the facts of the call running now, how its blocks get their matches, and the ledger of what they did.
Framework-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..algorithm.backend import get_ops
from ..algorithm.match import Match
from ..algorithm.ops import ArrayOps
from ..algorithm.partition import stacked_frames, window_limits
from ..config import DEFAULT_FRAME_WINDOW, ToMeConfig
from ..models.cost import why_unpaid
from ..models.levels import Place, block_place, level_grid
from ..models.selection import scale
from .call import CallFacts
from .ledger import Ledger, Level
from .matching import Matching, grid_of


@dataclass
class ToMeState:
    """What one patched model (a UNet, a transformer or a ControlNet) knows while it runs.

    The adapter's hooks call :meth:`begin_call` when the model is entered, :meth:`enter_grid` when its blocks'
    token grid becomes known, and :meth:`decide` with each transformer block's image tokens. ``config``: the
    patch's options (``choices``: those ``mode="auto"`` chooses among by size, :meth:`choose`); ``finest_level``:
    the downsample factor of the model's finest level with attention (it resolves ``max_downsample=None``);
    ``call``: the facts of the call running now; ``grid_hw``: the grid of the blocks running now; ``active``: the
    call's options; ``matching``: how blocks get their matches (:class:`~tome_core.hooks.matching.Matching`, its
    matcher ToMe's own by default); ``ledger``: what the last call did (:meth:`summary`) and what was said.
    """

    config: ToMeConfig
    finest_level: int = 1
    choices: Tuple[Tuple[int, ToMeConfig], ...] = ()  # ToMeConfig.auto_choices; empty: the config itself
    call: CallFacts = CallFacts()
    grid_hw: Optional[Tuple[int, int]] = None
    matching: Matching = field(default_factory=Matching)
    ledger: Ledger = field(default_factory=Ledger)
    fallback_configs: Dict[bool, ToMeConfig] = field(default_factory=dict)  # :meth:`fallback`'s, by takes_bias
    # a call of the model is in flight (from begin_call to the model's return): the blocks it lends (ModelLayout.lent)
    # run unmerged outside one, when another model that borrowed them runs them (the Z-Image ControlNet runs its
    # transformer's noise refiner); every other block, recomputed in backward after the call, merges as it did
    in_call: bool = False
    detach_after_call: bool = False  # remove() was called inside a running call: the call's end takes the patch off
    active: ToMeConfig = field(init=False, repr=False, compare=False)  # this call's options (:meth:`choose`)

    def __repr__(self) -> str:
        """The options and the finest level; ``summary()`` tells what the last call did."""
        return f"ToMeState(config={self.config!r}, finest_level={self.finest_level}{'' if self.ledger.started else ', no call yet'})"

    def __post_init__(self) -> None:
        self.active = self.choose()

    def choose(self) -> ToMeConfig:
        """The options a call runs with: ``mode="auto"`` resolved by the token count of the latent's finest
        merged level (the first choice whose threshold it reaches). Chosen once per call, as the latent becomes
        known (:meth:`begin_call`, :meth:`enter_grid`), into :attr:`active`, which every block reads."""
        choices = self.choices or ((0, self.config),)
        latent, shards = self.call.latent_hw, self.call.shards
        if latent is None:
            return choices[-1][1]
        height, width = level_grid(latent, self.finest_level)
        pieces = shards.count if shards is not None else 1  # chosen as for the whole sequence
        return next(config for fewest, config in choices if height * width * pieces >= fewest)

    def fallback(self, takes_bias: bool) -> ToMeConfig:
        """What ``mode="auto"`` runs in a block whose self-attention cannot take keys and values apart from its
        queries: ToMe for SD's arrangement (``tokens``, similarity matching at the default ratio), size-aware
        where the processor can take the bias (``takes_bias``). Its blocks are counted apart in
        :meth:`summary`, with the reason."""
        config = self.fallback_configs.get(takes_bias)
        if config is None:
            proportional = self.config.proportional_attn and takes_bias
            config = self.fallback_configs[takes_bias] = self.config.tokens(proportional_attn=proportional)
        return config

    @property
    def max_downsample(self) -> int:
        return self.config.max_downsample if self.config.max_downsample is not None else self.finest_level

    def summary(self) -> str:
        """What the last call merged, one line per level (:meth:`Ledger.summary
        <tome_core.hooks.ledger.Ledger.summary>`), or why it merged nothing."""
        call, config = self.call, self.active
        if not self.ledger.started:
            return "  no call yet: summary() describes the last call of the patched model"
        if not call.merging:
            return f"  no block merged: {call.why or f'the timestep is outside timestep_range={self.config.timestep_range}'}"
        notes = []
        if self.ledger.stats:
            window, frames = config.frame_window, stacked_frames(self._latent()[0], *call.frames(self._latent()))
            if config.matching == "similarity" and not config.local_window and window_limits(frames, window):
                notes.append(f"  (a token meets the destinations within {window} frame{'s' * (window != 1)} of its own, of {frames})")
            if call.shards is not None:
                notes.append(f"  (each of {call.shards.count} processes merges its own piece of the tokens, counted above)")
        fallback = self.fallback(True) if self.ledger.fallbacks else None  # built only where blocks ran it
        lines = self.ledger.summary(config, fallback, notes)
        return "\n".join(lines) if lines else "  no block merged"

    def begin_call(self, call: CallFacts) -> None:
        """Start a model ``call``: its facts, read as it starts; its matches, partitions and statistics, none yet
        (but matches that ``reuse_steps`` keeps)."""
        self.matching.start_call(self.config.reuse_steps)
        self.ledger.start_call()
        self.in_call = True
        self.call, self.grid_hw = call.eager(), None
        if call.merging and not call.frame_rows and self.config.frame_window != DEFAULT_FRAME_WINDOW:
            self.ledger.say_once(
                f"ToMe on {self.ledger.where}: frame_window={self.config.frame_window!r} sets how many frames the "
                "similarity search of a video transformer spans (its frames share one sequence), but a call of it holds "
                "one frame a sequence (an image, a one-frame video, or a video UNet's frames), so it changes nothing "
                "here; it acts in this model's calls of several frames, if any (said once)"
            )
        self.active = self.choose()

    def enter_grid(self, grid_hw: Tuple[int, int]) -> None:
        """The blocks running now lie on ``grid_hw``; the first grid a call is told is its latent's where it gave
        none."""
        self.grid_hw = grid_hw
        if self.call.latent_hw is None:
            self.call = self.call._replace(latent_hw=grid_hw)
            self.active = self.choose()

    def decide(
        self, image: Any, stream: int, shared: bool, block_ratio: Optional[float], config: ToMeConfig,
        fallback: Optional[str], grid: Optional[Tuple[int, int]] = None, around: Tuple[int, int] = (0, 0),
    ) -> Tuple[Optional[Dict[str, Match]], Optional[Level], Optional[Tuple[int, str, int]]]:
        """What a block does with its image tokens ``image`` ``[B, N, C]`` in this merging call, read in one pass:
        ``(matches, level, None)`` where it merges (:meth:`block_matches`; ``level``: where it is counted, None where
        it merges nothing); ``(None, None, unpaid)`` where it runs unmerged for its size: at a level above
        ``max_downsample`` (``unpaid`` None: not counted), or where merging would not pay (:mod:`tome_core.models.cost`;
        ``unpaid``: ``(level, why, tokens)``, counted for :meth:`summary`). ``grid``: the block's own grid, entered
        first (a block whose input is a feature map); the rest as :meth:`block_matches` takes them."""
        if grid is not None:
            self.enter_grid(grid)
        ops, place = found = self._place(image)
        if place.factor > self.max_downsample:
            return None, None, None
        why = self._unpaid(place, config)
        if why is not None:
            self.ledger.unpaid_block(place.factor, why, place.tokens)
            if self.call.execution[1] != "compiled":  # a compiler's trace cannot log (dynamo refuses it in a fullgraph trace)
                self.ledger.tell_unpaid(place.factor, why, self.config.min_tokens)
            return None, None, (place.factor, why, place.tokens)
        matches = self.block_matches(image, stream, shared, block_ratio, config, fallback, place=found, around=around)
        return matches, self._level(place, matches, fallback), None

    def _unpaid(self, place: Place, config: ToMeConfig) -> Optional[str]:
        """Why a block at ``place`` runs unmerged because merging would not pay there (:mod:`tome_core.models.cost`),
        or None where it merges: options that choose the arrangement by hand merge at every size unless
        ``min_tokens`` says otherwise."""
        min_tokens = self.config.min_tokens
        if min_tokens is None and self.config.mode != "auto":
            return None
        shards = self.call.shards
        pieces = shards.count if shards is not None else 1  # decided as for the whole sequence
        device, how = self.call.execution
        arrangement = "cells" if config.matching == "cell" else "similarity"  # a gather; a search and a scatter too
        return why_unpaid(place.tokens * pieces, device, how, arrangement, min_tokens)

    def block_matches(
        self, metric: Any, stream: int, shared: bool = False, block_ratio: Optional[float] = None,
        config: Optional[ToMeConfig] = None, fallback: Optional[str] = None,
        place: Optional[Tuple[ArrayOps, Place]] = None, around: Tuple[int, int] = (0, 0),
    ) -> Dict[str, Match]:
        """One match per merged sub-layer for a block's input ``metric`` ``[B, N, C]`` (:meth:`Matching.find
        <tome_core.hooks.matching.Matching.find>`): as many tokens merge as its level's ratios ask, where its grid
        can merge them. ``stream`` tells blocks apart (it keys their partition and, without ``reuse_level``, their
        reuse); ``shared``: one match for the whole batch (blocks whose tokens carry rotary positions);
        ``block_ratio``: this block's entry of ``block_ratios``; ``config``: its options (default :attr:`active`),
        ``fallback``: why they are :meth:`fallback`'s; ``place``: the metric's backend and place, where
        :meth:`decide` read them; ``around``: the tokens before and after the grid's in what its sub-layers run
        on. Nothing is counted here: the block's hooks count it when its merged sub-layer has run."""
        if not self.call.merging:
            return {}
        ops, place = place or self._place(metric)
        metric = ops.stop_gradient(metric)  # a discrete choice: training keeps nothing of it for backward
        batch, tokens = ops.shape(metric)[:2]
        config = config or self.active
        factor = place.factor
        ratios, cell = config.at_level(factor, block_ratio)
        merges = factor <= self.max_downsample
        merged = {sublayer: int(tokens * ratio) if merges else 0 for sublayer, ratio in ratios.items()}
        frames = self._chunk(batch, config) if merges else 1
        small = self._too_small(place, merged, frames, ratios, cell) if merges and frames == 1 else None
        if small is not None:  # nothing can merge here, whatever the tokens: said once, shown by summary()
            self.ledger.say_once(f"ToMe on {self.ledger.where}: {small}")
            self.ledger.too_small[factor] = small
            merged = dict.fromkeys(merged, 0)
        reuse = small is None and (config.reuse_level or config.reuse_steps > 1 or config.reuse_blocks > 1)
        return self.matching.find(
            ops, metric, place, config, merged, cell, frames, self.call.frames(place.grid), self.call.step, stream,
            shared, block_ratio, reuse, around,
        )

    def _level(self, place: Place, matches: Dict[str, Match], fallback: Optional[str]) -> Optional[Level]:
        if place.factor in self.ledger.too_small or not any(match.merged for match in matches.values()):
            return None
        return place.factor, fallback

    def _place(self, metric: Any) -> Tuple[ArrayOps, Place]:
        ops = get_ops(metric)
        return ops, block_place(self._latent(), ops.shape(metric)[1], self.grid_hw)

    def _latent(self) -> Tuple[int, int]:
        latent = self.call.latent_hw or self.grid_hw
        if latent is None:
            raise RuntimeError(
                "a transformer block ran before its model or transformer gave the latent size: ToMe needs the "
                "blocks inside a UNet, a ControlNet or a 2-D transformer (Transformer2DModel) to know their grid"
            )
        return latent

    def _too_small(
        self, place: Place, merged: Dict[str, int], frames: int, ratios: Dict[str, float], cell: Tuple[int, int],
    ) -> Optional[str]:
        """Why a block at ``place`` (a level this patch merges, its frames merged apart), whose options ask it to
        merge, can merge none of its tokens at this latent size: its grid holds no full cell (no destination), or
        its ``ratios`` times its tokens give no whole token (a 1x1 grid). None where it can merge, or where its
        options merge nothing there by choice (a ratio of 0: said at patch)."""
        if not ratios or max(ratios.values()) <= 0:
            return None
        h, w = grid_of(place)
        sx, sy = cell
        factor = place.factor
        if (h // sy) * (w // sx) == 0:
            return (
                f"a {h}x{w} token grid is smaller than one {sx}x{sy} cell, so its blocks at {scale(factor)} merge "
                "nothing at this latent size (a larger image, or smaller cells: sx, sy)"
            )
        if not any(merged.values()):
            return (
                f"a {h}x{w} token grid has too few tokens for ratio {max(ratios.values()):g} to merge a whole one, so "
                f"its blocks at {scale(factor)} merge nothing at this latent size (a larger image, or a larger ratio)"
            )
        return None

    def _chunk(self, batch: int, config: ToMeConfig) -> int:
        """Frames per chunk of cross-frame merging for a block whose input holds ``batch`` items: 1 unless the
        options ask for it and this is a video call."""
        chunk = config.frames
        if chunk == 1 or not self.call.videos:
            return 1
        frames = batch // self.call.videos
        if frames * self.call.videos != batch or frames % chunk:
            raise ValueError(
                f"frames_per_chunk={chunk} must divide the number of frames, but this call has {frames} frames "
                f"({batch} frame latents for a batch of {self.call.videos}); choose one of "
                f"{', '.join(str(d) for d in range(1, frames + 1) if frames % d == 0)}"
            )
        return chunk
