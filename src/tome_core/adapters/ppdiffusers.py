"""Patch ppdiffusers (paddle) models and pipelines: paddle's layer hooks under :mod:`tome_core.driver`.

The paddle twin of :mod:`tome_core.adapters.diffusers`: the driver attaches its hooks through
:class:`PaddleFramework` (paddle >= 3.0 layer hooks with keyword arguments; nothing is copied or replaced).
Size-aware attention reaches processors that score with the ``attention_mask`` argument (:data:`MASK_PROCESSORS`)
as that additive mask; every other one (SD3's joint attention) runs while paddle's :data:`SDPA` is wrapped
(:class:`_SdpaWrapper`, per thread, restored afterwards) to add the sizes to its ``attn_mask`` and, for ``kv``
inside the attention, merge its keys and values. A processor that
never calls it while armed gets a clear error after its call. :func:`patch` and :func:`remove` also undo
ppdiffusers' own ToMe port (``apply_tome``), so the two never stack.

``paddle.jit.to_static`` (issue #16): SOT mode guards on layer hooks but cannot simulate ours, so each hook runs
as ordinary Python (:class:`_Eager`); AST mode (``full_graph=True``) traces the hooks into its program, so
:func:`patch` and :func:`remove` clear the programs that traced the patched models (:func:`_drop_static_programs`).
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any, Dict, List, Optional, Tuple

import paddle
import paddle.nn.functional as F

try:  # paddle's SOT compiler (paddle >= 2.6): psdb.fallback is a no-op outside SOT
    from paddle.jit.sot import psdb as _psdb
except ImportError:  # pragma: no cover - older paddle
    _psdb = None
try:
    from paddle.jit.dy2static.program_translator import ASTStaticFunction as _ASTStaticFunction
except ImportError:  # pragma: no cover - older paddle
    _ASTStaticFunction = None

from tome_core import driver
from tome_core.adapters import processors
from tome_core.hooks.attention_bias import SizeBias, unbiased_processor, unreachable_kernel
from tome_core.hooks.block_hooks import KernelKeys
from tome_core.config import document
from tome_core.framework import Framework, PostHook, PreHook, call_running
from tome_core.models.model_tree import components
from tome_core.hooks.state import ToMeState

Layer = paddle.nn.Layer
ACCEPTED = (
    "a ppdiffusers DiffusionPipeline or one of its models (a UNet, video UNet, ControlNet, SD3Transformer2DModel or "
    "patchified (DiT) Transformer2DModel: README.md lists them), or a paddle.nn.Layer holding ppdiffusers "
    "transformer blocks"
)
# Processors that add a whole-batch ``attention_mask`` to their attention scores (``AttnProcessor2_5`` and its
# twins are aliases of the xformers classes).
LORA_PROCESSORS = frozenset({"LoRAAttnProcessor", "LoRAXFormersAttnProcessor"})  # ppdiffusers' only
MASK_PROCESSORS = processors.CLASSIC | processors.MASKED_TWINS | LORA_PROCESSORS
# Processors that compute keys and values from ``encoder_hidden_states`` when a self-attention is given one (the
# ``kv`` and ``queries`` arrangements), through the same ``to_k``/``to_v``, with a mask sized by those keys. Not
# custom-diffusion (mask sized by the queries), IP-Adapter (image-prompt tokens at the end), added-KV or joint ones.
SEPARATE_KV_PROCESSORS = processors.CLASSIC
# Norms on one side only (the queries' tokens, or ``encoder_hidden_states``): with any of them, keys computed from
# ``encoder_hidden_states`` are not the keys of the layer's own tokens.
_ONE_SIDED_NORMS = ("group_norm", "spatial_norm", "norm_cross")
SDPA = "scaled_dot_product_attention_"  # ppdiffusers' attention function (ppxformers / NPU), [B, L, H, D]
# Components ppdiffusers' own ToMe port never patches.
_PPDIFFUSERS_SKIPS = ("vae", "vqvae")


# ---------------------------------------------------------------------------------------------------------
# Size-aware attention through ppdiffusers' attention function


class _Armed:
    """One merged attention call whose ``scaled_dot_product_attention_`` calls get their keys and values merged
    (``keys``, a :class:`KernelKeys`, or None) and a size bias (``bias``, or None)."""

    def __init__(self, module: Layer, bias: Optional[SizeBias], keys: Optional[KernelKeys] = None):
        self.module = module
        self.bias = bias
        self.keys = keys
        self.calls = 0

    def arguments(self, query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor, attn_mask: Optional[paddle.Tensor]):
        """``(key, value, attn_mask)`` of one call, ``[B, L, H, D]`` inputs: keys and values merged, the mask's
        key axis with them, the size bias added."""
        self.calls += 1
        if self.keys is not None:
            key, value = (self._merged(x) for x in (key, value))
            if attn_mask is not None:
                attn_mask = self.keys.reduce_mask(attn_mask, attn_mask.ndim - 1)
        if self.bias is not None:
            attn_mask = self.mask(query, key, attn_mask)
        return key, value, attn_mask

    def _merged(self, x: paddle.Tensor) -> paddle.Tensor:
        batch, keys, heads, width = (int(n) for n in x.shape)
        if batch != self.keys.match.batch:
            raise RuntimeError(
                f"mode='kv' inside the attention: a {SDPA} call over {batch} items does not fit a batch of "
                f"{self.keys.match.batch}; pass mode='tokens'"
            )
        return self.keys.reduce(x.reshape([batch, keys, heads * width])).reshape([batch, -1, heads, width])

    def mask(self, query: paddle.Tensor, key: paddle.Tensor, attn_mask: Optional[paddle.Tensor]) -> paddle.Tensor:
        """``attn_mask`` plus the log sizes, ``[B, 1, Lq, K]`` for ``[B, L, H, D]`` inputs."""
        batch, queries, keys = int(query.shape[0]), int(query.shape[1]), int(key.shape[1])
        if query.ndim != 4 or batch != self.bias.match.batch:
            raise RuntimeError(
                f"size-aware attention: a {SDPA} call with query shape {list(query.shape)} does not fit a batch of "
                f"{self.bias.match.batch}; pass proportional_attn=False"
            )
        bias = self.bias.for_keys(keys, query).reshape([batch, 1, 1, keys]).expand([batch, 1, queries, keys])
        if attn_mask is None:
            return bias
        if attn_mask.dtype == paddle.bool:
            attn_mask = paddle.where(attn_mask, paddle.zeros([], query.dtype), paddle.full([], float("-inf"), query.dtype))
        return attn_mask.astype(query.dtype) + bias


class _SdpaWrapper:
    """Installs a wrapper of ``paddle.nn.functional.scaled_dot_product_attention_`` while any merged attention
    runs (reference-counted over threads); each thread's innermost armed call biases that thread's calls."""

    def __init__(self):
        self.lock = threading.Lock()
        self.local = threading.local()
        self.users = 0
        self.original: Any = None

    def stack(self) -> List[_Armed]:
        return vars(self.local).setdefault("stack", [])  # a threading.local's __dict__ is this thread's

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        stack = self.stack()
        if stack:
            key, value, attn_mask = stack[-1].arguments(query, key, value, attn_mask)
        return self.original(query, key, value, attn_mask, *args, **kwargs)

    def arm(self, armed: _Armed) -> bool:
        """Start biasing this thread's calls; False when paddle has no such function (the processor will
        raise its own AttributeError, as it does unpatched)."""
        with self.lock:
            if self.users == 0:
                current = getattr(F, SDPA, None)
                if current is None:
                    return False
                self.original = current
                setattr(F, SDPA, self)
            self.users += 1
        self.stack().append(armed)
        return True

    def disarm(self, module: Layer) -> Optional[_Armed]:
        stack = self.stack()
        if not stack or stack[-1].module is not module:
            return None
        armed = stack.pop()
        with self.lock:
            self.users -= 1
            if self.users == 0 and getattr(F, SDPA, None) is self:
                # ``original`` stays set: another thread may have looked the wrapper up just before this.
                setattr(F, SDPA, self.original)
        return armed

    def clear(self) -> None:
        """Disarm every call this thread armed: none is running as a patched model's call starts, so these were
        interrupted (a ``BaseException`` such as Ctrl-C skips post-hooks)."""
        for armed in reversed(list(self.stack())):
            self.disarm(armed.module)


_SDPA_WRAPPER = _SdpaWrapper()


# ---------------------------------------------------------------------------------------------------------
# The framework


class _Handle:
    """Removes one hook from the layer it was registered on; unlike paddle's handle (weak references to the
    original's tables), a deep copy of the layer copies it along."""

    TABLES = {
        "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs_flag",),
        "_forward_post_hooks": ("_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called"),
    }

    def __init__(self, layer: Layer, table: str, helper: Any):
        self.layer = layer
        self.table = table
        self.hook_id = helper._hook_id

    def remove(self) -> None:
        for name in (self.table,) + self.TABLES[self.table]:
            getattr(self.layer, name, {}).pop(self.hook_id, None)


class _Eager:
    """A hook that paddle's SOT compiler runs as ordinary Python instead of simulating it (a class, not a
    closure, so that a deep copy of a patched layer copies the hook it wraps)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Any):
        self.hook = hook

    def __call__(self, *args: Any) -> Any:
        if _psdb is not None:
            _psdb.fallback(recursive=True)
        return self.hook(*args)


def _needs_paddle_3(error: TypeError) -> RuntimeError:
    return RuntimeError(f"ToMe needs paddle >= 3.0 (layer hooks with keyword arguments), found {paddle.__version__}: {error}")


# what a Layer's call runs (its __call__, and with hooks _dygraph_call_func): frames that tell a running call
_LAYER_CALLS = frozenset(
    function.__code__ for function in (getattr(Layer, name, None) for name in ("__call__", "_dygraph_call_func"))
    if hasattr(function, "__code__")
)


class PaddleFramework(Framework):
    """paddle for :mod:`tome_core.driver`."""

    accepted = ACCEPTED

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, Layer)

    def submodules(self, module: Layer) -> List[Layer]:
        return module.sublayers(include_self=True)

    def add_pre_hook(self, module: Layer, hook: PreHook) -> _Handle:
        try:
            helper = module.register_forward_pre_hook(_Eager(hook), with_kwargs=True)
        except TypeError as error:  # paddle before 3.0
            raise _needs_paddle_3(error) from error
        return _Handle(module, "_forward_pre_hooks", helper)

    def add_post_hook(self, module: Layer, hook: PostHook) -> _Handle:
        try:
            helper = module.register_forward_post_hook(_Eager(hook), with_kwargs=True, always_call=True)
        except TypeError as error:
            raise _needs_paddle_3(error) from error
        return _Handle(module, "_forward_post_hooks", helper)

    def host_values(self, x: paddle.Tensor) -> List[float]:
        return x.numpy().reshape(-1).tolist()

    def may_run_again(self, x: paddle.Tensor) -> bool:
        return paddle.in_dynamic_mode()  # as on torch: a frozen input or a forward without gradients recomputes too

    def size_aware(self, module: Layer, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: SizeBias):
        processor = getattr(module, "processor", None)
        if type(processor).__name__ in MASK_PROCESSORS:
            return args, {**kwargs, "attention_mask": bias.for_merged_tokens()}
        _SDPA_WRAPPER.arm(_Armed(module, bias))
        return args, kwargs

    def execution(self, x: paddle.Tensor) -> Tuple[str, str]:
        place = getattr(x, "place", None)  # None on a static-graph variable (paddle.jit's AST mode)
        cpu = place.is_cpu_place() if place is not None else paddle.device.get_device().startswith("cpu")
        return "cpu" if cpu else "gpu", "eager" if paddle.in_dynamic_mode() else "compiled"

    def clear_interrupted(self) -> None:
        _SDPA_WRAPPER.clear()

    def running(self, module: Layer) -> bool:
        return call_running(module, _LAYER_CALLS)

    def kernel_keys_problem(self, module: Layer) -> Optional[str]:
        return unreachable_kernel(getattr(module, "processor", None), MASK_PROCESSORS, "ppdiffusers", (SDPA,))

    def kernel_keys(self, module: Layer, args: Tuple[Any, ...], kwargs: Dict[str, Any], keys: KernelKeys, bias: Optional[SizeBias] = None):
        _SDPA_WRAPPER.arm(_Armed(module, bias, keys))
        return args, kwargs

    def bias_problem(self, module: Layer) -> Optional[str]:
        return unbiased_processor(getattr(module, "processor", None), MASK_PROCESSORS, "ppdiffusers", (SDPA,))

    def separate_kv(self, module: Layer) -> bool:
        if type(getattr(module, "processor", None)).__name__ not in SEPARATE_KV_PROCESSORS:
            return False
        return all(getattr(module, name, None) is None for name in _ONE_SIDED_NORMS)

    def size_aware_done(self, module: Layer, computed: bool = True) -> None:
        armed = _SDPA_WRAPPER.disarm(module)
        if not computed or armed is None or armed.calls > 0:  # computed is False also when the attention raised
            return
        if armed.keys is not None:
            raise RuntimeError(
                f"mode='kv' inside the attention: the attention processor {type(getattr(module, 'processor', None)).__name__} "
                f"of a merged attention computes attention without paddle.nn.functional.{SDPA}, so its keys could not "
                "be merged; pass mode='tokens'"
            )
        raise RuntimeError(
            f"proportional_attn=True: the attention processor {type(getattr(module, 'processor', None)).__name__} "
            f"of a merged attention computes attention without paddle.nn.functional.{SDPA} or a whole-batch "
            "attention_mask, so the merged tokens' sizes cannot reach it; pass proportional_attn=False"
        )

    def inform(self, message: str) -> None:
        """Log ``message`` at info level under ppdiffusers' logger, which ``ppdiffusers.utils.logging.set_verbosity_info()``
        shows (Python's logger "tome_core" for a paddle model without ppdiffusers installed)."""
        try:
            from ppdiffusers.utils import logging as ppdiffusers_logging
        except ImportError:
            logging.getLogger("tome_core").info(message)
            return
        ppdiffusers_logging.get_logger("ppdiffusers.tome_core").info(message)


FRAMEWORK = PaddleFramework()


# ---------------------------------------------------------------------------------------------------------
# ppdiffusers' own ToMe port


def _drop_hook(layer: Layer, hook: Any) -> None:
    """Drop one of ppdiffusers' port's hooks from ``layer``; by id, which also works on a deep copy."""
    if getattr(layer, "_forward_pre_hooks", {}).pop(getattr(hook, "_hook_id", None), None) is None:
        hook.remove()


def _undo(layer: Layer) -> None:
    """Everything :func:`remove` undoes on one layer: our patch and ppdiffusers' port."""
    driver.detach(layer)
    driver.undo_tomesd(layer, _drop_hook)


def ppdiffusers_targets(obj: Any) -> List[Layer]:
    """The layers ppdiffusers' own ``apply_tome`` walks in ``obj`` (every component but the VAE), which it asks
    ``obj.remove_tome(only_return_self=False)`` for: :mod:`tome_core.paddle`'s methods return it."""
    if isinstance(obj, Layer):
        return [obj]
    return [
        layer
        for name, component in obj.components.items()
        if name not in _PPDIFFUSERS_SKIPS
        for layer in (component if isinstance(component, (list, tuple)) else [component])
        if isinstance(layer, Layer)
    ]


# ---------------------------------------------------------------------------------------------------------
# Entry points


def _refuse_fused_models(obj: Any) -> None:
    """Models built with ppdiffusers' ``INFERENCE_OPTIMIZE=True`` run one fused layer (``SimplifiedSD3``,
    ``SimplifiedFacebookDIT``) in place of their transformer blocks: hooks on the blocks would never run."""
    for component in components(FRAMEWORK, obj):
        for layer in FRAMEWORK.submodules(component):
            if getattr(layer, "inference_optimize", False) is True:
                raise ValueError(
                    f"cannot patch {type(layer).__qualname__} built with INFERENCE_OPTIMIZE=True: ppdiffusers then runs "
                    "a fused layer in place of the transformer blocks that ToMe merges in; build it without "
                    "INFERENCE_OPTIMIZE"
                )


# Model classes that merge on torch but not yet here, with the reason ``patch`` gives (the shared table of
# refusals, :data:`tome_core.models.model_zoo.REFUSED`, holds the classes refused everywhere).
_INSIDE = (
    "merge inside the attention, at its query, key and value projections; on torch this is tested against the "
    "unpatched model, while ppdiffusers' processors would size their attention mask and proportional attention "
    "from the unmerged input there"
)
NOT_ON_PADDLE: Dict[str, str] = {
    "UNet2DModel": "not supported on paddle yet: its attention layers (group norm and residual inside each Attention) " + _INSIDE,
    "Kandinsky3UNet": (
        "not supported on paddle yet: its attention blocks (Kandinsky3AttentionBlock, on the feature map, with "
        "ppdiffusers' own Kandi3AttnProcessor) " + _INSIDE
    ),
}


def _refuse_unsupported_models(obj: Any) -> None:
    """Refuse a model (or a pipeline holding one) of a class listed in :data:`NOT_ON_PADDLE`, with its reason;
    by exact class name or that of its nearest listed base class."""
    for component in components(FRAMEWORK, obj):
        listed = next((NOT_ON_PADDLE[c.__name__] for c in type(component).__mro__ if c.__name__ in NOT_ON_PADDLE), None)
        if listed is not None:
            raise ValueError(f"ToMe cannot patch {type(component).__qualname__}: {listed}")


def _static_parameters(program: Any) -> List[Any]:
    """The parameters (and buffers) a ``to_static`` concrete program holds: a list, or with PIR a pair
    ``(tensors, values)``."""
    parameters = getattr(program, "parameters", None) or []
    if isinstance(parameters, tuple) and len(parameters) == 2 and all(isinstance(p, list) for p in parameters):
        return parameters[0]
    return list(parameters)


def _drop_static_programs(obj: Any) -> int:
    """Clear the cached programs of every ``paddle.jit.to_static(..., full_graph=True)`` function that traced a
    parameter of ``obj``'s layers, so that its next call traces the hooks as they are now; returns how many."""
    if _ASTStaticFunction is None:
        return 0
    ours = {id(t) for layer in components(FRAMEWORK, obj) for t in (*layer.parameters(), *layer.buffers())}
    if not ours:
        return 0
    cleared = 0
    for candidate in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which raises on a weakref.proxy to a dead object
        if not issubclass(type(candidate), _ASTStaticFunction):
            continue
        cache = getattr(candidate, "_program_cache", None)
        if cache is None or not len(cache):
            continue
        if any(id(t) in ours for program in cache.concrete_programs() for t in _static_parameters(program)):
            cache.clear()
            cleared += 1
    return cleared


def patch(obj: Any, **options: Any) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options (and
    ppdiffusers' own port)."""
    _refuse_fused_models(obj)
    _refuse_unsupported_models(obj)
    driver.patch(FRAMEWORK, obj, options, undo=_undo)
    _drop_static_programs(obj)
    return obj


document(patch, """
obj: a ppdiffusers pipeline (every UNet, ControlNet and diffusion transformer it holds: SD 1.x/2.x/XL, SD3,
DiT) or one such model. A model it cannot handle is refused here with an error saying why.
""")


def remove(obj: Any) -> Any:
    """Undo :func:`patch`, or ppdiffusers' own ``apply_tome``, in place (a no-op when unpatched); return ``obj``."""
    patched = bool(driver.patched_models(FRAMEWORK, obj, "remove"))
    driver.remove(FRAMEWORK, obj, undo=_undo)
    if patched:
        _drop_static_programs(obj)
    return obj


def patched_models(obj: Any) -> List[Tuple[Layer, ToMeState]]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call)."""
    return driver.patched_models(FRAMEWORK, obj)
