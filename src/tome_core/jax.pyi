# Written by `python -m tome_tools.stubs` from tome_core/jax.py and ToMeConfig: edit those, then rerun it.
# Editors and type checkers read this stub; at runtime inspect.signature shows the same parameters.

from typing import Any, Mapping, Optional, Tuple

from tome_core.adapters.flax import (
    block_paths as block_paths,
    is_patched as is_patched,
    patched_models as patched_models,
    record as record,
    remove as remove,
)

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "patched_models", "is_patched", "record",
    "block_paths"]

def patch(
    model: Any,
    ratio: Optional[float] = None,
    *,
    max_downsample: Optional[int] = None,
    sx: Optional[int] = None,
    sy: Optional[int] = None,
    use_rand: bool = True,
    merge_attn: bool = True,
    merge_crossattn: bool = False,
    merge_mlp: bool = False,
    seed: int = 0,
    attn_ratio: Optional[float] = None,
    crossattn_ratio: Optional[float] = None,
    mlp_ratio: Optional[float] = None,
    level_ratios: Optional[Mapping[int, float]] = None,
    reuse_level: bool = False,
    reuse_steps: int = 1,
    local_window: int = 0,
    proportional_attn: bool = True,
    blocks: Optional[Tuple[int, ...]] = None,
    reuse_blocks: int = 1,
    block_ratios: Optional[Mapping[int, float]] = None,
    mode: Optional[str] = None,
    matching: Optional[str] = None,
    level_cells: Optional[Mapping[int, Any]] = None,
    cell_pool: Optional[str] = None,
    frames_per_chunk: Optional[int] = None,
    frame_ratio: Optional[float] = None,
    timestep_range: Optional[Tuple[float, float]] = None,
    min_tokens: Optional[int] = None,
    prefer: Optional[str] = None,
) -> Any:
    """Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.jax.patch) describes
    each."""

def apply_tome(
    model: Any,
    ratio: Optional[float] = None,
    *,
    max_downsample: Optional[int] = None,
    sx: Optional[int] = None,
    sy: Optional[int] = None,
    use_rand: bool = True,
    merge_attn: bool = True,
    merge_crossattn: bool = False,
    merge_mlp: bool = False,
    seed: int = 0,
    attn_ratio: Optional[float] = None,
    crossattn_ratio: Optional[float] = None,
    mlp_ratio: Optional[float] = None,
    level_ratios: Optional[Mapping[int, float]] = None,
    reuse_level: bool = False,
    reuse_steps: int = 1,
    local_window: int = 0,
    proportional_attn: bool = True,
    blocks: Optional[Tuple[int, ...]] = None,
    reuse_blocks: int = 1,
    block_ratios: Optional[Mapping[int, float]] = None,
    mode: Optional[str] = None,
    matching: Optional[str] = None,
    level_cells: Optional[Mapping[int, Any]] = None,
    cell_pool: Optional[str] = None,
    frames_per_chunk: Optional[int] = None,
    frame_ratio: Optional[float] = None,
    timestep_range: Optional[Tuple[float, float]] = None,
    min_tokens: Optional[int] = None,
    prefer: Optional[str] = None,
) -> Any:
    """Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.jax.apply_tome)
    describes each."""

remove_tome = remove
