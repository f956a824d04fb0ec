"""Patch diffusers (torch) models and pipelines: torch's module hooks under :mod:`tome_core.driver`.

The driver finds the models, reads :mod:`tome_core.models.families` and attaches its hooks through
:class:`TorchFramework`: no forward is copied or replaced, classes and state dicts stay as they were, and
:func:`remove` detaches every hook.

Size-aware attention (``proportional_attn``) reaches the attention by the module's processor at each call (so
processors set after ``patch`` work): those that score with a whole-batch ``attention_mask``
(:data:`MASK_PROCESSORS`) get the log sizes as that mask; every other one (SDPA, joint, PAG, user processors), and
an attention whose own code computes it (:data:`~tome_core.models.families.OWN_ATTENTIONS`: ldm's
``CrossAttention``), runs under an :class:`_AttentionMode` that adds them to the ``attn_mask`` of each of its
``scaled_dot_product_attention`` calls (or to the scores of its own softmax). One that never calls SDPA while
armed gets a clear error after its call, never a silent plain softmax.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.callback import callback_handler, on_compile_start
from torch._dynamo.eval_frame import OptimizedModule
from torch.overrides import TorchFunctionMode

from tome_core import driver
from tome_core.adapters import processors
from tome_core.hooks.attention_bias import SizeBias, unbiased_processor, unreachable_kernel
from tome_core.algorithm.backend import get_ops
from tome_core.hooks.block_hooks import KernelKeys
from tome_core.config import document
from tome_core.models.families import own_attention
from tome_core.framework import Framework, PostHook, PreHook, REUSED, call_running
from tome_core.models.model_tree import blocks_of, find_models
from tome_core.shards import Shards
from tome_core.hooks.state import ToMeState

ACCEPTED = (
    "a diffusers DiffusionPipeline or one of its models (UNet, ControlNet or diffusion transformer: docs/models.md "
    "lists every class), a torch.nn.Module holding diffusers transformer blocks, or an ldm UNetModel (A1111, sdkit)"
)
# Processors that build their attention scores from a whole-batch ``attention_mask`` without calling SDPA.
MASK_PROCESSORS = processors.CLASSIC | processors.MASKED_TWINS
# Processors that compute keys and values from ``encoder_hidden_states`` when a self-attention is given one
# (the ``kv`` and ``queries`` arrangements hand it the tokens to attend to there). Not the fused processor: a
# fused self-attention has one query-key-value projection and no separate key-value one.
SEPARATE_KV_PROCESSORS = processors.CLASSIC | {"AttnProcessor2_0", "AttnProcessorNPU"}
_SDPA_CALLS = ("scaled_dot_product_attention", "dispatch_attention_fn")  # what an SDPA processor's code calls

# diffusers' caching hooks (diffusers.hooks) on an attention module: those that hand back the stored output
# object, and those that extrapolate new outputs from stored ones.
REUSING_CACHES = frozenset({"pyramid_attention_broadcast"})
EXTRAPOLATING_CACHES = frozenset({"taylorseer_cache", "faster_cache_block"})


def _tgate_hands_back_cache(module: torch.nn.Module) -> bool:
    """Whether T-GATE (tgate 1.0) replaced ``module.forward`` by one that returns its cached output now."""
    forward = module.__dict__.get("forward")
    if ".warp_custom.<locals>.forward" not in getattr(forward, "__qualname__", "") or module.__dict__.get("cache") is None:
        return False
    flag = "ca_reuse" if getattr(module, "is_cross_attention", False) else "sa_reuse"
    parameter = inspect.signature(forward).parameters.get(flag)
    return bool(parameter is not None and parameter.default)


_STALE = object()  # the owner of a size-bias mode whose attention call was interrupted


def _call_frame() -> Any:
    """The frame of the innermost module call now running (``nn.Module._call_impl``): from a pre-hook, the call of
    the module it hooks."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return frame


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def drop_stale_modes() -> None:
    """Take the size-bias modes of interrupted attention calls (:meth:`_AttentionMode.live`) off torch's function
    mode stack, the others staying in order; not in traced code (:func:`_drop_stale_before_compiling` did it)."""
    if not torch.compiler.is_compiling():
        _drop_stale()


def _drop_stale_before_compiling(_: Any) -> None:
    """Drop the modes of interrupted attention calls before dynamo traces a frame (a leftover mode breaks every
    compile's graph); registered by each eager arming (:func:`_enter_mode`), as ``torch._dynamo.reset()`` clears it."""
    _drop_stale()


def _drop_stale() -> None:
    if not torch._C._len_torch_function_stack():
        return
    stack = torch.overrides._get_current_function_mode_stack()
    if not any(isinstance(mode, _AttentionMode) and (mode.owner is _STALE or not mode.live()) for mode in stack):
        return
    popped = [torch._C._pop_torch_function_stack() for _ in stack]  # innermost first
    for mode in reversed(popped):
        if not (isinstance(mode, _AttentionMode) and mode.owner is _STALE):
            torch._C._push_on_torch_function_stack(mode)


# the softmax calls through which an attention that computes its scores itself (OWN_ATTENTIONS) normalises them
_SOFTMAX = frozenset({torch.Tensor.softmax, torch.softmax, F.softmax})


class _AttentionMode(TorchFunctionMode):
    """While active, merges the keys and values of the armed attention's SDPA calls by ``keys`` (a
    :class:`~tome_core.hooks.block_hooks.KernelKeys`) and adds ``bias`` (a
    :class:`~tome_core.hooks.attention_bias.SizeBias`) over them; with ``softmax``, adds the bias to the scores of
    each softmax over the keys that the attention's own code calls instead. Under Ulysses context parallelism
    (``group``) each process's bias over its own keys is gathered in process order, as diffusers gathers the keys."""

    def __init__(
        self, bias: Optional[SizeBias], group: Any = None, owner: Any = None, keys: Optional[KernelKeys] = None,
        processor: Any = None, softmax: bool = False,
    ):
        super().__init__()
        self.processor = processor  # the attention's processor, which may itself be a module it calls
        self.bias = bias
        self.softmax = softmax
        self.keys = keys
        self.group = group
        self.calls = 0
        self.offset = 0  # first batch item of the next partial-batch call
        # the frame of the armed attention module's call (None in compiled code): while it runs, the mode is live
        self.owner = owner

    def live(self) -> bool:
        """Whether the attention call that armed this mode is still running: not after a ``BaseException`` such as
        Ctrl-C escaped it (torch runs post-hooks after ``Exception`` only), when it passes every call through."""
        return self._caller() is not _STALE

    def owns_call(self) -> bool:
        """Whether a function called now is called by the armed attention's or its processor's code, not by a
        module it calls (whose calls pass through); in compiled code, which has no frames, every call is."""
        return self._caller() is None

    def _caller(self) -> Any:
        """None where the innermost module call running now is the armed attention's (or its processor's), the
        frame of that other module call where it is not, ``_STALE`` where the attention's call has ended."""
        if self.owner is None:
            return None
        if self.owner is _STALE:
            return _STALE
        frame, inner = sys._getframe(2), None
        while frame is not None:
            if frame is self.owner:
                return inner
            if inner is None and frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is not self.processor:
                inner = frame
            frame = frame.f_back
        self.owner = _STALE  # and the frame, with its tensors, is let go
        return _STALE

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.unflatten:
            return _unflatten(*args, **kwargs)
        if self.softmax and func in _SOFTMAX and self.owns_call():
            args, kwargs = self._biased_scores(*args, **kwargs)
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self.owns_call() and self._own_call(args, kwargs):
            # query, key, value and attn_mask by name; every other argument passes as it came
            named = dict(zip(("query", "key", "value", "attn_mask"), args))
            kwargs.update(named)
            rest, positional_mask = tuple(args[4:]), len(args) > 3
            query, mask = kwargs["query"], kwargs.pop("attn_mask", None)
            first = self._first_item(query, (self.keys or self.bias).match.batch)
            if self.keys is not None:
                kwargs["key"], kwargs["value"] = (self._merged(kwargs[name], first) for name in ("key", "value"))
                if mask is not None:
                    mask = self.keys.reduce_mask(mask, mask.dim() - 1)
            if self.bias is not None:
                bias = self._rows(self._for_keys(kwargs["key"].shape[-2], query), query, first)
                if mask is not None and mask.dtype == torch.bool:
                    mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(~mask, float("-inf"))
                mask = bias if mask is None else mask + bias
            self.calls += 1
            qkv = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
            if positional_mask:
                return func(*qkv, mask, *rest, **kwargs)
            return func(*qkv, **kwargs, **({} if mask is None else {"attn_mask": mask}))
        return func(*args, **kwargs)

    def _biased_scores(self, scores: torch.Tensor, dim: Any = None, *rest: Any, **kwargs: Any) -> Tuple[Any, ...]:
        """The arguments of a softmax call over ``scores`` ``[B*heads, L, K]`` (or ``[B, heads, L, K]``), the bias
        added where it runs over the keys (the last axis) and they can hold the merged image tokens."""
        dim = kwargs.pop("dim", dim)
        if dim in (-1, scores.dim() - 1) and self.bias.holds_image(scores.shape[-1]):
            bias = self._for_keys(scores.shape[-1], scores)
            scores = scores + self._rows(bias, scores, self._first_item(scores, self.bias.match.batch))
            self.calls += 1
        return (scores, dim, *rest), kwargs

    def _own_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether an SDPA call is the armed attention's own (:func:`~tome_core.hooks.attention_bias.own_call`, from its query
        and key counts): any other passes through unchanged."""
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        return (self.keys or self.bias).own_call(query.shape[-2], key.shape[-2])

    def _first_item(self, query: torch.Tensor, batch: int) -> int:
        """The batch item an SDPA call with this ``query`` starts at: 0 over the whole batch (or 3-D); a 4-D call
        over part of it (PAG, Mochi item by item) goes on from where the previous partial call stopped."""
        rows = query.shape[0]
        if query.dim() != 4 or rows >= batch:
            return 0
        start = self.offset if self.offset + rows <= batch else 0
        self.offset = (start + rows) % batch
        return start

    def _merged(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """``[B, heads, K, d]`` keys or values merged along K (:class:`KernelKeys`), as ``[B, heads, K - r, d]``."""
        if x.dim() != 4:
            raise RuntimeError(
                f"mode='kv' inside the attention: an SDPA call with keys of shape {tuple(x.shape)}, not [batch, heads, "
                "keys, head_dim]; pass mode='tokens'"
            )
        batch, heads, keys, width = x.shape
        merged = self.keys.reduce(x.transpose(1, 2).reshape(batch, keys, heads * width), first)
        return merged.reshape(batch, -1, heads, width).transpose(1, 2)

    def _for_keys(self, keys: int, query: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.bias.for_keys(keys, query)
        pieces = dist.get_world_size(self.group)
        if keys % pieces:
            raise RuntimeError(
                f"size-aware attention under context parallelism: an SDPA call over {keys} keys does not hold "
                f"{pieces} equal pieces; pass proportional_attn=False"
            )
        from torch.distributed._functional_collectives import all_gather_single, wait_tensor  # traceable

        own = self.bias.for_keys(keys // pieces, query).movedim(2, 0).contiguous()  # it gathers along dim 0
        return wait_tensor(all_gather_single(own, gather_dim=0, group=self.group)).movedim(0, 2)

    def _rows(self, bias: torch.Tensor, query: torch.Tensor, first: int) -> torch.Tensor:
        """``[B, 1, K]`` shaped for an SDPA query: 4-D ``[b, heads, L, d]`` takes the call's items, from
        ``first`` (:meth:`_first_item`); 3-D ``[B*heads, L, d]`` repeats each item per head."""
        batch = bias.shape[0]
        rows = query.shape[0]
        if query.dim() == 4 and rows <= batch:
            return bias[first : first + rows, None]
        if query.dim() == 3 and rows % batch == 0:
            return bias.repeat_interleave(rows // batch, dim=0)
        raise RuntimeError(
            f"size-aware attention: an SDPA call with query shape {tuple(query.shape)} does not fit a batch of "
            f"{batch}; pass proportional_attn=False"
        )


def _enter_mode(module: torch.nn.Module, bias: Optional[SizeBias], group: Any, keys: Optional[KernelKeys] = None) -> None:
    """Arm an :class:`_AttentionMode` for the call of ``module`` now starting (:meth:`TorchFramework.size_aware_done`
    takes it off)."""
    drop_stale_modes()
    owner = None if torch.compiler.is_compiling() else _call_frame()
    if owner is not None and _drop_stale_before_compiling not in callback_handler.start_callbacks:
        on_compile_start(_drop_stale_before_compiling)
    own = own_attention(type(module))
    mode = _AttentionMode(bias, group, owner, keys, getattr(module, "processor", None), own is not None and own.softmax)
    module.__dict__["_tome_size_bias"] = mode
    mode.__enter__()


def _unflatten(x: torch.Tensor, dim: int, sizes: Any) -> torch.Tensor:
    """``x.unflatten(dim, sizes)`` as a reshape. ``Tensor.unflatten`` is Python code that ends in
    ``super().unflatten()``, which torch.compile cannot trace while a function mode is active (a graph break in
    every merged attention of Flux, Wan..., and an error under ``fullgraph=True``)."""
    if not all(isinstance(size, int) for size in sizes):  # named dimensions: torch's own code
        return torch.Tensor.unflatten(x, dim, sizes)
    dim = dim % x.dim()
    return x.reshape(*x.shape[:dim], *sizes, *x.shape[dim + 1 :])


class TorchFramework(Framework):
    """torch for :mod:`tome_core.driver`."""

    accepted = ACCEPTED

    def is_module(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def submodules(self, module: torch.nn.Module) -> List[torch.nn.Module]:
        """Without ``torch.compile``'s wrappers: hooks go on the module it compiles, whose class its code
        guards on."""
        return [m for m in module.modules() if not isinstance(m, OptimizedModule)]

    def add_pre_hook(self, module: torch.nn.Module, hook: PreHook) -> Any:
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    def add_post_hook(self, module: torch.nn.Module, hook: PostHook) -> Any:
        return module.register_forward_hook(hook, with_kwargs=True, always_call=True)

    def host_values(self, x: torch.Tensor) -> List[float]:
        if torch.compiler.is_compiling():
            # a graph break: compiled code cannot branch on a tensor's value; fullgraph=True stops here, so say why
            torch._dynamo.graph_break(msg=(
                "tome_core reads a small tensor on the host at the model's entry, a graph break: the timestep "
                "under timestep_range or reuse_steps > 1 (its value decides whether and how the call merges), or "
                "Flux's img_ids once per ids tensor (their token grid). Under torch.compile(fullgraph=True) pass "
                "the timestep as a Python number (or leave those options out), and call the model once eagerly with "
                "the same img_ids tensor before its first compiled call; or compile without fullgraph"
            ))
        return x.reshape(-1).tolist()

    def may_run_again(self, x: torch.Tensor) -> bool:
        # eager code recording gradients (non-reentrant checkpointing) or whose input needs them (reentrant
        # checkpointing); not compiled code, which traces a checkpointed block once
        return (torch.is_grad_enabled() or x.requires_grad) and not torch.compiler.is_compiling()

    def size_aware(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: SizeBias):
        processor = getattr(module, "processor", None)
        if type(processor).__name__ in MASK_PROCESSORS and bias.whole_mask:
            return args, {**kwargs, "attention_mask": bias.for_merged_tokens()}
        _enter_mode(module, bias, _ulysses_group(processor))
        return args, kwargs

    def kernel_keys(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], keys: KernelKeys, bias: Optional[SizeBias] = None):
        _enter_mode(module, bias, None, keys)  # (context parallelism is refused: kernel_keys_problem)
        return args, kwargs

    def kernel_keys_problem(self, module: torch.nn.Module) -> Optional[str]:
        own = own_attention(type(module))
        if own is not None:
            return f"{type(module).__name__} computes attention itself ({own.through}), not through scaled_dot_product_attention"
        processor = getattr(module, "processor", None)
        if getattr(getattr(processor, "_parallel_config", None), "context_parallel_config", None) is not None:
            return "its processor splits the keys across processes (context parallelism)"
        return unreachable_kernel(processor, MASK_PROCESSORS, "diffusers", _SDPA_CALLS)

    def execution(self, x: torch.Tensor) -> Tuple[str, str]:
        device = "cpu" if x.device.type == "cpu" else "gpu"
        if torch.compiler.is_compiling():
            return device, "compiled"
        captured = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return device, "captured" if captured else "eager"

    def clear_interrupted(self) -> None:
        drop_stale_modes()

    def running(self, module: torch.nn.Module) -> bool:
        return call_running(module, (_CALL_IMPL,))

    def bias_problem(self, module: torch.nn.Module) -> Optional[str]:
        own = own_attention(type(module))
        if own is not None:
            return None if own.softmax else f"{type(module).__name__} computes attention through {own.through}, which takes no bias"
        return unbiased_processor(getattr(module, "processor", None), MASK_PROCESSORS, "diffusers", _SDPA_CALLS)

    def separate_kv(self, module: torch.nn.Module) -> bool:
        own = own_attention(type(module)) is not None  # its keys and values come from its kv_input (ldm's context)
        return own or type(getattr(module, "processor", None)).__name__ in SEPARATE_KV_PROCESSORS

    def output_cache(self, module: torch.nn.Module) -> Any:
        registry = module.__dict__.get("_diffusers_hook")
        names = set(getattr(registry, "hooks", {}) or {})
        extrapolating = sorted(names & EXTRAPOLATING_CACHES)
        if extrapolating:
            raise ValueError(
                f"ToMe cannot merge {type(module).__name__} while diffusers' {extrapolating[0]} hook builds its output "
                "from outputs of earlier steps, which were merged by other matches; use FirstBlockCache, MagCache or "
                "Pyramid Attention Broadcast with ToMe, or disable that cache"
            )
        if _tgate_hands_back_cache(module):
            raise ValueError(
                f"ToMe cannot merge this {type(module).__name__}: T-GATE hands back its output cached at an earlier step, "
                "which that step's match merged; run T-GATE with sp_interval=1 (and merge_crossattn=False), or "
                "disable T-GATE"
            )
        return REUSED if names & REUSING_CACHES else None

    def same_data(self, a: Optional[torch.Tensor], b: Any) -> bool:
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a is not b and a.device == b.device
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        )

    def shards(self, model: torch.nn.Module) -> Optional[Shards]:
        """From diffusers' ``enable_parallelism`` (``model._parallel_config``), read once per config."""
        config = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)
        if config is None:
            return None
        known = model.__dict__.get("_tome_shards")
        if known is not None and known[0] is config:
            return known[1]
        mesh = config._flattened_mesh
        shards = Shards(
            count=mesh.size(), rank=dist.get_rank(mesh.get_group()),
            even=not (config.ulysses_anything or config.ring_anything), ring=config.ring_degree > 1,
            split_inside=frozenset(id(m) for m in model.modules() if m is not model and _splits_hidden_states(m)),
        )
        model.__dict__["_tome_shards"] = (config, shards)
        return shards

    def size_aware_done(self, module: torch.nn.Module, computed: bool) -> None:
        mode = module.__dict__.pop("_tome_size_bias", None)
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if not computed or mode.calls or torch.compiler.is_compiling():
            return
        processor = type(getattr(module, "processor", None)).__name__
        if mode.keys is not None:
            raise RuntimeError(
                f"mode='kv' inside the attention: the attention processor {processor} of a merged attention computes "
                "attention without torch.nn.functional.scaled_dot_product_attention (another attention backend?), so "
                "its keys could not be merged; pass mode='tokens' or use diffusers' native attention backend"
            )
        if mode.softmax:
            raise RuntimeError(
                f"proportional_attn=True: the merged attention {type(module).__name__} computed attention without a "
                "softmax over its keys, so the merged tokens' sizes could not reach it; pass proportional_attn=False"
            )
        raise RuntimeError(
            f"proportional_attn=True: the attention processor {processor} of a merged attention computes attention "
            "without torch.nn.functional.scaled_dot_product_attention or a whole-batch attention_mask, so the merged "
            "tokens' sizes cannot reach it; pass proportional_attn=False or use an SDPA processor"
        )

    def inform(self, message: str) -> None:
        """Log ``message`` at info level under diffusers' logger, which ``diffusers.utils.logging.set_verbosity_info()``
        shows."""
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.get_logger("diffusers.tome_core").info(message)


FRAMEWORK = TorchFramework()


def _ulysses_group(processor: Any) -> Any:
    """The process group of a processor's Ulysses attention (diffusers' ``enable_parallelism``), or None."""
    config = getattr(getattr(processor, "_parallel_config", None), "context_parallel_config", None)
    if config is None or config.ulysses_degree == 1:
        return None
    return config._ulysses_mesh.get_group()


def _splits_hidden_states(module: torch.nn.Module) -> bool:
    """Whether diffusers' context-parallel hook on ``module`` splits its ``hidden_states`` argument."""
    registry = module.__dict__.get("_diffusers_hook")
    for name, hook in (getattr(registry, "hooks", None) or {}).items():
        plan = getattr(hook, "metadata", None)
        if name.startswith("cp_input") and isinstance(plan, dict) and "hidden_states" in plan:
            return True
    return False


def _check_compiled_regions(obj: Any) -> None:
    """Refuse a patch that torch.compile would refuse at the first call: blocks compiled one by one share one code
    object, and once patched each compiles on its own, so more of them than ``recompile_limit`` cannot."""
    limit = torch._dynamo.config.recompile_limit
    for model in find_models(FRAMEWORK, obj):
        regions = [
            m for m in model.modules()
            if m is not model and getattr(m, "_compiled_call_impl", None) is not None and blocks_of(FRAMEWORK, m)
        ]
        if len(regions) >= limit:
            raise ValueError(
                f"{len(regions)} {type(regions[0]).__name__}s of {type(model).__name__} are compiled one by one "
                "(compile_repeated_blocks or module.compile()); once patched each compiles on its own, more "
                f"compilations of their shared code than torch._dynamo.config.recompile_limit ({limit}) allows: set it "
                "to at least "
                f"{len(regions) + 1} per patch you will make (e.g. {4 * (len(regions) + 1)}) before patching, or "
                "compile the whole model instead (torch.compile(model) compiles once per patch)"
            )


def _drop_hook(module: torch.nn.Module, handle: Any) -> None:
    """Drop one of tomesd's pre-hooks from ``module``; by id, which also works on a deep copy."""
    if module._forward_pre_hooks.pop(getattr(handle, "id", None), None) is None:
        handle.remove()


def _undo(module: torch.nn.Module) -> None:
    """Everything :func:`remove` undoes on one module: our patch and tomesd's (``tomesd.apply_patch``)."""
    driver.detach(module)
    driver.undo_tomesd(module, _drop_hook)


def patch(obj: Any, **options: Any) -> Any:
    """Apply ToMe to ``obj`` in place and return it; patching again replaces the earlier options."""
    get_ops(torch.empty(0))  # resolve the backend now: its import cannot be traced by torch.compile later
    _check_compiled_regions(obj)
    driver.patch(FRAMEWORK, obj, options, undo=_undo)
    for model, _ in driver.patched_models(FRAMEWORK, obj):  # each attention class is looked up now, not in a trace
        for module in model.modules():
            own_attention(type(module))
    return obj


document(patch, """
obj: a diffusers pipeline (every UNet, ControlNet and diffusion transformer it holds: SD 1.x/2.x/XL, SD3/3.5,
Flux, PixArt, DiT, and the video UNets of AnimateDiff, SVD and text-to-video, whose spatial blocks merge per
frame and whose temporal blocks are never merged) or one such model. A model it cannot handle is refused here
with an error saying why.
""")


def remove(obj: Any) -> Any:
    """Undo :func:`patch` in place (a no-op on an unpatched object) and return ``obj``."""
    return driver.remove(FRAMEWORK, obj, undo=_undo)


def patched_models(obj: Any) -> List[Tuple[torch.nn.Module, ToMeState]]:
    """The patched models inside ``obj`` with their run state (its ``stats`` describe the last call)."""
    return driver.patched_models(FRAMEWORK, obj)
