"""Per-model run state that an adapter's hooks update and a block's match reads. Framework-free."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from ..algorithm.backend import get_ops
from ..algorithm.match import TOME, Match, Matcher
from ..algorithm.ops import ArrayOps
from ..algorithm.partition import Draw, stacked_frames, window_limits
from ..config import DEFAULT_FRAME_WINDOW, ToMeConfig
from ..models.cost import arrangement_of, why_unpaid
from ..models.levels import Place, block_place, level_grid
from ..models.selection import scale
from ..shards import Shards


@dataclass
class LevelStats:
    """What merging did at one level during the last model call."""

    blocks: int = 0
    tokens: int = 0
    kept: int = 0
    frames: int = 1  # > 1: tokens and kept count a chunk of this many frames (cross-frame merging)


# A block's level in a call's statistics: (downsample factor, why its options are the fallback's, or None).
Level = Tuple[int, Optional[str]]

UNPAID = "unpaid"  # in ToMeState.said: the user was told that merging would not pay at some level


@dataclass
class ToMeState:
    """What one patched model (a UNet or a ControlNet) knows while it runs.

    The adapter calls :meth:`begin_call` when the model is entered, :meth:`enter_grid` when a transformer
    sees its 2-D token grid, and :meth:`block_matches` with each transformer block's input.
    ``finest_level`` is the downsample factor of the model's finest level with attention; it resolves
    ``max_downsample=None``. ``matcher`` finds each block's matches (:class:`~tome_core.algorithm.match.Matcher`;
    ToMe's own by default): the state decides where and how many tokens merge, the matcher which.
    """

    config: ToMeConfig
    finest_level: int = 1
    latent_hw: Optional[Tuple[int, int]] = None
    videos: Optional[int] = None  # the batch of a video model's call (its blocks see videos * frames items)
    grid_hw: Optional[Tuple[int, int]] = None
    step: Any = 0
    stats: Dict[int, LevelStats] = field(default_factory=dict)
    calls: int = 0
    cache: Dict[Any, Dict[str, Match]] = field(default_factory=dict)
    choices: Tuple[Tuple[int, ToMeConfig], ...] = ()  # ToMeConfig.auto_choices; empty: the config itself
    merging: bool = True  # False: this call's timestep is outside timestep_range, or ``why`` (it runs unmerged)
    why: Optional[str] = None
    tail: int = 0  # tokens after the grid's in each block's image stream (a reference image's), never merged
    grid_last: bool = False  # tokens past the grid's in a block's image stream come before it (FramePack's history)
    frame_rows: int = 0  # the latent grid stacks a video's frames of this many rows (0: it holds one frame)
    last_timestep: Optional[float] = None  # with reuse_steps > 1: the previous call's (largest) timestep
    pipeline: Any = None  # with reuse_steps > 1: the pipeline patched with the model (call_hooks.PipelineWatch)
    generation: Any = None  # with reuse_steps > 1: the pipeline's generation of the previous call (call_hooks.generation)
    fallbacks: Dict[Tuple[int, str], LevelStats] = field(default_factory=dict)  # (level, why): blocks run as tokens
    too_small: Dict[int, str] = field(default_factory=dict)  # level: why its grid merged nothing in the last call
    # (level, sub-layer, why): blocks whose matched self-attention ran on all its tokens all the same (:meth:`passed`)
    passes: Dict[Tuple[int, str, str], LevelStats] = field(default_factory=dict)
    fallback_configs: Dict[bool, ToMeConfig] = field(default_factory=dict)  # :meth:`fallback`'s, by takes_bias
    unpaid: Dict[int, Tuple[LevelStats, str]] = field(default_factory=dict)  # level: blocks run unmerged, and why
    held: Dict[str, int] = field(default_factory=dict)  # why: blocks this call's own arguments ran unmerged (hold)
    shards: Optional[Shards] = None  # how context parallelism splits this call's tokens (None: it does not)
    where: str = "the model"  # the patched model's class, for warnings
    said: set = field(default_factory=set)  # warnings given (each once per patch), and UNPAID once told
    # where a word for the user goes (:meth:`_tell_unpaid`): the framework's ``Framework.inform`` (its library's
    # logger at info level); Python's logger "tome_core" where no framework gave one
    inform: Callable[[str], None] = field(default=logging.getLogger("tome_core").info, repr=False, compare=False)
    # a call of the model is in flight (from begin_call to the model's return): the blocks it lends (ModelLayout.lent)
    # run unmerged outside one, when another model that borrowed them runs them (the Z-Image ControlNet runs its
    # transformer's noise refiner); every other block, recomputed in backward after the call, merges as it did
    in_call: bool = False
    detach_after_call: bool = False  # remove() was called inside a running call: the call's end takes the patch off
    streams: int = 0  # the patched model's block streams (their partitions are drawn together, partition.Draw)
    hooked: int = 0  # the blocks that carry hooks (one at a level above max_downsample never merges, and has none)
    drawn: Dict[Tuple[int, ...], Any] = field(default_factory=dict)  # this call's partitions, by grid and seed
    execution: Optional[Tuple[str, str]] = None  # this call's (device, execution) (Framework.execution), once read
    call_key: Any = None  # an eager call's inputs to its blocks' size decisions (begin_call; None: not eager)
    started: bool = False  # a call of the model has begun since patch (summary() describes the last one)
    matcher: Matcher = field(default=TOME, repr=False, compare=False)  # how each block's matches are found
    active: ToMeConfig = field(init=False, repr=False, compare=False)  # this call's options (:meth:`choose`)

    def __repr__(self) -> str:
        """The options and the finest level; ``summary()`` tells what the last call did."""
        return f"ToMeState(config={self.config!r}, finest_level={self.finest_level}{'' if self.started else ', no call yet'})"

    def __post_init__(self) -> None:
        self.active = self.choose()

    def choose(self) -> ToMeConfig:
        """The options a call runs with: ``mode="auto"`` resolved by the token count of the latent's finest
        merged level (the first choice whose threshold it reaches). Chosen once per call, as the latent becomes
        known (:meth:`begin_call`, :meth:`enter_grid`), into :attr:`active`, which every block reads."""
        choices = self.choices or ((0, self.config),)
        if self.latent_hw is None:
            return choices[-1][1]
        height, width = level_grid(self.latent_hw, self.finest_level)
        pieces = self.shards.count if self.shards is not None else 1  # chosen as for the whole sequence
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
        """One line per level of the last call (named by its scale: ``1/2`` is the level at half the latent's
        width): the blocks whose merged sub-layer ran on fewer tokens, tokens before and after (what their
        attention saw), and the arrangement; then the blocks whose self-attention ran on all its tokens, and why.
        Blocks are counted as their sub-layers' calls return (:meth:`count`, :meth:`passed`), not as they match."""
        if not self.started:
            return "  no call yet: summary() describes the last call of the patched model"
        if not self.merging:
            return f"  no block merged: {self.why or f'the timestep is outside timestep_range={self.config.timestep_range}'}"
        lines = [_summary_line(self.active, factor, level) for factor, level in sorted(self.stats.items())]
        config = self.active
        window, frames = config.frame_window, stacked_frames(self._latent()[0], *self._frames(self._latent())) if lines else 1
        if config.matching == "similarity" and not config.local_window and window_limits(frames, window):
            lines.append(f"  (a token meets the destinations within {window} frame{'s' * (window != 1)} of its own, of {frames})")
        if lines and self.shards is not None:
            lines.append(f"  (each of {self.shards.count} processes merges its own piece of the tokens, counted above)")
        lines += [
            _summary_line(self.fallback(True), factor, level) + f"; {why}, so ToMe for SD's arrangement runs there"
            for (factor, why), level in sorted(self.fallbacks.items())
        ]
        lines += [
            f"  {scale(factor)}: {level.blocks} blocks unmerged: {why}"
            for factor, (level, why) in sorted(self.unpaid.items())
        ]
        lines += [f"  {scale(factor)}: no block merged: {why}" for factor, why in sorted(self.too_small.items())]
        lines += [f"  {blocks} blocks unmerged: {why}" for why, blocks in sorted(self.held.items())]
        lines += [
            f"  1/{factor} scale: {level.blocks} blocks ran {sublayer} on all {level.tokens} tokens: {why}"
            for (factor, sublayer, why), level in sorted(self.passes.items())
        ]
        return "\n".join(lines) if lines else "  no block merged"

    def count(self, level: Level, match: Match) -> None:
        """Count a block at ``level`` of this call's statistics: its sub-layer merged by ``match`` ran."""
        factor, fallback = level
        stats = self.stats.setdefault(factor, LevelStats()) if fallback is None else self.fallbacks.setdefault(level, LevelStats())
        stats.blocks += 1
        stats.tokens = match.tokens
        stats.kept = match.kept
        stats.frames = match.frames

    def passed(self, level: Level, sublayer: str, why: str, tokens: int) -> None:
        """Count a block at ``level`` whose ``sublayer`` (its self-attention) was matched but ran on all its
        ``tokens`` image tokens, because of ``why``: :meth:`summary` lists it apart."""
        stats = self.passes.setdefault((level[0], sublayer, why), LevelStats())
        stats.blocks += 1
        stats.tokens = stats.kept = tokens

    def merges(self, sublayer: str) -> bool:
        """Whether ``sublayer`` ("attn", "crossattn" or "mlp") is wrapped in merge/unmerge."""
        return self.config.sublayers[sublayer]

    def begin_call(
        self, latent_hw: Optional[Tuple[int, int]], step: Any, videos: Optional[int] = None, merging: bool = True,
        tail: int = 0, why: Optional[str] = None, grid_last: bool = False, shards: Optional[Shards] = None,
        execution: Optional[Tuple[str, str]] = None, frame_rows: int = 0,
    ) -> None:
        """Start a model call on a latent of ``latent_hw`` (None: the first grid seen) at ``step``; ``videos``:
        the batch of a video model's call (None: not a video call); ``merging``: False runs the call unmerged
        (its timestep is outside ``timestep_range``, or ``why`` says why); ``tail``: tokens of other images
        (a reference image's) after the grid's in every block's image stream, passed through unmerged;
        ``grid_last``: a block's image stream ends with the grid, the tokens before it passed through unmerged;
        ``shards``: how context parallelism splits the call (``latent_hw`` is then this process's piece);
        ``execution``: the call's device and execution (``Framework.execution``; None: read by the first block);
        ``frame_rows``: the latent grid stacks a video's frames of that many rows (0: one frame; a shard of context
        parallelism counts its frames from the row of the whole grid that it starts at: :meth:`_frames`)."""
        if self.config.reuse_steps == 1:
            self.cache = {}  # also where reuse_blocks keeps its matches within the call
        else:  # the call counter is read only here, so compiled models do not specialise on it otherwise
            if self.calls % self.config.reuse_steps == 0:
                self.cache = {}
            self.calls += 1
        self.in_call = self.started = True
        self.latent_hw, self.videos, self.step, self.execution = latent_hw, videos, step, execution
        self.merging, self.why, self.tail, self.grid_last, self.shards = merging, why, tail, grid_last, shards
        self.frame_rows = frame_rows
        if merging and not frame_rows and self.config.frame_window != DEFAULT_FRAME_WINDOW:
            self.say_once(
                f"ToMe on {self.where}: frame_window={self.config.frame_window!r} sets how many frames the similarity "
                "search of a video transformer spans (its frames share one sequence), but a call of it holds one "
                "frame a sequence (an image, a one-frame video, or a video UNet's frames), so it changes nothing here; "
                "it acts in this model's calls of several frames, if any (said once)"
            )
        self.grid_hw = None
        # what an eager call's blocks decide from: a call with the same key repeats their size decisions (BlockRun)
        eager = execution is not None and execution[1] == "eager" and shards is None
        self.call_key = (latent_hw, videos, merging, tail, grid_last, execution, frame_rows) if eager else None
        # the call's partitions and statistics, none yet
        self.drawn, self.stats, self.fallbacks, self.unpaid, self.too_small, self.passes, self.held = ({} for _ in range(7))
        self.active = self.choose()

    def follow_generation(self, timestep: float, generation: Any = None) -> None:
        """With ``reuse_steps > 1``, called before :meth:`begin_call` with each model call's (largest) timestep
        and, for a model patched in its pipeline, the pipeline's generation (a new one with each call of the
        pipeline: its scheduler's ``set_timesteps``, :func:`~tome_core.hooks.call_hooks.generation`). A new generation
        drops the matches and restarts the count of calls, so that the same seed gives the same image in every
        generation. A model patched without its pipeline tells a new generation by a timestep above the
        previous call's (sampling runs from high noise to low); repeated calls at one timestep (a pipeline
        running its conditional and unconditional halves apart) stay in one generation, and so do one-step
        generations at one timestep, which only the pipeline tells apart."""
        if generation is not None:
            if generation != self.generation:
                self.calls = 0
                self.cache = {}
            self.generation = generation
        elif self.last_timestep is not None and timestep > self.last_timestep:
            self.calls = 0
            self.cache = {}
        self.last_timestep = timestep

    def enter_grid(self, grid_hw: Tuple[int, int]) -> None:
        self.grid_hw = grid_hw
        if self.latent_hw is None:
            self.latent_hw = grid_hw
            self.active = self.choose()

    def decide(
        self, image: Any, execution: Tuple[str, str], stream: int, shared: bool, block_ratio: Optional[float],
        config: ToMeConfig, fallback: Optional[str], grid: Optional[Tuple[int, int]] = None,
    ) -> Tuple[Optional[Dict[str, Match]], Optional[Level], Optional[Tuple[int, str, int]]]:
        """What a block does with its image tokens ``image`` ``[B, N, C]`` in this merging call, read in one pass:
        ``(matches, level, None)`` where it merges (:meth:`block_matches`, counted at ``level``: :meth:`level`);
        ``(None, None, unpaid)`` where it runs unmerged for its size: at a level above ``max_downsample`` (``unpaid``
        None: not counted), or where merging would not pay (:mod:`tome_core.models.cost`; ``unpaid``: ``(level, why,
        tokens)``, counted for :meth:`summary`). ``execution``: the call's device and execution
        (``Framework.execution``); ``grid``: the block's own grid, entered first (:meth:`enter_grid`; a block whose
        input is a feature map); the rest as :meth:`block_matches` takes them."""
        if grid is not None:
            self.enter_grid(grid)
        ops, place = found = self._place(image)
        if place.factor > self.max_downsample:
            return None, None, None
        why = self._unpaid(place, execution, config)
        if why is not None:
            self.unpaid_block(place.factor, why, place.tokens)
            if execution[1] != "compiled":  # a compiler's trace cannot log (dynamo refuses it in a fullgraph trace)
                self._tell_unpaid(place.factor, why)
            return None, None, (place.factor, why, place.tokens)
        matches = self.block_matches(image, stream, shared, block_ratio, config, fallback, place=found)
        return matches, self._level(place, matches, fallback), None

    def _unpaid(self, place: Place, execution: Tuple[str, str], config: ToMeConfig) -> Optional[str]:
        """Why a block at ``place`` runs unmerged because merging would not pay there (:mod:`tome_core.models.cost`), or
        None where it merges: options that choose the arrangement by hand merge at every size unless
        ``min_tokens`` says otherwise."""
        min_tokens = self.config.min_tokens
        if min_tokens is None and self.config.mode != "auto":
            return None
        pieces = self.shards.count if self.shards is not None else 1  # decided as for the whole sequence
        device, how = execution
        return why_unpaid(place.tokens * pieces, device, how, arrangement_of(config.mode, config.matching), min_tokens)

    def _tell_unpaid(self, factor: int, why: str) -> None:
        """Tell the user once per patch (:attr:`inform`) that blocks at level ``factor`` run unmerged because of
        ``why`` (merging would not pay there), and how to merge anyway: otherwise a patched model that merges
        nothing looks like one that merges, unless its user reads ``summary()``."""
        if UNPAID in self.said:
            return
        self.said.add(UNPAID)
        how = (
            "To merge there, lower min_tokens (0 merges at every size)" if self.config.min_tokens is not None else
            "To merge at every size, pass min_tokens=0 or choose the arrangement yourself (mode='tokens' or "
            "mode='kv', or a ratio)"
        )
        self.inform(
            f"ToMe on {self.where}: its blocks at {scale(factor)} run unmerged: {why}. {how}; summary() tells what "
            "each call merged (said once)"
        )

    def hold(self, why: str) -> None:
        """Count a block that this call's own arguments run unmerged, because of ``why``, for :meth:`summary`."""
        self.held[why] = self.held.get(why, 0) + 1

    def unpaid_block(self, factor: int, why: str, tokens: int) -> None:
        """Count a block of ``tokens`` tokens at level ``factor`` that runs unmerged because of ``why``
        (:meth:`why_unmerged`)."""
        if factor not in self.unpaid:
            self.unpaid[factor] = (LevelStats(), why)
        level = self.unpaid[factor][0]
        level.blocks += 1
        level.tokens = level.kept = tokens

    def block_matches(
        self, metric: Any, stream: int, shared: bool = False, block_ratio: Optional[float] = None,
        config: Optional[ToMeConfig] = None, fallback: Optional[str] = None,
        place: Optional[Tuple[ArrayOps, Place]] = None,
    ) -> Dict[str, Match]:
        """One match per merged sub-layer for a block's input ``metric`` ``[B, N, C]``, found by :attr:`matcher`.

        ``stream`` tells blocks apart (it keys their partition and, without ``reuse_level``, their reuse).
        Sub-layers share the similarity and ranking; only their ratios may differ. ``shared``: one match for
        the whole batch (blocks whose tokens carry rotary positions). ``block_ratio``: this block's entry of
        ``block_ratios``, if any. ``config``: the block's options (default :attr:`active`); ``fallback``: why
        they are :meth:`fallback`'s. ``place``: the metric's backend and :class:`~tome_core.models.levels.Place`, where
        :meth:`decide` has read them (None: read here). Nothing is counted here: the block's hooks :meth:`count`
        it at its :meth:`level` when its merged sub-layer has run (a sub-layer may still run on all its tokens).
        """
        if not self.merging:
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
            self.say_once(f"ToMe on {self.where}: {small}")
            self.too_small[factor] = small
            merged = dict.fromkeys(merged, 0)
        reuse = small is None and (config.reuse_level or config.reuse_steps > 1 or config.reuse_blocks > 1)
        first = stream - stream % config.reuse_blocks  # the block whose match a run of reuse_blocks shares
        # a match is reused only where its partition would be drawn alike: the same grid (not just as many tokens:
        # a 16x12 latent then a 12x16 one), cells and frames
        video = self._frames(place.grid)
        key = (factor if config.reuse_level else ("block", first), batch, tokens, place.grid, cell, video, shared, block_ratio, frames)
        matches = self.cache.get(key) if reuse else None
        if matches is None:
            across = int((frames - 1) * place.tokens * config.across_frames)
            grid = _grid(place) if any(merged.values()) or across else None  # None: no partition, nothing merges
            draw = None
            if config.use_rand and grid is not None:  # this call's partitions, drawn per step and stream
                draw = Draw(config.seed, self.step, first, self.streams, self.drawn)
            matches = self.matcher(ops, metric, grid, cell, merged, config, draw, across, shared, frames, video)
            if reuse:
                self.cache[key] = matches
        return matches

    def level(self, tokens: int, matches: Dict[str, Match], *, fallback: Optional[str] = None) -> Optional[Level]:
        """Where a block of ``tokens`` image tokens, given ``matches`` by :meth:`block_matches` (``fallback``: why
        its options were :meth:`fallback`'s), is counted in this call's statistics; None: it merges nothing at its
        level (above ``max_downsample``, at ratio 0, or in a grid too small), and is not counted."""
        return self._level(block_place(self._latent(), tokens, self.grid_hw), matches, fallback)

    def _level(self, place: Place, matches: Dict[str, Match], fallback: Optional[str]) -> Optional[Level]:
        if place.factor in self.too_small or not any(match.merged for match in matches.values()):
            return None
        return place.factor, fallback

    def _place(self, metric: Any) -> Tuple[ArrayOps, Place]:
        ops = get_ops(metric)
        return ops, block_place(self._latent(), ops.shape(metric)[1], self.grid_hw)

    def _latent(self) -> Tuple[int, int]:
        latent = self.latent_hw or self.grid_hw
        if latent is None:
            raise RuntimeError(
                "a transformer block ran before its model or transformer gave the latent size: ToMe needs the "
                "blocks inside a UNet, a ControlNet or a 2-D transformer (Transformer2DModel) to know their grid"
            )
        return latent

    def _frames(self, grid: Optional[Tuple[int, int]]) -> Tuple[int, int]:
        """``(frame_rows, offset)``: a block on ``grid`` sees a video whose frames of ``frame_rows`` rows are stacked
        in its rows, its first row being row ``offset`` of its frame (a process's piece under context parallelism
        starts where the rows of the pieces before it end); ``(0, 0)``: one frame (the call's latent holds one, or
        the block's grid is not the latent's)."""
        if not self.frame_rows or grid is None or grid != self.latent_hw:
            return 0, 0
        offset = self.shards.rank * grid[0] % self.frame_rows if self.shards is not None else 0
        return self.frame_rows, offset

    def _too_small(
        self, place: Place, merged: Dict[str, int], frames: int, ratios: Dict[str, float], cell: Tuple[int, int],
    ) -> Optional[str]:
        """Why a block at ``place`` (a level this patch merges, its frames merged apart), whose options ask it to
        merge, can merge none of its tokens at this latent size: its grid holds no full cell (no destination), or
        its ``ratios`` times its tokens give no whole token (a 1x1 grid). None where it can merge, or where its
        options merge nothing there by choice (a ratio of 0: said at patch)."""
        if not ratios or max(ratios.values()) <= 0:
            return None
        h, w = _grid(place)
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

    def say_once(self, message: str) -> None:
        """Warn ``message`` the first time this patch has it to say."""
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, UserWarning, stacklevel=3)

    def _chunk(self, batch: int, config: ToMeConfig) -> int:
        """Frames per chunk of cross-frame merging for a block whose input holds ``batch`` items: 1 unless the
        options ask for it and this is a video call."""
        chunk = config.frames
        if chunk == 1 or not self.videos:
            return 1
        frames = batch // self.videos
        if frames * self.videos != batch or frames % chunk:
            raise ValueError(
                f"frames_per_chunk={chunk} must divide the number of frames, but this call has {frames} frames "
                f"({batch} frame latents for a batch of {self.videos}); choose one of "
                f"{', '.join(str(d) for d in range(1, frames + 1) if frames % d == 0)}"
            )
        return chunk


def _grid(place: Place) -> Tuple[int, int]:
    """The block's grid, refused where its tokens lie on none (:class:`~tome_core.models.levels.Place`)."""
    if place.grid is None:
        raise ValueError(place.problem)
    return place.grid


def shown_sublayer(matches: Dict[str, Match]) -> str:
    """The sub-layer kind whose match a block's line of :meth:`ToMeState.summary` shows: its self-attention's,
    else its first merged sub-layer's."""
    return "attn" if "attn" in matches else next(iter(matches))


def _summary_line(config: ToMeConfig, factor: int, level: LevelStats) -> str:
    kind = "keys/values" if config.mode == "kv" else "queries" if config.mode == "queries" else "tokens"
    how = "x".join(map(str, config.cell_at(factor))) + " cells" if config.matching == "cell" else "similarity"
    chunk = f" (chunks of {level.frames} frames)" if level.frames > 1 else ""
    return (
        f"  1/{factor} scale: {level.blocks} blocks, {level.tokens} -> {level.kept} {kind}{chunk}"
        f" ({1 - level.kept / level.tokens:.0%} merged; {config.mode}, {how})"
    )
