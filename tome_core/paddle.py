"""ToMe for paddle / ppdiffusers: ``tome_core.paddle.patch(pipe, ratio=0.5)``.

Importing this module also makes ``apply_tome(**options)`` and ``remove_tome()`` of every ppdiffusers
``DiffusionPipeline`` and every ``paddle.nn.Layer`` run this implementation, in place of the port of tomesd
that ppdiffusers installs under those names. ``remove_tome`` undoes either implementation. ppdiffusers' own
functions stay reachable as :data:`PPDIFFUSERS_APPLY_TOME` and :data:`PPDIFFUSERS_REMOVE_TOME`.
"""

from __future__ import annotations

from typing import Any

import paddle
import ppdiffusers.patches.tomesd_patch_utils  # noqa: F401  (installs ppdiffusers' methods before ours replace them)
from ppdiffusers import DiffusionPipeline

from tome_core.adapters.ppdiffusers import patch, patched_models, ppdiffusers_targets, remove

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


def _remove_tome_method(self, only_return_self: bool = True):
    # only_return_self=False is how ppdiffusers' own apply_tome asks which layers to patch.
    remove(self)
    return self if only_return_self else (self, ppdiffusers_targets(self))


# ppdiffusers' own implementation (a tomesd port), kept for comparison before ours takes its place
# (a reload of this module keeps the originals it found the first time).
PPDIFFUSERS_APPLY_TOME = globals().get("PPDIFFUSERS_APPLY_TOME") or paddle.nn.Layer.__dict__.get("apply_tome")
PPDIFFUSERS_REMOVE_TOME = globals().get("PPDIFFUSERS_REMOVE_TOME") or paddle.nn.Layer.__dict__.get("remove_tome")

for _cls in (DiffusionPipeline, paddle.nn.Layer):
    _cls.apply_tome = _apply_tome_method
    _cls.remove_tome = _remove_tome_method

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models"]
