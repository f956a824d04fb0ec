# Written by `python -m tome_tools.stubs` from ToMeConfig and tome_core/dropin.py: edit those, then rerun it.
# Stub-only: the entry points' signatures, by which the entry modules' stubs (torch.pyi,
# paddle.pyi, jax.pyi) declare their functions, so that each option is listed once.

from typing import Any, Mapping, Optional, Protocol, Tuple

class PatchFunction(Protocol):
    """``patch`` and ``apply_tome`` of every entry module (tome_core.torch, .paddle, .jax)."""

    def __call__(
        self,
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
        frame_window: Optional[int] = 1,
        timestep_range: Optional[Tuple[float, float]] = None,
        min_tokens: Optional[int] = None,
        prefer: Optional[str] = None,
    ) -> Any:
        """Every option of tome_core.ToMeConfig, the ratio also positional; help() of either lists each."""

class TomesdApplyPatch(Protocol):
    """``apply_patch`` of the entry modules with tomesd's drop-ins (tome_core.torch, .paddle)."""

    def __call__(
        self,
        model: Any,
        ratio: float = 0.5,
        max_downsample: int = 1,
        sx: int = 2,
        sy: int = 2,
        use_rand: bool = True,
        merge_attn: bool = True,
        merge_crossattn: bool = False,
        merge_mlp: bool = False,
    ) -> Any:
        """Drop-in for ``tomesd.apply_patch``: the same signature, defaults and arithmetic
        (``max_downsample=1``, ``proportional_attn=False``)."""
