"""What the driver asks of a framework (:class:`Framework`, and the hooks it registers), and how a module's
call is read: its arguments by name or position, and the names models give the arguments a call is read by.
Framework-free."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Collection, Dict, List, Optional, Protocol, Sequence, Tuple

from .shards import Shards


REUSED = "reused"  # an output cache that hands back the same object it stored
PreHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]]
PostHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any], Any], Any]


class Framework(Protocol):
    """What an adapter tells the driver about its framework. An adapter subclasses it; a framework without output
    caches, context parallelism, recomputation or interruptible arming keeps the defaults."""

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

    def size_aware(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Make ``module``'s attention add ``bias`` (a ``SizeBias``) to its logits during this call; returns its
        arguments."""

    def kernel_keys(
        self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], keys: Any, bias: Any = None
    ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Make ``module``'s attention kernel take its keys and values merged by ``keys`` (a ``KernelKeys``) during this
        call, adding ``bias`` (a ``SizeBias``, or None) over the merged keys; returns its arguments."""

    def kernel_keys_problem(self, module: Any) -> Optional[str]:
        """Why :meth:`kernel_keys` cannot reach ``module``'s attention (its processor now), or None."""

    def size_aware_done(self, module: Any, computed: bool) -> None:
        """The call armed by :meth:`size_aware` or :meth:`kernel_keys` has returned (``computed`` False: an output
        cache returned a stored output instead)."""

    def execution(self, x: Any) -> Tuple[str, str]:
        """Where and how a call on ``x`` runs (:mod:`tome_core.models.cost`): ``"cpu"`` or ``"gpu"`` (any accelerator),
        and ``"eager"``, ``"captured"`` (in a CUDA graph) or ``"compiled"`` (while a compiler traces)."""

    def clear_interrupted(self) -> None:
        """Undo the arming (:meth:`size_aware`) that attention calls interrupted by a ``BaseException`` (Ctrl-C) left,
        their post-hooks not run; called as each patched model's call starts, and by ``remove``."""
        return None

    def bias_problem(self, module: Any) -> Optional[str]:
        """Why ``module``'s attention (its processor now) cannot add a size bias to its logits, or None (it can, or
        its code does not tell)."""

    def separate_kv(self, module: Any) -> bool:
        """Whether ``module``'s attention (its processor now) computes keys and values from its ``kv_input``
        argument when one is given (the ``kv`` and ``queries`` arrangements need it)."""

    def may_run_again(self, x: Any) -> bool:
        """Whether a block called on ``x`` may be run again on the same ``x`` (or a copy of its data) after its model's
        call returned (gradient checkpointing): true in eager code, whether or not anything records gradients."""
        return False

    def shards(self, model: Any) -> Optional[Shards]:
        """How context parallelism splits ``model``'s tokens now (None: it does not)."""
        return None

    def same_data(self, a: Any, b: Any) -> bool:
        """Whether ``b`` is ``a``'s data under another array object (a detached copy), ``a`` being alive or None."""
        return False

    def output_cache(self, module: Any) -> Optional[str]:
        """How another library caches ``module``'s output across calls: None, ``REUSED`` (the very output object of an
        earlier call), or a ValueError naming a cache that builds new outputs from earlier ones (merged otherwise)."""
        return None

    def running(self, module: Any) -> bool:
        """Whether a call of ``module`` is running now (:func:`call_running`): a hook inside it may call ``patch``."""

    def inform(self, message: str) -> None:
        """Tell the user ``message`` through this framework's library's logger, at info level (a word the user can act
        on, not a warning: :attr:`Ledger.inform <tome_core.hooks.ledger.Ledger.inform>`)."""


def call_running(module: Any, codes: Collection[Any]) -> bool:
    """Whether a frame of a module-call function (its code one of ``codes``) called on ``module`` is on the stack.
    Read only by ``patch`` and ``remove``, never by a hook."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def argument(args: Sequence[Any], kwargs: Dict[str, Any], name: str, position: Optional[int]) -> Any:
    """The argument ``name`` of a call: by keyword, else positional at ``position``; None where it was not passed."""
    if name in kwargs:
        return kwargs[name]
    if position is not None and len(args) > position:
        return args[position]
    return None


def arguments(
    args: Sequence[Any], kwargs: Dict[str, Any], wanted: Sequence[Tuple[Optional[str], Optional[int]]]
) -> Tuple[Any, ...]:
    """Several arguments of one call, each ``(name, position)`` of ``wanted`` read as :func:`argument` reads it, in
    one pass with no call per argument (an eager GPU call is bound by its hooks' host time)."""
    return tuple([
        kwargs[name] if name in kwargs else args[position] if position is not None and len(args) > position else None
        for name, position in wanted
    ])


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


# what models call their timestep argument (HiDream, Z-Image; Stable Cascade's ratio in [0, 1])
TIMESTEPS = ("timestep", "timesteps", "t", "timestep_ratio")
# what models call the ids of their packed tokens; Krea 2's cover [text; image], the image's rows last
TOKEN_IDS = ("img_ids", "position_ids")
# what models call the per-item (frames, h, w) of the images in their token sequence, the output's first (Qwen-Image's
# packed tokens; JoyImage-Edit-Plus's patches [B, N, C, pt, ph, pw], padded after its references)
SHAPE_LISTS = ("img_shapes", "shape_list")
