"""Patch ppdiffusers (paddle) models and pipelines with layer hooks; no forward is copied or replaced.

The paddle twin of :mod:`tome_core.adapters.diffusers`. The hooks read positional inputs only (paddle's
hooks see keyword arguments only from 3.0 on), and every input they use is positional in ppdiffusers' own
calls however the user called the model. For every patched model (a UNet2DConditionModel, a ControlNetModel,
or any layer holding ppdiffusers ``BasicTransformerBlock``s) the hooks are:

* on a latent model's ``time_proj`` and ``conv_in``: pre-hooks reading the call's timestep and latent size
  (their inputs are the model's ``timesteps`` and ``sample``, so keyword-only model calls work); on any other
  model, a pre-hook starting the call;
* on each ``Transformer2DModel``'s input ``norm``: a pre-hook reading the real 2-D token grid;
* on each ``BasicTransformerBlock``'s ``norm1``: a pre-hook computing the block's matches (one per merged
  sub-layer) from its input, which is the block's input; a hook on the block dropping them when it returns;
* on ``attn1`` / ``attn2`` / ``ff`` (as selected): a pre-hook merging their first input and a hook unmerging
  their output, before the block adds its residual. With ``proportional_attn`` the ``attn1`` pre-hook also
  passes the merged keys' log sizes as ``attention_mask`` (a keyword argument: paddle >= 3.0).

ppdiffusers installs its own ToMe port (``apply_tome``, which swaps block classes); :func:`patch` and
:func:`remove` also undo that port wherever they find it, so the two never stack.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import paddle
from ppdiffusers.models.attention import BasicTransformerBlock
from ppdiffusers.models.transformer_2d import Transformer2DModel

from tome_core.config import ToMeConfig
from tome_core.levels import finest_attention_level, warn_if_nothing_merges
from tome_core.match import Match
from tome_core.merge import merge, size_bias, unmerge
from tome_core.state import ToMeState

Layer = paddle.nn.Layer
SUBLAYERS = (("attn1", "attn"), ("attn2", "crossattn"), ("ff", "mlp"))
ACCEPTED = (
    "a ppdiffusers DiffusionPipeline, a UNet2DConditionModel, a ControlNetModel (or MultiControlNetModel) or a "
    "paddle.nn.Layer containing ppdiffusers BasicTransformerBlocks"
)
# Components ppdiffusers' own ToMe port never patches.
_PPDIFFUSERS_SKIPS = ("vae", "vqvae")


def _step(timesteps: Any) -> Any:
    """The timestep as the partition hash takes it: a 0-d tensor (no host sync) or a Python number."""
    if isinstance(timesteps, paddle.Tensor):
        return timesteps.reshape([-1])[0]
    return 0 if timesteps is None else int(timesteps)


def _spatial(x: paddle.Tensor, data_format: str) -> Tuple[int, int]:
    shape = x.shape
    return (int(shape[1]), int(shape[2])) if data_format == "NHWC" else (int(shape[-2]), int(shape[-1]))


class _LatentCall:
    """Pre-hooks on a latent model's ``time_proj`` and ``conv_in``, which every call runs in that order.

    ``time_proj`` may run a second time in the same call (class labels embedded as timesteps): only the
    first input of a call is the timestep.
    """

    def __init__(self, state: ToMeState, data_format: str):
        self.state = state
        self.data_format = data_format
        self.step: Any = None

    def on_time_proj(self, layer, inputs):
        if self.step is None and inputs:
            self.step = _step(inputs[0])

    def on_conv_in(self, layer, inputs):
        step, self.step = self.step, None
        self.state.begin_call(_spatial(inputs[0], self.data_format), 0 if step is None else step)


class _PlainCall:
    """Pre-hook on a model that is not a latent model: a call starts; the first grid seen is the latent."""

    def __init__(self, state: ToMeState):
        self.state = state

    def __call__(self, layer, inputs):
        self.state.begin_call(None, 0)


class _GridHook:
    """Pre-hook on a Transformer2DModel's input norm: its input is the 4-D map of the blocks' tokens."""

    def __init__(self, state: ToMeState, data_format: str):
        self.state = state
        self.data_format = data_format

    def __call__(self, layer, inputs):
        if inputs and inputs[0].ndim == 4:
            self.state.enter_grid(_spatial(inputs[0], self.data_format))


class _BlockMatch:
    """The matches of one transformer block while it runs (one per merged sub-layer), shared by its hooks."""

    def __init__(self, state: ToMeState, stream: int, block: Layer):
        self.state = state
        self.stream = stream
        self.block = block
        self.matches: Dict[str, Match] = {}

    def begin(self, norm1, inputs):
        if self.state.merges("mlp") and getattr(self.block, "_chunk_size", None) is not None:
            raise ValueError(
                "merge_mlp=True cannot be combined with feed-forward chunking (enable_forward_chunking): the "
                "feed-forward runs on chunks of the merged tokens; disable one of them"
            )
        self.matches = self.state.block_matches(inputs[0], self.stream)

    def end(self, block, inputs, output):
        self.matches = {}


class _MergeInput:
    """Pre-hook on a sub-layer: merge its first input's tokens."""

    def __init__(self, block: _BlockMatch, sublayer: str):
        self.block = block
        self.sublayer = sublayer

    def __call__(self, layer, inputs):
        match = self.block.matches.get(self.sublayer)
        if match is None or match.merged == 0:
            return None
        return (merge(inputs[0], match),) + tuple(inputs[1:])


class _MergeInputWithSizes(_MergeInput):
    """Pre-hook (with keyword arguments) on self-attention for size-aware attention: merge the tokens and
    pass each merged key's log size as the additive ``attention_mask`` ``[B, 1, N - r]``."""

    def __call__(self, layer, inputs, kwargs):
        match = self.block.matches.get(self.sublayer)
        if match is None or match.merged == 0:
            return None
        if kwargs.get("encoder_hidden_states") is not None:  # only_cross_attention: the keys are text tokens
            return (merge(inputs[0], match),) + tuple(inputs[1:]), kwargs
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                "proportional_attn=True cannot be combined with an attention_mask on self-attention "
                "(the mask covers the unmerged tokens); pass proportional_attn=False to use the mask"
            )
        hidden_states = merge(inputs[0], match)
        return (hidden_states,) + tuple(inputs[1:]), {**kwargs, "attention_mask": size_bias(match, hidden_states)}


class _UnmergeOutput:
    def __init__(self, block: _BlockMatch, sublayer: str):
        self.block = block
        self.sublayer = sublayer

    def __call__(self, layer, inputs, output):
        match = self.block.matches.get(self.sublayer)
        if match is None or match.merged == 0:
            return None
        return unmerge(output, match)


class _Handle:
    """Removes one hook from the layer it was registered on.

    paddle's own handle holds a weak reference to the hook table of the layer it came from, so on a deep
    copy of a patched model it would remove the original's hook; this one is copied along with its layer.
    """

    def __init__(self, layer: Layer, table: str, helper: Any):
        self.layer = layer
        self.table = table
        self.hook_id = helper._hook_id

    def remove(self) -> None:
        getattr(self.layer, self.table).pop(self.hook_id, None)
        getattr(self.layer, self.table + "_with_kwargs_flag", {}).pop(self.hook_id, None)


def _pre_hook(layer: Layer, hook: Any, with_kwargs: bool = False) -> _Handle:
    if not with_kwargs:
        return _Handle(layer, "_forward_pre_hooks", layer.register_forward_pre_hook(hook))
    try:
        helper = layer.register_forward_pre_hook(hook, with_kwargs=True)
    except TypeError as error:  # paddle before 3.0
        raise RuntimeError(
            "proportional_attn=True (the default) needs paddle >= 3.0 (hooks with keyword arguments); on older "
            f"paddle pass proportional_attn=False: {error}"
        )
    return _Handle(layer, "_forward_pre_hooks", helper)


def _post_hook(layer: Layer, hook: Any) -> _Handle:
    return _Handle(layer, "_forward_post_hooks", layer.register_forward_post_hook(hook))


class _Patch:
    """Everything one patched model holds: its state and the handles of its hooks."""

    def __init__(self, state: ToMeState):
        self.state = state
        self.handles: List[_Handle] = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _layers(model: Layer) -> List[Layer]:
    return model.sublayers(include_self=True)


def _is_latent_model(layer: Layer) -> bool:
    """UNet2DConditionModel, ControlNetModel and their kin: a ``sample`` latent in, down blocks inside."""
    return hasattr(layer, "down_blocks") and isinstance(getattr(layer, "conv_in", None), Layer)


def _has_blocks(layer: Layer) -> bool:
    return any(isinstance(m, BasicTransformerBlock) for m in _layers(layer))


def _finest_level(model: Layer) -> int:
    if not _is_latent_model(model):
        return 1
    return finest_attention_level([_has_blocks(block) for block in model.down_blocks])


def _attach(model: Layer, config: ToMeConfig) -> None:
    state = ToMeState(config=config, finest_level=_finest_level(model))
    patch = _Patch(state)
    add = patch.handles.append
    if _is_latent_model(model):
        call = _LatentCall(state, getattr(model, "data_format", "NCHW"))
        if isinstance(getattr(model, "time_proj", None), Layer):
            add(_pre_hook(model.time_proj, call.on_time_proj))
        add(_pre_hook(model.conv_in, call.on_conv_in))
    else:
        add(_pre_hook(model, _PlainCall(state)))
    stream = 0
    for layer in _layers(model):
        if isinstance(layer, Transformer2DModel) and isinstance(getattr(layer, "norm", None), Layer):
            add(_pre_hook(layer.norm, _GridHook(state, getattr(layer, "data_format", "NCHW"))))
        if not isinstance(layer, BasicTransformerBlock):
            continue
        block = _BlockMatch(state, stream, layer)
        stream += 1
        add(_pre_hook(layer.norm1, block.begin))
        add(_post_hook(layer, block.end))
        for name, sublayer in SUBLAYERS:
            target = getattr(layer, name, None)
            if target is None or not state.merges(sublayer):
                continue
            if sublayer == "attn" and config.proportional_attn:
                add(_pre_hook(target, _MergeInputWithSizes(block, sublayer), with_kwargs=True))
            else:
                add(_pre_hook(target, _MergeInput(block, sublayer)))
            add(_post_hook(target, _UnmergeOutput(block, sublayer)))
    model._tome_patch = patch


def _detach(layer: Layer) -> None:
    patch = layer.__dict__.pop("_tome_patch", None)
    if patch is not None:
        patch.remove()


def _undo_ppdiffusers_port(layer: Layer) -> None:
    """Undo ppdiffusers' own ``apply_tome`` on one layer: its size hook, its info, its swapped block class."""
    info = layer.__dict__.pop("_tome_info", None)
    if isinstance(info, dict):
        own_hooks = getattr(layer, "_forward_pre_hooks", {})
        for hook in info.get("hooks", ()):
            # Its hooks sit on the layer holding the info; removing by id also works on a deep copy.
            if own_hooks.pop(getattr(hook, "_hook_id", None), None) is None:
                hook.remove()
        info.get("hooks", []).clear()
    cls = type(layer)
    if cls.__name__.startswith("ToMe") and "_parent" in cls.__dict__:
        layer.__class__ = cls._parent


def _component_layers(obj: Any) -> List[Layer]:
    """The layers ``obj`` consists of: itself if it is a layer, else a pipeline's layer components."""
    if isinstance(obj, Layer):
        return [obj]
    if hasattr(obj, "components") and isinstance(getattr(obj, "components"), dict):
        found = []
        for component in obj.components.values():
            items = component if isinstance(component, (list, tuple)) else [component]
            found.extend(item for item in items if isinstance(item, Layer))
        return found
    raise TypeError(f"ToMe can patch {ACCEPTED}; got {type(obj).__module__}.{type(obj).__qualname__}")


def _models(obj: Any) -> List[Layer]:
    """The models to patch inside ``obj``: every latent model (UNet, ControlNet), else the layer itself."""
    found: List[Layer] = []
    for layer in _component_layers(obj):
        latent_models = [m for m in _layers(layer) if _is_latent_model(m) and _has_blocks(m)]
        if latent_models:
            found.extend(latent_models)
        elif _has_blocks(layer):
            found.append(layer)
    return found


def patch(obj: Any, **options: Any) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options."""
    config = ToMeConfig.from_options(options)
    models = _models(obj)
    if not models:
        raise ValueError(
            f"nothing to patch: {type(obj).__qualname__} contains no ppdiffusers BasicTransformerBlock"
        )
    remove(obj)
    for model in models:
        warn_if_nothing_merges(config, _finest_level(model), type(model).__qualname__)
        _attach(model, config)
    return obj


def remove(obj: Any) -> Any:
    """Undo :func:`patch`, or ppdiffusers' own ``apply_tome``, in place (a no-op when unpatched); return ``obj``."""
    for component in _component_layers(obj):
        for layer in _layers(component):
            _detach(layer)
            _undo_ppdiffusers_port(layer)
    return obj


def patched_models(obj: Any) -> List[Tuple[Layer, ToMeState]]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call)."""
    return [(m, m._tome_patch.state) for m in _models(obj) if "_tome_patch" in m.__dict__]


def ppdiffusers_targets(obj: Any) -> List[Layer]:
    """The layers ppdiffusers' own ``apply_tome`` walks in ``obj`` (every component but the VAE).

    Its ``apply_tome`` asks ``obj.remove_tome(only_return_self=False)`` for this list, so the methods that
    :mod:`tome_core.paddle` installs return it to keep that function working.
    """
    if isinstance(obj, Layer):
        return [obj]
    return [
        layer
        for name, component in obj.components.items()
        if name not in _PPDIFFUSERS_SKIPS
        for layer in (component if isinstance(component, (list, tuple)) else [component])
        if isinstance(layer, Layer)
    ]
