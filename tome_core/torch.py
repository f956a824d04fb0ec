"""ToMe for torch / diffusers: ``tome_core.torch.patch(pipe, ratio=0.5)``.

Importing this module also gives every diffusers ``DiffusionPipeline`` and ``ModelMixin`` the methods
``apply_tome(**options)`` and ``remove_tome()``.
"""

from __future__ import annotations

from typing import Any

from diffusers import DiffusionPipeline, ModelMixin

from tome_core.adapters.diffusers import patch, patched_models, remove

apply_tome = patch
remove_tome = remove


def apply_patch(
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
    """Drop-in for ``tomesd.apply_patch``: the same signature and defaults (``max_downsample=1``)."""
    return patch(
        model,
        ratio=ratio,
        max_downsample=max_downsample,
        sx=sx,
        sy=sy,
        use_rand=use_rand,
        merge_attn=merge_attn,
        merge_crossattn=merge_crossattn,
        merge_mlp=merge_mlp,
    )


def remove_patch(model: Any) -> Any:
    """Drop-in for ``tomesd.remove_patch``."""
    return remove(model)


def _apply_tome_method(self, **options):
    return patch(self, **options)


def _remove_tome_method(self):
    return remove(self)


for _cls in (DiffusionPipeline, ModelMixin):
    _cls.apply_tome = _apply_tome_method
    _cls.remove_tome = _remove_tome_method

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models"]
