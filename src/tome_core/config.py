"""The ToMe options, their defaults and their validation (shared by every framework's entry point).

Each option is a field of :class:`ToMeConfig` whose default is what leaving it out means. :func:`resolve` computes
and checks every option's acting value from all the options as given (a bad value raises naming the option, the
value and what is allowed); ``ToMeConfig.__init__`` sets each field once, to that value, so ``fields()``,
``dataclasses.replace()`` (acting values resolve to themselves), equality and hashing work as for any dataclass.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import textwrap
from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, get_type_hints

LEVELS = (1, 2, 4, 8)
SUBLAYERS = ("attn", "crossattn", "mlp")
MODES = ("auto", "tokens", "kv", "queries")
MATCHINGS = ("similarity", "cell")
CELL_POOLS = ("mean", "sample")
DEFAULT_RATIO = 0.5  # with similarity matching; a cell match's reduction is fixed by its cell
# What mode="auto" runs for each ``prefer``: where self-attention takes separate keys, keys and values in cells
# chosen by the finest merged level's token count, ((fewest tokens, (sx, sy)), ...) most tokens first, in UNets and
# in transformers; elsewhere ToMe for SD at the ratio. Measured points of the speed-fidelity front, monotone in
# ``prefer`` at every token count (docs/fidelity.md, "One knob"; tests/core: the table's property).
PREFERENCES = {  # prefer: (UNet cells, transformer cells, ratio)
    "fidelity": (((0, (2, 1)),), ((0, (2, 1)),), 0.25),
    "balance": (((128 * 128, (4, 4)), (0, (2, 2))), ((128 * 128, (4, 4)), (0, (2, 2))), 0.5),
    "speed": (((0, (4, 4)),), ((128 * 128, (4, 4)), (0, (4, 2))), 0.75),
}
DEFAULT_PREFERENCE = "balance"
AUTO_POOL = "sample"
# Options that say how many tokens to merge or how to match them: giving any of them leaves mode="auto" out.
_ARRANGING = (
    "ratio", "matching", "sx", "sy", "level_cells", "attn_ratio", "crossattn_ratio", "mlp_ratio", "level_ratios",
    "block_ratios", "frames_per_chunk", "frame_ratio",
)
DEFAULT_FRAME_RATIO = 0.9  # with frames_per_chunk > 1
DEFAULT_FRAME_WINDOW = 1  # a video transformer's sources meet the destinations of their own and the next frames


# The options' groups, in the order help lists them: (name, title).
KNOB, WHERE, AMOUNT, ARRANGEMENT, REUSE, VIDEO = "knob", "where", "amount", "arrangement", "reuse", "video"
OPTION_GROUPS = (
    (KNOB, "The one knob"),
    (WHERE, "Where it merges: levels, sub-layers, blocks, timesteps"),
    (AMOUNT, "How many tokens: ratios overall, per sub-layer, level and block"),
    (ARRANGEMENT, "How tokens are matched and arranged around attention"),
    (REUSE, "Reusing matches across blocks and steps (similarity matching)"),
    (VIDEO, "Video: merging across frames"),
)


def option(default: Any, group: str, help: str) -> Any:
    """A :class:`ToMeConfig` field with its default, its group (:data:`OPTION_GROUPS`) and its help: prose
    wrapped in the source as a docstring is, each run of whitespace read as one space."""
    return field(default=default, metadata={"group": group, "help": " ".join(help.split())})


def _bool(name: str, value: Any) -> bool:
    """``value``, refused unless it is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value``, refused unless it is one of ``choices`` (strings, or None); a value of another type is refused
    by its type before any comparison, which would fail on it (``unhashable type``, an array's truth value)."""
    allowed = ", ".join(repr(c) for c in choices if c is not None) + (" or None" if None in choices else "")
    if value is None and None in choices:
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {allowed}, got {value!r} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _int(name: str, value: Any, minimum: int) -> int:
    """``value`` as a Python int (a numpy integer becomes one), refused unless it is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def _optional_int(name: str, value: Any, minimum: int) -> Optional[int]:
    """None, or ``value`` as :func:`_int` takes it."""
    return None if value is None else _int(name, value, minimum)


def _cell_ratio(sx: int, sy: int) -> float:
    """The share of tokens an ``sx x sy`` cell removes when it keeps one: ``1 - 1/(sx*sy)``."""
    return 1 - 1 / (sx * sy)


@dataclass(frozen=True, init=False)
class ToMeConfig:
    """Token Merging options, validated on construction. Each field carries its own help and group
    (:data:`OPTION_GROUPS`), which ``help()`` of every entry point lists (:func:`options_help`). Defaults follow
    tomesd, except ``max_downsample=None``, ``proportional_attn=True`` and ``mode="auto"``; with
    ``use_rand=False, proportional_attn=False`` and the options beyond tomesd at their defaults, results equal
    tomesd's.
    """

    ratio: Optional[float] = option(None, AMOUNT, """fraction of a merged level's tokens removed, in ``[0, 1 -
        1/(sx*sy)]``; ``None`` (default): 0.5, or the cell's ``1 - 1/(sx*sy)`` with cell matching.""")
    max_downsample: Optional[int] = option(None, WHERE, """merge blocks whose latent downsample factor is at
        most this (1, 2, 4 or 8); ``None``: the finest level with attention (1 on SD 1.x/2.x, 2 on SDXL).""")
    sx: Optional[int] = option(None, ARRANGEMENT, """cell width in tokens (``None``: 2); each ``sx x sy`` cell
        of the grid keeps one destination token.""")
    sy: Optional[int] = option(None, ARRANGEMENT, "cell height in tokens (``None``: 2).")
    use_rand: bool = option(True, ARRANGEMENT, """place each cell's destination at a pseudo-random position
        (else the cell's first).""")
    merge_attn: bool = option(True, WHERE, "merge around self-attention (the arrangement: ``mode``).")
    merge_crossattn: bool = option(False, WHERE, """merge around cross-attention (its queries; the text keys
        are never merged).""")
    merge_mlp: bool = option(False, WHERE, "merge around the feed-forward.")
    seed: int = option(0, ARRANGEMENT, """seeds the destination placement; with the timestep it fully
        determines the partition.""")
    attn_ratio: Optional[float] = option(None, AMOUNT, "a ratio for self-attention only (``None``: the level's).")
    crossattn_ratio: Optional[float] = option(None, AMOUNT, "a ratio for cross-attention only (``None``: the level's).")
    mlp_ratio: Optional[float] = option(None, AMOUNT, "a ratio for the feed-forward only (``None``: the level's).")
    level_ratios: Optional[Mapping[int, float]] = option(None, AMOUNT, """``{downsample factor: ratio}``
        replacing ``ratio`` at those levels (a sub-layer ratio wins).""")
    reuse_level: bool = option(False, REUSE, """compute one match per level per model call (from the level's
        first block) instead of one per block.""")
    reuse_steps: int = option(1, REUSE, """keep matches for this many consecutive model calls (denoising
        steps); 1 = recompute every call. A new generation starts afresh: each call of a patched pipeline, or,
        for a model patched on its own, a call whose timestep is above the previous call's.""")
    local_window: int = option(0, ARRANGEMENT, """compare each source only with destinations within this many
        cells (Chebyshev distance); 0 compares with all destinations, as tomesd does.""")
    proportional_attn: bool = option(True, ARRANGEMENT, """size-aware self-attention: each merged key's
        attention logit gets ``log(size)``, as if every token it stands for were still there: 2-3x closer to the
        unpatched model for ~5% of the call time (docs/size-aware.md); ``False`` is tomesd's arithmetic.""")
    blocks: Optional[Tuple[int, ...]] = option(None, WHERE, """indices of the transformer blocks that merge, in
        the model's module order (negative from the end); ``None``: every block the level selection allows.""")
    reuse_blocks: int = option(1, REUSE, """one match serves this many consecutive blocks (computed in the
        first); 1 = a match per block.""")
    block_ratios: Optional[Mapping[int, float]] = option(None, AMOUNT, """``{block index: ratio}`` replacing
        ``ratio`` and level ratios in those blocks (indices as in ``blocks``; a sub-layer ratio still wins).""")
    mode: Optional[str] = option(None, ARRANGEMENT, """the arrangement around self-attention
        (docs/high-resolution.md): ``"tokens"`` merges its input and unmerges its output (ToMe for SD); ``"kv"``
        reduces only its keys and values (ToDo); ``"queries"`` merges only its queries (ComfyUI's); ``"auto"``
        chooses by the model and latent size, ``prefer``'s ``"kv"`` cells where only self-attention merges, it
        takes separate keys and no similarity option is set, else ``"tokens"`` at ``prefer``'s ratio.
        ``None`` (default): ``"tokens"`` when an option that says how many tokens merge or how they are
        matched is given (``ratio``, ``sx``, ``sy``, ``matching``, ``level_cells``, a sub-layer, level or block
        ratio, ``frames_per_chunk``, ``frame_ratio``), else ``"auto"``. Cross-attention and MLP always merge
        as ``"tokens"``.""")
    matching: Optional[str] = option(None, ARRANGEMENT, """how tokens are grouped: ``"similarity"`` (bipartite
        soft matching) or ``"cell"`` (every token joins its own sx*sy cell: average pooling, no similarity
        computed; the reduction is fixed by the cell, so ``ratio`` may be left out).""")
    level_cells: Optional[Mapping[int, Any]] = option(None, ARRANGEMENT, """``{downsample factor: n or (sx,
        sy)}``: the cell at those levels instead of ``sx``, ``sy`` (with ``matching="cell"``, e.g. ``{1: 4, 2:
        2}`` pools 4x4 at the finest level and 2x2 at the next).""")
    cell_pool: Optional[str] = option(None, ARRANGEMENT, """with ``matching="cell"``, what stands for a cell's
        tokens: ``"mean"`` (average pooling, the default there) or ``"sample"``: one of its tokens, drawn per
        call and block from ``seed`` and the timestep (the first with ``use_rand=False``), which averages out
        over steps (docs/fidelity.md). ``None`` under ``mode="auto"``: ``"sample"``.""")
    frames_per_chunk: Optional[int] = option(None, VIDEO, """video models: merge across this many consecutive
        frames (VidToMe's arrangement, docs/video.md); ``None`` or 1 (default): each frame on its own. Must
        divide every call's frame count; needs ``mode="tokens"``, similarity matching, ``merge_crossattn=False``.""")
    frame_ratio: Optional[float] = option(None, VIDEO, """with ``frames_per_chunk > 1``, the share of the other
        frames' tokens merged into the chunk's reference frame, in ``[0, 1]``; ``None``: 0.9.""")
    frame_window: Optional[int] = option(DEFAULT_FRAME_WINDOW, VIDEO, """video transformers, whose frames share
        one sequence (Wan, HunyuanVideo, LTX...): compare each source only with the destinations of the frames
        within this many frames of its own, linear in frames instead of quadratic; ``None``: the whole clip.
        Images and video UNets have one frame per sequence: nothing changes there.""")
    timestep_range: Optional[Tuple[float, float]] = option(None, WHERE, """``(low, high)``: merge only in
        model calls whose timesteps all lie in ``[low, high]``, in the model's units (0-1000 for UNets, SD3 and
        PixArt; 0-1 for Flux); other calls, and batches on both sides of a bound, run unmerged. A device-array
        timestep costs one host sync per call. ``None`` (default): every call merges. Not on jax.""")
    min_tokens: Optional[int] = option(None, WHERE, """merge a level only in calls where it has at least this
        many tokens (per item); 0 merges at every size. ``None`` (default): under ``mode="auto"``, where
        measurements say merging makes the call faster on this device and execution (tome_core.models.cost),
        else every size; ``summary()`` names the levels left unmerged and why.""")
    prefer: Optional[str] = option(None, KNOB, """the one knob of the default (``mode="auto"``):
        ``"fidelity"``, ``"balance"`` or ``"speed"``, measured points of the speed-fidelity front per model kind
        (docs/fidelity.md, "One knob"), each merging at least as much as the one before it at every size.
        ``None`` (default): ``"balance"``. Options that choose the arrangement (``ratio``, ``mode``...) leave it
        out.""")

    def __init__(self, **options: Any) -> None:
        """Set each option once, to its acting value (:func:`resolve`), then check the ratios against
        ``level_cells`` level by level."""
        for name, value in resolve(options).items():
            object.__setattr__(self, name, value)
        self._check_level_cells()

    def __repr__(self) -> str:
        """The options that differ from the defaults (``ToMeConfig()``), as the call that makes them (a cell's
        ratio is left out: the cell sets it)."""
        default = ToMeConfig()
        derived = ("ratio",) + (("cell_pool",) if self.cell_pool == "mean" else ()) if self.matching == "cell" else ()
        derived += ("ratio",) if self.mode == "auto" else ()  # prefer sets it
        changed = [
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
            if f.name not in derived and getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"ToMeConfig({', '.join(changed)})"

    def _check_level_cells(self) -> None:
        """Each merged sub-layer's ratio at a level of ``level_cells`` leaves one token per cell of that level."""
        for level in self.level_cells or {}:
            for sublayer, on in self.sublayers.items():
                ratio = self.ratio_for(sublayer, level)
                if on and ratio > self.max_ratio_at(level):
                    sx, sy = self.cell_at(level)
                    raise ValueError(
                        f"the {sublayer} ratio {ratio:g} at level {level} cannot be reached with level_cells[{level}] = "
                        f"{sx}x{sy}: one token per cell is kept, so at most {self.max_ratio_at(level):g}"
                    )

    def auto_choices(self, kv_input: bool, unet: bool = True) -> Tuple[Tuple[int, "ToMeConfig"], ...]:
        """What ``mode="auto"`` runs: ``((fewest tokens at the finest merged level, options), ...)``, most tokens
        first: keys and values pooled in cells where every merged self-attention takes them apart from its queries
        (``kv_input``), nothing else merges and no similarity option is set, else ``tokens``. ``unet``: a UNet,
        else a transformer (the cells of ``speed`` differ)."""
        if self.mode != "auto":
            return ((0, self),)
        similarity_only = self.reuse_level or self.reuse_steps > 1 or self.reuse_blocks > 1 or self.local_window
        if not kv_input or not self.merge_attn or self.merge_crossattn or self.merge_mlp or similarity_only:
            return ((0, self.tokens()),)
        pool = self.cell_pool or AUTO_POOL
        return tuple(
            (tokens, replace(
                self, mode="kv", matching="cell", ratio=_cell_ratio(sx, sy), sx=sx, sy=sy, cell_pool=pool, prefer=None,
                frame_window=DEFAULT_FRAME_WINDOW,  # cells search nothing (a window given here: said at the call)
            ))
            for tokens, (sx, sy) in PREFERENCES[self.prefer or DEFAULT_PREFERENCE][0 if unet else 1]
        )

    def tokens(self, **changes: Any) -> "ToMeConfig":
        """These options in ToMe for SD's arrangement (``mode="tokens"``, similarity matching): what
        ``mode="auto"`` runs where keys and values cannot be pooled."""
        return replace(self, mode="tokens", cell_pool=None, prefer=None, **changes)

    def merges_at(self, timesteps: Sequence[float]) -> bool:
        """Whether a model call at ``timesteps`` (its batch's, on the host) merges under ``timestep_range``."""
        if self.timestep_range is None:
            return True
        low, high = self.timestep_range
        return all(low <= t <= high for t in timesteps)

    def arrangement(self, kind: str, self_attention: bool) -> Tuple[str, bool]:
        """How a sub-layer of ``kind`` ("attn", "crossattn", "mlp") runs: its mode (else "tokens"), and whether
        size-aware attention applies: a self-attention (``self_attention``) whose keys are merged by similarity,
        so not under "queries" (keys are every token) nor with cell pooling (every key stands for one cell)."""
        mode = self.mode if kind == "attn" else "tokens"
        return mode, self_attention and self.proportional_attn and mode != "queries" and self.matching == "similarity"

    def cell_at(self, level: int) -> Tuple[int, int]:
        """The ``(sx, sy)`` cell at downsample ``level``."""
        if self.level_cells is not None and level in self.level_cells:
            return self.level_cells[level]
        return self.sx, self.sy

    def max_ratio_at(self, level: int) -> float:
        return _cell_ratio(*self.cell_at(level))

    def ratio_for(self, sublayer: str, level: int, block_ratio: Optional[float] = None) -> float:
        """The ratio of ``sublayer`` ("attn", "crossattn", "mlp") at downsample ``level``, in a block whose
        ``block_ratios`` entry is ``block_ratio`` (None: it has none)."""
        if self.matching == "cell":
            return self.max_ratio_at(level)
        own = getattr(self, f"{sublayer}_ratio")
        if own is not None:
            return own
        if block_ratio is not None:
            return block_ratio
        if self.level_ratios is not None and level in self.level_ratios:
            return self.level_ratios[level]
        return self.ratio

    def at_level(self, level: int, block_ratio: Optional[float] = None) -> Tuple[Dict[str, float], Tuple[int, int]]:
        """What a block at downsample ``level`` (its ``block_ratios`` entry ``block_ratio``) runs with, read at once:
        the ratio of each merged sub-layer (:meth:`ratio_for`) and its ``(sx, sy)`` cell (:meth:`cell_at`)."""
        ratios = {sublayer: self.ratio_for(sublayer, level, block_ratio) for sublayer, on in self.sublayers.items() if on}
        return ratios, self.cell_at(level)

    @property
    def sublayers(self) -> Dict[str, bool]:
        """Which sub-layers are wrapped in merge/unmerge."""
        return {"attn": self.merge_attn, "crossattn": self.merge_crossattn, "mlp": self.merge_mlp}

    @property
    def frames(self) -> int:
        """Frames per chunk of cross-frame merging (1: each frame merges on its own)."""
        return self.frames_per_chunk or 1

    @property
    def across_frames(self) -> float:
        """The share of a chunk's other-frame tokens merged into its reference frame (``frame_ratio``)."""
        return DEFAULT_FRAME_RATIO if self.frame_ratio is None else self.frame_ratio

    @property
    def max_ratio(self) -> float:
        """The largest ratio the cell size allows: every source merged, one destination per cell kept."""
        return _cell_ratio(self.sx, self.sy)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ToMeConfig":
        """Build from keyword options; unknown names raise TypeError listing the valid ones."""
        return cls(**options)


def resolve(options: Mapping[str, Any]) -> Dict[str, Any]:
    """Every option's acting value (what each field of :class:`ToMeConfig` holds) from ``options`` as given, each
    checked as it is computed, group by group (the amounts last: the cells bound them), so that of several bad
    options the first in this order is named. ``None`` stays where its meaning needs the model (``max_downsample``,
    ``min_tokens``) or a property reads it (:attr:`~ToMeConfig.frames`, :attr:`~ToMeConfig.across_frames`)."""
    given = _given(options)
    # every field given: a config's own acting values passed back in with some changed (dataclasses.replace)
    given.every = set(options) >= {f.name for f in fields(ToMeConfig)}
    acting = SimpleNamespace()  # each set once
    # The knob, and the mode: "auto" unless an option says how to merge
    acting.prefer = _choice("prefer", given.prefer, (*PREFERENCES, None))
    acting.mode = _mode(given)
    # Where it merges
    acting.blocks = _blocks(given.blocks)
    acting.merge_attn = _bool("merge_attn", given.merge_attn)
    acting.merge_crossattn = _bool("merge_crossattn", given.merge_crossattn)
    acting.merge_mlp = _bool("merge_mlp", given.merge_mlp)
    acting.min_tokens = _optional_int("min_tokens", given.min_tokens, 0)
    acting.max_downsample = _max_downsample(given.max_downsample)
    # Reusing matches
    acting.reuse_level = _bool("reuse_level", given.reuse_level)
    acting.reuse_steps = _int("reuse_steps", given.reuse_steps, 1)
    acting.reuse_blocks = _int("reuse_blocks", given.reuse_blocks, 1)
    # The arrangement
    acting.sx = _int("sx", 2 if given.sx is None else given.sx, 1)
    acting.sy = _int("sy", 2 if given.sy is None else given.sy, 1)
    acting.use_rand = _bool("use_rand", given.use_rand)
    acting.proportional_attn = _bool("proportional_attn", given.proportional_attn)
    acting.seed = _int("seed", given.seed, 0)
    acting.local_window = _int("local_window", given.local_window, 0)
    acting.matching = _choice("matching", "similarity" if given.matching is None else given.matching, MATCHINGS)
    if acting.mode in ("kv", "queries") and not acting.merge_attn:
        raise ValueError(
            f"mode={acting.mode!r} arranges self-attention, but merge_attn=False leaves it alone; pass "
            "merge_attn=True or mode='tokens'"
        )
    acting.level_cells = _level_cells(given.level_cells)
    acting.cell_pool = _cell_pool(given.cell_pool, acting)
    _check_cell_matching(given, acting)
    # Video
    acting.frames_per_chunk = _optional_int("frames_per_chunk", given.frames_per_chunk, 1)
    acting.frame_ratio = _frame_ratio(given.frame_ratio, acting)
    acting.frame_window = _optional_int("frame_window", given.frame_window, 0)
    if acting.matching == "cell" and acting.frame_window != DEFAULT_FRAME_WINDOW:
        raise ValueError(
            f"frame_window={acting.frame_window!r} sets how far a similarity search reaches across frames; "
            "matching='cell' searches nothing (leave frame_window out)"
        )
    _check_frames(acting)
    # When it merges
    acting.timestep_range = _timestep_range(given.timestep_range)
    # How many tokens
    acting.ratio = _ratio(given.ratio, acting, given.every)
    acting.attn_ratio = _sublayer_ratio("attn_ratio", given.attn_ratio, acting)
    acting.crossattn_ratio = _sublayer_ratio("crossattn_ratio", given.crossattn_ratio, acting)
    acting.mlp_ratio = _sublayer_ratio("mlp_ratio", given.mlp_ratio, acting)
    acting.level_ratios = _ratio_map("level_ratios", given.level_ratios, "level", _check_level, acting)
    acting.block_ratios = _ratio_map("block_ratios", given.block_ratios, "block index", _check_block, acting)
    return vars(acting)


def _given(options: Mapping[str, Any]) -> SimpleNamespace:
    """The options as given, one left out as its field's default; unknown names raise TypeError listing the
    valid ones."""
    defaults = {f.name: f.default for f in fields(ToMeConfig)}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        guesses = [(name, difflib.get_close_matches(name, list(defaults), n=1)) for name in unknown]
        meant = ", ".join(f"{guess[0]} for {name}" for name, guess in guesses if guess)
        raise TypeError(
            f"unknown ToMe option(s) {', '.join(unknown)}{f' (did you mean {meant}?)' if meant else ''}; "
            f"valid options are {', '.join(defaults)}"
        )
    return SimpleNamespace(**{**defaults, **options})


def _mode(given: SimpleNamespace) -> str:
    """``mode`` as given, else "auto" when no option says how many tokens merge or how they are matched
    (:data:`_ARRANGING`; ``frames_per_chunk=1`` says nothing), else "tokens"; ``prefer`` only with "auto"."""
    one_frame = isinstance(given.frames_per_chunk, numbers.Integral) and given.frames_per_chunk == 1  # (arrays: later)
    arranging = [
        name for name in _ARRANGING
        if getattr(given, name) is not None and not (name == "frames_per_chunk" and one_frame)
    ]
    if given.every and isinstance(given.mode, str) and given.mode == "auto" and arranging and (
        given.prefer is None or (isinstance(given.prefer, str) and given.prefer in PREFERENCES)
    ):
        # every option given: acting values passed back in (dataclasses.replace), where what "auto" sets itself is
        # no choice of the caller's
        auto = ToMeConfig(prefer=given.prefer)
        arranging = [name for name in arranging if not _same(getattr(given, name), getattr(auto, name))]
    if given.mode is None:
        mode = "tokens" if arranging else "auto"
    else:
        mode = _choice("mode", given.mode, MODES)
        if mode == "auto" and arranging:
            raise ValueError(
                f"mode='auto' chooses the arrangement, ratio and cells by the latent size; leave out "
                f"{', '.join(arranging)}, or pass mode='tokens', 'kv' or 'queries'"
            )
    if given.prefer is not None and mode != "auto":
        chosen = ", ".join(arranging) if arranging else f"mode={mode!r}"
        raise ValueError(
            f"prefer={given.prefer!r} chooses among the default's settings (mode='auto'), but {chosen} "
            "chooses the arrangement itself; pass one or the other"
        )
    return mode


def _same(given: Any, acting: Any) -> bool:
    """Whether an option's given value is its acting value (a number of any type, or a value equal to it)."""
    try:
        return bool(given == acting)
    except Exception:  # an array, compared elementwise
        return False


def _blocks(blocks: Any) -> Optional[Tuple[int, ...]]:
    if blocks is None:
        return None
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__") or len(getattr(blocks, "shape", (0,))) != 1:
        raise TypeError(f"blocks must be a list of block indices (ints) or None, got {blocks!r}")
    indices = tuple(blocks)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"blocks must hold block indices (ints), got {index!r} in {blocks!r}")
    return tuple(int(i) for i in indices)


def _max_downsample(value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in LEVELS:
        raise ValueError(f"max_downsample must be one of None, 1, 2, 4, 8, got {value!r}")
    return int(value)


def _level_cells(level_cells: Any) -> Optional[Dict[int, Tuple[int, int]]]:
    """``{level: (sx, sy)}``, an ``n`` standing for ``(n, n)``."""
    if level_cells is None:
        return None
    if not isinstance(level_cells, Mapping):
        raise TypeError(f"level_cells must be a dict {{level: n or (sx, sy)}}, got {level_cells!r}")
    cells = {}
    for level, cell in level_cells.items():
        _check_level("level_cells", level)
        pair = (cell, cell) if isinstance(cell, numbers.Integral) and not isinstance(cell, bool) else cell
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"level_cells[{level}] must be an int n (an n x n cell) or a pair (sx, sy), got {cell!r}")
        cells[int(level)] = (_int(f"level_cells[{level}]", pair[0], 1), _int(f"level_cells[{level}]", pair[1], 1))
    return cells


def _cell_pool(cell_pool: Any, acting: SimpleNamespace) -> Optional[str]:
    """``cell_pool`` as given, "mean" when left out with ``matching="cell"``; outside cell matching only the
    default's cells (``mode="auto"``) take one."""
    if cell_pool is not None:
        _choice("cell_pool", cell_pool, CELL_POOLS)
    if acting.matching == "cell":
        return "mean" if cell_pool is None else cell_pool
    if cell_pool not in (None, "mean") and acting.mode != "auto":
        raise ValueError(
            f"cell_pool={cell_pool!r} says what stands for a cell of matching='cell', but matching is "
            f"{acting.matching!r}; pass matching='cell' (and mode='kv', 'tokens' or 'queries'), or leave mode "
            "out (the default's cells then use it)"
        )
    return cell_pool


def _check_cell_matching(given: SimpleNamespace, acting: SimpleNamespace) -> None:
    """``matching="cell"`` fixes the ratios and computes no similarity: no option may set either."""
    if acting.matching != "cell":
        return
    for name in ("level_ratios", "block_ratios", "attn_ratio", "crossattn_ratio", "mlp_ratio"):
        if getattr(given, name) is not None:
            raise ValueError(
                f"{name} cannot be combined with matching='cell': the cell fixes each level's reduction "
                "(1 - 1/(sx*sy)); choose cells with sx, sy or level_cells instead"
            )
    if acting.local_window:
        raise ValueError("local_window limits a similarity search; matching='cell' has none (pass local_window=0)")
    reusing = (("reuse_level", acting.reuse_level), ("reuse_steps", acting.reuse_steps > 1),
               ("reuse_blocks", acting.reuse_blocks > 1))
    for name, unused in reusing:
        if unused:
            raise ValueError(
                f"{name} reuses a similarity match; matching='cell' computes none (its match depends on the "
                "shape only), so it has nothing to reuse"
            )


def _frame_ratio(frame_ratio: Any, acting: SimpleNamespace) -> Optional[float]:
    if frame_ratio is None:
        return None
    if isinstance(frame_ratio, bool) or not isinstance(frame_ratio, numbers.Real):
        raise TypeError(f"frame_ratio must be a float in [0, 1], got {frame_ratio!r} ({type(frame_ratio).__name__})")
    if not (math.isfinite(frame_ratio) and 0 <= frame_ratio <= 1):
        raise ValueError(f"frame_ratio must be in [0, 1], got {frame_ratio!r}")
    if (acting.frames_per_chunk or 1) == 1:
        raise ValueError(
            f"frame_ratio={frame_ratio!r} merges across frames, which needs frames_per_chunk > 1 "
            "(frames_per_chunk=1 merges each frame on its own)"
        )
    return float(frame_ratio)


def _check_frames(acting: SimpleNamespace) -> None:
    """What merging across frames (``frames_per_chunk > 1``) combines with."""
    if (acting.frames_per_chunk or 1) == 1:
        return
    conflicts = (
        (acting.mode != "tokens", f"mode={acting.mode!r}", "mode='tokens' (one attention over the merged chunk)"),
        (acting.matching != "similarity", f"matching={acting.matching!r}", "matching='similarity'"),
        (acting.merge_crossattn, "merge_crossattn=True", "merge_crossattn=False (each frame has its own text)"),
    )
    for bad, option, needed in conflicts:
        if bad:
            raise ValueError(
                f"frames_per_chunk={acting.frames_per_chunk} cannot be combined with {option}; it needs {needed}"
            )


def _timestep_range(value: Any) -> Optional[Tuple[float, float]]:
    if value is None:
        return None
    allowed = "a pair (low, high) of numbers with low <= high, or None"
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"timestep_range must be {allowed}, got {value!r}")
    for bound in value:
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or math.isnan(bound):
            raise TypeError(f"timestep_range must be {allowed}, got {value!r} (bound {bound!r})")
    if value[0] > value[1]:
        raise ValueError(f"timestep_range must be {allowed}, got {value!r} (low > high)")
    return float(value[0]), float(value[1])


def _ratio(ratio: Any, acting: SimpleNamespace, every: bool = False) -> float:
    """``ratio``: ``prefer``'s under ``mode="auto"``; left out, the cell's with ``matching="cell"``, else
    :data:`DEFAULT_RATIO`; each within reach of the cells. ``every``: every option was given (a config's acting
    values passed back in), where a cell's own ratio is what leaving it out means."""
    if acting.mode == "auto":  # ToMe for SD's ratio where cells cannot run
        ratio = PREFERENCES[acting.prefer or DEFAULT_PREFERENCE][2]
    elif ratio is None or (every and acting.matching == "cell" and _same(ratio, _cell_ratio(acting.sx, acting.sy))):
        ratio = _cell_ratio(acting.sx, acting.sy) if acting.matching == "cell" else DEFAULT_RATIO
    else:
        _check_ratio_type("ratio", ratio)
        if acting.matching == "cell":
            _check_cell_ratio(ratio, acting)
    _check_ratio("ratio", ratio, acting, _cells_of_ratio(acting))
    return float(ratio)


def _sublayer_ratio(name: str, ratio: Any, acting: SimpleNamespace) -> Optional[float]:
    if ratio is None:
        return None
    _check_ratio(name, ratio, acting)
    return float(ratio)


def _ratio_map(
    name: str, ratios: Any, key: str, check_key: Callable[[str, Any], None], acting: SimpleNamespace
) -> Optional[Dict[int, float]]:
    """``ratios``: None, or a ``{key: ratio}`` mapping (``level_ratios``, ``block_ratios``) as int keys and float
    ratios, each key passed by ``check_key`` and each ratio checked."""
    if ratios is None:
        return None
    if not isinstance(ratios, Mapping):
        raise TypeError(f"{name} must be a dict {{{key}: ratio}}, got {ratios!r}")
    for k, ratio in ratios.items():
        check_key(name, k)
        _check_ratio(f"{name}[{k}]", ratio, acting)
    return {int(k): float(v) for k, v in ratios.items()}


def _check_level(name: str, level: Any) -> None:
    if level not in LEVELS or isinstance(level, bool):
        raise ValueError(f"{name} keys must be levels 1, 2, 4 or 8, got {level!r}")


def _check_block(name: str, index: Any) -> None:
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError(f"{name} keys must be block indices (ints), got {index!r}")


def _check_ratio_type(name: str, ratio: Any) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1 - 1/(sx*sy)], got {ratio!r} ({type(ratio).__name__})")


def _cells_of_ratio(acting: SimpleNamespace) -> Optional[Tuple[int, int]]:
    """The cell that bounds ``ratio`` when the options alone tell it, ``(sx, sy)``; None when ``level_cells``
    gives some levels other cells (``patch`` checks each merged level's cell)."""
    if acting.level_cells and any(cell != (acting.sx, acting.sy) for cell in acting.level_cells.values()):
        return None
    return acting.sx, acting.sy


def _check_ratio(name: str, ratio: Any, acting: SimpleNamespace, cell: Optional[Tuple[int, int]] = None) -> None:
    """A ratio's type and range, and that keeping one token per ``cell`` leaves room for it (None: the options'
    largest cell; each merged level's own cell is checked at ``patch``)."""
    _check_ratio_type(name, ratio)
    if cell is None:
        cell = max([(acting.sx, acting.sy), *(acting.level_cells or {}).values()], key=lambda c: c[0] * c[1])
    sx, sy = cell
    reachable = _cell_ratio(sx, sy)
    if not (math.isfinite(ratio) and 0 <= ratio < 1):
        raise ValueError(
            f"{name} must be in [0, {reachable:g}] (one token per {sx}x{sy} cell is kept: at most 1 - 1/(sx*sy)), "
            f"got {ratio!r}"
        )
    if ratio > reachable:
        where = "" if cell == (acting.sx, acting.sy) else f" (the largest cell of level_cells={acting.level_cells})"
        raise ValueError(
            f"{name}={ratio!r} cannot be reached with sx={sx}, sy={sy}{where}: one token per "
            f"{sx}x{sy} cell is kept, so {name} must be at most 1 - 1/(sx*sy) = {reachable:g}"
        )


def _check_cell_ratio(ratio: Any, acting: SimpleNamespace) -> None:
    """A ratio given with ``matching="cell"`` is the one its cells remove."""
    cells = {(acting.sx, acting.sy), *(acting.level_cells or {}).values()}
    if len({_cell_ratio(*cell) for cell in cells}) > 1:
        raise ValueError(
            f"ratio={ratio!r} cannot be combined with matching='cell' and level_cells of other sizes: each "
            "cell fixes its level's reduction; leave ratio out"
        )
    if not math.isclose(ratio, _cell_ratio(acting.sx, acting.sy)):
        raise ValueError(
            f"ratio={ratio!r} contradicts matching='cell' with {acting.sx}x{acting.sy} cells, which remove "
            f"1 - 1/(sx*sy) = {_cell_ratio(acting.sx, acting.sy):g} of the tokens; leave ratio out, or change sx and sy"
        )


def option_parameters() -> List[inspect.Parameter]:
    """Every option as a keyword-only parameter with its type and its default (which acts as leaving the option
    out: tests/core/test_documented_defaults.py): what the entry points' signatures list after the model."""
    types = get_type_hints(ToMeConfig)
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
        for f in fields(ToMeConfig)
    ]


ToMeConfig.__signature__ = inspect.Signature(option_parameters())  # what help() and inspect show of its **options


def option_meanings() -> Dict[str, str]:
    """Each option's help, as its field gives it."""
    return {f.name: f.metadata["help"] for f in fields(ToMeConfig)}


def options_help() -> str:
    """Every option with its default and help, group by group (:data:`OPTION_GROUPS`), from the fields of
    :class:`ToMeConfig` (the one place the options are defined): what each entry point's ``help()`` lists."""
    lines = ["Options (keywords; tome_core.ToMeConfig validates them, and bad values raise naming them):"]
    for group, title in OPTION_GROUPS:
        lines.append(f"  {title}:")
        for f in fields(ToMeConfig):
            if f.metadata["group"] == group:
                text = f"{f.name}={f.default!r}: {f.metadata['help']}"
                lines += textwrap.wrap(text, 110, initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


def document(function: Any, accepts: str) -> Any:
    """Give an entry point's ``patch`` its full ``help()``: its own first paragraph, what it accepts, and
    :func:`options_help`."""
    first = (function.__doc__ or "").strip()
    function.__doc__ = f"{first}\n\n{accepts.strip()}\n\n{options_help()}\n"
    return function
