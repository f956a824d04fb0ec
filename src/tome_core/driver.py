"""The patch driver: find the models in an object, attach ToMe hooks, run them, remove them. Framework-free.

Every adapter (diffusers/torch, ppdiffusers/paddle, Flax diffusers/jax) gives the driver a :class:`Framework`:
how to list a module's submodules, register a pre-hook and a post-hook (both with keyword arguments), and
deliver an attention bias. Everything else happens here, once, read from :mod:`tome_core.families`:

* a pre-hook on each patched model starts a call: its timestep (the partition's ``step``) and, from its
  ``sample``/``hidden_states``, the latent size (UNets) or the token grid (transformers: the latent over the
  patch size, or, for packed tokens, the grid of ``img_ids``);
* a pre-hook on each UNet ``Transformer2DModel`` (and SVD's ``TransformerSpatioTemporalModel``) reads the real
  grid of the blocks inside; in video UNets that is one frame's grid (their input is ``(batch * frames, C, H,
  W)``), so spatial blocks merge per frame;
* temporal blocks (:data:`~tome_core.families.TEMPORAL`: motion modules, temporal transformers, whose tokens
  are frames) get no hook at all;
* a pre-hook on each transformer block computes its matches from its image stream, a post-hook drops them;
* on each selected sub-layer a pre-hook merges the image tokens of its input (text tokens beside them are
  kept exactly), moves rotary positions to the merged tokens and arms size-aware attention; a post-hook
  unmerges the image stream of its output, before the block adds its residual.

Models (what gets its own :class:`~tome_core.state.ToMeState`) are UNet-like modules (``down_blocks`` and
``conv_in``: UNets, ControlNets, video UNets) and diffusion transformers (a config with a ``patch_size``: SD3,
Flux, PixArt, DiT and their ControlNets) that hold (spatial) blocks of a known family.
"""

from __future__ import annotations

import copyreg
import inspect
import itertools
import math
import numbers
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from .backend import get_ops
from .config import ToMeConfig
from .families import (
    BLOCK_FAMILIES, CHANNELS_LAST_GRID_CONTAINERS, GRID_CONTAINERS, TEXT_NONE, TEXT_PREFIX, TEXT_SUFFIX, BlockFamily,
    Sublayer, GridLayout, attends_text_only, block_family, child_at, context_latents, grid_layout, grid_source,
    grid_last, lent_children, temporal, text_follows, text_only, token_roles, with_text_after,
)
from .levels import finest_attention_level, indicated_run, leading_raster, trailing_frames, trailing_raster
from .match import Match
from .merge import merge, size_bias, unmerge
from .model_zoo import AUXILIARY, refusal
from .selection import ModelFacts, block_ratios, check_model, selected_blocks
from .shards import CONTEXT_PARALLEL, Shards, check_shard_cells, check_shards, shard_grid
from .state import ToMeState

REUSED = "reused"  # an output cache that hands back the same object it stored
PreHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]]
PostHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any], Any], Any]


class Framework(Protocol):
    """What an adapter tells the driver about its framework."""

    accepted: str  # what patch accepts, for the error on anything else

    def is_module(self, obj: Any) -> bool: ...

    def submodules(self, module: Any) -> List[Any]:
        """``module`` and every module inside it, in registration order; a compiler's wrapper is replaced by the
        module it wraps (hooks go where the compiled code looks)."""

    def add_pre_hook(self, module: Any, hook: PreHook) -> Any:
        """Register ``hook(module, args, kwargs)`` to run before ``module``; returns a handle with ``remove()``."""

    def add_post_hook(self, module: Any, hook: PostHook) -> Any:
        """Register ``hook(module, args, kwargs, output)`` to run after ``module`` (also when it raises)."""

    def host_values(self, x: Any) -> List[float]:
        """A small array's values on the host, flattened (Python ints or floats)."""

    def size_aware(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: "SizeBias") -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Make ``module``'s attention add ``bias`` to its logits during this call; returns its arguments."""

    def size_aware_done(self, module: Any, computed: bool) -> None:
        """The call of ``module`` armed by :meth:`size_aware` has returned; ``computed`` is False when an
        output cache returned a stored output instead of running attention."""

    def bias_problem(self, module: Any) -> Optional[str]:
        """Why ``module``'s attention (its processor now) cannot add a size bias to its logits, or None (it
        can, or its processor's code does not tell): checked at ``patch`` where size-aware attention applies."""

    def separate_kv(self, module: Any) -> bool:
        """Whether ``module``'s attention (its processor now) computes keys and values from its ``kv_input``
        argument when one is given (the ``kv`` and ``queries`` arrangements need it)."""

    def may_run_again(self, x: Any) -> bool:
        """Whether a block called on ``x`` may be run again on the very same ``x`` (or on a copy of its data) in the
        backward pass, after its model's call returned (gradient checkpointing recomputes it then): true in eager
        code, whether or not ``x`` or the forward records gradients (a LoRA's frozen input; reentrant checkpointing
        runs its forward without them)."""

    def shards(self, model: Any) -> Optional[Shards]:
        """How context parallelism splits ``model``'s tokens now (None: it does not)."""

    def same_data(self, a: Any, b: Any) -> bool:
        """Whether ``b`` is ``a``'s data under another array object (a detached copy), ``a`` being alive or None."""

    def output_cache(self, module: Any) -> Optional[str]:
        """How another library caches ``module``'s output across calls: None (it does not), ``REUSED`` (it
        returns the very output object of an earlier call), or raises ValueError naming a cache that builds
        new outputs from earlier ones (those were merged by other matches)."""


class SizeBias:
    """Log sizes of one sub-layer's keys: merged image keys get ``log(size)``, text keys 0.

    ``text`` says where the text keys sit (``TEXT_*``); :meth:`for_keys` builds the ``[B, 1, K]`` bias for an
    attention over ``K`` keys, or raises if ``K`` does not fit.
    """

    def __init__(self, match: Match, text: str, like: Any, tail: int = 0, head: int = 0, whole_mask: bool = True):
        self.match = match
        # whether an attention_mask over the merged tokens can carry it: not where the attention merges inside
        # itself (Sublayer.projections), since it sizes its masks from its unmerged input
        self.whole_mask = whole_mask
        self.text = text
        self.like = like  # the merged tokens: the dtype of the mask
        self.tail = tail  # unmerged tokens of other images right after the merged ones (size 1, bias 0)
        self.head = head  # and right before them (FramePack's history)

    def for_merged_tokens(self) -> Any:
        """The bias as a whole-batch additive ``attention_mask`` over the merged tokens (self-attention)."""
        return self.for_keys(self.head + self.match.kept + self.tail, self.like)

    def for_keys(self, keys: int, like: Any) -> Any:
        """``[B, 1, keys]``: the log sizes where the merged image keys sit, 0 for text, head and tail keys."""
        ops = get_ops(like)
        match = self.match
        sizes = size_bias(match, like)
        if self.head and keys <= self.head:  # an attention over (leading) head tokens alone (Flux.2 Klein KV's extract
            return ops.zeros((match.batch, 1, keys), like)  # step, Qwen-Image 2.1's prefix segments): each of size 1
        text = keys - self.head - match.kept - self.tail
        if text < 0 or (text and self.text == TEXT_NONE):
            raise RuntimeError(
                f"size-aware attention: the attention has {keys} keys but the merged sequence has "
                f"{self.head + match.kept + self.tail} tokens; pass proportional_attn=False"
            )
        zeros = lambda count: [ops.zeros((match.batch, 1, count), like)] if count else []  # noqa: E731
        if text_follows(self.text):  # [head; image; tail; text]
            parts = [*zeros(self.head), sizes, *zeros(self.tail + text)]
        else:  # [text; head; image; tail]
            parts = [*zeros(text + self.head), sizes, *zeros(self.tail)]
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis=2)


def argument(args: Sequence[Any], kwargs: Dict[str, Any], name: str, position: Optional[int]) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position is not None and len(args) > position:
        return args[position]
    return None


def replace_argument(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, position: int, value: Any
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` with the argument ``name`` (keyword, or positional at ``position``) set to ``value``."""
    if name in kwargs or len(args) <= position:
        return args, {**kwargs, name: value}
    return args[:position] + (value,) + args[position + 1 :], kwargs


def forward_of(cls: type) -> Callable[..., Any]:
    """What a call of a module of class ``cls`` runs: its ``forward`` (torch, paddle), else its ``__call__`` (Flax)."""
    return getattr(cls, "forward", None) or cls.__call__


def argument_positions(function: Callable[..., Any], *names: str) -> Dict[str, Optional[int]]:
    """Positional index (after ``self``) of each named parameter of a ``forward``, or None."""
    try:
        parameters = [p.name for p in inspect.signature(function).parameters.values()][1:]
    except (TypeError, ValueError):
        parameters = []
    return {name: parameters.index(name) if name in parameters else None for name in names}


def unbiased_processor(processor: Any, trusted: Sequence[str], library: str, functions: Sequence[str]) -> Optional[str]:
    """Why an attention ``processor`` cannot take a size bias, judged from its classes' code: when none of its
    classes is ``trusted`` by name or comes from the ``library`` (whose processors take it through an
    attention mask or the attention ``functions`` the adapter biases) and none of their code names one of
    ``functions``. None when it can, or when its code cannot be read."""
    classes = [cls for cls in type(processor).__mro__ if cls is not object]
    if not classes or any(cls.__name__ in trusted or cls.__module__.split(".")[0] == library for cls in classes):
        return None
    try:
        sources = [inspect.getsource(cls) for cls in classes]
    except (OSError, TypeError):
        return None
    if any(name in source for source in sources for name in functions):
        return None
    return f"processor {type(processor).__name__} computes attention without {' or '.join(functions)} (read from its code)"


def arrangement_problem(fw: Framework, block: Any, sublayer: Sublayer, module: Any) -> Optional[str]:
    """Why a self-attention cannot run the ``kv`` or ``queries`` arrangement now (None: it can): they hand it
    keys and values apart from its queries, through its ``kv_input``."""
    where = lambda: f"{type(block).__name__}.{sublayer.child}"  # noqa: E731 (formatted only for a problem)
    if sublayer.projections:
        if fw.separate_kv(module):
            return None
        return (
            f"{where()}'s processor {type(getattr(module, 'processor', None)).__name__} does not run its query, key "
            f"and value projections ({', '.join(sublayer.projections[:3])}) apart, where ToMe merges"
        )
    if sublayer.kv_input is None:
        if sublayer.text != TEXT_NONE:
            return f"{where()} runs joint attention over text and image tokens"
        return f"{where()} takes no keys and values apart from its queries"
    if attends_text_only(block, sublayer):
        return f"{where()} attends to the text ({sublayer.text_if or sublayer.text_unless}={bool(sublayer.text_if)}), not to its own tokens"
    if not fw.separate_kv(module):
        processor = type(getattr(module, "processor", None)).__name__
        return (
            f"{where()}'s processor {processor} does not compute keys and values from {sublayer.kv_input} "
            "(fused projections, perturbed-attention guidance, or a processor of its own)"
        )
    return None


def arrangement_error(mode: str, where: str, problem: str) -> ValueError:
    return ValueError(
        f"mode={mode!r} needs self-attention that takes keys and values apart from its queries, and in {where} "
        f"{problem}; pass mode='tokens' there, or leave mode out (the default runs ToMe for SD's arrangement where "
        "kv cannot run)"
    )


def _on_host(timestep: Any) -> bool:
    """Whether a timestep is already on the host: a Python or numpy number, or a numpy array."""
    return isinstance(timestep, numbers.Number) or type(timestep).__module__ == "numpy"


def _step(timestep: Any) -> Any:
    """The timestep as the partition hash takes it: a Python number (from a Python or numpy number or array)
    or the first element of a framework array (no host sync)."""
    if timestep is None:
        return 0
    if _on_host(timestep):
        return _host_timesteps(None, timestep)[0]
    ops = get_ops(timestep)
    return ops.reshape(timestep, (-1,))[0]


def _host_timesteps(fw: Optional["Framework"], timestep: Any) -> List[float]:
    """Every timestep of a call as Python numbers (0-d and 1-d, Python, numpy or framework arrays; the last
    read on the host through ``fw``)."""
    if isinstance(timestep, numbers.Number):
        return [timestep.item() if hasattr(timestep, "item") else timestep]
    if type(timestep).__module__ == "numpy":
        return timestep.reshape(-1).tolist()
    return fw.host_values(timestep)


def _spatial(x: Any, data_format: str) -> Tuple[int, int]:
    shape = get_ops(x).shape(x)
    return (shape[1], shape[2]) if data_format == "NHWC" else (shape[-2], shape[-1])


# ---------------------------------------------------------------------------------------------------------
# Which modules are models, and how a model call begins


def _config_value(module: Any, name: str) -> Any:
    config = getattr(module, "config", None)
    getter = getattr(config, "get", None)
    return getter(name) if callable(getter) else getattr(config, name, None)


def is_unet_like(module: Any) -> bool:
    """UNet2DConditionModel, ControlNetModel and their kin: a ``sample`` latent in, down blocks inside."""
    return hasattr(module, "down_blocks") and hasattr(module, "conv_in")


# what models call their timestep argument (HiDream, Z-Image; Stable Cascade's ratio in [0, 1])
TIMESTEPS = ("timestep", "timesteps", "t", "timestep_ratio")
# what models call the ids of their packed tokens; Krea 2's cover [text; image], the image's rows last
TOKEN_IDS = ("img_ids", "position_ids")
# what models call the per-item (frames, h, w) of the images in their token sequence, the output's first (Qwen-Image's
# packed tokens; JoyImage-Edit-Plus's patches [B, N, C, pt, ph, pw], padded after its references)
SHAPE_LISTS = ("img_shapes", "shape_list")


def is_transformer_model(module: Any) -> bool:
    """A diffusion transformer (SD3, Flux, PixArt, DiT, their ControlNets): a config with a patch size, a class
    whose call :data:`~tome_core.families.GRID_LAYOUTS` describes, or one whose call takes its tokens' ids."""
    if is_unet_like(module):
        return False
    if _config_value(module, "patch_size") is not None or grid_layout(type(module)) is not None:
        return True
    forward = getattr(type(module), "forward", None)
    return forward is not None and any(p in inspect.signature(forward).parameters for p in TOKEN_IDS)


class CallStart:
    """Pre-hook on a patched model: a new call starts, at its timestep, on its latent or token grid.

    Also a documented helper for tools that cut tokens as a patch would (the benchmark's oracle): hooked on
    an unpatched model with a state of its own, it reads each call's grid into that state and merges nothing."""

    def __init__(self, fw: Framework, model: Any, state: ToMeState):
        self.fw = fw
        self.state = state
        self.unet = is_unet_like(model)
        self.transformer = is_transformer_model(model)
        self.patch_size = _config_value(model, "patch_size") if self.transformer else None
        self.data_format = getattr(model, "data_format", "NCHW")
        forward = forward_of(type(model))
        self.where = argument_positions(forward, "sample", "hidden_states", *TIMESTEPS, *TOKEN_IDS, *SHAPE_LISTS)
        parameters = list(inspect.signature(forward).parameters.values())[1:]
        self.first = parameters[0].name if parameters else None  # the latent, by keyword where not named as above
        self.defaults = {p.name: p.default for p in parameters}
        # a model whose timestep rises while sampling: a falling one starts a generation
        self.rising = any(family.timesteps_rise for _, family in blocks_of(fw, model))
        self.model = type(model).__qualname__
        self.ids_grid: Tuple[Any, Optional[Tuple[int, int, int]]] = (None, None)  # (ids, leading_raster of them)
        self.size_aware = size_aware_somewhere(fw, model, state.config)
        self.layout = grid_layout(type(model)) if self.transformer else None
        self.context = context_latents(type(model)) if self.transformer else None  # images' latents after the grid
        if self.context is not None:
            self.where.update(argument_positions(forward, self.context))
        self.grid_last = grid_last(type(model))  # the latent's tokens end each block's image stream
        self.roles = token_roles(type(model)) if self.transformer else None  # the image's tokens by their role
        self.roles_read: Tuple[Tuple[Any, ...], Any] = ((), None)  # (the arrays read, indicated_run of them)
        if self.roles is not None:
            self.where.update(argument_positions(forward, *self.roles.arguments))
        if self.layout is not None:
            self.temporal_patch = (self.layout.temporal_patch and _config_value(model, self.layout.temporal_patch)) or 1
            named = tuple(name for name in (self.layout.coords, self.layout.frame_types) if name)
            self.where.update(argument_positions(forward, *self.layout.sizes, *self.layout.patch_arguments, *named))

    def __call__(self, module, args, kwargs):
        where = self.where
        sample = argument(args, kwargs, "sample", where["sample"])
        if sample is None:
            sample = argument(args, kwargs, "hidden_states", where["hidden_states"])
        if sample is None:
            sample = argument(args, kwargs, self.first, 0)
        timestep = next(
            (value for value in (argument(args, kwargs, name, where[name]) for name in TIMESTEPS) if value is not None), None
        )
        config = self.state.config
        # read on the host once, only where an option decides from the timestep's value
        values = (
            _host_timesteps(self.fw, timestep)
            if timestep is not None and (config.timestep_range is not None or config.reuse_steps > 1) else None
        )
        step, merging = _step(timestep), self._merges_at(values)
        if config.reuse_steps > 1 and values is not None:  # matches live within one generation
            self.state.follow_generation(-min(values) if self.rising else max(values))
        if not self.transformer:  # UNets give their latent; inner Transformer2DModels give the grids
            latent = _spatial(sample, self.data_format) if self.unet else None
            shape = get_ops(sample).shape(sample) if self.unet else ()
            # a video UNet's sample is 5-D (batch first); its blocks see batch * frames items
            self.state.begin_call(latent, step, videos=shape[0] if len(shape) == 5 else None, merging=merging)
            return None
        if isinstance(sample, (list, tuple)):  # a list of [C, F, H, W] latents (Z-Image): one batch
            if not sample or isinstance(sample[0], (list, tuple)):
                why = "its input is a list of lists (several images per item), whose order ToMe does not know; such calls run unmerged"
                return self._unplaced(step, why)
            shape = (len(sample),) + tuple(get_ops(sample[0]).shape(sample[0]))
        else:
            shape = get_ops(sample).shape(sample)
        videos, tail = None, 0
        layout = self.layout
        grid_last = self.grid_last
        shapes = next(
            (value for value in (argument(args, kwargs, name, where[name]) for name in SHAPE_LISTS) if value is not None), None
        )
        if self.roles is not None:
            run = self._indicated(args, kwargs)
            if run is None:
                roles = self.roles
                why = (
                    f"its {roles.indicator} does not end the image's tokens with one run at the same place in every row, "
                    f"in one segment and under the same {roles.ids} of one grid (rows packing other samples elsewhere), "
                    "so no token grid is known; such calls run unmerged"
                )
                return self._unplaced(step, why)
            grid, tail = run[:2], run[3]  # the tokens before the run: the blocks' text in front (TEXT_PREFIX)
        elif shapes is not None and layout is None:
            grid = shapes_grid(shapes, shape[1], last=grid_last)
            if grid is None:
                why = (
                    "the items of its batch give their output images different sizes in its shape list, so no one token "
                    "grid is known; such calls run unmerged"
                )
                return self._unplaced(step, why)
            grid, tail = grid[:2], grid[2]
        elif layout is not None:
            sizes = self._video_grid(layout, shape, args, kwargs)
            if sizes is None:
                given = ", ".join((*layout.sizes, *((layout.coords,) if layout.coords else ())))
                why = f"the call gave none of {given} (or coordinates of no video grid), so no token grid is known; such calls run unmerged"
                return self._unplaced(step, why)
            frames, height, width, from_coords = sizes
            grid, tail = (frames * height, width), (shape[1] - frames * height * width if layout.frames_axis is None else 0)
            conditions = self._condition_frames(layout, args, kwargs)
            if conditions is None:
                why = (
                    f"its {layout.frame_types} do not give noisy frames (type 0) first and conditions after them, the "
                    "same in every item, so no token grid is known; such calls run unmerged"
                )
                return self._unplaced(step, why)
            if conditions:  # appended condition frames: a tail after the grid
                grid, tail = ((frames - conditions) * height, width), tail + conditions * height * width
            if from_coords:  # conditioning tokens before the grid: the blocks' head
                grid_last, tail = True, 0
        elif len(shape) == 4:
            height, width = _spatial(sample, self.data_format)
            patch = self.patch_size if isinstance(self.patch_size, int) else self.patch_size[-1]  # (1, 1): HunyuanImage
            grid = (height // patch, width // patch)
            for latent in (argument(args, kwargs, self.context, where[self.context]) or ()) if self.context else ():
                rows, cols = _spatial(latent, self.data_format)  # CONTEXT_LATENTS: a tail after the grid
                tail += (rows // patch) * (cols // patch)
        elif len(shape) == 5 and isinstance(self.patch_size, int):
            # (batch, C, frames, H, W) with a 2-D patch (Latte): each frame is an item of the spatial blocks' batch,
            # merged on its own grid, as in video UNets
            grid, videos = (shape[3] // self.patch_size, shape[4] // self.patch_size), shape[0]
        elif len(shape) == 5:  # a 3-D patch (Wan): (batch, C, frames, H, W), its frames' grids stacked in one sequence
            frames, height, width = (n // p for n, p in zip(shape[2:], self.patch_size))
            grid = (frames * height, width)
        elif len(shape) == 6:  # (batch, items, C, frames, H, W): one item after another in the sequence, the
            # output's first (JoyImage-Edit moves its target there); the other items pass through as a tail
            frames, height, width = (n // p for n, p in zip(shape[3:], self.patch_size))
            grid, tail = (frames * height, width), (shape[1] - 1) * frames * height * width
        else:
            ids = next((value for value in (argument(args, kwargs, name, where[name]) for name in TOKEN_IDS) if value is not None), None)
            packed = self._packed_grid(ids, shape[1])
            if packed is None:
                why = (
                    "its img_ids do not begin with one image's tokens in raster order (row by row), so no token "
                    "grid is known; calls with such ids run unmerged"
                )
                return self._unplaced(step, why)
            grid, tail, grid_last = packed[:2], packed[2], packed[3]
        shards = self.fw.shards(module)
        if shards is not None:
            check_shards(shards, self.size_aware, self.model)
            grid = shard_grid(grid, shards, tail, videos, self.model)
        self.state.begin_call(grid, step, videos=videos, merging=merging, tail=tail, grid_last=grid_last, shards=shards)
        self.state.enter_grid(grid)
        if shards is not None:
            check_shard_cells(grid, shards, self.state.active, self.model)
        return None

    def _unplaced(self, step: Any, why: str) -> None:
        """Begin a call whose tokens no grid places: it runs unmerged, and ``why`` is said once."""
        self.state.say_once(f"ToMe on {self.model}: {why}")
        self.state.begin_call(None, step, merging=False, why=why)

    def _indicated(self, args, kwargs) -> Optional[Tuple[int, int, int, int]]:
        """``(rows, cols, head, tail)`` of the image's last run in the call's packed rows, told by its token roles
        (:class:`~tome_core.families.TokenRoles`, :func:`~tome_core.levels.indicated_run`), or None. Read on the host
        once per set of arrays (pipelines build them once per generation)."""
        roles = self.roles
        arrays = tuple(argument(args, kwargs, name, self.where[name]) for name in roles.arguments)
        if any(array is None for array in arrays):
            return None
        if len(arrays) != len(self.roles_read[0]) or any(a is not b for a, b in zip(arrays, self.roles_read[0])):
            rows = []
            for name, array in zip(roles.arguments, arrays):
                values, shape = self.fw.host_values(array), get_ops(array).shape(array)
                # ids [B, L, k], roles and segments [B, L]; without the batch axis, one layout the batch shares
                width = shape[-1] if name == roles.ids else 1
                length = shape[-2] if name == roles.ids else shape[-1]
                tokens = [values[i : i + width] if name == roles.ids else values[i] for i in range(0, len(values), width)]
                rows.append([tokens[i : i + length] for i in range(0, len(tokens), length)])
            indicator, ids = rows[0], rows[1]
            self.roles_read = (arrays, indicated_run(indicator, roles.image, ids, rows[2] if len(rows) > 2 else None))
        return self.roles_read[1]

    def _video_grid(self, layout: GridLayout, shape: Sequence[int], args, kwargs) -> Optional[Tuple[int, int, int, bool]]:
        """``(frames, rows, cols, from_coords)`` of a video transformer's tokens
        (:class:`~tome_core.families.GridLayout`), or None where its call does not give them; ``from_coords``: read
        from the tokens' coordinates, after conditioning tokens."""
        temporal = self.temporal_patch
        spatial = self.patch_size if isinstance(self.patch_size, int) else (self.patch_size or (1,))[-1]
        if isinstance(self.patch_size, (tuple, list)) and len(self.patch_size) == 3:
            temporal = self.patch_size[0]
        if layout.patch_arguments:
            temporal, spatial = (
                argument(args, kwargs, name, self.where[name]) or self.defaults[name] for name in layout.patch_arguments
            )
        if layout.frames_axis is None:
            sizes = [argument(args, kwargs, name, self.where[name]) for name in layout.sizes]
            if any(size is None for size in sizes):
                coords = argument(args, kwargs, layout.coords, self.where[layout.coords]) if layout.coords else None
                found = None if coords is None else self._coords_grid(coords)
                return None if found is None else (*found[:3], True)
        else:
            sizes = [shape[layout.frames_axis], *(shape[2:4] if layout.channels_last else shape[-2:])]
        return sizes[0] // temporal, sizes[1] // spatial, sizes[2] // spatial, False

    def _condition_frames(self, layout: GridLayout, args, kwargs) -> Optional[int]:
        """How many frames at the end of the call's video are conditions (:attr:`GridLayout.frame_types`): 0
        where it gives no types; None where its types are not noisy frames (0) then conditions in every item."""
        types = argument(args, kwargs, layout.frame_types, self.where[layout.frame_types]) if layout.frame_types else None
        if types is None:
            return 0

        def read(values: List[float], shape: Tuple[int, ...]) -> Optional[int]:
            rows = [values[i : i + shape[-1]] for i in range(0, len(values), shape[-1])]
            noisy = sum(1 for value in rows[0] if value == 0)
            if not noisy or any(row != rows[0] for row in rows) or any(value != 0 for value in rows[0][:noisy]):
                return None
            return len(rows[0]) - noisy

        return self._read_once(types, read)

    def _coords_grid(self, coords: Any) -> Optional[Tuple[int, int, int, int]]:
        """``(frames, rows, cols, head)`` of tokens from their coordinates ``[B, 3, N]`` (batch item 0)
        (:func:`~tome_core.levels.trailing_frames`)."""

        def read(values: List[float], shape: Tuple[int, ...]) -> Optional[Tuple[int, int, int, int]]:
            axes, tokens = shape[-2], shape[-1]
            return trailing_frames([[values[axis * tokens + i] for axis in range(axes)] for i in range(tokens)])

        return self._read_once(coords, read)

    def _read_once(self, array: Any, read: Callable[[List[float], Tuple[int, ...]], Any]) -> Any:
        """``read(values, shape)`` of an array's values, read on the host once per array (pipelines build their
        ids and coordinates once per generation)."""
        if self.ids_grid[0] is not array:
            self.ids_grid = (array, read(self.fw.host_values(array), get_ops(array).shape(array)))
        return self.ids_grid[1]

    def _merges_at(self, timesteps: Optional[List[float]]) -> bool:
        """Whether this call, at ``timesteps`` (read on the host where an option needs them), merges under
        ``timestep_range``."""
        if self.state.config.timestep_range is None:
            return True
        if timesteps is None:
            raise ValueError(f"timestep_range={self.state.config.timestep_range} needs the model's timestep, and this call gave none")
        return self.state.config.merges_at(timesteps)

    def _packed_grid(self, img_ids: Any, tokens: int) -> Optional[Tuple[int, int, int, bool]]:
        """``(h, w, tail, grid_last)`` of ``tokens`` packed image tokens from their ids ``[N, 3]``
        (:func:`~tome_core.levels.leading_raster`: the output image's raster grid, then ``tail`` tokens of
        reference images; or :func:`~tome_core.levels.trailing_raster`: the grid last, after reference images'
        tokens, ``grid_last``), or None. Ids of more rows than tokens (Krea 2's ``position_ids`` over ``[text;
        image]``) are read from their last ``tokens`` rows.

        Read on the host once per ids array (pipelines build it once per generation)."""
        if img_ids is None:
            raise ValueError("ToMe needs img_ids to place packed image tokens on their grid")

        def read(values: List[float], shape: Tuple[int, ...]) -> Optional[Tuple[int, int, int, bool]]:
            ids = [values[i : i + shape[-1]] for i in range(0, len(values), shape[-1])]
            ids = ids[-min(tokens, len(ids) // (shape[0] if len(shape) == 3 else 1)):]
            leading = leading_raster(ids)
            if leading is not None:
                return (*leading, False)
            trailing = trailing_raster(ids)
            return None if trailing is None else (*trailing[:2], 0, True)

        return self._read_once(img_ids, read)


def size_aware_somewhere(fw: Framework, model: Any, config: ToMeConfig) -> bool:
    """Whether some merged self-attention of ``model`` runs size-aware under ``config``."""
    choices = [choice for _, choice in auto_choices(fw, model, config)]
    return any(
        choice.arrangement(sublayer.kind, sublayer.attention)[1]
        for *_, sublayer, _ in _sublayers(fw, model, config) for choice in choices
    )


def shapes_grid(img_shapes: Sequence[Any], tokens: int, last: bool = False) -> Optional[Tuple[int, int, int]]:
    """``(h, w, tail)`` of ``tokens`` tokens from a shape list (:data:`SHAPE_LISTS`: Qwen-Image's ``img_shapes``,
    JoyImage-Edit-Plus's ``shape_list``): per batch item, the ``(frames, h, w)`` of each image in the sequence (or
    one such tuple), the output's first; the images after it (Edit's references, Layered's further layers and
    condition) and any padding are the tail. With ``last`` the output's is each item's last (Qwen-Image 2.1's,
    after its condition images: the blocks' head, :data:`~tome_core.families.GRID_LAST`), and the tail is 0. None
    where the items' outputs differ in size."""
    outputs = [tuple(item[-1 if last else 0] if isinstance(item[0], (tuple, list)) else item) for item in img_shapes]
    if any(output != outputs[0] for output in outputs):
        return None
    frames, height, width = outputs[0]
    if frames * height * width > tokens:
        raise ValueError(f"shapes {outputs[0]} give more than the {tokens} tokens of hidden_states")
    return frames * height, width, 0 if last else tokens - frames * height * width


def _call_ends(state: ToMeState, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a patched model: its call has returned, so a block of it that runs now is run by another
    model that borrowed it (:attr:`ToMeState.in_call`)."""
    state.in_call = False


def _grid_output(state: ToMeState, data_format: str, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a model's :data:`~tome_core.families.GRID_SOURCES` child: its 4-D output is the grid of the
    blocks the model runs after it on that map's flattened pixels."""
    if len(get_ops(output).shape(output)) == 4:
        state.enter_grid(_spatial(output, data_format))


class _GridHook:
    """Pre-hook on a UNet's ``Transformer2DModel`` (or another 2-D container): its 4-D input is the grid of the
    blocks inside."""

    def __init__(self, state: ToMeState, data_format: str):
        self.state = state
        self.data_format = data_format

    def __call__(self, module, args, kwargs):
        hidden_states = argument(args, kwargs, "hidden_states", 0)
        if hidden_states is not None and len(get_ops(hidden_states).shape(hidden_states)) == 4:
            self.state.enter_grid(_spatial(hidden_states, self.data_format))
        return None


# ---------------------------------------------------------------------------------------------------------
# Blocks and sub-layers


@dataclass(frozen=True)
class BlockPlan:
    """What one block does at one call, decided once as the block starts (:meth:`_BlockRun.begin`, the one
    place that decides it) and read by its sub-layers' hooks: the options it runs with (``mode="auto"``
    resolved for this call, or the fallback where its attention cannot take keys apart), its matches per
    sub-layer kind (none: the block runs unmerged), and the tokens before (``head``) and after (``tail``) the
    grid's in its image stream."""

    config: ToMeConfig
    matches: Dict[str, Match] = field(default_factory=dict)
    head: int = 0
    tail: int = 0

    def unmerged(self) -> "BlockPlan":
        return BlockPlan(self.config, {}, self.head, self.tail)


class _BlockRun:
    """The matches of one transformer block while it runs, shared by the hooks of its sub-layers.

    A block that gradient checkpointing runs again in the backward pass gets its input tensor back, but the
    model's state may by then be another call's (another timestep, latent size or arrangement): so a forward
    that records gradients remembers, per input tensor (while it lives), the matches and options it used,
    and a run on the same tensor takes them back instead of matching again."""

    def __init__(
        self, fw: Framework, state: ToMeState, family: BlockFamily, stream: int, block: Any, ratio: Optional[float],
        where: str,
    ):
        self.fw = fw
        self.state = state
        self.base = self.family = family  # family: the base, or its variant in this call (family_in_call)
        self.stream = stream
        self.block = block
        self.ratio = ratio  # its block_ratios entry
        self.where = where
        self.attentions: List[Tuple[Sublayer, Any]] = []  # its merged self-attentions (what kv/queries arrange)
        self.merged: set = set()  # sub-layers (children) merged in this run of the block
        self.passing: set = set()  # sub-layers whose call now in flight runs unmerged (_MergeInput._passes)
        # token masks are gathered like rotary positions: one match for the whole batch
        self.masks = any(sublayer.masks for sublayer in family.sublayers)
        name = family.unmerged_with[0] if family.unmerged_with else None
        self.unmerged_at = argument_positions(forward_of(type(block)), name)[name] if name else None
        self.text_after_at = family_argument_position(family, block)
        self.metric, self.metric_at = block_metric(family, block)  # what the match is computed from
        self.lent = False  # another model may run this block in its own call (families.LENT)
        self.plan = BlockPlan(state.active)
        self.ran: Dict[int, Tuple[Any, BlockPlan]] = {}  # id(input): (weakref to it, the plan it ran with)

    def begin(self, module, args, kwargs):
        """Decide this block's :class:`BlockPlan` for the call now starting."""
        block_problem(self.block, self.state.config)
        self.family = family_in_call(self.base, self.text_after_at, args, kwargs)
        metric = argument(args, kwargs, self.metric, self.metric_at)
        earlier = self._ran_on(metric)
        if earlier is not None:  # a recomputation (checkpointing): as it ran then
            self.plan = earlier[1]
            return None
        if self.lent and not self.state.in_call:  # another model runs this block (it borrowed it): unmerged
            self.plan = self.plan.unmerged()
            return None
        config, fallback = self._arrangement(self.state.active)
        whole = metric
        if self.family.feature_map:
            self.state.enter_grid(_spatial(metric, "NCHW"))
            metric = pixels(metric)
        metric = self._own_piece(_batch_first(metric) if self.family.sequence_first else metric)
        head, tail = self._around(metric)
        self.plan = BlockPlan(config, {}, head, tail)
        if not self.state.merging or self._unmerged(args, kwargs):  # a call that runs unmerged, said where decided
            return None
        matches = self.state.block_matches(
            self._image(metric), self.stream, self.family.rotary is not None or self.masks, self.ratio, config, fallback
        )
        self.plan = BlockPlan(config, matches, head, tail)
        if self.fw.may_run_again(whole):
            self.ran = {key: entry for key, entry in self.ran.items() if entry[0]() is not None}
            self.ran[id(whole)] = (weakref.ref(whole), self.plan)
        return None

    def _ran_on(self, x: Any) -> Optional[Tuple[Any, BlockPlan]]:
        """What an earlier run of this block on ``x`` used, if this is a recomputation of it: on ``x`` itself
        (non-reentrant checkpointing), or on a tensor whose data ``x`` shares (reentrant checkpointing
        recomputes from a detached copy); the earlier input is alive, so its memory holds no other tensor."""
        earlier = self.ran.get(id(x))
        if earlier is not None and earlier[0]() is x:
            return earlier
        return next((entry for entry in self.ran.values() if self.fw.same_data(entry[0](), x)), None)

    def _own_piece(self, x: Any) -> Any:
        """This process's piece of a block input that context parallelism splits inside the block's own call
        (:attr:`Shards.split_inside`); ``x`` itself otherwise."""
        shards = self.state.shards
        if shards is None or id(self.block) not in shards.split_inside:
            return x
        if self.family.stream != TEXT_NONE:
            raise ValueError(
                f"ToMe cannot merge {self.where} {CONTEXT_PARALLEL}: its {type(self.block).__name__} splits its "
                "input of text and image tokens together, so a process's piece mixes both"
            )
        length = get_ops(x).shape(x)[1] // shards.count
        return x[:, shards.rank * length : (shards.rank + 1) * length]

    def _unmerged(self, args, kwargs) -> bool:
        """Whether this call of the block runs unmerged (:attr:`BlockFamily.unmerged_with`), said once."""
        if self.family.unmerged_with is None:
            return False
        name, why = self.family.unmerged_with
        if argument(args, kwargs, name, self.unmerged_at) is None:
            return False
        self.state.say_once(f"ToMe on {self.where}: calls whose blocks get {name} ({why}) run unmerged in those blocks")
        return True

    def _around(self, x: Any) -> Tuple[int, int]:
        """``(head, tail)``: the tokens before and after the grid's in this block's image stream. The tail: the
        call's (reference tokens its model put in the stream), or, in a stream of image tokens alone, every token
        past the grid (FLUX.3's joint blocks get the reference images' tokens after the output's, which its
        earlier blocks ran apart). Where the call's grid comes last (FramePack), those tokens are the head."""
        grid = self.state.grid_hw
        if self.family.stream != TEXT_NONE or grid is None:
            return 0, self.state.tail
        extra = get_ops(x).shape(x)[1] - grid[0] * grid[1] - self.state.tail
        if extra > 0 and self.state.shards is not None:
            raise ValueError(
                f"ToMe cannot merge {self.where} {CONTEXT_PARALLEL}: its {type(self.block).__name__}s get {extra} "
                "tokens of other images beside the output's grid, which the split divides together with it"
            )
        if self.state.grid_last:
            return max(extra, 0), self.state.tail
        return 0, self.state.tail + max(extra, 0)

    def _image(self, x: Any) -> Any:
        """The image tokens of the block's input: without the tail, and without the text in front where the
        block's input is ``[text; image; tail]`` (their count: the call's grid)."""
        stream = self.family.stream
        if stream == TEXT_NONE and not self.plan.tail and not self.plan.head:
            return x
        length = get_ops(x).shape(x)[1]
        if stream == TEXT_NONE:
            return x[:, self.plan.head : length - self.plan.tail]
        grid = self.state.grid_hw
        if grid is None:
            raise ValueError(f"ToMe on {self.where}: a {type(self.block).__name__} got no token grid from its model's call")
        if stream == TEXT_SUFFIX:
            return x[:, : grid[0] * grid[1]]
        return x[:, length - self.plan.tail - grid[0] * grid[1] : length - self.plan.tail]

    def _arrangement(self, config: ToMeConfig) -> Tuple[ToMeConfig, Optional[str]]:
        """The options this block runs with now, and why they are a fallback (None: they are not):
        ``config``, unless its self-attention (its processor at this call) cannot take keys and values apart
        from its queries; then ``mode="auto"`` runs ToMe for SD's arrangement here
        (:meth:`ToMeState.fallback`), and an explicit ``kv`` or ``queries`` is refused."""
        if config.mode not in ("kv", "queries"):
            return config, None
        for sublayer, module in self.attentions:
            problem = arrangement_problem(self.fw, self.block, sublayer, module)
            if problem is None:
                continue
            if self.state.config.mode != "auto":
                raise arrangement_error(config.mode, f"block {self.stream} of {self.where}", problem)
            return self.state.fallback(self.fw.bias_problem(module) is None), problem
        return config, None

    def end(self, module, args, kwargs, output):
        self.plan = self.plan.unmerged()
        self.merged.clear()
        return None


def family_argument_position(family: BlockFamily, block: Any) -> Optional[int]:
    """Where ``block``'s forward takes its family's ``text_after_with`` argument by position (None: by keyword
    only, or the family has none)."""
    name = family.text_after_with
    return argument_positions(forward_of(type(block)), name)[name] if name else None


def family_in_call(family: BlockFamily, at: Optional[int], args, kwargs) -> BlockFamily:
    """``family`` as a block call with these arguments runs it: with its text after the image where the call gives
    its ``text_after_with`` argument (at position ``at``, :func:`~tome_core.families.with_text_after`)."""
    if family.text_after_with is None or argument(args, kwargs, family.text_after_with, at) is None:
        return family
    return with_text_after(family)


class _SublayerHook:
    """A hook on one sub-layer of a block run: its :class:`Sublayer` is the family's entry as the block's call
    now runs it (:func:`family_in_call`)."""

    def __init__(self, fw: Framework, run: "_BlockRun", sublayer: Sublayer):
        self.fw = fw
        self.run = run
        self.index = run.base.sublayers.index(sublayer)

    @property
    def sublayer(self) -> Sublayer:
        return self.run.family.sublayers[self.index]


def pixels(x: Any) -> Any:
    """A feature map ``(B, C, H, W)`` as tokens ``[B, H * W, C]``, with the ops protocol's transpose."""
    ops = get_ops(x)
    batch, channels, height, width = ops.shape(x)
    return ops.matrix_transpose(ops.reshape(x, (batch, channels, height * width)))


def _batch_first(x: Any) -> Any:
    """``[S, B, C]`` as ``[B, S, C]``, with the ops protocol's transpose of the last two axes."""
    ops = get_ops(x)
    length, batch, channels = ops.shape(x)
    x = ops.matrix_transpose(ops.reshape(x, (length, batch * channels)))  # [B * C, S]
    return ops.matrix_transpose(ops.reshape(x, (batch, channels, length)))


def block_problem(block: Any, config: ToMeConfig) -> None:
    """Refuse options that this block, as it is now set up, cannot run (at ``patch`` and at each call)."""
    if config.merge_mlp and getattr(block, "_chunk_size", None) is not None:
        raise ValueError(
            f"merge_mlp=True cannot be combined with feed-forward chunking (enable_forward_chunking) of "
            f"{type(block).__name__}: the feed-forward runs on chunks of the merged tokens; disable one of them"
        )


class _MergeInput(_SublayerHook):
    """Pre-hook on a sub-layer: merge the image tokens of its first input (text tokens stay), give merged
    tokens their destination's rotary position, and arm size-aware attention.

    A self-attention with a ``kv_input`` runs in the configured arrangement: ``tokens`` merges its input,
    ``kv`` keeps its queries and hands it the merged tokens as keys and values, ``queries`` merges its
    queries and hands it every token as keys and values."""

    def __init__(self, fw: Framework, run: _BlockRun, sublayer: Sublayer, module: Any):
        super().__init__(fw, run, sublayer)
        # where ``module``'s forward takes the rotary arguments and masks by position (None: by keyword only)
        self.rotary_at = argument_positions(forward_of(type(module)), *rotary_arguments(run.family))
        self.masks_at = argument_positions(forward_of(type(module)), "attention_mask", *(name for name, _ in sublayer.masks))
        self.aligned_at = argument_positions(forward_of(type(module)), *sublayer.aligned)
        self.counts_at = argument_positions(forward_of(type(module)), *sublayer.counts, *sublayer.log_bases)
        self.head = 0  # the head in this call's input (sublayer_head)
        self.inside = _Inside(fw, run, sublayer, module) if sublayer.projections else None
        self.text_only = attends_text_only(run.block, sublayer)  # its block's flag makes it a cross-attention
        # what the attention takes keys and values from (diffusers' encoder_hidden_states, Flax's context)
        self.kv_name = sublayer.kv_input or "encoder_hidden_states"
        self.kv_at = argument_positions(forward_of(type(module)), self.kv_name)[self.kv_name]

    def __call__(self, module, args, kwargs):
        if self.inside is not None:
            return self._arm_inside(module, args, kwargs)
        match = self.run.plan.matches.get(self.sublayer.kind)
        if match is None or match.merged == 0 or self._passes(args, kwargs):
            return None
        mode, size_aware = self.run.plan.config.arrangement(self.sublayer.kind, self.sublayer.attention)
        self.fw.output_cache(module)  # a cache set after patch is checked here
        x = argument(args, kwargs, "hidden_states", 0)
        self.head = sublayer_head(self.run, self.sublayer, get_ops(x).shape(x)[1], match.tokens)
        merged = around_image(x, match.tokens, self.run.plan.tail, self.sublayer.text, lambda image: merge(image, match), self.head)
        if mode != "tokens":
            return self._arrange(module, args, kwargs, x, merged, match, mode, size_aware)
        args, kwargs = replace_argument(args, kwargs, "hidden_states", 0, merged)
        for name in self.sublayer.aligned:
            other = argument(args, kwargs, name, self.aligned_at[name])
            if other is not None:
                alike = merged if other is x else around_image(
                    other, match.tokens, self.run.plan.tail, self.sublayer.text, lambda image: merge(image, match), self.head
                )
                args, kwargs = replace_argument(args, kwargs, name, self.aligned_at[name], alike)
        for name, at in self.rotary_at.items():
            args, kwargs = self._merge_rotary(args, kwargs, match, name, at)
        gathered = self._gather_masks(args, kwargs, match)
        for name, mask in gathered.items():
            args, kwargs = replace_argument(args, kwargs, name, self.masks_at[name], mask)
        for name in self.sublayer.counts:
            if argument(args, kwargs, name, self.counts_at[name]) is not None:
                args, kwargs = replace_argument(args, kwargs, name, self.counts_at[name], match.kept)
        for name in self.sublayer.log_bases:
            base = argument(args, kwargs, name, self.counts_at[name])
            if base is not None:
                base = same_logarithm(base, get_ops(x).shape(x)[1], get_ops(merged).shape(merged)[1])
                args, kwargs = replace_argument(args, kwargs, name, self.counts_at[name], base)
        if not size_aware:
            return args, kwargs
        # With only_cross_attention, a BasicTransformerBlock's attn1 attends to text: its keys are not merged. (Its
        # own input given again there, Lumina-Next's and OmniGen's, was merged alike: its keys are.)
        attends_text = self.kv_name not in self.sublayer.aligned and argument(args, kwargs, self.kv_name, self.kv_at) is not None
        if self.sublayer.text == TEXT_NONE and attends_text:
            return args, kwargs
        return self._size_aware(module, args, kwargs, match, merged)

    def _arm_inside(self, module, args, kwargs):
        """Arm the hooks inside an attention that merges at its projections (:class:`_Inside`) for this call: a
        self-attention, or a cross-attention (given keys and values other than its input, with no image among
        them), which merges its queries as ``crossattn``."""
        x = argument(args, kwargs, "hidden_states", 0)
        kv = argument(args, kwargs, self.kv_name, self.kv_at)
        cross = (self.sublayer.text == TEXT_NONE and kv is not None and kv is not x) or self.text_only
        kind = "crossattn" if cross else self.sublayer.kind
        match = self.run.plan.matches.get(kind)
        # a cross-attention's attention_mask is over the text's keys (Kandinsky 3's), which merging never touches
        if match is None or match.merged == 0 or (not cross and self._passes(args, kwargs)):
            return None
        mode, size_aware = self.run.plan.config.arrangement(kind, self.sublayer.attention and not cross)
        self.inside.arm(match, mode, cross, size_aware)
        if not size_aware:
            return None
        bias = SizeBias(match, self.sublayer.text, x, self.run.plan.tail, whole_mask=False)
        return self.fw.size_aware(module, args, kwargs, bias)

    def _passes(self, args, kwargs) -> bool:
        """Whether this call of the sub-layer runs on all its tokens, unmerged: a call after the block's first
        where the sub-layer runs once on the image and then on other tokens (:attr:`Sublayer.once`), or a
        self-attention given an ``attention_mask`` over its tokens that the family table does not say how to
        gather (SkyReels-V2's block-causal mask; a UNet call's ``attention_mask``): merging would mix tokens the
        mask keeps apart."""
        run, child = self.run, self.sublayer.child
        if self.sublayer.once and child in run.merged:
            run.passing.add(child)
            return True
        run.merged.add(child)
        mask = argument(args, kwargs, "attention_mask", self.masks_at["attention_mask"])
        placed = any(name == "attention_mask" for name, _ in self.sublayer.masks)
        if mask is None or self.sublayer.kind != "attn" or (placed and gatherable(mask, argument(args, kwargs, "hidden_states", 0))):
            return False
        run.state.say_once(
            f"ToMe on {run.where}: {type(run.block).__name__}.{child} is given an attention_mask over its tokens, which "
            "merging cannot follow; it runs on all its tokens (its block's other sub-layers still merge) in such calls"
        )
        run.passing.add(child)
        return True

    def _gather_masks(self, args, kwargs: Dict[str, Any], match: Match) -> Dict[str, Any]:
        """The sub-layer's token masks (:attr:`Sublayer.masks`) over ``[text; merged image; tail]``."""
        gathered = {}
        for name, axes in self.sublayer.masks:
            mask = argument(args, kwargs, name, self.masks_at[name])
            if mask is None:
                continue
            for axis in axes:  # none: a mask over the text only, which the processor extends over the image
                mask = merge_positions((mask,), match, axis, self.run.plan.tail, text_follows(self.sublayer.text), self.head)[0]
            gathered[name] = mask
        return gathered

    def _arrange(self, module, args, kwargs, x, merged, match, mode, size_aware):
        """The ``kv`` or ``queries`` arrangement of a self-attention."""
        name = self.sublayer.kv_input
        if mode == "queries":
            args, kwargs = replace_argument(args, kwargs, "hidden_states", 0, merged)
            return args, {**kwargs, name: x}
        kwargs = {**kwargs, name: merged}
        if size_aware:
            return self._size_aware(module, args, kwargs, match, merged)
        return args, kwargs

    def _merge_rotary(self, args, kwargs, match, name: str, at: Optional[int]):
        """The sub-layer's rotary argument ``name`` (at position ``at``) moved to the merged tokens."""
        rotary = argument(args, kwargs, name, at)
        if rotary is None:
            return args, kwargs
        family, after = self.run.family, text_follows(self.sublayer.text)
        if isinstance(rotary, dict):  # tables by name (AnyFlow's query and key frequencies)
            moved = merge_positions(tuple(rotary.values()), match, family.rotary_axis, self.run.plan.tail, after, self.head)
            return replace_argument(args, kwargs, name, at, type(rotary)(zip(rotary, moved)))
        if not isinstance(rotary, (tuple, list)):  # one table (Z-Image's complex frequencies)
            moved = merge_positions((rotary,), match, family.rotary_axis, self.run.plan.tail, after, self.head)[0]
            return replace_argument(args, kwargs, name, at, moved)
        items = family.rotary_items
        moved = merge_positions(
            [table for i, table in enumerate(rotary) if items is None or i in items], match, family.rotary_axis,
            self.run.plan.tail, after, self.head,
        )
        if items is not None:
            moved = iter(moved)
            moved = [next(moved) if i in items else table for i, table in enumerate(rotary)]
        return replace_argument(args, kwargs, name, at, type(rotary)(moved))

    def _size_aware(self, module, args, kwargs, match, merged, masked=False):
        return self.fw.size_aware(
            module, args, kwargs, SizeBias(match, self.sublayer.text, merged, self.run.plan.tail, self.head)
        )


def gatherable(mask: Any, x: Any) -> bool:
    """Whether a token mask can be gathered as a sub-layer's input ``x`` merges: an array of ``x``'s type (not,
    e.g., a flex-attention ``BlockMask``, which Qwen-Image 2.1's flex processor gets)."""
    return mask is None or isinstance(mask, type(x)) or isinstance(x, type(mask))


def rotary_arguments(family: BlockFamily) -> Tuple[str, ...]:
    """The arguments of a family's sub-layers that carry rotary tables: ``rotary``, and ``key_rotary`` where the
    keys' table is given apart."""
    return tuple(name for name in (family.rotary, family.key_rotary) if name is not None)


def same_logarithm(base: float, whole: int, short: int) -> float:
    """The base under which the logarithm of ``short`` is that of ``whole`` under ``base``
    (:attr:`~tome_core.families.Sublayer.log_bases`): ``base ** (ln short / ln whole)``. ``base`` itself where no
    base can hold it (fewer than two tokens)."""
    if short < 2 or whole < 2 or short == whole:
        return base
    return float(base) ** (math.log(short) / math.log(whole))


def sublayer_head(run: "_BlockRun", sublayer: Sublayer, length: int, tokens: int) -> int:
    """The block's head in a sub-layer's input (or output) of ``length`` tokens around ``tokens`` image tokens:
    where no text shares the tensor, a sub-layer may run on the grid alone (Helios' cross-attention gets the
    current frames without their history), and then it has none."""
    if sublayer.text in (TEXT_PREFIX, TEXT_SUFFIX) or length == run.plan.head + tokens + run.plan.tail:
        return run.plan.head
    return 0


def around_image(x: Any, tokens: int, tail: int, text: str, change: Callable[[Any], Any], head: int = 0) -> Any:
    """``x`` ``[B, L, C]`` with its ``tokens`` image tokens replaced by ``change(image)``: ``x`` is ``[head; image;
    tail]``, or with the rest of ``L`` text in front (``text == TEXT_PREFIX``) or behind (``TEXT_SUFFIX``)."""
    ops = get_ops(x)
    length = ops.shape(x)[1]
    words = length - head - tokens - tail if text in (TEXT_PREFIX, TEXT_SUFFIX) else 0
    if not words and not tail and not head:
        return change(x)
    start = (words if text == TEXT_PREFIX else 0) + head
    parts = [x[:, :start]] if start else []
    parts.append(change(x[:, start : start + tokens]))
    if start + tokens < length:
        parts.append(x[:, start + tokens :])
    return ops.concat(parts, axis=1)


def merge_positions(
    rotary: Any, match: Match, axis: int = 0, tail: int = 0, text_after: bool = False, head: int = 0
) -> Any:
    """Tables ``(cos, sin)`` (rotary positions, token masks) over ``[text; head; image; tail]`` tokens along
    ``axis`` (``[head; image; tail; text]`` with ``text_after``) moved to the merged tokens: each merged token takes the entry
    of the token it stands at (its destination). The match is shared by the batch, so batch item 0 tells every
    item's positions."""
    if match.representatives is None:
        return rotary
    moved = []
    for table in rotary:
        if isinstance(table, (tuple, list)):  # nested: Allegro's per-token positions (t, h, w)
            moved.append(type(table)(merge_positions(table, match, axis, tail, text_after, head)))
            continue
        ops = get_ops(table)
        text = ops.shape(table)[axis] - head - match.tokens - tail
        first = (0 if text_after else text) + head  # the image's first row
        image = match.representatives[0] + first
        rows = lambda start, stop: ops.astype_like(ops.arange(stop - start, image), image) + start  # noqa: E731
        pieces = [rows(0, first)] if first else []
        pieces.append(image)
        if tail or (text and text_after):
            end = first + match.tokens
            pieces.append(rows(end, end + tail + (text if text_after else 0)))
        rows_taken = ops.concat(pieces, axis=0) if len(pieces) > 1 else image
        moved.append(ops.take(table, rows_taken, axis=axis))
    return tuple(moved)


class _UnmergeOutput(_SublayerHook):
    """Post-hook on a sub-layer: unmerge the image stream of its output (the text part stays).

    Where an output cache (e.g. diffusers' Pyramid Attention Broadcast) hands back an output it stored in an
    earlier call, that output was merged by that call's match: the unmerged result of that call is returned
    instead, which is what the cache gives an unpatched model."""

    def __init__(self, fw: Framework, run: _BlockRun, sublayer: Sublayer, inside: Optional["_Inside"] = None):
        super().__init__(fw, run, sublayer)
        self.inside = inside  # where the sub-layer merges inside itself (Sublayer.projections)
        self.stored: Tuple[Any, Any] = (None, None)  # (raw output, its unmerged form), only under a cache

    def __call__(self, module, args, kwargs, output):
        if self.inside is not None:
            self.inside.done(module, output)
            return None
        if self.sublayer.child in self.run.passing:  # this call ran on all its tokens
            self.run.passing.discard(self.sublayer.child)
            return None
        cached = output is not None and self.fw.output_cache(module) == REUSED  # None: the sub-layer raised
        reused = cached and output is self.stored[0]
        mode, size_aware = self.run.plan.config.arrangement(self.sublayer.kind, self.sublayer.attention)
        if size_aware:
            self.fw.size_aware_done(module, computed=output is not None and not reused)  # None: it raised
        if reused:
            return self.stored[1]
        match = self.run.plan.matches.get(self.sublayer.kind)
        # kv: the queries kept every token, so the output has them all
        if output is None or match is None or match.merged == 0 or mode == "kv":
            self.stored = (None, None)
            return None
        result = self._unmerge(output, match)
        self.stored = (output, result) if cached else (None, None)
        return result

    def _unmerge(self, output: Any, match: Match) -> Any:
        index = self.sublayer.output
        image = output if index is None else output[index]
        head = sublayer_head(self.run, self.sublayer, get_ops(image).shape(image)[1], match.kept)
        image = around_image(image, match.kept, self.run.plan.tail, self.sublayer.text, lambda x: unmerge(x, match), head)
        if index is None:
            return image
        return type(output)(image if i == index else part for i, part in enumerate(output))


class _Inside:
    """ToMe inside an attention that keeps its norm and residual to itself (:attr:`Sublayer.projections`): while a
    call of it armed by :class:`_MergeInput` runs, pre-hooks on its query, key and value projections merge their
    inputs (``[B, N, C]`` tokens, after its norm) and a post-hook on its output projection unmerges that one's
    output (before its residual), as the call's arrangement says."""

    def __init__(self, fw: Framework, run: _BlockRun, sublayer: Sublayer, module: Any):
        self.fw = fw
        self.run = run
        self.sublayer = sublayer
        self.projections = [child_at(module, path) for path in sublayer.projections]
        missing = [path for path, found in zip(sublayer.projections, self.projections) if not fw.is_module(found)]
        if missing:
            raise ValueError(f"ToMe cannot merge {type(module).__name__}: it has no {', '.join(missing)}")
        self.armed: Optional[Tuple[Match, str, bool, bool]] = None  # (match, mode, cross, size-aware) of a call
        self.query: Tuple[Any, Any] = (None, None)  # (what the query projection got, what it got instead)
        self.keys: Tuple[Any, Any] = (None, None)  # the same for the key and value projections
        self.acted = False

    def attach(self, add: Callable[[Any], None]) -> None:
        query, key, value, output = self.projections
        add(self.fw.add_pre_hook(query, self._query))
        add(self.fw.add_pre_hook(key, self._key))
        add(self.fw.add_pre_hook(value, self._key))
        add(self.fw.add_post_hook(output, self._output))

    def arm(self, match: Match, mode: str, cross: bool, size_aware: bool) -> None:
        self.armed = (match, mode, cross, size_aware)
        self.query = self.keys = (None, None)
        self.acted = False

    def done(self, module: Any, output: Any) -> None:
        """The armed attention returned (``output`` None: it raised): disarm, and refuse a call whose processor
        passed by the projections."""
        armed, acted = self.armed, self.acted
        self.armed, self.query, self.keys = None, (None, None), (None, None)
        if armed is None:
            return
        if armed[3]:
            self.fw.size_aware_done(module, computed=output is not None)
        if output is not None and not acted:
            raise RuntimeError(
                f"ToMe: the processor {type(getattr(module, 'processor', None)).__name__} of a merged "
                f"{type(module).__name__} did not run its projections ({', '.join(self.sublayer.projections)}), where "
                "ToMe merges; use diffusers' default attention processor there"
            )

    def _query(self, module, args, kwargs):
        if self.armed is None:
            return None
        match, mode = self.armed[:2]
        x = args[0]
        if mode not in ("tokens", "queries"):
            self.query = (x, x)
            return None
        self.acted = True
        self.query = (x, merge(x, match))
        return (self.query[1],) + tuple(args[1:]), kwargs

    def _key(self, module, args, kwargs):
        if self.armed is None:
            return None
        match, mode, cross = self.armed[:3]
        x = args[0]
        if cross or mode == "queries":
            return None
        if x is not self.keys[0]:
            if x is self.query[0] and self.query[1] is not x:
                merged = self.query[1]
            elif x is self.query[0]:
                merged = merge(x, match)
            elif self.sublayer.text != TEXT_NONE:  # [image; text] (or [text; image]) keys: the image part
                text = TEXT_SUFFIX if text_follows(self.sublayer.text) else TEXT_PREFIX
                merged = around_image(x, match.tokens, self.run.plan.tail, text, lambda image: merge(image, match))
            else:
                return None
            self.keys = (x, merged)
        self.acted = True
        return (self.keys[1],) + tuple(args[1:]), kwargs

    def _output(self, module, args, kwargs, output):
        if self.armed is None or output is None or self.armed[1] not in ("tokens", "queries"):
            return None
        return unmerge(output, self.armed[0])


# ---------------------------------------------------------------------------------------------------------
# Patching


_PATCHED_CLASSES: "weakref.WeakValueDictionary[Tuple[type, int], type]" = weakref.WeakValueDictionary()
_GENERATIONS = itertools.count()


def patched_class(cls: type, generation: int) -> type:
    """The class that patch number ``generation`` gives the modules of class ``cls`` it hooks: a subclass with
    the same name, module and qualified name that overrides nothing. It pickles as a call of this function,
    so copies and pickles of a patched model stay patched."""
    key = (cls, generation)
    made = _PATCHED_CLASSES.get(key)
    if made is None:

        def __reduce_ex__(self, protocol):
            function, arguments, *rest = cls.__reduce_ex__(self, protocol)
            if function is copyreg.__newobj__ and arguments[0] is type(self):
                return (_new_patched, (cls, generation) + tuple(arguments[1:]), *rest)
            return (function, arguments, *rest)

        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__}
        made = _PATCHED_CLASSES[key] = type(cls.__name__, (cls,), names)
    return made


def _new_patched(cls: type, generation: int, *arguments: Any) -> Any:
    made = patched_class(cls, generation)
    return made.__new__(made, *arguments)


class Patch:
    """Everything one patched model holds: its state, the handles of its hooks, and the classes it changed.

    Every sub-layer that merges (an ``attn1``, ``attn2``, ``ff``...) also gets, for the life of the patch, this
    patch's :func:`patched_class` of its class. Compilers guard on the classes of the modules they trace but not
    on their hooks (torch.compile's default ``skip_nnmodule_hook_guards``): the new classes make any code that
    runs these sub-layers (the whole model, or one block) and was compiled before this patch, or under an
    earlier one, compile again, hooks included, instead of replaying a graph traced without them. :meth:`remove`
    puts the classes back, so code compiled before patching is valid again and runs without compiling. Models
    and blocks keep their classes: pipelines match their components' classes exactly (diffusers' ``from_pipe``),
    and diffusers' caching hooks look blocks up by exact class."""

    def __init__(self, state: ToMeState):
        self.state = state
        self.handles: List[Any] = []
        self.generation = next(_GENERATIONS)
        self.retyped: List[Tuple[Any, type]] = []  # (module, the class it had)
        self.targets: List[Any] = []  # the sub-layers that merge

    def retype(self, module: Any) -> None:
        """Give ``module`` this patch's class (once)."""
        if any(done is module for done, _ in self.retyped):
            return
        self.retyped.append((module, type(module)))
        module.__class__ = patched_class(type(module), self.generation)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module, cls in self.retyped:
            if type(module) is patched_class(cls, self.generation):  # not when something else changed it since
                module.__class__ = cls
        self.retyped.clear()


def temporal_modules(fw: Framework, model: Any, table: Callable[[type], Any] = temporal) -> set:
    """The ids of the modules inside ``model`` that attend across frames (:data:`~tome_core.families.TEMPORAL`):
    those containers' blocks (or the blocks under their listed children) and everything inside them; with
    ``table=text_only``, those that run on the text alone (:data:`~tome_core.families.TEXT_ONLY`)."""
    inside: set = set()
    for module in fw.submodules(model):
        if id(module) in inside:
            continue
        entry = table(type(module))
        if entry is None:
            continue
        roots = [child_at(module, child) for child in entry.children] if entry.children else [module]
        for root in roots:
            if root is not None and fw.is_module(root):
                inside.update(id(sub) for sub in fw.submodules(root))
    return inside


def blocks_of(fw: Framework, model: Any) -> List[Tuple[Any, BlockFamily]]:
    """The spatial transformer blocks of a known family inside ``model``, in module order (their stream index).

    Temporal blocks (tokens = frames: video UNets' motion modules and temporal transformers) are left out:
    they are never merged, get no hook, and count in no block index, level or statistic."""
    found = []
    skip = temporal_modules(fw, model) | temporal_modules(fw, model, text_only)
    for module in fw.submodules(model):
        family = block_family(type(module), type(model))
        if family is not None and id(module) not in skip:
            found.append((module, family))
    return found


def finest_level(fw: Framework, model: Any) -> int:
    """Downsample factor of a UNet's finest level with attention; 1 for transformers. Stable Cascade's UNet (a
    patchified model whose levels are resampled by its ``down_downscalers``, before each level's blocks) counts
    the downscalers that halve the grid before its first level with attention: its stage B has none at the two
    finest levels, its stage C two levels on one grid."""
    attending = lambda: {  # noqa: E731
        id(block) for block, family in blocks_of(fw, model)
        for sublayer in family.sublayers if sublayer.kind == "attn" and fw.is_module(child_at(block, sublayer.child))
    }
    downscalers = getattr(model, "down_downscalers", None)
    if not is_unet_like(model) and downscalers is not None and hasattr(model, "down_blocks"):
        ids, factor = attending(), 1
        for down, downscaler in zip(model.down_blocks, downscalers):
            factor *= 2 if _halves(fw, downscaler) else 1
            if any(id(m) in ids for m in fw.submodules(down)):
                return factor
        return factor
    if not is_unet_like(model):
        return 1
    ids = attending()
    return finest_attention_level([any(id(m) in ids for m in fw.submodules(down)) for down in model.down_blocks])


def _halves(fw: Framework, module: Any) -> bool:
    """Whether a resampling module halves the grid: it holds a stride-2 convolution or a 0.5x interpolation."""
    return any(
        getattr(m, "stride", None) in (2, (2, 2)) or getattr(m, "scale_factor", None) in (0.5, (0.5, 0.5))
        for m in fw.submodules(module)
    )


def block_levels(fw: Framework, model: Any) -> List[Optional[int]]:
    """The level (downsample factor) of each block of :func:`blocks_of`: 1 in a diffusion transformer (and after a
    model's :data:`~tome_core.families.GRID_SOURCES` child, whose grid its blocks' tokens are); in a
    UNet-like model, doubled after each down block that downsamples and halved after each up block that
    upsamples (the middle block at the deepest level); ``None`` where the model does not tell: blocks on a
    feature map outside a UNet (Stable Cascade's levels), and UNets whose down blocks resample inside their
    ResNets rather than in ``downsamplers`` (Kandinsky 3's); their merges then follow each block's grid."""
    blocks = blocks_of(fw, model)
    if not is_unet_like(model):
        one = is_transformer_model(model) or grid_source(type(model)) is not None  # one grid: the model's tokens
        return [1 if one and not family.feature_map else None for _, family in blocks]
    if not any(hasattr(down, "downsamplers") for down in model.down_blocks):
        return [None for _ in blocks]
    level: Dict[int, int] = {}
    factor = 1
    path = [(down, "downsamplers") for down in model.down_blocks]
    middle = getattr(model, "mid_block", None)
    path += [(middle, None)] if middle is not None else []
    path += [(up, "upsamplers") for up in getattr(model, "up_blocks", None) or ()]
    for part, resamples in path:
        for sub in fw.submodules(part):
            level.setdefault(id(sub), factor)
        if resamples is not None and getattr(part, resamples, None) is not None:
            factor = factor * 2 if resamples == "downsamplers" else max(factor // 2, 1)
    return [level.get(id(block)) for block, _ in blocks]


def model_facts(fw: Framework, model: Any) -> ModelFacts:
    """What :func:`~tome_core.selection.check_model` checks the options against."""
    families = {family for _, family in blocks_of(fw, model)}
    timesteps = max(family.timesteps for family in families) if families else None
    return ModelFacts(type(model).__qualname__, finest_level(fw, model), block_levels(fw, model), timesteps)


def _grid_modules(fw: Framework, model: Any) -> List[Any]:
    """The 2-D containers in ``model`` (:data:`~tome_core.families.GRID_CONTAINERS`: UNet-style
    ``Transformer2DModel``, SVD's ``TransformerSpatioTemporalModel``; channels-last, Flax's): their 4-D input
    ``(batch [* frames], C, H, W)`` is the grid of their spatial blocks."""
    return [m for m in fw.submodules(model) if type(m).__name__ in GRID_CONTAINERS + CHANNELS_LAST_GRID_CONTAINERS]


def check_grids(fw: Framework, model: Any) -> None:
    """Refuse a model whose blocks cannot know their grid: neither a UNet, a ControlNet or a diffusion
    transformer, nor inside a 2-D container (``Transformer2DModel``, ``TransformerSpatioTemporalModel``), nor after
    a child whose output gives it (:data:`~tome_core.families.GRID_SOURCES`)."""
    if is_unet_like(model) or is_transformer_model(model) or grid_source(type(model)) is not None:
        return
    inside = {id(sub) for grid in _grid_modules(fw, model) for sub in fw.submodules(grid)}
    lost = [type(block).__name__ for block, _ in blocks_of(fw, model) if id(block) not in inside]
    if lost:
        raise ValueError(
            f"cannot patch {type(model).__qualname__}: its {lost[0]}s are outside a UNet, a ControlNet, a "
            "diffusion transformer or a 2-D Transformer2DModel, so nothing tells them their token grid"
        )


def _sublayers(fw: Framework, model: Any, config: ToMeConfig):
    """``(stream, block, family, block ratio, sublayer, module)`` of every sub-layer that merges under
    ``config`` (the block ratio is its ``block_ratios`` entry or None); block indices are checked first."""
    blocks = blocks_of(fw, model)
    chosen = set(selected_blocks(config, len(blocks), type(model).__qualname__))
    ratios = block_ratios(config, len(blocks), type(model).__qualname__)
    for stream, (block, family) in enumerate(blocks):
        if stream not in chosen:
            continue
        for sublayer in family.sublayers:
            target = child_at(block, sublayer.child)
            if target is not None and fw.is_module(target) and config.sublayers[sublayer.kind]:
                yield stream, block, family, ratios.get(stream), sublayer, target


def auto_choices(fw: Framework, model: Any, config: ToMeConfig) -> Tuple[Tuple[int, ToMeConfig], ...]:
    """:meth:`ToMeConfig.auto_choices` for ``model``: keys and values in cells only where every merged
    self-attention takes them apart from its queries (the family table's ``kv_input``)."""
    kv_input = all(s.kv_input is not None or s.projections for *_, s, _ in _sublayers(fw, model, config) if s.kind == "attn")
    return config.auto_choices(kv_input, is_unet_like(model))


def grid_hooks(fw: Framework, model: Any, state: ToMeState) -> List[Any]:
    """Hook the modules of ``model`` that tell ``state`` its blocks' grid where its call's input does not: the 2-D
    containers of a UNet-style model (their 4-D input) and its :data:`~tome_core.families.GRID_SOURCES` child (its
    4-D output); returns the handles."""
    data_format = getattr(model, "data_format", "NCHW")
    handles = []
    if not is_transformer_model(model):
        for module in _grid_modules(fw, model):
            layout = "NHWC" if type(module).__name__ in CHANNELS_LAST_GRID_CONTAINERS else data_format
            handles.append(fw.add_pre_hook(module, _GridHook(state, getattr(module, "data_format", layout))))
    source = grid_source(type(model))
    if source is not None and fw.is_module(child_at(model, source)):
        handles.append(fw.add_post_hook(child_at(model, source), partial(_grid_output, state, data_format)))
    return handles


def block_metric(family: BlockFamily, block: Any) -> Tuple[str, Optional[int]]:
    """The argument of ``block``'s call whose tokens the match is computed from (:attr:`BlockFamily.metric`;
    ``hidden_states``, its first input, by default) and its position in the block's ``forward``."""
    if family.metric is None:
        return "hidden_states", 0
    return family.metric, argument_positions(forward_of(type(block)), family.metric)[family.metric]


def model_state(fw: Framework, model: Any, config: ToMeConfig) -> ToMeState:
    """A new run state for ``model`` (one found by :func:`find_models`) under ``config``."""
    return ToMeState(
        config=config, finest_level=finest_level(fw, model), choices=auto_choices(fw, model, config),
        where=type(model).__qualname__,
    )


def attach_hooks(fw: Framework, model: Any, state: ToMeState) -> Patch:
    """Attach every hook ToMe runs ``model`` with, sharing ``state``; returns the patch holding their handles
    and the sub-layers that merge (:attr:`Patch.targets`)."""
    patch = Patch(state)
    add = patch.handles.append
    add(fw.add_pre_hook(model, CallStart(fw, model, state)))
    lent = {
        id(m) for path in lent_children(type(model)) if fw.is_module(child_at(model, path))
        for m in fw.submodules(child_at(model, path))
    }
    if lent:  # only the blocks a model lends ask whether its call is in flight
        add(fw.add_post_hook(model, partial(_call_ends, state)))
    patch.handles += grid_hooks(fw, model, state)
    runs: Dict[int, _BlockRun] = {}
    for stream, block, family, ratio, sublayer, target in _sublayers(fw, model, state.config):
        run = runs.get(stream)
        if run is None:
            run = runs[stream] = _BlockRun(fw, state, family, stream, block, ratio, type(model).__qualname__)
            run.lent = id(block) in lent
            add(fw.add_pre_hook(block, run.begin))
        if sublayer.kind == "attn":
            run.attentions.append((sublayer, target))
        merge_input = _MergeInput(fw, run, sublayer, target)
        add(fw.add_pre_hook(target, merge_input))
        add(fw.add_post_hook(target, _UnmergeOutput(fw, run, sublayer, merge_input.inside)))
        if merge_input.inside is not None:
            merge_input.inside.attach(add)
        patch.targets.append(target)
    for run in runs.values():  # after its sub-layers' post-hooks: a block may be its own sub-layer (child "")
        add(fw.add_post_hook(run.block, run.end))
    return patch


def attach(fw: Framework, model: Any, config: ToMeConfig) -> None:
    """Hook ``model`` (one found by :func:`find_models`) with ``config``, for the life of the patch."""
    patch = attach_hooks(fw, model, model_state(fw, model, config))
    for target in patch.targets:
        patch.retype(target)
    model.__dict__["_tome_patch"] = patch


def detach(model: Any) -> None:
    patch = model.__dict__.pop("_tome_patch", None)
    if patch is not None:
        patch.remove()


def undo_tomesd(module: Any, drop_hook: Callable[[Any, Any], None]) -> None:
    """Undo a tomesd-style patch on one module (``tomesd.apply_patch``, and ppdiffusers' port of it): the
    info dict it keeps as ``_tome_info`` on the model and its blocks, the pre-hooks listed there (each dropped
    from ``module`` by ``drop_hook(module, handle)``), and the block class it swapped in (a subclass whose
    ``_parent`` is the original). :func:`patch` runs it first, so such a patch is taken over, never stacked."""
    info = module.__dict__.pop("_tome_info", None)
    if isinstance(info, dict):
        for hook in info.get("hooks", ()):
            drop_hook(module, hook)
        info.get("hooks", []).clear()
    cls = type(module)
    if cls.__name__.startswith("ToMe") and "_parent" in cls.__dict__:
        module.__class__ = cls._parent


def components(fw: Framework, obj: Any) -> List[Any]:
    """The modules ``obj`` consists of: itself if it is a module, else a pipeline's module components."""
    if fw.is_module(obj):
        return [obj]
    if isinstance(getattr(obj, "components", None), dict):
        found = []
        for component in obj.components.values():
            items = component if isinstance(component, (list, tuple)) else [component]
            found.extend(item for item in items if fw.is_module(item))
        return found
    raise TypeError(f"ToMe can patch {fw.accepted}; got {type(obj).__module__}.{type(obj).__qualname__}")


def find_models(fw: Framework, obj: Any) -> List[Any]:
    """The models to patch inside ``obj``: every UNet-like model and diffusion transformer holding blocks of a
    known family (outermost first), else a component that holds such blocks itself."""
    found: List[Any] = []
    for component in components(fw, obj):
        models = [
            m for m in fw.submodules(component) if (is_unet_like(m) or is_transformer_model(m)) and blocks_of(fw, m)
        ]
        inner = {id(sub) for m in models for sub in fw.submodules(m) if sub is not m}
        models = [m for m in models if id(m) not in inner]
        if models:
            found.extend(models)
        elif blocks_of(fw, component):
            found.append(fw.submodules(component)[0])  # the component, or the module its wrapper compiles
    return found


def patch(fw: Framework, obj: Any, options: Dict[str, Any], undo: Callable[[Any], None] = detach) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options.

    Options are checked, and every model's block selection too, before anything is patched."""
    config = ToMeConfig.from_options(options)
    refuse_listed(fw, obj)
    models = find_models(fw, obj)
    if not models:
        temporal_only = any(temporal_modules(fw, component) for component in components(fw, obj))
        raise ValueError(
            f"nothing to patch: {type(obj).__qualname__} contains no transformer block ToMe knows "
            f"({', '.join(name for family in BLOCK_FAMILIES for name in family.classes)})"
            + (" outside temporal layers (their tokens are frames, which ToMe does not merge)" if temporal_only else "")
        )
    if config.frames > 1 and not any(temporal_modules(fw, model) for model in models):
        raise ValueError(
            f"frames_per_chunk={config.frames} merges across the frames of a video model, but "
            f"{type(obj).__qualname__} holds no video UNet (no temporal layers); leave frames_per_chunk out (a video "
            "transformer such as Wan runs one sequence over all frames, where a token merges with any frame's)"
        )
    for model in models:
        check_grids(fw, model)
        check_model(config, model_facts(fw, model))
        check_sublayers(fw, model, config)
        shards = fw.shards(model)
        if shards is not None:
            check_shards(shards, size_aware_somewhere(fw, model, config), type(model).__qualname__)
    remove(fw, obj, undo)
    for model in models:
        attach(fw, model, config)
    return obj


def refuse_listed(fw: Framework, obj: Any) -> None:
    """Refuse a model of a class that :data:`~tome_core.model_zoo.REFUSED` lists, with that class's reason, and a
    pipeline that holds one (a pipeline is patched whole or not at all), except for auxiliary components
    (:data:`~tome_core.model_zoo.AUXILIARY`, such as AnimateDiff's motion adapter) beside a model that merges."""
    listed = [(c, refusal(type(c))) for c in components(fw, obj)]
    listed = [(c, reason) for c, reason in listed if reason is not None]
    if not fw.is_module(obj) and find_models(fw, obj):
        listed = [(c, reason) for c, reason in listed if type(c).__name__ not in AUXILIARY]
    if listed:
        raise ValueError("; ".join(f"ToMe cannot patch {type(c).__qualname__}: {reason}" for c, reason in listed))


def check_sublayers(fw: Framework, model: Any, config: ToMeConfig) -> None:
    """Refuse, before anything is attached, what a merged sub-layer as it is now set up cannot run: an output
    cache that extrapolates, an explicit ``kv`` or ``queries`` arrangement without separate keys and values,
    size-aware attention through a processor that cannot take the bias, MLP merging with chunked feed-forward.
    A processor swapped in after ``patch`` is checked at its first call with the same messages."""
    where = type(model).__qualname__
    choices = [choice for _, choice in auto_choices(fw, model, config)]
    for stream, block, _, _, sublayer, target in _sublayers(fw, model, config):
        fw.output_cache(target)
        block_problem(block, config)
        if sublayer.kind != "attn":
            continue
        problem = arrangement_problem(fw, block, sublayer, target)
        if problem is not None and sublayer.projections:
            raise ValueError(f"ToMe cannot merge block {stream} of {where}: {problem}")
        if problem is not None and config.mode in ("kv", "queries"):
            raise arrangement_error(config.mode, f"block {stream} of {where}", problem)
        if attends_text_only(block, sublayer):
            continue  # it attends to the text: no merged keys, no sizes
        size_aware = any(choice.arrangement(sublayer.kind, sublayer.attention)[1] for choice in choices)
        bias = fw.bias_problem(target) if size_aware else None
        if bias is not None:
            raise ValueError(
                f"proportional_attn=True (size-aware attention) needs the merged tokens' sizes in the attention "
                f"logits, and in block {stream} of {where} {type(block).__name__}.{sublayer.child}'s {bias}; pass "
                "proportional_attn=False, or use an SDPA attention processor"
            )


def remove(fw: Framework, obj: Any, undo: Callable[[Any], None] = detach) -> Any:
    """Undo :func:`patch` in place (a no-op on an unpatched object) and return ``obj``.

    ``undo`` runs on every module of ``obj`` (an adapter may also undo other ToMe implementations there)."""
    for component in components(fw, obj):
        for module in fw.submodules(component):
            undo(module)
    return obj


class Patched(NamedTuple):
    """A patched model and its run state; prints as the model's class and the state, not the model's layers."""

    model: Any
    state: ToMeState

    def __repr__(self) -> str:
        return f"Patched(model={type(self.model).__name__}, state={self.state!r})"


def patched_models(fw: Framework, obj: Any) -> List[Patched]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call)."""
    return [Patched(m, m.__dict__["_tome_patch"].state) for m in find_models(fw, obj) if "_tome_patch" in m.__dict__]
