"""Patch diffusers (torch) models and pipelines with module hooks; no forward is copied or replaced.

For every patched model (a UNet2DConditionModel, a ControlNetModel, or any module holding diffusers
``BasicTransformerBlock``s) the hooks are:

* on the model: a pre-hook reading the latent size and timestep of the call (``sample`` and ``timestep``,
  positional or keyword);
* on each ``Transformer2DModel``: a pre-hook reading the block's real 2-D token grid;
* on each ``BasicTransformerBlock``: a pre-hook computing one match from the block's input, and a hook
  dropping it when the block returns;
* on ``attn1`` / ``attn2`` / ``ff`` (as selected): a pre-hook merging their input tokens and a hook
  unmerging their output, before the block adds its residual.

That reproduces tomesd's arithmetic and follows whatever the block's own forward does (norm types, gates,
GLIGEN, keyword calls). The model keeps its class, parameters and state dict; :func:`remove` detaches
every hook.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from tome_core.backend import get_ops
from tome_core.config import ToMeConfig
from tome_core.levels import finest_attention_level, warn_if_nothing_merges
from tome_core.match import Match
from tome_core.merge import merge, size_bias, unmerge
from tome_core.state import ToMeState

SUBLAYERS = (("attn1", "attn"), ("attn2", "crossattn"), ("ff", "mlp"))
ACCEPTED = (
    "a diffusers DiffusionPipeline, a UNet2DConditionModel, a ControlNetModel (or MultiControlNetModel) or a "
    "torch.nn.Module containing diffusers BasicTransformerBlocks"
)


def _first(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, position: int = 0) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def _step(timestep: Any) -> Any:
    """The timestep as something the partition hash takes: a Python number or a 0-d tensor (no host sync)."""
    if isinstance(timestep, torch.Tensor):
        return timestep.reshape(-1)[0]
    return 0 if timestep is None else int(timestep)


class _ModelHook:
    """Pre-hook on a patched model: a new call starts, on a latent of ``sample``'s size (if it has one)."""

    def __init__(self, state: ToMeState, reads_latent: bool):
        self.state = state
        self.reads_latent = reads_latent

    def __call__(self, module, args, kwargs):
        latent_hw = None
        if self.reads_latent:
            sample = _first(args, kwargs, "sample")
            latent_hw = tuple(sample.shape[-2:])
        self.state.begin_call(latent_hw, _step(_first(args, kwargs, "timestep", 1)))


class _GridHook:
    """Pre-hook on a Transformer2DModel: its input is ``[B, C, h, w]``, the grid of the blocks inside."""

    def __init__(self, state: ToMeState):
        self.state = state

    def __call__(self, module, args, kwargs):
        hidden_states = _first(args, kwargs, "hidden_states")
        if hidden_states.ndim == 4:
            self.state.enter_grid(tuple(hidden_states.shape[-2:]))


class _BlockMatch:
    """The matches of one transformer block while it runs, shared by the block's sub-layer hooks."""

    def __init__(self, state: ToMeState, stream: int):
        self.state = state
        self.stream = stream
        self.matches: Dict[str, Match] = {}

    def begin(self, block, args, kwargs):
        if self.state.merges("mlp") and getattr(block, "_chunk_size", None) is not None:
            raise ValueError(
                "merge_mlp=True cannot be combined with feed-forward chunking (enable_forward_chunking): the "
                "feed-forward runs on chunks of the merged tokens; disable one of them"
            )
        self.matches = self.state.block_matches(_first(args, kwargs, "hidden_states"), self.stream)

    def end(self, block, args, kwargs, output):
        self.matches = {}


class _MergeInput:
    """Pre-hook on a sub-layer: merge its input tokens; for size-aware self-attention, also pass each
    merged key's log size as an additive attention bias ``[B, 1, N - r]``."""

    def __init__(self, block: _BlockMatch, sublayer: str, proportional: bool):
        self.block = block
        self.sublayer = sublayer
        self.proportional = proportional

    def __call__(self, module, args, kwargs):
        match = self.block.matches.get(self.sublayer)
        if match is None or match.merged == 0:
            return None
        if "hidden_states" in kwargs:
            hidden_states = merge(kwargs["hidden_states"], match)
            args, kwargs = args, {**kwargs, "hidden_states": hidden_states}
        else:
            hidden_states = merge(args[0], match)
            args = (hidden_states,) + tuple(args[1:])
        # With only_cross_attention, attn1 attends to text: its keys are not merged and get no size.
        if self.proportional and kwargs.get("encoder_hidden_states") is None:
            if kwargs.get("attention_mask") is not None:
                raise ValueError(
                    "proportional_attn=True cannot be combined with an attention_mask on self-attention "
                    "(the mask covers the unmerged tokens); pass proportional_attn=False to use the mask"
                )
            kwargs = {**kwargs, "attention_mask": size_bias(match, hidden_states)}
        return args, kwargs


class _UnmergeOutput:
    def __init__(self, block: _BlockMatch, sublayer: str):
        self.block = block
        self.sublayer = sublayer

    def __call__(self, module, args, kwargs, output):
        match = self.block.matches.get(self.sublayer)
        if match is None or match.merged == 0:
            return None
        return unmerge(output, match)


class _Patch:
    """Everything one patched model holds: its state and the handles of its hooks."""

    def __init__(self, state: ToMeState):
        self.state = state
        self.handles: List[Any] = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _is_latent_model(module: torch.nn.Module) -> bool:
    """UNet2DConditionModel, ControlNetModel and their kin: a ``sample`` latent in, down blocks inside."""
    return hasattr(module, "down_blocks") and hasattr(module, "conv_in")


def _has_blocks(module: torch.nn.Module) -> bool:
    return any(isinstance(m, BasicTransformerBlock) for m in module.modules())


def finest_level(model: torch.nn.Module) -> int:
    if not _is_latent_model(model):
        return 1
    return finest_attention_level([_has_blocks(block) for block in model.down_blocks])


def _attach(model: torch.nn.Module, config: ToMeConfig) -> None:
    get_ops(torch.empty(0))  # resolve the backend now: its import cannot be traced by torch.compile later
    state = ToMeState(config=config, finest_level=finest_level(model))
    patch = _Patch(state)
    add = patch.handles.append
    add(model.register_forward_pre_hook(_ModelHook(state, _is_latent_model(model)), with_kwargs=True))
    stream = 0
    for module in model.modules():
        if isinstance(module, Transformer2DModel):
            add(module.register_forward_pre_hook(_GridHook(state), with_kwargs=True))
        if not isinstance(module, BasicTransformerBlock):
            continue
        block = _BlockMatch(state, stream)
        stream += 1
        add(module.register_forward_pre_hook(block.begin, with_kwargs=True))
        add(module.register_forward_hook(block.end, with_kwargs=True))
        for name, sublayer in SUBLAYERS:
            target = getattr(module, name, None)
            if target is not None and state.merges(sublayer):
                proportional = sublayer == "attn" and config.proportional_attn
                add(target.register_forward_pre_hook(_MergeInput(block, sublayer, proportional), with_kwargs=True))
                add(target.register_forward_hook(_UnmergeOutput(block, sublayer), with_kwargs=True))
    model._tome_patch = patch


def _detach(model: torch.nn.Module) -> None:
    patch = model.__dict__.pop("_tome_patch", None)
    if patch is not None:
        patch.remove()


def _models(obj: Any) -> List[torch.nn.Module]:
    """The models to patch inside ``obj``: every latent model (UNet, ControlNet), else ``obj`` itself."""
    if isinstance(obj, torch.nn.Module):
        modules = [obj]
    elif hasattr(obj, "components") and isinstance(getattr(obj, "components"), dict):
        modules = [m for m in obj.components.values() if isinstance(m, torch.nn.Module)]
    else:
        raise TypeError(f"ToMe can patch {ACCEPTED}; got {type(obj).__module__}.{type(obj).__qualname__}")
    found: List[torch.nn.Module] = []
    for module in modules:
        latent_models = [m for m in module.modules() if _is_latent_model(m) and _has_blocks(m)]
        if latent_models:
            found.extend(latent_models)
        elif _has_blocks(module):
            found.append(module)
    return found


def patch(obj: Any, **options: Any) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options."""
    config = ToMeConfig.from_options(options)
    models = _models(obj)
    if not models:
        raise ValueError(f"nothing to patch: {type(obj).__qualname__} contains no diffusers BasicTransformerBlock")
    for model in models:
        _detach(model)
        warn_if_nothing_merges(config, finest_level(model), type(model).__qualname__)
        _attach(model, config)
    return obj


def remove(obj: Any) -> Any:
    """Undo :func:`patch` in place (a no-op on an unpatched object) and return ``obj``."""
    for model in _models(obj):
        _detach(model)
    return obj


def patched_models(obj: Any) -> List[Tuple[torch.nn.Module, ToMeState]]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call)."""
    return [(m, m._tome_patch.state) for m in _models(obj) if "_tome_patch" in m.__dict__]
