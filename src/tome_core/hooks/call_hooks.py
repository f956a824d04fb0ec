"""The hooks on a patched model: :class:`CallStart` begins each call (its timestep, its grid, context
parallelism), the grid hooks tell blocks their grid where the model's input does not; on a patched pipeline,
:class:`Generations` counts its generations and :class:`GridTeller` tags its ids with their grid. Framework-free."""

from __future__ import annotations

import inspect
import itertools
import numbers
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..algorithm.backend import get_ops
from ..framework import Framework, TIMESTEPS, argument, argument_positions, forward_of
from ..models.families import CHANNELS_LAST_GRID_CONTAINERS, IDS_MAKERS, IdsMaker, child_at, model_layout
from ..models.grid_readers import Call, grid_reader, mixed_sizes, tell_grid
from ..models.levels import spatial_size
from ..models.model_tree import grid_modules, is_transformer_model, is_unet_like
from ..models.plan import ModelPlan
from ..shards import check_shard_cells, check_shards, shard_grid
from .call import CallFacts
from .retyping import detach
from .state import ToMeState


class CallStart:
    """Pre-hook on a patched model: a new call starts, at its timestep, on its latent or token grid. Hooked on an
    unpatched model with a state of its own (tools), it reads each call's grid into that state and merges nothing."""

    def __init__(self, fw: Framework, plan: ModelPlan, state: ToMeState):
        model = plan.model
        self.fw = fw
        self.state = state
        self.unet = is_unet_like(model)
        self.transformer = is_transformer_model(model)
        self.data_format = getattr(model, "data_format", "NCHW")
        forward = forward_of(type(model))
        self.where = argument_positions(forward, "sample", "hidden_states", *TIMESTEPS)
        parameters = list(inspect.signature(forward).parameters.values())[1:]
        self.first = parameters[0].name if parameters else None  # the latent, by keyword where not named as above
        self.rising = plan.rising
        self.model = type(model).__qualname__
        self.size_aware = plan.size_aware
        self.read_grid = grid_reader(fw, model) if self.transformer else None

    def __call__(self, module, args, kwargs):
        self.fw.clear_interrupted()
        if self.state.detach_after_call:  # remove() was called inside a call that never returned (interrupted)
            detach(module)
            return None
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
        if config.timestep_range is not None and values is None:
            raise ValueError(f"timestep_range={config.timestep_range} needs the model's timestep, and this call gave none")
        step, merging = partition_step(timestep), config.timestep_range is None or config.merges_at(values)
        if config.reuse_steps > 1 and values is not None:  # matches live within one generation
            matching = self.state.matching
            matching.follow_generation(-min(values) if self.rising else max(values), generation(matching.pipeline))
        if not self.transformer:  # UNets give their latent; inner Transformer2DModels give the grids
            latent = spatial_size(sample, self.data_format) if self.unet else None
            shape = get_ops(sample).shape(sample) if self.unet else ()
            # a video UNet's sample is 5-D (batch first); its blocks see batch * frames items
            videos = shape[0] if len(shape) == 5 else None
            self.state.begin_call(CallFacts(latent, step, videos, merging, execution=self.fw.execution(sample)))
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
        placed = self.read_grid(Call(args, kwargs, sample, tuple(shape)))
        if isinstance(placed, str):
            return self._unplaced(step, placed)
        grid, tail, videos, grid_last, frames = placed
        shards = self.fw.shards(module)
        if shards is not None:
            check_shards(shards, self.size_aware, self.model)
            grid = shard_grid(grid, shards, tail, videos, self.model)
        execution = self.fw.execution(sample[0] if isinstance(sample, (list, tuple)) else sample)
        self.state.begin_call(CallFacts(
            grid, step, videos, merging, tail=tail, grid_last=grid_last, shards=shards, execution=execution,
            frame_rows=placed.grid[0] // frames if frames > 1 else 0,
        ))
        self.state.enter_grid(grid)
        if shards is not None:
            check_shard_cells(grid, shards, self.state.active, self.model)
        return None

    def _unplaced(self, step: Any, why: str) -> None:
        """Begin a call whose tokens no grid places: it runs unmerged, and ``why`` is said once."""
        self.state.ledger.say_once(f"ToMe on {self.model}: {why}")
        self.state.begin_call(CallFacts(None, step, merging=False, why=why))


def partition_step(timestep: Any) -> Any:
    """The timestep as the partition hash takes it: a Python number, or a framework array's first element (no
    host sync)."""
    if timestep is None:
        return 0
    if isinstance(timestep, numbers.Number) or type(timestep).__module__ == "numpy":
        return host_timesteps(None, timestep)[0]
    return get_ops(timestep).reshape(timestep, (-1,))[0]


def host_timesteps(fw: Optional[Framework], timestep: Any) -> List[float]:
    """Every timestep of a call as Python numbers (a framework array's read on the host through ``fw``)."""
    if isinstance(timestep, numbers.Number):
        return [timestep.item() if hasattr(timestep, "item") else timestep]
    if type(timestep).__module__ == "numpy":
        return timestep.reshape(-1).tolist()
    return fw.host_values(timestep)


def call_ends(state: ToMeState, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a patched model: its call has returned, so a block of it that runs now is run by a model that
    borrowed it (:attr:`ToMeState.in_call`). The call's drawn partitions are let go (a block recomputed in backward
    draws them again from the call's seed and step); index tables of shapes and seed alone, and matches that
    ``reuse_steps`` or ``reuse_blocks`` keep, stay."""
    state.in_call = False
    state.matching.drawn = {}
    if state.detach_after_call:  # remove() was called inside this call (driver._detach_after_call)
        detach(module)


def grid_output(state: ToMeState, data_format: str, module: Any, args: Any, kwargs: Any, output: Any) -> None:
    """Post-hook on a model's ``grid_source`` child (:class:`~tome_core.models.families.ModelLayout`): its 4-D
    output is the grid of the blocks run after it."""
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
    """Hook the modules of ``model`` that tell ``state`` its blocks' grid where its call's input does not (the 2-D
    containers of a UNet-style model holding one of ``blocks``, ids of the hooked blocks, where given; its
    ``grid_source`` child); returns the handles."""
    data_format = getattr(model, "data_format", "NCHW")
    handles = []
    if not is_transformer_model(model):
        for module in grid_modules(fw, model):
            if blocks is not None and not any(id(sub) in blocks for sub in fw.submodules(module)):
                continue
            layout = "NHWC" if type(module).__name__ in CHANNELS_LAST_GRID_CONTAINERS else data_format
            handles.append(fw.add_pre_hook(module, GridHook(state, getattr(module, "data_format", layout))))
    source = model_layout(type(model)).grid_source
    if source is not None and fw.is_module(child_at(model, source)):
        handles.append(fw.add_post_hook(child_at(model, source), partial(grid_output, state, data_format)))
    return handles


# ------------------------------------------------------------------ generations: a pipeline call starts afresh

_COUNTERS = itertools.count()


class Generations:
    """A patched pipeline's scheduler's ``set_timesteps`` (an attribute of that object, its class untouched): it
    counts the calls, then runs the scheduler's own. Pipelines call it once as a generation starts, so the count
    tells a patched model a new generation began, however its timesteps run; it holds nothing of the models."""

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
    """The counter of generations on ``pipeline``'s scheduler, put there if it has none yet; None: the pipeline
    has no scheduler with ``set_timesteps``."""
    scheduler = getattr(pipeline, "scheduler", None)
    if not callable(getattr(scheduler, "set_timesteps", None)) or not hasattr(scheduler, "__dict__"):
        return None
    counter = scheduler.__dict__.get("set_timesteps")
    if not isinstance(counter, Generations):
        counter = scheduler.__dict__["set_timesteps"] = Generations(scheduler, counter)
    return counter


def forget_generations(pipeline: Any) -> None:
    """Take what ``patch`` put on ``pipeline`` off again (at ``remove``): the counter of :func:`generations` on its
    scheduler, and the grid tellers of :func:`tell_grids` on the pipeline, each giving back what it stood for."""
    put = [(getattr(pipeline, "scheduler", None), "set_timesteps", Generations)]
    for obj, name, kind in put + [(pipeline, maker.method, GridTeller) for maker in IDS_MAKERS]:
        held = getattr(obj, "__dict__", {}).get(name)
        if isinstance(held, kind):
            if held.before is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = held.before


class PipelineWatch:
    """The pipeline a model was patched in, held weakly by its state for :func:`generation`. A deep copy of the
    pipeline watches the copy; a copy or pickle of the model alone watches none (it then goes by timesteps)."""

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
    """Which generation of its pipeline a model call belongs to (:class:`Generations`' serial and count); None:
    the model was patched without its pipeline, or the pipeline is gone."""
    pipeline = watch.pipeline() if watch is not None else None
    counter = generations(pipeline) if pipeline is not None else None
    return None if counter is None else (counter.serial, counter.count)


# ------------------------------------------------------------------ grids the pipeline knows: told, not read


class GridTeller:
    """One of a patched pipeline's ids makers (:data:`~tome_core.models.families.IDS_MAKERS`, an attribute of the
    object): the pipeline's own method, whose ids it tags with the grid of the height and width passed
    (:func:`~tome_core.models.grid_readers.tell_grid`), so a model given them reads no ids on the host."""

    def __init__(self, pipeline: Any, maker: IdsMaker, before: Optional[Callable[..., Any]]):
        self.pipeline = pipeline
        self.maker = maker
        self.before = before  # a maker the object itself held before this one (None: its class's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cls = type(self.pipeline)  # its own method as its class defines it (a static method as its function):
        own = self.before or inspect.getattr_static(cls, self.maker.method).__get__(self.pipeline, cls)
        ids = own(*args, **kwargs)
        given = inspect.signature(own).bind(*args, **kwargs).arguments
        tell_grid(ids, given.get(self.maker.rows), given.get(self.maker.cols))
        return ids


def tell_grids(fw: Framework, pipeline: Any) -> None:
    """Put a :class:`GridTeller` on each ids maker ``pipeline`` has that takes the arguments its
    :class:`~tome_core.models.families.IdsMaker` names (at ``patch``)."""
    if fw.is_module(pipeline) or not hasattr(pipeline, "__dict__"):
        return
    for maker in IDS_MAKERS:
        own = getattr(pipeline, maker.method, None)
        if not callable(own) or isinstance(own, GridTeller):
            continue
        try:
            names = inspect.signature(own).parameters
        except (TypeError, ValueError):
            continue
        if maker.rows in names and maker.cols in names:
            pipeline.__dict__[maker.method] = GridTeller(pipeline, maker, pipeline.__dict__.get(maker.method))
