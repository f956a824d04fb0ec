"""What a model holds, read through a :class:`~tome_core.framework.Framework`: its blocks of a known family, their
levels and grids, the models inside a pipeline, and what kind of model one is. Framework-free."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..framework import TOKEN_IDS, Framework, argument_positions, forward_of
from .families import (
    BlockFamily, CHANNELS_LAST_GRID_CONTAINERS, GRID_CONTAINERS, UNetPath, block_family, child_at, model_layout,
    named, temporal,
)
from .levels import finest_attention_level


def temporal_modules(fw: Framework, model: Any) -> set:
    """The ids of the modules inside ``model`` that attend across frames (``families.TEMPORAL``)."""
    return _held(fw, model, lambda module: (
        None if temporal(type(module)) is None else temporal(type(module)).children or ("",)
    ))


def _held(fw: Framework, model: Any, paths: Callable[[Any], Optional[Tuple[str, ...]]]) -> set:
    """The ids of everything under the children ``paths(module)`` names (``""``: the module itself) of each module
    inside ``model`` for which it names any."""
    inside: set = set()
    for module in fw.submodules(model):
        named = None if id(module) in inside else paths(module)
        for root in (child_at(module, path) for path in named or ()):
            if root is not None and fw.is_module(root):
                inside.update(id(sub) for sub in fw.submodules(root))
    return inside


def blocks_of(fw: Framework, model: Any) -> List[Tuple[Any, BlockFamily]]:
    """The spatial transformer blocks of a known family inside ``model``, in module order (their stream index; in an
    ``ldm`` UNet, :attr:`~tome_core.models.families.UNetPath.counted`'s). Temporal and text-only blocks are left
    out: they never merge and count in no block index, level or statistic."""
    found = []
    skip = temporal_modules(fw, model) | _held(fw, model, lambda module: model_layout(type(module)).text_only or None)
    path = model_layout(type(model)).unet
    modules = fw.submodules(model) if path is None else [
        module for name in path.counted if fw.is_module(getattr(model, name, None))
        for module in fw.submodules(getattr(model, name))
    ]
    for module in modules:
        family = block_family(type(module), type(model))
        if family is not None and id(module) not in skip:
            found.append((module, family))
    return found


def finest_level(fw: Framework, model: Any, blocks: Optional[Sequence[Tuple[Any, BlockFamily]]] = None) -> int:
    """Downsample factor of a UNet's finest level with attention; 1 for transformers. Stable Cascade's UNet counts
    the ``down_downscalers`` that halve the grid before its first level with attention. ``blocks``:
    :func:`blocks_of`'s, where already read."""
    attending = lambda: {  # noqa: E731
        id(block) for block, family in (blocks_of(fw, model) if blocks is None else blocks)
        for sublayer in family.sublayers if sublayer.kind == "attn" and fw.is_module(child_at(block, sublayer.child))
    }
    path = model_layout(type(model)).unet
    if path is not None:
        ids = attending()
        levels = _path_levels(fw, model, path)
        down = [levels[id(m)] for m in fw.submodules(getattr(model, path.parts[0])) if id(m) in ids]
        return min(down) if down else max(levels.values(), default=1)
    downscalers = getattr(model, "down_downscalers", None)
    if not is_unet_like(model) and downscalers is not None and hasattr(model, "down_blocks"):
        ids, factor = attending(), 1
        for down, downscaler in zip(model.down_blocks, downscalers):
            factor *= 2 if _halves(fw, downscaler) else 1
            if any(id(m) in ids for m in fw.submodules(down)):
                return factor
        return factor
    if not is_unet_like(model):
        return 1
    ids = attending()
    return finest_attention_level([any(id(m) in ids for m in fw.submodules(down)) for down in model.down_blocks])


def _halves(fw: Framework, module: Any) -> bool:
    """Whether a resampling module halves the grid: it holds a stride-2 convolution or a 0.5x interpolation."""
    return any(
        getattr(m, "stride", None) in (2, (2, 2)) or getattr(m, "scale_factor", None) in (0.5, (0.5, 0.5))
        for m in fw.submodules(module)
    )


def block_levels(
    fw: Framework, model: Any, blocks: Optional[Sequence[Tuple[Any, BlockFamily]]] = None
) -> List[Optional[int]]:
    """The level (downsample factor) of each block of :func:`blocks_of`: 1 in a diffusion transformer (or after a
    ``grid_source`` child); in a UNet, doubled after each down block that downsamples and halved after each up
    block that upsamples; ``None`` where the model does not tell (blocks on a feature map outside a UNet, UNets
    that resample inside their ResNets), whose merges then follow each block's grid. ``blocks``: as
    :func:`finest_level`'s."""
    blocks = blocks_of(fw, model) if blocks is None else blocks
    if not is_unet_like(model):
        one = is_transformer_model(model) or model_layout(type(model)).grid_source is not None  # one grid: the model's tokens
        return [1 if one and not family.feature_map else None for _, family in blocks]
    path = model_layout(type(model)).unet
    if path is not None:
        levels = _path_levels(fw, model, path)
        return [levels.get(id(block)) for block, _ in blocks]
    if not any(hasattr(down, "downsamplers") for down in model.down_blocks):
        return [None for _ in blocks]
    level: Dict[int, int] = {}
    factor = 1
    path = [(down, "downsamplers") for down in model.down_blocks]
    middle = getattr(model, "mid_block", None)
    path += [(middle, None)] if middle is not None else []
    path += [(up, "upsamplers") for up in getattr(model, "up_blocks", None) or ()]
    for part, resamples in path:
        for sub in fw.submodules(part):
            level.setdefault(id(sub), factor)
        if resamples is not None and getattr(part, resamples, None) is not None:
            factor = factor * 2 if resamples == "downsamplers" else max(factor // 2, 1)
    return [level.get(id(block)) for block, _ in blocks]


def _path_levels(fw: Framework, model: Any, path: UNetPath) -> Dict[int, int]:
    """The level of every module inside the parts of a UNet laid out as ``path`` (:class:`UNetPath`)."""
    level: Dict[int, int] = {}
    factor = 1
    for name in path.parts:
        child = getattr(model, name, None)  # a module, or a module list of parts
        listed = type(child).__name__ in ("ModuleList", "LayerList")
        for part in list(child) if listed else [child] if fw.is_module(child) else []:
            inside = fw.submodules(part)
            for sub in inside:
                level.setdefault(id(sub), factor)
            if any(named(type(sub), path.downsample) for sub in inside):
                factor *= 2
            elif any(named(type(sub), path.upsample) for sub in inside):
                factor = max(factor // 2, 1)
    return level


def grid_modules(fw: Framework, model: Any) -> List[Any]:
    """The 2-D containers in ``model`` (:data:`~tome_core.models.families.GRID_CONTAINERS` and Flax's channels-last
    ones), whose 4-D input is the grid of their spatial blocks."""
    path = model_layout(type(model)).unet
    names = GRID_CONTAINERS + CHANNELS_LAST_GRID_CONTAINERS + (path.containers if path is not None else ())
    return [m for m in fw.submodules(model) if type(m).__name__ in names]


def check_grids(fw: Framework, model: Any, blocks: Optional[Sequence[Tuple[Any, BlockFamily]]] = None) -> None:
    """Refuse a model whose blocks cannot know their grid: neither a UNet, a ControlNet or a diffusion transformer,
    nor inside a 2-D container, nor after a ``grid_source`` child."""
    if is_unet_like(model) or is_transformer_model(model) or model_layout(type(model)).grid_source is not None:
        return
    inside = {id(sub) for grid in grid_modules(fw, model) for sub in fw.submodules(grid)}
    lost = [type(block).__name__ for block, _ in (blocks_of(fw, model) if blocks is None else blocks) if id(block) not in inside]
    if lost:
        raise ValueError(
            f"cannot patch {type(model).__qualname__}: its {lost[0]}s are outside a UNet, a ControlNet, a "
            "diffusion transformer or a 2-D Transformer2DModel, so nothing tells them their token grid"
        )


def block_metric(family: BlockFamily, block: Any) -> Tuple[str, Optional[int]]:
    """The argument of ``block``'s call whose tokens the match is computed from (:attr:`BlockFamily.metric`;
    ``hidden_states``, its first input, by default) and its position in the block's ``forward``."""
    if family.metric is None:
        return "hidden_states", 0
    return family.metric, argument_positions(forward_of(type(block)), family.metric)[family.metric]


def components(fw: Framework, obj: Any, entry: str = "patch") -> List[Any]:
    """The modules ``obj`` consists of: a latent-diffusion model's UNet (A1111-style UIs' and sdkit's
    ``LatentDiffusion``, read as ``tomesd.apply_patch`` reads it: ``obj.model.diffusion_model``, checked for
    ``patch``), itself if it is a module, else a pipeline's module components; anything else raises
    :func:`not_a_model`."""
    held = getattr(getattr(obj, "model", None), "diffusion_model", None)
    if held is not None:
        if entry == "patch":
            _check_held(fw, obj, held)
        return [held] if fw.is_module(held) else []
    if fw.is_module(obj):
        return [obj]
    if isinstance(getattr(obj, "components", None), dict):
        found = []
        for component in obj.components.values():
            items = component if isinstance(component, (list, tuple)) else [component]
            found.extend(item for item in items if fw.is_module(item))
        return found
    raise not_a_model(fw.accepted, obj, entry)


def _check_held(fw: Framework, obj: Any, held: Any) -> None:
    """Refuse a latent-diffusion model whose ``model.diffusion_model`` holds no UNet ToMe knows, naming what it holds."""
    if fw.is_module(held) and any(is_unet_like(m) and blocks_of(fw, m) for m in fw.submodules(held)):
        return
    message = (
        f"ToMe patches the UNet that a latent-diffusion model holds at model.diffusion_model (the ldm UNetModel of "
        f"A1111-style UIs and sdkit, SD 1.x and 2.x), but {type(obj).__qualname__}.model.diffusion_model is "
        f"{_shown(held)}"
    )
    if type(held).__module__.split(".")[0] == "sgm":
        message += ": Stability's sgm code (SDXL in A1111 and ComfyUI-style UIs) is not supported; load SDXL with diffusers"
    elif fw.is_module(held):
        message += ", which holds no UNet of transformer blocks ToMe knows (docs/a1111.md)"
    raise ValueError(message)


LOAD = "pipe = DiffusionPipeline.from_pretrained({name})"  # how a diffusers or ppdiffusers user loads a model id


def not_a_model(accepted: str, obj: Any, entry: str = "patch", load: str = LOAD) -> TypeError:
    """The error for an ``obj`` given to ``entry`` (``patch``, ``remove``, ``patched_models``) that is neither a
    pipeline nor a model: what was given, how to load a name or path (``load``, with ``{name}``), then what
    ``patch`` takes (``accepted``, the adapter's words)."""
    if entry != "patch":
        taken = "a patched pipeline or model" if entry == "remove" else "a pipeline or a model"
        return TypeError(f"{entry} takes {taken}; got {_shown(obj)}")
    message = f"ToMe patches a pipeline or a model; got {_shown(obj)}"
    if isinstance(obj, (str, os.PathLike)):
        name = repr(os.fspath(obj))
        message += f": a model id or folder is not a model; load it first, e.g. {load.format(name=name)}, then patch(pipe)"
    elif isinstance(obj, type) and hasattr(obj, "from_pretrained"):
        message += f": pass a model of it, e.g. {obj.__name__}.from_pretrained(...)"
    return TypeError(f"{message}. It takes {accepted}")


def _shown(obj: Any) -> str:
    """``obj`` in a message: None, a class by its name, else its type and a short repr."""
    if obj is None:
        return "None"
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    kind = type(obj).__qualname__ if type(obj).__module__ == "builtins" else f"{type(obj).__module__}.{type(obj).__qualname__}"
    text = " ".join(repr(obj).split())
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def find_models(fw: Framework, obj: Any, entry: str = "patch") -> List[Any]:
    """The models to patch inside ``obj``: every outermost UNet-like model and diffusion transformer holding blocks
    of a known family, else a component holding such blocks itself. ``entry``: as :func:`components`'s."""
    found: List[Any] = []
    for component in components(fw, obj, entry):
        models = [
            m for m in fw.submodules(component) if (is_unet_like(m) or is_transformer_model(m)) and blocks_of(fw, m)
        ]
        inner = {id(sub) for m in models for sub in fw.submodules(m) if sub is not m}
        models = [m for m in models if id(m) not in inner]
        if models:
            found.extend(models)
        elif blocks_of(fw, component):
            found.append(fw.submodules(component)[0])  # the component, or the module its wrapper compiles
    return found


def config_value(module: Any, name: str) -> Any:
    """The entry ``name`` of a model's ``config`` (a dict-like one, or one with attributes), or None."""
    config = getattr(module, "config", None)
    getter = getattr(config, "get", None)
    return getter(name) if callable(getter) else getattr(config, name, None)


def is_unet_like(module: Any) -> bool:
    """UNet2DConditionModel, ControlNetModel and their kin: a ``sample`` latent in, down blocks inside; or a UNet
    of another library whose levels its layout tells (:class:`~tome_core.models.families.UNetPath`: ldm's)."""
    return (hasattr(module, "down_blocks") and hasattr(module, "conv_in")) or model_layout(type(module)).unet is not None


def is_transformer_model(module: Any) -> bool:
    """A diffusion transformer: a config with a patch size, a video :class:`~tome_core.models.families.GridLayout`,
    or a call that takes its tokens' ids."""
    if is_unet_like(module):
        return False
    if config_value(module, "patch_size") is not None or model_layout(type(module)).video is not None:
        return True
    forward = getattr(type(module), "forward", None)
    return forward is not None and any(p in inspect.signature(forward).parameters for p in TOKEN_IDS)
