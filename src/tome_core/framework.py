"""What the driver asks of a framework (:class:`Framework`), and how it reads a module's call: its
arguments by name or position, its timestep on the host, what kind of model it is, whether its attention can
take keys apart from its queries. Framework-free."""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .backend import get_ops
from .families import Sublayer, TEXT_NONE, attends_text_only, model_layout, text_follows
from .match import Match
from .merge import size_bias
from .shards import Shards


REUSED = "reused"  # an output cache that hands back the same object it stored
PreHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]]
PostHook = Callable[[Any, Tuple[Any, ...], Dict[str, Any], Any], Any]


class Framework(Protocol):
    """What an adapter tells the driver about its framework."""

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

    def size_aware(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], bias: "SizeBias") -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Make ``module``'s attention add ``bias`` to its logits during this call; returns its arguments."""

    def size_aware_done(self, module: Any, computed: bool) -> None:
        """The call of ``module`` armed by :meth:`size_aware` has returned; ``computed`` is False when an
        output cache returned a stored output instead of running attention."""

    def execution(self, x: Any) -> Tuple[str, str]:
        """Where and how a call on ``x`` runs, as :mod:`tome_core.cost` tells them apart: the device (``"cpu"`` or
        ``"gpu"``, any accelerator) and the execution (``"eager"``, ``"captured"`` in a CUDA graph, or ``"compiled"``
        while a compiler traces)."""

    def clear_interrupted(self) -> None:
        """Undo what attention calls interrupted by a ``BaseException`` other than ``Exception`` (Ctrl-C) left in
        the process: post-hooks do not run then (:meth:`size_aware`'s arming). Called as each patched model's call
        starts, and by ``remove``."""

    def bias_problem(self, module: Any) -> Optional[str]:
        """Why ``module``'s attention (its processor now) cannot add a size bias to its logits, or None (it
        can, or its processor's code does not tell): checked at ``patch`` where size-aware attention applies."""

    def separate_kv(self, module: Any) -> bool:
        """Whether ``module``'s attention (its processor now) computes keys and values from its ``kv_input``
        argument when one is given (the ``kv`` and ``queries`` arrangements need it)."""

    def may_run_again(self, x: Any) -> bool:
        """Whether a block called on ``x`` may be run again on the very same ``x`` (or on a copy of its data) in the
        backward pass, after its model's call returned (gradient checkpointing recomputes it then): true in eager
        code, whether or not ``x`` or the forward records gradients (a LoRA's frozen input; reentrant checkpointing
        runs its forward without them)."""

    def shards(self, model: Any) -> Optional[Shards]:
        """How context parallelism splits ``model``'s tokens now (None: it does not)."""

    def same_data(self, a: Any, b: Any) -> bool:
        """Whether ``b`` is ``a``'s data under another array object (a detached copy), ``a`` being alive or None."""

    def output_cache(self, module: Any) -> Optional[str]:
        """How another library caches ``module``'s output across calls: None (it does not), ``REUSED`` (it
        returns the very output object of an earlier call), or raises ValueError naming a cache that builds
        new outputs from earlier ones (those were merged by other matches)."""


class SizeBias:
    """Log sizes of one sub-layer's keys: merged image keys get ``log(size)``, text keys 0.

    ``text`` says where the text keys sit (``TEXT_*``); :meth:`for_keys` builds the ``[B, 1, K]`` bias for an
    attention over ``K`` keys, or raises if ``K`` does not fit.
    """

    def __init__(self, match: Match, text: str, like: Any, tail: int = 0, head: int = 0, whole_mask: bool = True):
        self.match = match
        # whether an attention_mask over the merged tokens can carry it: not where the attention merges inside
        # itself (Sublayer.projections), since it sizes its masks from its unmerged input
        self.whole_mask = whole_mask
        self.text = text
        self.like = like  # the merged tokens: the dtype of the mask
        self.tail = tail  # unmerged tokens of other images right after the merged ones (size 1, bias 0)
        self.head = head  # and right before them (FramePack's history)

    def for_merged_tokens(self) -> Any:
        """The bias as a whole-batch additive ``attention_mask`` over the merged tokens (self-attention)."""
        return self.for_keys(self.head + self.match.kept + self.tail, self.like)

    def for_keys(self, keys: int, like: Any) -> Any:
        """``[B, 1, keys]``: the log sizes where the merged image keys sit, 0 for text, head and tail keys."""
        ops = get_ops(like)
        match = self.match
        sizes = size_bias(match, like)
        if self.head and keys <= self.head:  # an attention over (leading) head tokens alone (Flux.2 Klein KV's extract
            return ops.zeros((match.batch, 1, keys), like)  # step, Qwen-Image 2.1's prefix segments): each of size 1
        text = keys - self.head - match.kept - self.tail
        if text < 0 or (text and self.text == TEXT_NONE):
            raise RuntimeError(
                f"size-aware attention: the attention has {keys} keys but the merged sequence has "
                f"{self.head + match.kept + self.tail} tokens; pass proportional_attn=False"
            )
        zeros = lambda count: [ops.zeros((match.batch, 1, count), like)] if count else []  # noqa: E731
        if text_follows(self.text):  # [head; image; tail; text]
            parts = [*zeros(self.head), sizes, *zeros(self.tail + text)]
        else:  # [text; head; image; tail]
            parts = [*zeros(text + self.head), sizes, *zeros(self.tail)]
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis=2)


def argument(args: Sequence[Any], kwargs: Dict[str, Any], name: str, position: Optional[int]) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position is not None and len(args) > position:
        return args[position]
    return None


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


def unbiased_processor(processor: Any, trusted: Sequence[str], library: str, functions: Sequence[str]) -> Optional[str]:
    """Why an attention ``processor`` cannot take a size bias, judged from its classes' code: when none of its
    classes is ``trusted`` by name or comes from the ``library`` (whose processors take it through an
    attention mask or the attention ``functions`` the adapter biases) and none of their code names one of
    ``functions``. None when it can, or when its code cannot be read."""
    classes = [cls for cls in type(processor).__mro__ if cls is not object]
    if not classes or any(cls.__name__ in trusted or cls.__module__.split(".")[0] == library for cls in classes):
        return None
    try:
        sources = [inspect.getsource(cls) for cls in classes]
    except (OSError, TypeError):
        return None
    if any(name in source for source in sources for name in functions):
        return None
    return f"processor {type(processor).__name__} computes attention without {' or '.join(functions)} (read from its code)"


def arrangement_problem(fw: Framework, block: Any, sublayer: Sublayer, module: Any) -> Optional[str]:
    """Why a self-attention cannot run the ``kv`` or ``queries`` arrangement now (None: it can): they hand it
    keys and values apart from its queries, through its ``kv_input``."""
    where = lambda: f"{type(block).__name__}.{sublayer.child}"  # noqa: E731 (formatted only for a problem)
    if sublayer.projections:
        if fw.separate_kv(module):
            return None
        return (
            f"{where()}'s processor {type(getattr(module, 'processor', None)).__name__} does not run its query, key "
            f"and value projections ({', '.join(sublayer.projections[:3])}) apart, where ToMe merges"
        )
    if sublayer.kv_input is None:
        if sublayer.text != TEXT_NONE:
            return f"{where()} runs joint attention over text and image tokens"
        return f"{where()} takes no keys and values apart from its queries"
    if attends_text_only(block, sublayer):
        return f"{where()} attends to the text ({sublayer.text_if or sublayer.text_unless}={bool(sublayer.text_if)}), not to its own tokens"
    if not fw.separate_kv(module):
        processor = type(getattr(module, "processor", None)).__name__
        return (
            f"{where()}'s processor {processor} does not compute keys and values from {sublayer.kv_input} "
            "(fused projections, perturbed-attention guidance, or a processor of its own)"
        )
    return None


def arrangement_error(mode: str, where: str, problem: str) -> ValueError:
    return ValueError(
        f"mode={mode!r} needs self-attention that takes keys and values apart from its queries, and in {where} "
        f"{problem}; pass mode='tokens' there, or leave mode out (the default runs ToMe for SD's arrangement where "
        "kv cannot run)"
    )


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


def host_timesteps(fw: Optional["Framework"], timestep: Any) -> List[float]:
    """Every timestep of a call as Python numbers (0-d and 1-d, Python, numpy or framework arrays; the last
    read on the host through ``fw``)."""
    if isinstance(timestep, numbers.Number):
        return [timestep.item() if hasattr(timestep, "item") else timestep]
    if type(timestep).__module__ == "numpy":
        return timestep.reshape(-1).tolist()
    return fw.host_values(timestep)


def spatial_size(x: Any, data_format: str) -> Tuple[int, int]:
    shape = get_ops(x).shape(x)
    return (shape[1], shape[2]) if data_format == "NHWC" else (shape[-2], shape[-1])


def config_value(module: Any, name: str) -> Any:
    config = getattr(module, "config", None)
    getter = getattr(config, "get", None)
    return getter(name) if callable(getter) else getattr(config, name, None)


def is_unet_like(module: Any) -> bool:
    """UNet2DConditionModel, ControlNetModel and their kin: a ``sample`` latent in, down blocks inside."""
    return hasattr(module, "down_blocks") and hasattr(module, "conv_in")


# what models call their timestep argument (HiDream, Z-Image; Stable Cascade's ratio in [0, 1])
TIMESTEPS = ("timestep", "timesteps", "t", "timestep_ratio")
# what models call the ids of their packed tokens; Krea 2's cover [text; image], the image's rows last
TOKEN_IDS = ("img_ids", "position_ids")
# what models call the per-item (frames, h, w) of the images in their token sequence, the output's first (Qwen-Image's
# packed tokens; JoyImage-Edit-Plus's patches [B, N, C, pt, ph, pw], padded after its references)
SHAPE_LISTS = ("img_shapes", "shape_list")


def is_transformer_model(module: Any) -> bool:
    """A diffusion transformer (SD3, Flux, PixArt, DiT, their ControlNets): a config with a patch size, a class
    whose call :class:`~tome_core.families.GridLayout` describes, or one whose call takes its tokens' ids."""
    if is_unet_like(module):
        return False
    if config_value(module, "patch_size") is not None or model_layout(type(module)).video is not None:
        return True
    forward = getattr(type(module), "forward", None)
    return forward is not None and any(p in inspect.signature(forward).parameters for p in TOKEN_IDS)
