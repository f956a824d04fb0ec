"""Patch diffusers' Flax models and pipelines (diffusers 0.39.0, the last release with Flax).

Flax modules are immutable, so patching a model returns a new module: an instance of a subclass of the
model's class (same fields, same ``config``, same parameter tree) whose ``__call__`` runs the original one
inside :func:`flax.linen.intercept_methods`. The interceptor mirrors the torch adapter's hooks:

* the model call gives the latent size (``sample`` is NCHW) and the timestep (the partition's ``step``);
* each ``FlaxTransformer2DModel`` gives its real 2-D token grid (its input is NHWC);
* each ``FlaxBasicTransformerBlock`` computes one match from its input;
* its ``attn1`` / ``attn2`` / ``ff`` (as selected) merge their input and unmerge their output, before the
  block adds its residual. ``attn1`` follows ``mode``: ``FlaxAttention.__call__(hidden_states, context)``
  takes its keys and values from ``context``, so ``"kv"`` runs ``attn1(h, context=merge(h))`` (nothing to
  unmerge) and ``"queries"`` runs ``unmerge(attn1(merge(h), context=h))``; ``attn2`` and ``ff`` always
  merge as ``"tokens"``.
* with ``proportional_attn`` and keys merged by similarity (``mode`` ``"tokens"`` or ``"kv"``, ``matching``
  ``"similarity"``), a merged ``attn1`` runs as size-aware attention instead of its own ``__call__``:
  ``FlaxAttention`` has no bias argument, so :func:`_size_aware_attention` runs attention over the module's
  own ``query``/``key``/``value``/``proj_attn`` layers with the merged keys' log sizes added to the logits.
  Its parameters and outputs are those of the module; only the softmax changes. Cell pooling
  (``matching="cell"``) and ``"queries"`` (whole keys) pay for no bias.

Everything happens while jax traces the call: shapes (N, r, grid) are Python ints, the timestep may be a
tracer, and a fresh :class:`~tome_core.state.ToMeState` is used per call, so nothing traced outlives the
trace. The patched module works under ``jax.jit``, ``pmap`` and the pipelines' ``jit=True`` path.

Pipelines are patched in place (their ``unet`` and ``controlnet`` are swapped for patched modules), and the
pipeline's hash changes with its ToMe options: the pipelines pass ``self`` to ``jax.pmap`` as a static
argument, so a pipeline compiled before patching recompiles instead of silently reusing the unpatched UNet.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from diffusers.configuration_utils import flax_register_to_config
from diffusers.models.attention_flax import FlaxAttention, FlaxBasicTransformerBlock, FlaxTransformer2DModel
from diffusers.models.controlnets.controlnet_flax import FlaxControlNetModel
from diffusers.models.unets.unet_2d_condition_flax import FlaxUNet2DConditionModel
from diffusers.pipelines.pipeline_flax_utils import FlaxDiffusionPipeline

from tome_core.config import ToMeConfig, document
from tome_core.driver import argument, replace_argument
from tome_core.levels import finest_attention_level
from tome_core.match import Match
from tome_core.merge import merge, size_bias, unmerge
from tome_core.selection import ModelFacts, check_model
from tome_core.state import ToMeState

LATENT_MODELS = (FlaxUNet2DConditionModel, FlaxControlNetModel)
PIPELINE_MODELS = ("unet", "controlnet")
SUBLAYERS = {"attn1": "attn", "attn2": "crossattn", "ff": "mlp"}
ACCEPTED = (
    "a diffusers Flax pipeline with a FlaxUNet2DConditionModel `unet` (e.g. FlaxStableDiffusionPipeline, "
    "FlaxStableDiffusionControlNetPipeline), a FlaxUNet2DConditionModel or a FlaxControlNetModel"
)
# Order of a UNet's parts in the torch model's module list: the partition stream of a block is its index in
# that order, so the same seed and timestep give the same partition in torch and in Flax.
_TORCH_PART_ORDER = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}


# --------------------------------------------------------------------------------------------------------
# The run of one patched model call (lives only while jax traces it)


def _step(timesteps: Any) -> Any:
    """The partition's ``step``: the first timestep, a Python int or a (traced) 0-d array, never synced."""
    if timesteps is None:
        return 0
    if isinstance(timesteps, (int, float)):
        return int(timesteps)
    return jnp.reshape(jnp.asarray(timesteps), (-1,))[0]


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


def _size_aware_attention(
    attention: FlaxAttention,
    hidden_states: jax.Array,
    match: Match,
    deterministic: bool = True,
    keys: Optional[jax.Array] = None,
) -> jax.Array:
    """``attention`` with queries from ``hidden_states`` and keys/values from the merged tokens ``keys``
    (default: ``hidden_states`` themselves, the ``tokens`` arrangement), each key's logit raised by log(its
    size).

    Equals the module's own attention over all tokens with every merged token repeated once per token it
    stands for. In the ``kv`` arrangement the queries are all N tokens and ``keys`` the ``N - r`` merged ones.
    The full ``[B, heads, queries, N - r]`` logits are formed even when the module was built with
    ``use_memory_efficient_attention`` (diffusers' chunked kernel takes no bias).
    """
    keys = hidden_states if keys is None else keys
    batch, queries, _ = hidden_states.shape
    kept = keys.shape[1]
    query = jnp.reshape(attention.query(hidden_states), (batch, queries, attention.heads, -1))
    key, value = (jnp.reshape(layer(keys), (batch, kept, attention.heads, -1)) for layer in (attention.key, attention.value))
    # Plain einsums in the module's dtype, as FlaxAttention computes: jax.nn.dot_product_attention asks for
    # float32 accumulation, which XLA's CPU dot does not offer for float16 inputs.
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) * attention.scale
    logits = logits + size_bias(match, logits)[:, None]  # [B, 1, 1, N - r]: every head and query
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), value)
    out = attention.proj_attn(jnp.reshape(out, (batch, queries, -1)))
    return attention.dropout_layer(out, deterministic=deterministic)


class _Run:
    """One traced call of a patched model: its state, its block streams and the block being run."""

    def __init__(self, state: ToMeState, root: Tuple[str, ...], block_paths: List[Tuple[str, ...]]):
        self.state = state
        self.root = root  # the patched model's own path, when it runs inside a larger module
        self.streams = {path: index for index, path in enumerate(block_paths)}
        self.block_path: Optional[Tuple[str, ...]] = None
        self.matches: Dict[str, Match] = {}

    def stream(self, path: Tuple[str, ...]) -> int:
        # Without parameters (inside ``init``) streams follow the call order; the output is not used there.
        return self.streams.setdefault(path, len(self.streams))

    def intercept(self, next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        module = context.module
        if isinstance(module, FlaxTransformer2DModel):
            hidden_states = argument(args, kwargs, "hidden_states", 0)
            if hidden_states.ndim == 4:
                self.state.enter_grid(tuple(int(n) for n in hidden_states.shape[1:3]))
            return next_fun(*args, **kwargs)
        if isinstance(module, FlaxBasicTransformerBlock):
            path = tuple(module.path)[len(self.root) :]
            outer = (self.block_path, self.matches)
            self.block_path = path
            self.matches = self.state.block_matches(argument(args, kwargs, "hidden_states", 0), self.stream(path))
            try:
                return next_fun(*args, **kwargs)
            finally:
                self.block_path, self.matches = outer
        sublayer = SUBLAYERS.get(module.name, "")
        match = self.matches.get(sublayer)
        if match is None or match.merged == 0 or tuple(module.path)[len(self.root) : -1] != self.block_path:
            return next_fun(*args, **kwargs)
        x = argument(args, kwargs, "hidden_states", 0)
        merged = merge(x, match)
        deterministic = argument(args, kwargs, "deterministic", 2)
        deterministic = True if deterministic is None else deterministic
        attends_to_itself = sublayer == "attn" and argument(args, kwargs, "context", 1) is None
        mode, size_aware = self.state.active.arrangement(sublayer, attends_to_itself)
        if mode in ("kv", "queries") and not attends_to_itself:
            raise ValueError(
                f"mode={mode!r}: this {type(module).__name__} attends to its context (only_cross_attention), not to "
                "its own tokens, so it has no self-attention keys to arrange; use mode='tokens'"
            )
        if mode == "kv":  # queries keep every token, keys and values are the merged tokens: nothing to unmerge
            if size_aware:
                return _size_aware_attention(module, x, match, deterministic, keys=merged)
            args, kwargs = replace_argument(args, kwargs, "context", 1, merged)
            return next_fun(*args, **kwargs)
        args, kwargs = replace_argument(args, kwargs, "hidden_states", 0, merged)
        if mode == "queries":  # merged queries attend to every token; the output is unmerged
            args, kwargs = replace_argument(args, kwargs, "context", 1, x)
        elif size_aware:
            return unmerge(_size_aware_attention(module, merged, match, deterministic), match)
        return unmerge(next_fun(*args, **kwargs), match)


class _Recorder(threading.local):
    """States of the patched calls traced while :func:`record` is active (for stats and tests)."""

    def __init__(self):
        self.stack: List[List[Tuple[str, ToMeState]]] = []


_recorder = _Recorder()


class record:
    """Context manager collecting ``(class name, ToMeState)`` for every patched model call traced inside it.

    A state's ``stats`` tell, per downsample level, how many blocks merged and their token counts. Under
    ``jax.jit`` a call is traced once per input shape, so stats appear only when tracing happens.
    """

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


def _finest_level(model: nn.Module) -> int:
    return finest_attention_level(["CrossAttn" in block_type for block_type in model.down_block_types])


def _patched_call(self, *args, **kwargs):
    config: Optional[ToMeConfig] = self.tome
    if config is None:
        return super(type(self), self).__call__(*args, **kwargs)
    sample = argument(args, kwargs, "sample", 0)
    state = ToMeState(config=config, finest_level=_finest_level(self), choices=config.auto_choices(True))
    state.begin_call(tuple(int(n) for n in sample.shape[-2:]), _step(argument(args, kwargs, "timesteps", 1)))
    run = _Run(state, tuple(self.path), block_paths(self.variables.get("params", {})))
    with nn.intercept_methods(run.intercept):
        out = super(type(self), self).__call__(*args, **kwargs)
    for states in _recorder.stack:
        states.append((type(self).__name__, state))
    return out


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
        "__qualname__": f"ToMe[{base.__qualname__}]",
        "__annotations__": {"tome": Optional[ToMeConfig]},
        "tome": None,
        "_flax_internal_args": [*getattr(base, "_flax_internal_args", ()), "tome"],
        "__call__": _patched_call,
        "__doc__": f"{base.__name__} with Token Merging (see tome_core.jax).",
    }
    # Same __name__ as the base: diffusers records class names in configs and model_index.json.
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
    check_model(config, ModelFacts(type(model).__name__, _finest_level(model), [None]))
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


def _check(obj: Any) -> None:
    if isinstance(obj, FlaxDiffusionPipeline):
        if not _pipeline_models(obj):
            raise ValueError(
                f"nothing to patch: {type(obj).__name__} has no FlaxUNet2DConditionModel `unet` or "
                f"FlaxControlNetModel `controlnet`; ToMe can patch {ACCEPTED}"
            )
    elif not isinstance(obj, LATENT_MODELS):
        raise TypeError(f"ToMe can patch {ACCEPTED}; got {type(obj).__module__}.{type(obj).__qualname__}")


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
    _check(obj)
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
