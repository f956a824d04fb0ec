"""The patch driver: :func:`patch` finds the models in an object, checks the options against each of them before
anything is attached (:func:`check`), attaches ToMe's hooks to each (:func:`attach_hooks`, sharing one
:class:`~tome_core.hooks.state.ToMeState` per model) and :func:`remove` takes them off again. Framework-free: every
adapter (diffusers/torch, ppdiffusers/paddle, Flax diffusers/jax) hands it a :class:`~tome_core.framework.Framework`.

What it attaches lives beside it: the hooks that begin each call of a model (its timestep and grid) in
:mod:`~tome_core.hooks.call_hooks`, those on each transformer block and its merged sub-layers (merge, unmerge,
size-aware attention) in :mod:`~tome_core.hooks.block_hooks`, the patched classes in :mod:`~tome_core.hooks.retyping`.
Which models, blocks and sub-layers there are is read once per model into a :class:`~tome_core.models.plan.ModelPlan`
(:mod:`~tome_core.models.plan`, through :mod:`~tome_core.models.model_tree` and the family tables of :mod:`~tome_core.models.families`),
which checking and attaching read."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple

from .algorithm.match import TOME, Matcher
from .algorithm.partition import forget_tables
from .config import ToMeConfig
from .framework import Framework
from .hooks.block_hooks import BlockRun, SublayerHooks, block_problem
from .hooks.call_hooks import CallStart, PipelineWatch, call_ends, forget_generations, generations, grid_hooks, tell_grids
from .hooks.ledger import Ledger
from .hooks.matching import Matching
from .hooks.retyping import Patch, detach, other_patch
from .hooks.state import ToMeState
from .models.arrangement_rules import arrangement_error, arrangement_problem
from .models.families import attends_text_only, child_at
from .models.model_tree import check_grids, components, find_models, temporal_modules
from .models.model_zoo import AUXILIARY, refusal
from .models.plan import ModelPlan, plan_model
from .models.selection import check_model
from .shards import check_shards

__all__ = [
    "Patched", "attach", "attach_hooks", "check", "check_sublayers", "detach", "model_state",
    "patch", "patched_models", "refuse_listed", "remove", "undo_tomesd",
]


def model_state(plan: ModelPlan, matcher: Matcher = TOME) -> ToMeState:
    """A new run state for the model of ``plan``, finding its blocks' matches with ``matcher`` (ToMe's own by
    default; another keeps ToMe's blocks, levels, counts and arrangement and chooses the tokens its own way)."""
    return ToMeState(
        config=plan.config, finest_level=plan.finest, choices=plan.choices,
        matching=Matching(matcher, streams=plan.streams), ledger=Ledger(where=plan.where),
    )


def attach_hooks(fw: Framework, plan: ModelPlan, state: ToMeState) -> Patch:
    """Attach every hook ToMe runs the model of ``plan`` with, sharing ``state``; returns the patch holding their
    handles and the sub-layers that merge (:attr:`Patch.targets`)."""
    model = plan.model
    state.ledger.inform = fw.inform  # a word for the user goes where the framework's users look
    patch = Patch(state)
    add = patch.handles.append
    add(fw.add_pre_hook(model, CallStart(fw, plan, state)))
    add(fw.add_post_hook(model, partial(call_ends, state)))
    hooked = plan.hooked
    patch.handles += grid_hooks(fw, model, state, {id(m.block) for m in hooked})
    runs: Dict[int, BlockRun] = {}
    for stream, block, family, _, ratio, sublayer, target in hooked:
        run = runs.get(stream)
        if run is None:
            run = runs[stream] = BlockRun(fw, state, family, stream, block, ratio, plan.where)
            run.lent = id(block) in plan.lent
            add(fw.add_pre_hook(block, run.begin))
        if sublayer.kind == "attn":
            run.attentions.append((sublayer, target))
        hooks = SublayerHooks(fw, run, sublayer, target)
        add(fw.add_pre_hook(target, hooks.before))
        add(fw.add_post_hook(target, hooks.after))
        if hooks.inside is not None:
            hooks.inside.attach(add)
        patch.targets.append(target)
    for run in runs.values():  # after its sub-layers' post-hooks: a block may be its own sub-layer (child "")
        add(fw.add_post_hook(run.block, run.end))
    return patch


def attach(fw: Framework, plan: ModelPlan) -> None:
    """Hook the model of ``plan``, for the life of the patch."""
    patch = _retyped(attach_hooks(fw, plan, model_state(plan)))
    for block in {id(m.block): m.block for m in plan.hooked}.values():
        patch.mark(block)  # another model that holds it is refused (check_shared_blocks)
    plan.model.__dict__["_tome_patch"] = patch


def _retyped(patch: Patch) -> Patch:
    """``patch`` with every sub-layer it merges given its class (:class:`~tome_core.hooks.retyping.Patch`)."""
    for target in patch.targets:
        patch.retype(target)
    return patch


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


def patch(fw: Framework, obj: Any, options: Dict[str, Any], undo: Callable[[Any], None] = detach) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options.

    Options are checked, and every model's plan too, before anything is patched."""
    config = ToMeConfig.from_options(options)
    refuse_listed(fw, obj)
    models = find_models(fw, obj)
    if not models:
        temporal_only = any(temporal_modules(fw, component) for component in components(fw, obj))
        raise ValueError(
            f"nothing to patch: {type(obj).__qualname__} contains no transformer block ToMe knows"
            + (" outside temporal layers (their tokens are frames, which ToMe does not merge)" if temporal_only else "")
            + "; pass a pipeline, or its UNet, ControlNet or diffusion transformer (docs/models.md lists the models "
            "ToMe merges)"
        )
    if config.frames > 1 and not any(temporal_modules(fw, model) for model in models):
        raise ValueError(
            f"frames_per_chunk={config.frames} merges across the frames of a video model, but "
            f"{type(obj).__qualname__} holds no video UNet (no temporal layers); leave frames_per_chunk out (a video "
            "transformer such as Wan runs one sequence over all frames, where a token merges with any frame's)"
        )
    running = [model for model in models if fw.running(model)]
    if running:
        raise ValueError(
            f"patch() was called inside a running call of {type(running[0]).__qualname__} (from a hook or callback "
            "within it): its blocks would change half-way through that call; patch between calls"
        )
    plans = [plan_model(fw, model, config) for model in models]
    for plan in plans:
        check(fw, plan)
    check_shared_blocks(plans)
    remove(fw, obj, undo)
    for plan in plans:
        attach(fw, plan)
    tell_grids(fw, obj)  # a pipeline's ids carry their grid: no host read, so fullgraph compiles trace them
    if config.reuse_steps > 1 and not fw.is_module(obj) and generations(obj) is not None:
        for model in models:  # each call of the pipeline starts a generation (Matching.follow_generation)
            model.__dict__["_tome_patch"].state.matching.pipeline = PipelineWatch(obj)
    return obj


def check(fw: Framework, plan: ModelPlan) -> None:
    """Refuse ``plan`` before anything is attached: its model's grids, its block selection and levels, its merged
    sub-layers (:func:`check_sublayers`), its context parallelism."""
    check_grids(fw, plan.model, plan.blocks)
    check_model(plan.config, plan.facts, [
        {sublayer.kind for sublayer in family.sublayers if fw.is_module(child_at(block, sublayer.child))}
        for block, family in plan.blocks
    ])
    check_sublayers(fw, plan)
    shards = fw.shards(plan.model)
    if shards is not None:
        check_shards(shards, plan.size_aware, plan.where)


def check_shared_blocks(plans: List[ModelPlan]) -> None:
    """Refuse a block that two models would hook: one this patch makes and one patched before (not the same model
    patched again), or two of this patch. Each model keeps one run state, begun by its own call; a block hooked by
    two would run the other model's hooks too, whose state no call began."""
    hooked: Dict[int, Any] = {}
    for plan in plans:
        for stream, block, *_ in plan.hooked:
            other = other_patch(block, plan.model)
            first = hooked.setdefault(id(block), plan.model)
            if other is not None or first is not plan.model:
                holder = f"a patched {other.state.ledger.where}" if other is not None else f"{type(first).__qualname__}, also in this patch"
                raise ValueError(
                    f"ToMe cannot patch {plan.where}: its block {stream} ({type(block).__name__}) is also a block of "
                    f"{holder}. Models that share blocks cannot both be patched, each keeps its own run state: remove "
                    "the other model's patch first, or give each model its own blocks"
                )


def refuse_listed(fw: Framework, obj: Any) -> None:
    """Refuse a model of a class that :data:`~tome_core.models.model_zoo.REFUSED` lists, with that class's reason, and a
    pipeline that holds one (a pipeline is patched whole or not at all), except for auxiliary components
    (:data:`~tome_core.models.model_zoo.AUXILIARY`, such as AnimateDiff's motion adapter) beside a model that merges."""
    listed = [(c, refusal(type(c))) for c in components(fw, obj)]
    listed = [(c, reason) for c, reason in listed if reason is not None]
    if not fw.is_module(obj) and find_models(fw, obj):
        listed = [(c, reason) for c, reason in listed if type(c).__name__ not in AUXILIARY]
    if listed:
        raise ValueError("; ".join(f"ToMe cannot patch {type(c).__qualname__}: {reason}" for c, reason in listed))


def check_sublayers(fw: Framework, plan: ModelPlan) -> None:
    """Refuse, before anything is attached, what a merged sub-layer of ``plan`` as it is now set up cannot run: an
    output cache that extrapolates, an explicit ``kv`` or ``queries`` arrangement without separate keys and values,
    size-aware attention through a processor that cannot take the bias, MLP merging with chunked feed-forward.
    A processor swapped in after ``patch`` is checked at its first call with the same messages."""
    where, config = plan.where, plan.config
    for stream, block, _, _, _, sublayer, target in plan.merged:
        fw.output_cache(target)
        block_problem(block, config)
        if sublayer.kind != "attn":
            continue
        problem = arrangement_problem(fw, block, sublayer, target, config.mode, config.mode == "kv")
        if problem is not None and sublayer.projections:
            raise ValueError(f"ToMe cannot merge block {stream} of {where}: {problem}")
        if problem is not None and config.mode in ("kv", "queries"):
            raise arrangement_error(config.mode, f"block {stream} of {where}", problem)
        if attends_text_only(block, sublayer):
            continue  # it attends to the text: no merged keys, no sizes
        size_aware = any(choice.arrangement(sublayer.kind, sublayer.attention)[1] for _, choice in plan.choices)
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
    fw.clear_interrupted()
    for component in components(fw, obj, "remove"):
        for module in fw.submodules(component):
            if not _detach_after_call(fw, module):
                undo(module)
    if not fw.is_module(obj):
        forget_generations(obj)
    forget_tables()
    return obj


def _detach_after_call(fw: Framework, module: Any) -> bool:
    """Whether ``module`` is a patched model whose call is running now (a hook inside it called ``remove``): it keeps
    its hooks until that call returns, so the call ends as it began, merged and unmerged alike; its post-hook
    (:func:`~tome_core.hooks.call_hooks.call_ends`) takes them off then, or its next call's start where that call was
    interrupted."""
    patch = module.__dict__.get("_tome_patch")
    if patch is None or not fw.running(module):
        return False
    patch.state.detach_after_call = True
    return True


class Patched(NamedTuple):
    """A patched model and its run state; prints as the model's class and the state, not the model's layers."""

    model: Any
    state: ToMeState

    def __repr__(self) -> str:
        return f"Patched(model={type(self.model).__name__}, state={self.state!r})"


def patched_models(fw: Framework, obj: Any, entry: str = "patched_models") -> List[Patched]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call). ``entry``:
    the entry point named if ``obj`` is no pipeline or model."""
    return [
        Patched(m, m.__dict__["_tome_patch"].state) for m in find_models(fw, obj, entry) if "_tome_patch" in m.__dict__
    ]
