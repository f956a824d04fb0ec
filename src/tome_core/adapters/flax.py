"""Patch diffusers' Flax models and pipelines (diffusers 0.39.0, the last release with Flax).

Flax modules are immutable, so patching a model returns an instance of a subclass of its class (same fields,
``config`` and parameter tree) whose ``__call__`` runs the original under :mod:`tome_core.driver`. Flax modules
take no hooks and exist, bound, only inside a call: each patched call attaches the driver's hooks to its bound
module tree (:class:`_CallHooks`) and runs them from :func:`flax.linen.intercept_methods`, all while jax traces
(shapes are Python ints, the timestep may be a tracer, the state lives for one call), so it works under
``jax.jit``, ``pmap`` and the pipelines' ``jit=True`` path. Pipelines are patched in place, and their hash
follows their ToMe options: they pass ``self`` to ``jax.pmap`` as a static argument, so a pipeline compiled
before patching recompiles instead of reusing the unpatched UNet.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from types import SimpleNamespace
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from diffusers.configuration_utils import flax_register_to_config
from diffusers.models.attention_flax import FlaxAttention
from diffusers.models.controlnets.controlnet_flax import FlaxControlNetModel
from diffusers.models.unets.unet_2d_condition_flax import FlaxUNet2DConditionModel
from diffusers.pipelines.pipeline_flax_utils import FlaxDiffusionPipeline
from diffusers.utils import logging as diffusers_logging

from tome_core import driver
from tome_core.hooks.attention_bias import SizeBias
from tome_core.config import ToMeConfig, document
from tome_core.framework import Framework, PostHook, PreHook, argument
from tome_core.models.levels import finest_attention_level
from tome_core.models.model_tree import not_a_model
from tome_core.models.plan import plan_model
from tome_core.models.selection import ModelFacts, check_model
from tome_core.hooks.state import ToMeState

LATENT_MODELS = (FlaxUNet2DConditionModel, FlaxControlNetModel)
PIPELINE_MODELS = ("unet", "controlnet")
ACCEPTED = (
    "a diffusers Flax pipeline with a FlaxUNet2DConditionModel `unet` (e.g. FlaxStableDiffusionPipeline, "
    "FlaxStableDiffusionControlNetPipeline), a FlaxUNet2DConditionModel or a FlaxControlNetModel"
)
LOAD = "pipe, params = FlaxStableDiffusionPipeline.from_pretrained({name})"
# Order of a UNet's parts in the torch model's module list: the partition stream of a block is its index in
# that order, so the same seed and timestep give the same partition in torch and in Flax.
_TORCH_PART_ORDER = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}


# --------------------------------------------------------------------------------------------------------
# The driver's hooks in one patched model call (they live only while jax traces it)


def _part_key(path: Tuple[str, ...]) -> Tuple[Any, ...]:
    """Sort key putting a block path (``down_blocks_1/attentions_0/transformer_blocks_1``) in torch order."""
    key: List[Any] = []
    for part in path:
        name, _, index = part.rpartition("_")
        if index.isdigit():
            key.append((_TORCH_PART_ORDER.get(name, 3), name, int(index)))
        else:
            key.append((_TORCH_PART_ORDER.get(part, 3), part, -1))
    return tuple(key)


def block_paths(params: Any) -> List[Tuple[str, ...]]:
    """Paths of every transformer block in a UNet's or ControlNet's parameter tree, in torch module order
    (a block's index in this list is its partition stream, as in the torch adapter)."""
    found = set()

    def walk(tree: Any, path: Tuple[str, ...]) -> None:
        if not hasattr(tree, "items"):
            return
        for name, sub in tree.items():
            if name.startswith("transformer_blocks_"):
                found.add(path + (name,))
            else:
                walk(sub, path + (name,))

    walk(params, ())
    return sorted(found, key=_part_key)


def _children(module: nn.Module) -> List[nn.Module]:
    """The submodules a bound module defines in its ``setup``, in torch's module order (:func:`_part_key`), so
    that a block's index among the model's blocks (its partition stream) is the torch model's."""
    module._try_setup()
    named = [(name, child) for name, child in module._state.children.items() if isinstance(child, nn.Module)]
    return [child for _, child in sorted(named, key=lambda item: _part_key((item[0],)))]


def _size_aware_attention(
    attention: FlaxAttention,
    hidden_states: jax.Array,
    bias: SizeBias,
    deterministic: bool = True,
    keys: Optional[jax.Array] = None,
) -> jax.Array:
    """``attention`` with queries from ``hidden_states`` and keys/values from the merged tokens ``keys`` (default:
    ``hidden_states``), each key's logit raised by ``bias`` (log(its size)). ``FlaxAttention`` takes no bias, so
    this runs its own layers with only the softmax changed (full logits, also under
    ``use_memory_efficient_attention``)."""
    keys = hidden_states if keys is None else keys
    batch, queries, _ = hidden_states.shape
    kept = keys.shape[1]
    query = jnp.reshape(attention.query(hidden_states), (batch, queries, attention.heads, -1))
    key, value = (jnp.reshape(layer(keys), (batch, kept, attention.heads, -1)) for layer in (attention.key, attention.value))
    # plain einsums in the module's dtype, as FlaxAttention computes (XLA's CPU dot has no float32 accumulation
    # of float16, which jax.nn.dot_product_attention asks for)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) * attention.scale
    logits = logits + bias.for_keys(kept, logits)[:, None]  # [B, 1, 1, N - r]: every head and query
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), value)
    out = attention.proj_attn(jnp.reshape(out, (batch, queries, -1)))
    return attention.dropout_layer(out, deterministic=deterministic)


def _biased_call(attention: FlaxAttention, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: SizeBias) -> jax.Array:
    """A call ``attention(hidden_states, context=None, deterministic=True)`` run as size-aware attention."""
    deterministic = argument(args, kwargs, "deterministic", 2)
    return _size_aware_attention(
        attention, argument(args, kwargs, "hidden_states", 0), bias, True if deterministic is None else deterministic,
        keys=argument(args, kwargs, "context", 1),
    )


class _CallHooks(Framework):
    """Flax for :mod:`tome_core.driver`, for one traced call of a patched model: :meth:`intercept` runs the hooks
    of each module whose ``__call__`` it sees, and an armed ``FlaxAttention`` as :func:`_size_aware_attention`."""

    accepted = ACCEPTED

    def __init__(self) -> None:
        self.pre: Dict[int, List[PreHook]] = {}
        self.post: Dict[int, List[PostHook]] = {}
        self.hooked: Dict[int, nn.Module] = {}  # keeps each hooked module alive, so that its id stays its own
        self.biases: Dict[int, SizeBias] = {}  # attentions armed by size_aware, for their call now
        self.walked: Dict[int, List[nn.Module]] = {}

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def submodules(self, module: nn.Module) -> List[nn.Module]:
        found = self.walked.get(id(module))
        if found is None:
            found = self.walked[id(module)] = [module, *(sub for child in _children(module) for sub in self.submodules(child))]
        return found

    def add_pre_hook(self, module: nn.Module, hook: PreHook) -> Any:
        return self._add(self.pre, module, hook)

    def add_post_hook(self, module: nn.Module, hook: PostHook) -> Any:
        return self._add(self.post, module, hook)

    def _add(self, table: Dict[int, List[Any]], module: nn.Module, hook: Any) -> Any:
        """Add ``hook`` to ``module``'s list in ``table``; returns a handle whose ``remove()`` drops it."""
        self.hooked[id(module)] = module
        hooks = table.setdefault(id(module), [])
        hooks.append(hook)
        return SimpleNamespace(remove=functools.partial(hooks.remove, hook))

    def intercept(self, next_fun, args, kwargs, context):
        """Run a hooked module's ``__call__`` between its pre-hooks and its post-hooks (also when it raises)."""
        module = context.module
        key = id(module)
        if context.method_name != "__call__" or self.hooked.get(key) is not module:
            return next_fun(*args, **kwargs)
        for hook in self.pre.get(key, ()):
            changed = hook(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        output = None
        try:
            bias = self.biases.get(key)
            output = next_fun(*args, **kwargs) if bias is None else _biased_call(module, args, kwargs, bias)
        finally:
            for hook in self.post.get(key, ()):
                changed = hook(module, args, kwargs, output)
                output = output if changed is None else changed
        return output

    def host_values(self, x: Any) -> List[float]:
        return np.asarray(x).reshape(-1).tolist()  # only for options refused on jax (_check_supported)

    def size_aware(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: SizeBias):
        self.biases[id(module)] = bias
        return args, kwargs

    def size_aware_done(self, module: nn.Module, computed: bool) -> None:
        self.biases.pop(id(module), None)

    def execution(self, x: Any) -> Tuple[str, str]:
        traced = isinstance(x, jax.core.Tracer)  # under jax.jit (a traced program), or jax.grad in eager code
        devices = None if traced else getattr(x, "devices", None)  # none on a NumPy input, which runs on the default
        platform = next(iter(devices())).platform if devices is not None else jax.default_backend()
        return "cpu" if platform == "cpu" else "gpu", "compiled" if traced else "eager"

    def kernel_keys_problem(self, module: nn.Module) -> str:
        return "ToMe merges keys inside an attention kernel on diffusers and ppdiffusers only"

    def kernel_keys(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], keys: Any, bias: Any = None):
        raise NotImplementedError(self.kernel_keys_problem(module))  # refused by kernel_keys_problem first

    def bias_problem(self, module: nn.Module) -> Optional[str]:
        return None  # _size_aware_attention runs every FlaxAttention with the bias

    def separate_kv(self, module: nn.Module) -> bool:
        return True  # FlaxAttention computes keys and values from its context argument when given one

    def inform(self, message: str) -> None:
        """Log ``message`` at info level with Python's logging, under diffusers' logger (its Flax models are
        diffusers'), which ``diffusers.utils.logging.set_verbosity_info()`` shows."""
        diffusers_logging.get_logger("diffusers.tome_core").info(message)


class _Recorder(threading.local):
    """States of the patched calls traced while :func:`record` is active (for stats and tests)."""

    def __init__(self):
        self.stack: List[List[Tuple[str, ToMeState]]] = []


_recorder = _Recorder()


class record:
    """Context manager collecting ``(class name, ToMeState)`` for every patched model call traced inside it
    (under ``jax.jit`` once per input shape, so stats appear only when tracing happens)."""

    def __enter__(self) -> List[Tuple[str, ToMeState]]:
        self.states: List[Tuple[str, ToMeState]] = []
        _recorder.stack.append(self.states)
        return self.states

    def __exit__(self, *exc: Any) -> None:
        stack = _recorder.stack
        del stack[next(i for i, states in enumerate(stack) if states is self.states)]


# --------------------------------------------------------------------------------------------------------
# Patched model classes


def config_key(config: Optional[ToMeConfig]) -> Any:
    """A hashable stand-in for a config (``level_ratios`` is a dict)."""
    if config is None:
        return None
    return tuple(
        (f.name, tuple(sorted(v.items())) if isinstance(v, dict) else v)
        for f in dataclasses.fields(config)
        for v in [getattr(config, f.name)]
    )


def _check_supported(config: ToMeConfig) -> None:
    for name in ("blocks", "block_ratios"):
        if getattr(config, name) is not None:
            raise ValueError(
                f"{name} is not supported on jax: diffusers' Flax models are UNets, whose blocks are chosen by level "
                "(max_downsample, level_ratios); diffusion transformers, where block choice matters, exist in torch "
                "and paddle only"
            )
    if config.timestep_range is not None:
        raise ValueError(
            f"timestep_range={config.timestep_range} is not supported on jax: whether a call merges would depend on "
            "its timestep, which jax.jit traces; patch the model for the steps that should merge and use the "
            "unpatched one for the others (both share the parameters)"
        )
    if config.reuse_steps != 1:
        raise ValueError(
            f"reuse_steps={config.reuse_steps} is not supported on jax: a match is computed inside a traced model "
            "call and cannot outlive it (the pipelines trace each denoising step in one loop); use reuse_steps=1 "
            "(reuse_level=True works)"
        )


def finest_level(model: nn.Module) -> int:
    """The finest level (0 = full resolution) of an unbound Flax UNet with attention, read from its block types
    (its modules do not exist before a call)."""
    return finest_attention_level(["CrossAttn" in block_type for block_type in model.down_block_types])


def _patched_call(self, *args, **kwargs):
    """A patched model's call: the driver's hooks on its bound module tree, run by an interceptor."""
    config: Optional[ToMeConfig] = self.tome
    call = super(type(self), self).__call__
    if config is None:
        return call(*args, **kwargs)
    hooks = _CallHooks()
    plan = plan_model(hooks, self, config)
    state = driver.model_state(plan)
    driver.attach_hooks(hooks, plan, state)
    with nn.intercept_methods(hooks.intercept):
        out = call(*args, **kwargs)  # intercepted too: the model's own hooks start and end the call
    for states in _recorder.stack:
        states.append((type(self).__name__, state))
    return out


def _call_of(base: type) -> Any:
    """:func:`_patched_call` for a subclass of ``base``, with ``base.__call__``'s signature (the driver finds its
    arguments by name there)."""

    def __call__(self, *args, **kwargs):
        return _patched_call(self, *args, **kwargs)

    __call__.__signature__ = inspect.signature(base.__call__)
    return __call__


@functools.lru_cache(maxsize=None)
def _patched_class(base: type) -> type:
    """A subclass of a Flax model class with a ``tome`` field (not part of its diffusers config)."""

    def __hash__(self):
        return hash((base.__hash__(self), config_key(self.tome)))

    @nn.nowrap
    def register_to_config(self, **kwargs):
        # ``Module.clone()`` re-runs ``__init__`` with every field; ``tome`` must not enter the diffusers config
        # (``save_pretrained`` would write it, or fail to).
        kwargs.pop("tome", None)
        return base.register_to_config(self, **kwargs)

    namespace = {
        "__hash__": __hash__,
        "register_to_config": register_to_config,
        "__module__": __name__,
        "__qualname__": base.__qualname__,
        "__annotations__": {"tome": Optional[ToMeConfig]},
        "tome": None,
        "_flax_internal_args": [*getattr(base, "_flax_internal_args", ()), "tome"],
        "__call__": _call_of(base),
        "__doc__": f"{base.__name__} with Token Merging (see tome_core.jax).",
    }
    # The base's names: diffusers records class names in configs and model_index.json, and the driver's
    # messages name the model by its class.
    return flax_register_to_config(type(base.__name__, (base,), namespace))


def _unpatched_class(cls: type) -> type:
    """The class a patched model or pipeline class of this module extends; any other class as it is."""
    return cls.__bases__[0] if cls.__module__ == __name__ else cls


def module_fields(model: nn.Module) -> Dict[str, Any]:
    """A model's constructor arguments, with lists as tuples: ``from_pretrained`` reads a config's sequences
    from JSON as lists, and a module with a list field cannot hash, as a static argument of ``jax.jit`` must."""
    return {
        f.name: tuple(value) if isinstance(value, list) else value
        for f in dataclasses.fields(model)
        if f.init and f.name not in ("parent", "name", "tome")
        for value in [getattr(model, f.name)]
    }


def _original(model: nn.Module) -> nn.Module:
    if "_tome_original" in model.__dict__:
        return model.__dict__["_tome_original"]
    base = _unpatched_class(type(model))
    if base is type(model):
        return model
    # A copy that kept the patched class but not our attribute (``Module.clone()``): rebuild the original.
    original = base(**module_fields(model))
    object.__setattr__(original, "_internal_dict", model._internal_dict)
    return original


def is_patched(model: Any) -> bool:
    return isinstance(model, nn.Module) and _unpatched_class(type(model)) is not type(model)


def _patch_model(model: nn.Module, config: ToMeConfig) -> nn.Module:
    _check_supported(config)
    model = _original(model)
    # no module tree to read block levels from: the model is known by its finest level with attention
    check_model(config, ModelFacts(type(model).__name__, finest_level(model), [None]))
    cls = _patched_class(type(model))
    patched = cls(**module_fields(model), tome=config)
    # The same diffusers config (it may hold entries that are not fields, e.g. _diffusers_version).
    object.__setattr__(patched, "_internal_dict", model._internal_dict)
    object.__setattr__(patched, "_tome_original", model)
    return patched


# --------------------------------------------------------------------------------------------------------
# Pipelines


@functools.lru_cache(maxsize=None)
def _pipeline_class(base: type) -> type:
    """A subclass whose hash follows the ToMe options of the pipeline's models (see the module doc)."""

    def __hash__(self):
        return hash((object.__hash__(self), self.__dict__.get("_tome_key")))

    namespace = {"__module__": __name__, "__qualname__": f"ToMe[{base.__qualname__}]", "__hash__": __hash__}
    return type(base.__name__, (base,), namespace)


def _pipeline_models(pipe: FlaxDiffusionPipeline) -> Dict[str, nn.Module]:
    return {
        name: getattr(pipe, name)
        for name in PIPELINE_MODELS
        if isinstance(getattr(pipe, name, None), LATENT_MODELS)
    }


def _check(obj: Any, entry: str = "patch") -> None:
    if isinstance(obj, FlaxDiffusionPipeline):
        if not _pipeline_models(obj):
            raise ValueError(
                f"nothing to patch: {type(obj).__name__} has no FlaxUNet2DConditionModel `unet` or "
                f"FlaxControlNetModel `controlnet`; ToMe can patch {ACCEPTED}"
            )
    elif not isinstance(obj, LATENT_MODELS):
        raise not_a_model(ACCEPTED, obj, entry, LOAD)


def _seed_from_key(seed: Any) -> Any:
    """``seed=`` may be a ``jax.random`` key: it draws the integer seed of the partition hash."""
    if isinstance(seed, jax.Array) and (jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) or seed.shape == (2,)):
        if isinstance(seed, jax.core.Tracer):
            raise TypeError("seed= must be an int or a concrete jax.random key, not a traced value: patch outside jit")
        return int(jax.random.randint(seed, (), 0, 2**31 - 1))
    return seed


def patch(obj: Any, **options: Any) -> Any:
    """Apply ToMe. A model: returns a patched copy (same parameter tree); a pipeline: patched in place.

    ``seed`` may be an int or a ``jax.random`` key (which draws the int).
    """
    if "seed" in options:
        options = {**options, "seed": _seed_from_key(options["seed"])}
    config = ToMeConfig.from_options(options)
    _check_supported(config)
    _check(obj)
    if not isinstance(obj, FlaxDiffusionPipeline):
        return _patch_model(obj, config)
    key = []
    for name, model in _pipeline_models(obj).items():
        setattr(obj, name, _patch_model(model, config))
        key.append((name, config_key(config)))
    object.__setattr__(obj, "__class__", _pipeline_class(_unpatched_class(type(obj))))
    obj._tome_key = tuple(key)
    return obj


def remove(obj: Any) -> Any:
    """Undo :func:`patch`: a model gives back the original module, a pipeline is restored in place."""
    _check(obj, "remove")
    if not isinstance(obj, FlaxDiffusionPipeline):
        return _original(obj)
    for name, model in _pipeline_models(obj).items():
        setattr(obj, name, _original(model))
    object.__setattr__(obj, "__class__", _unpatched_class(type(obj)))
    obj.__dict__.pop("_tome_key", None)
    return obj


document(patch, """
obj: a FlaxUNet2DConditionModel or FlaxControlNetModel (a patched copy is returned), or a Flax pipeline
(FlaxStableDiffusionPipeline, FlaxStableDiffusionControlNetPipeline; patched in place). Other models are
refused here with an error saying why.
""")


class PatchedModel(NamedTuple):
    """A patched model and its name; prints as the name and the model's class, not its configuration."""

    name: str
    model: nn.Module

    def __repr__(self) -> str:
        return f"PatchedModel(name={self.name!r}, model={type(self.model).__name__})"


def patched_models(obj: Any) -> List[PatchedModel]:
    """The patched models of ``obj`` (a pipeline or a model) as ``(name, module)`` pairs."""
    if isinstance(obj, FlaxDiffusionPipeline):
        return [PatchedModel(name, m) for name, m in _pipeline_models(obj).items() if is_patched(m)]
    return [PatchedModel(type(obj).__name__, obj)] if is_patched(obj) else []
