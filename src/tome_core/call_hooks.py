"""The hooks on a patched model: :class:`CallStart` begins each call (its timestep, its latent or token
grid, the tokens around the grid, context parallelism), the grid hooks tell blocks their grid where the
model's input does not. Framework-free."""

from __future__ import annotations

import inspect
import itertools
import numbers
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .backend import get_ops
from .families import (
    CHANNELS_LAST_GRID_CONTAINERS, GridLayout, child_at, context_latents, grid_last, grid_layout, grid_source,
    token_roles,
)
from .framework import Framework, SHAPE_LISTS, TIMESTEPS, TOKEN_IDS, argument, argument_positions, forward_of
from .levels import indicated_run, leading_raster, spatial_size, trailing_frames, trailing_raster
from .model_tree import (
    blocks_of, config_value, grid_modules, is_transformer_model, is_unet_like, size_aware_somewhere,
)
from .shards import check_shard_cells, check_shards, shard_grid
from .state import ToMeState


class CallStart:
    """Pre-hook on a patched model: a new call starts, at its timestep, on its latent or token grid.

    Also a documented helper for tools that read a call's grid as a patch would (the benchmark's per-block
    timing): hooked on an unpatched model with a state of its own, it reads each call's grid into that state and
    merges nothing."""

    def __init__(self, fw: Framework, model: Any, state: ToMeState):
        self.fw = fw
        self.state = state
        self.unet = is_unet_like(model)
        self.transformer = is_transformer_model(model)
        self.patch_size = config_value(model, "patch_size") if self.transformer else None
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
            self.temporal_patch = (self.layout.temporal_patch and config_value(model, self.layout.temporal_patch)) or 1
            named = tuple(name for name in (self.layout.coords, self.layout.frame_types) if name)
            self.where.update(argument_positions(forward, *self.layout.sizes, *self.layout.patch_arguments, *named))

    def __call__(self, module, args, kwargs):
        self.fw.clear_interrupted()
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
            host_timesteps(self.fw, timestep)
            if timestep is not None and (config.timestep_range is not None or config.reuse_steps > 1) else None
        )
        step, merging = partition_step(timestep), self._merges_at(values)
        if config.reuse_steps > 1 and values is not None:  # matches live within one generation
            self.state.follow_generation(-min(values) if self.rising else max(values), generation(self.state.pipeline))
        if not self.transformer:  # UNets give their latent; inner Transformer2DModels give the grids
            latent = spatial_size(sample, self.data_format) if self.unet else None
            shape = get_ops(sample).shape(sample) if self.unet else ()
            # a video UNet's sample is 5-D (batch first); its blocks see batch * frames items
            videos = shape[0] if len(shape) == 5 else None
            self.state.begin_call(latent, step, videos=videos, merging=merging, execution=self.fw.execution(sample))
            return None
        if isinstance(sample, (list, tuple)):  # a list of [C, F, H, W] latents (Z-Image): one batch
            if not sample or isinstance(sample[0], (list, tuple)):
                why = "its input is a list of lists (several images per item), whose order ToMe does not know; such calls run unmerged"
                return self._unplaced(step, why)
            shapes = [tuple(get_ops(item).shape(item)) for item in sample]
            if any(item != shapes[0] for item in shapes):
                return self._unplaced(step, mixed_sizes("latents", "its list of latents"))
            shape = (len(sample),) + shapes[0]
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
                return self._unplaced(step, mixed_sizes("output images", "its shape list"))
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
            height, width = spatial_size(sample, self.data_format)
            patch = self.patch_size if isinstance(self.patch_size, int) else self.patch_size[-1]  # (1, 1): HunyuanImage
            grid = (height // patch, width // patch)
            for latent in (argument(args, kwargs, self.context, where[self.context]) or ()) if self.context else ():
                rows, cols = spatial_size(latent, self.data_format)  # CONTEXT_LATENTS: a tail after the grid
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
        execution = self.fw.execution(sample[0] if isinstance(sample, (list, tuple)) else sample)
        self.state.begin_call(
            grid, step, videos=videos, merging=merging, tail=tail, grid_last=grid_last, shards=shards, execution=execution
        )
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


def _on_host(timestep: Any) -> bool:
    """Whether a timestep is already on the host: a Python or numpy number, or a numpy array."""
    return isinstance(timestep, numbers.Number) or type(timestep).__module__ == "numpy"


def partition_step(timestep: Any) -> Any:
    """The timestep as the partition hash takes it: a Python number (from a Python or numpy number or array)
    or the first element of a framework array (no host sync)."""
    if timestep is None:
        return 0
    if _on_host(timestep):
        return host_timesteps(None, timestep)[0]
    ops = get_ops(timestep)
    return ops.reshape(timestep, (-1,))[0]


def host_timesteps(fw: Optional[Framework], timestep: Any) -> List[float]:
    """Every timestep of a call as Python numbers (0-d and 1-d, Python, numpy or framework arrays; the last
    read on the host through ``fw``)."""
    if isinstance(timestep, numbers.Number):
        return [timestep.item() if hasattr(timestep, "item") else timestep]
    if type(timestep).__module__ == "numpy":
        return timestep.reshape(-1).tolist()
    return fw.host_values(timestep)


def mixed_sizes(what: str, where: str) -> str:
    """Why a call whose batch items give their ``what`` different sizes in ``where`` runs unmerged: a match is
    one partition of one token grid for the whole batch, and each item's tokens sit at other places in the
    padded sequence, so no item can merge on another's grid (Qwen-Image's shape lists, Z-Image's latents)."""
    return (
        f"the items of its batch give their {what} different sizes in {where}, so no one token grid is known; "
        "such calls run unmerged"
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


def call_ends(state: ToMeState, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a patched model: its call has returned, so a block of it that runs now is run by another
    model that borrowed it (:attr:`ToMeState.in_call`)."""
    state.in_call = False


def grid_output(state: ToMeState, data_format: str, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a model's :data:`~tome_core.families.GRID_SOURCES` child: its 4-D output is the grid of the
    blocks the model runs after it on that map's flattened pixels."""
    if len(get_ops(output).shape(output)) == 4:
        state.enter_grid(spatial_size(output, data_format))


class GridHook:
    """Pre-hook on a UNet's ``Transformer2DModel`` (or another 2-D container): its 4-D input is the grid of the
    blocks inside."""

    def __init__(self, state: ToMeState, data_format: str):
        self.state = state
        self.data_format = data_format

    def __call__(self, module, args, kwargs):
        hidden_states = argument(args, kwargs, "hidden_states", 0)
        if hidden_states is not None and len(get_ops(hidden_states).shape(hidden_states)) == 4:
            self.state.enter_grid(spatial_size(hidden_states, self.data_format))
        return None


def grid_hooks(fw: Framework, model: Any, state: ToMeState, blocks: Optional[Set[int]] = None) -> List[Any]:
    """Hook the modules of ``model`` that tell ``state`` its blocks' grid where its call's input does not: the 2-D
    containers of a UNet-style model (their 4-D input; only those holding one of ``blocks``, ids of the hooked
    blocks, where given) and its :data:`~tome_core.families.GRID_SOURCES` child (its 4-D output); returns the
    handles."""
    data_format = getattr(model, "data_format", "NCHW")
    handles = []
    if not is_transformer_model(model):
        for module in grid_modules(fw, model):
            if blocks is not None and not any(id(sub) in blocks for sub in fw.submodules(module)):
                continue
            layout = "NHWC" if type(module).__name__ in CHANNELS_LAST_GRID_CONTAINERS else data_format
            handles.append(fw.add_pre_hook(module, GridHook(state, getattr(module, "data_format", layout))))
    source = grid_source(type(model))
    if source is not None and fw.is_module(child_at(model, source)):
        handles.append(fw.add_post_hook(child_at(model, source), partial(grid_output, state, data_format)))
    return handles


# ------------------------------------------------------------------ generations: a pipeline call starts afresh

_COUNTERS = itertools.count()


class Generations:
    """What a patched pipeline's scheduler runs as its ``set_timesteps`` (an attribute of that scheduler object;
    its class is untouched): it counts the calls, then runs the scheduler's own. Every diffusers and ppdiffusers
    pipeline calls ``set_timesteps`` once as a generation starts, so a change of the count tells a patched model
    of the pipeline that a new generation began, however its timesteps run (one-step generations all run at
    one timestep). It holds nothing of the models, so the scheduler copies and pickles as before."""

    def __init__(self, scheduler: Any, before: Optional[Callable[..., Any]]):
        self.scheduler = scheduler
        self.before = before  # a set_timesteps the object itself held before this one (None: its class's)
        self.serial = next(_COUNTERS)  # tells this counter from one on a scheduler swapped in later
        self.count = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        run = self.before or type(self.scheduler).set_timesteps.__get__(self.scheduler)
        return run(*args, **kwargs)


def generations(pipeline: Any) -> Optional[Generations]:
    """The counter of generations on ``pipeline``'s scheduler, put there if it has none yet (at ``patch``, or at
    the first model call after the scheduler was swapped); None: the pipeline has no scheduler with
    ``set_timesteps``."""
    scheduler = getattr(pipeline, "scheduler", None)
    if not callable(getattr(scheduler, "set_timesteps", None)) or not hasattr(scheduler, "__dict__"):
        return None
    counter = scheduler.__dict__.get("set_timesteps")
    if not isinstance(counter, Generations):
        counter = scheduler.__dict__["set_timesteps"] = Generations(scheduler, counter)
    return counter


def forget_generations(pipeline: Any) -> None:
    """Take the counter of :func:`generations` off ``pipeline``'s scheduler (at ``remove``)."""
    scheduler = getattr(pipeline, "scheduler", None)
    counter = getattr(scheduler, "__dict__", {}).get("set_timesteps")
    if isinstance(counter, Generations):
        if counter.before is None:
            del scheduler.__dict__["set_timesteps"]
        else:
            scheduler.__dict__["set_timesteps"] = counter.before


class PipelineWatch:
    """The pipeline a model was patched in, held weakly by the model's state: each call of the model reads the
    pipeline's count of generations (:func:`generation`). A deep copy of the pipeline watches the copy; a
    copy or pickle of the model alone watches none (it then tells generations by their timesteps)."""

    def __init__(self, pipeline: Any):
        self.pipeline = weakref.ref(pipeline)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Optional["PipelineWatch"]:
        copied = memo.get(id(self.pipeline()))
        return PipelineWatch(copied) if copied is not None else None

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_no_watch, ())


def _no_watch() -> None:
    return None


def generation(watch: Optional[PipelineWatch]) -> Optional[Tuple[int, int]]:
    """Which generation of its pipeline a model call belongs to: ``(counter, count)`` of the pipeline's
    scheduler (:class:`Generations`); None: the model was patched without its pipeline, or the pipeline is gone."""
    pipeline = watch.pipeline() if watch is not None else None
    counter = generations(pipeline) if pipeline is not None else None
    return None if counter is None else (counter.serial, counter.count)
